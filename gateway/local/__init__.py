"""In-process mode: the backends that serve models in this process, the generation engine and
the embedding batcher."""

"""The engine's device side: everything that touches tensors on the CPU or a GPU. It reads the
engine's settings only as engine/resolve.py decided them (`ResolvedConfig`).

    worker.py            EngineWorker: the model loaded, the KV cache sized, the ranks started,
                         each rank's runner built
    runner.py            ModelRunner: one step's forward pass and sampling over a packed batch
    models/              the model registry: a module per family reading its checkpoint, one
                         DecoderModel over shared blocks (attention with windows and sinks,
                         experts, rope), the forward pass over the paged cache
    lora_weights.py      LoraWeights: the resident adapters' deltas, stacked per layer
    cuda_graphs.py       the decode step captured and replayed per batch-size bucket (CUDA)
    triton_attention.py  decode attention straight from the block table (CUDA, Triton)
    parallel.py          tensor parallelism: the other ranks, their shards, the step broadcast
    quant.py             quantized weights and the linear layer that picks a kernel
    kv_cache.py          the KV cache's size and zeroed tensors
    loader.py            weights, config and tokenizer from a Hugging Face folder or a GGUF file
    native.py            the C++ CPU kernels (csrc/), compiled on first use
    platform.py          the CPU's instruction-set level, native bf16, container memory
    ops.py               torch's untyped ops, typed
"""

"""Embedding models beside the generation engine: a BERT-family encoder with sentence-transformers
pooling (model.py), and the dynamic batcher that groups requests' inputs into its calls
(batcher.py: a torch-free policy and the thread that runs it)."""

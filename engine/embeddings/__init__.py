"""Embedding models beside the generation engine: a BERT-family encoder with sentence-transformers
pooling (model.py), the dynamic batching policy that groups requests' inputs into its calls
(policy.py, torch-free), and the thread that runs the policy over the model (batcher.py)."""

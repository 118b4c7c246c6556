"""The models: one decoder over shared blocks, and a module per family for what its checkpoint
says differently (what its config says differently is engine/model_spec.py's).

    registry.py     family -> its checkpoint reader (model_type -> family: engine/model_spec.py)
    llama.py        Llama, Mistral, Qwen2, Qwen3          gemma3.py      Gemma 3 (text)
    phi3.py         Phi-3, Phi-4                          mixtral.py     Mixtral
    qwen3_moe.py    Qwen3-MoE                             gpt_oss.py     gpt-oss (MXFP4 experts)
    checkpoint.py   the canonical names, shared helpers
    decoder.py      DecoderModel: the forward pass over the paged cache, every family's
    attention.py    attention with windows and sinks (paged kernels, or the torch reference)
    moe.py          routing and the experts' grouped matmuls
    rope.py         rope tables: default, linear, llama3, yarn, longrope; partial rotary
"""

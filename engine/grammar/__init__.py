"""Constrained decoding behind a small interface: specs, backends, per-sequence grammars, a cache.

    GrammarSpec --(GrammarBackend.compile, on a worker thread, LRU-cached)--> CompiledGrammar
    CompiledGrammar.new_grammar() --> Grammar (one per sequence: its own parser state)

Each engine step fills one token bitmask for the constrained rows of the batch (`fill_bitmask`,
one row each); the sampler masks the disallowed tokens before it samples; the engine feeds each
sampled token back (`accept_token`) and ends the sequence when `is_terminated()`.

    interface.py  Grammar, CompiledGrammar, GrammarBackend; the bitmask layout; GrammarCache
    backend.py    LLGuidanceBackend: specs compiled by llguidance, one matcher per sequence
    closing.py    steering an output to its end before max_tokens: JSON closing, plan search
    mask.py       the step's mask: when a row closes, filled during the forward pass or after
"""

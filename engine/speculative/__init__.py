"""Speculative decoding: more than one token per pass over the weights.

A decoding sequence's draft (`proposers.py`: prompt lookup over its own tokens, or the request's
predicted output) is verified in the same step as the rest of the batch: the last sampled token and
the draft run as decode rows of their own (each row attends to the rows before it, whose K/V the
layer wrote first), so every row's next-token logits come out of one forward pass. `verify.py`
keeps the longest prefix of the draft the model agrees with (greedy: equal to its argmax; sampled:
rejection sampling, so the output's distribution is the model's) and one more token of the model's
own. The rejected rows' K/V lies beyond the sequence's computed tokens and is overwritten later.
`speculator.py` decides, per step and per sequence, whether a draft pays and how long it is.
"""

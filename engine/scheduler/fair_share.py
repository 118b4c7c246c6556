"""Fair shares by work: how many tokens each fairness key (tenant) of a class has been served.

The per-key turns of a class (waiting_queue.py's `FairQueue`, and the order of a step's prefill
chunks in continuous.py) go to the key that has been served the fewest tokens, not to the next key
in a rotation: a virtual token counter per key (VTC, Sheng et al., "Fairness in Serving Large
Language Models", OSDI '24, the token-weighted form of fair queuing). Every token a step computes
for a key's sequence (a prefill chunk's tokens, a decode's one) is added to its counter, so a
tenant of 2,000-token prompts takes one turn for about as many tokens as a tenant of 20-token
prompts takes a hundred turns.

A key that starts waiting again is lifted to the lowest counter among the keys that wait (or, when
none does, to the counter of the key served last): time spent idle is not banked as credit, so a
key cannot save up turns and then flood the others. Counters only grow; one at or below that floor
says nothing the lift would not, so such counters of keys that wait for nothing are dropped (the
map stays as small as the set of active keys) and a key without one reads as at the floor.
"""

from __future__ import annotations


class ServedTokens:
    """One class's virtual token counters, and how many sequences of each key wait in it."""

    def __init__(self) -> None:
        self._served: dict[str, float] = {}
        self._waiting: dict[str, int] = {}
        self._vtime = 0.0  # the counter of the key most recently served a turn (never decreases)

    def __getitem__(self, key: str) -> float:
        served = self._served.get(key)
        return self.floor() if served is None else served

    def __len__(self) -> int:
        """Keys with a counter kept (tests check that it stays bounded)."""
        return len(self._served)

    def floor(self) -> float:
        """What a key that starts waiting is lifted to (see the module docstring)."""
        if not self._waiting:
            return self._vtime
        return min(self._served.get(k, 0.0) for k in self._waiting)

    def enter(self, key: str) -> None:
        """A sequence of `key` starts waiting in the class."""
        num = self._waiting.get(key, 0)
        if num == 0:
            lifted = max(self._served.get(key, 0.0), self.floor())
            self._served[key] = lifted
            if len(self._served) > 2 * len(self._waiting) + 16:
                self._prune()
        self._waiting[key] = num + 1

    def leave(self, key: str, turn: bool = False) -> None:
        """A sequence of `key` stops waiting; `turn`: it was served a turn (admitted in turn)."""
        num = self._waiting[key] - 1
        if num:
            self._waiting[key] = num
        else:
            del self._waiting[key]
        if turn:
            self._vtime = max(self._vtime, self._served.get(key, 0.0))

    def charge(self, key: str, num_tokens: int) -> None:
        """`key` was served `num_tokens` tokens (a step computed them)."""
        served = self._served.get(key)
        self._served[key] = (self.floor() if served is None else served) + num_tokens

    def _prune(self) -> None:
        floor = self.floor()
        for key in [k for k, v in self._served.items() if k not in self._waiting and v <= floor]:
            del self._served[key]

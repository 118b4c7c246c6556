"""Who waits where, and who is next: priority classes, length buckets, fair share between keys.

    WaitingQueue
      PAID  resume: [preempted, served first]   buckets: [<=256] [<=1024] [<=4096] [>4096]
      FREE  resume: [...]                       buckets: [...]
                                                each bucket: one FIFO per fairness key

A higher class is always served before a lower one. Within a class, sequences that were preempted
come back first (they had started, and their callers are mid-stream); then the buckets take turns
(one admission from a bucket moves the turn to the next non-empty bucket), and within a bucket the
fairness keys (tenants) take turns by work: the key served the fewest tokens in the class goes next
(fair_share.py; keys served alike take turns in rotation), so one key's flood waits behind its own
requests, not in front of everybody else's, and a key of long prompts takes a turn for as many
tokens as a key of short ones takes many. With no bucket boundaries and one key this is plain FIFO
per class.

Counters (per class and bucket, tokens per class, counts per key) are kept as sequences come and go,
so the engine's per-step statistics never walk the queue. What a sequence added is recorded when it
enters and exactly that is taken off when it leaves: the scheduler changes a queued sequence's
progress before popping it (admission first takes its cached prefix, which counts as computed), so
recounting it on the way out would let the counters drift with every prefix-cache hit.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterator
from typing import NamedTuple

from engine.scheduler.buckets import bucket_labels, bucket_of, validate_boundaries
from engine.scheduler.fair_share import ServedTokens
from engine.sequence import Sequence
from engine.types import Priority


class FairQueue:
    """FIFOs per fairness key, served in turn by work: the head of the key served the fewest tokens
    (`served`, its class's counters) goes next; keys served alike take turns in rotation (each gets
    one before any gets a second). A key that empties leaves the rotation; one that arrives joins
    at its end."""

    def __init__(self, served: ServedTokens | None = None) -> None:
        self._fifos: OrderedDict[str, deque[Sequence]] = OrderedDict()
        self._len = 0
        self._served = served if served is not None else ServedTokens()

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        """In the order `pop` would serve them as the counters stand (the least served key's
        head first, then round by round)."""
        order = sorted(self._fifos, key=lambda k: self._served[k])  # stable: the rotation breaks ties
        fifos = [list(self._fifos[k]) for k in order]
        for i in range(max((len(f) for f in fifos), default=0)):
            for fifo in fifos:
                if i < len(fifo):
                    yield fifo[i]

    def push(self, seq: Sequence) -> None:
        self._fifos.setdefault(seq.fairness_key, deque()).append(seq)
        self._len += 1

    def _next_key(self) -> str:
        """The key whose turn it is: the least served, the earliest in the rotation among equals."""
        return min(self._fifos, key=lambda k: self._served[k])

    def peek(self) -> Sequence | None:
        if not self._fifos:
            return None
        return self._fifos[self._next_key()][0]

    def pop(self) -> Sequence:
        """The head of the key whose turn it is; that key moves to the back of the rotation."""
        if not self._fifos:
            raise IndexError("pop from an empty FairQueue")
        key = self._next_key()
        fifo = self._fifos[key]
        seq = fifo.popleft()
        if fifo:
            self._fifos.move_to_end(key)
        else:
            del self._fifos[key]
        self._len -= 1
        return seq

    def remove(self, seq: Sequence) -> None:
        fifo = self._fifos[seq.fairness_key]
        fifo.remove(seq)
        if not fifo:
            del self._fifos[seq.fairness_key]
        self._len -= 1

    def count_by_key(self) -> dict[str, int]:
        return {key: len(fifo) for key, fifo in self._fifos.items()}


class _Entry(NamedTuple):
    """What a queued sequence added to the counters when it entered (taken off when it leaves)."""

    bucket: int
    tokens: int  # tokens to (re)compute
    decode_tokens: int  # tokens it may still generate (max_tokens left)


class _ClassQueue:
    def __init__(self, num_buckets: int) -> None:
        self.resume: deque[Sequence] = deque()
        self.served = ServedTokens()  # the class's counters, shared by its buckets' FairQueues
        self.buckets = [FairQueue(self.served) for _ in range(num_buckets)]
        self.next_bucket = 0  # whose turn it is among the buckets

    def bucket_order(self) -> list[int]:
        n = len(self.buckets)
        return [(self.next_bucket + i) % n for i in range(n)]


class WaitingQueue:
    """Waiting sequences by class, bucket and fairness key; see the module docstring for the order.

    `peek`/`pop` decide who is next; `remove` takes a sequence out without moving any turn (abort,
    expiry). `push_front` is for preempted sequences: they return ahead of everything in their class.
    """

    def __init__(self, length_buckets: tuple[int, ...] = ()) -> None:
        validate_boundaries(length_buckets)
        self.boundaries = tuple(length_buckets)
        self.labels = bucket_labels(self.boundaries)
        n = len(self.labels)
        self._classes = {p: _ClassQueue(n) for p in Priority}
        self._counts = {p: [0] * n for p in Priority}  # waiting sequences per class and bucket
        self._tokens = dict.fromkeys(Priority, 0)  # tokens to (re)compute per class
        self._decode_tokens = dict.fromkeys(Priority, 0)  # tokens still to generate per class
        self._entries: dict[tuple[str, int], _Entry] = {}  # by seq_id, what each one was counted as

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, Sequence) and seq.seq_id in self._entries

    def __iter__(self) -> Iterator[Sequence]:
        for p in sorted(self._classes):
            q = self._classes[p]
            yield from q.resume
            for b in range(len(q.buckets)):
                yield from q.buckets[b]

    def bucket(self, seq: Sequence) -> int:
        return bucket_of(seq.num_prompt_tokens, self.boundaries)

    # ---- in and out -------------------------------------------------------------------------

    def push(self, seq: Sequence) -> None:
        self._enter(seq)
        self._classes[seq.priority].buckets[self.bucket(seq)].push(seq)

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence goes back to the head of its class: it was admitted before others."""
        self._enter(seq)
        self._classes[seq.priority].resume.appendleft(seq)

    def peek(self, priority: Priority | None = None, skip_buckets: Collection[int] = ()) -> Sequence | None:
        """Who is next: in `priority`'s class only when given, else in the highest non-empty class.

        `skip_buckets` passes over buckets that cannot take more this step (their turn is kept).
        """
        classes = [priority] if priority is not None else sorted(self._classes)
        for p in classes:
            q = self._classes[p]
            for seq in q.resume:
                if self.bucket(seq) not in skip_buckets:
                    return seq
            for b in q.bucket_order():
                if b not in skip_buckets and len(q.buckets[b]):
                    return q.buckets[b].peek()
        return None

    def pop(self, seq: Sequence | None = None) -> Sequence:
        """Take `seq` (by default `peek()`), which must be what `peek` returned; the turn moves on."""
        if seq is None:
            seq = self.peek()
            if seq is None:
                raise IndexError("pop from an empty waiting queue")
        q = self._classes[seq.priority]
        if q.resume and seq in q.resume:
            q.resume.remove(seq)
        else:
            b = self.bucket(seq)
            head = q.buckets[b].pop()
            assert head is seq, f"pop({seq}) but the head of its bucket is {head}"
            q.next_bucket = (b + 1) % len(q.buckets)
            q.served.leave(seq.fairness_key, turn=True)
            self._leave(seq, counted=True)
            return seq
        self._leave(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        q = self._classes[seq.priority]
        if seq in q.resume:
            q.resume.remove(seq)
        else:
            q.buckets[self.bucket(seq)].remove(seq)
        self._leave(seq)

    def _enter(self, seq: Sequence) -> None:
        if seq.seq_id in self._entries:
            raise RuntimeError(f"{seq} is already in the waiting queue")
        decode_tokens = max(0, seq.sampling.max_tokens - seq.num_output_tokens)
        entry = _Entry(self.bucket(seq), seq.num_uncomputed_tokens, decode_tokens)
        self._entries[seq.seq_id] = entry
        self._add(seq.priority, entry, +1)
        self._classes[seq.priority].served.enter(seq.fairness_key)

    def _leave(self, seq: Sequence, counted: bool = False) -> None:
        """`counted`: the fair-share counters already know (a pop in turn)."""
        self._add(seq.priority, self._entries.pop(seq.seq_id), -1)
        if not counted:
            self._classes[seq.priority].served.leave(seq.fairness_key)

    def _add(self, priority: Priority, entry: _Entry, sign: int) -> None:
        self._counts[priority][entry.bucket] += sign
        self._tokens[priority] += sign * entry.tokens
        self._decode_tokens[priority] += sign * entry.decode_tokens

    # ---- fair shares by work (fair_share.py) ------------------------------------------------------

    def served(self, seq: Sequence) -> float:
        """Tokens `seq`'s key has been served in its class (the virtual token counter)."""
        return self._classes[seq.priority].served[seq.fairness_key]

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """A step computed `num_tokens` tokens of `seq` (waiting or not)."""
        self._classes[seq.priority].served.charge(seq.fairness_key, num_tokens)

    # ---- what the scheduler and the statistics ask ----------------------------------------------

    def has_waiting_below(self, bucket: int, max_priority: Priority) -> bool:
        """Whether a sequence of class <= `max_priority` waits in a bucket below `bucket`."""
        return any(any(self._counts[p][:bucket]) for p in self._counts if p <= max_priority)

    def top_class(self) -> Priority | None:
        """The highest class with a waiting sequence (from the counters, not a pass over the queue)."""
        return next((p for p in sorted(self._counts) if any(self._counts[p])), None)

    def count_by_priority(self) -> dict[str, int]:
        return {p.name.lower(): sum(c) for p, c in self._counts.items()}

    def count_by_bucket(self) -> dict[str, int]:
        return {label: sum(self._counts[p][b] for p in self._counts) for b, label in enumerate(self.labels)}

    def count_by_priority_and_bucket(self) -> dict[str, dict[str, int]]:
        return {p.name.lower(): dict(zip(self.labels, c, strict=True)) for p, c in self._counts.items()}

    def tokens_by_priority(self) -> dict[Priority, int]:
        """Tokens to compute before the waiting sequences of each class could all have started."""
        return dict(self._tokens)

    def decode_tokens_by_priority(self) -> dict[Priority, int]:
        """Tokens the waiting sequences of each class may still generate (max_tokens left)."""
        return dict(self._decode_tokens)

    def count_by_key(self) -> dict[Priority, dict[str, int]]:
        """Waiting sequences per class and fairness key (the resume queue included)."""
        counts: dict[Priority, dict[str, int]] = {}
        for p, q in self._classes.items():
            by_key: dict[str, int] = {}
            for seq in q.resume:
                by_key[seq.fairness_key] = by_key.get(seq.fairness_key, 0) + 1
            for fq in q.buckets:
                for key, n in fq.count_by_key().items():
                    by_key[key] = by_key.get(key, 0) + n
            counts[p] = by_key
        return counts

"""Fair shares by work (engine/scheduler/fair_share.py): tenants of one class take turns weighted by
the tokens they were served, so a tenant of long prompts cannot take most of the steps from a
tenant of short ones. Model-free: closed-loop tenants over the scheduler and a fake step."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import pytest

from engine.scheduler.core import SchedulerCore
from engine.scheduler.fair_share import ServedTokens
from engine.scheduler.waiting_queue import FairQueue, WaitingQueue
from engine.sequence import Sequence
from engine.types import Priority
from tests.engine.factories import make_scheduler, make_seq, run_step

PAID, FREE = Priority.PAID, Priority.FREE


def test_a_key_that_starts_waiting_is_lifted_to_the_least_served_waiting_key() -> None:
    served = ServedTokens()
    served.enter("a")
    served.charge("a", 1000)
    served.enter("b")  # lifted to a's counter: a was the only one waiting
    assert served["b"] == 1000
    served.charge("b", 10)
    served.leave("b")
    served.charge("a", 500)
    served.enter("b")  # its own counter (1010) is below the floor (a: 1500)
    assert served["b"] == 1500
    served.leave("a", turn=True)
    served.leave("b", turn=True)
    served.enter("c")  # nobody waits: the counter of the key served last
    assert served["c"] == 1500


def test_idle_keys_counters_are_dropped_and_read_as_the_floor() -> None:
    served = ServedTokens()
    served.enter("busy")
    for i in range(200):
        served.enter(f"k{i}")
        served.leave(f"k{i}", turn=True)
        served.charge("busy", 10)
    assert len(served) < 40  # bounded by the keys that wait, not by every key ever seen
    assert served["k0"] == served.floor() == served["busy"]


def test_the_least_served_key_goes_first_and_equals_take_turns() -> None:
    q = WaitingQueue(())
    a = [make_seq(4, fairness_key="a") for _ in range(3)]
    b = [make_seq(4, fairness_key="b") for _ in range(3)]
    for s in (*a, *b):
        q.push(s)
    assert [q.pop() for _ in range(2)] == [a[0], b[0]]  # nobody served yet: in rotation
    q.charge(a[0], 100)  # a's first turn cost 100 tokens, b's 4
    q.charge(b[0], 4)
    assert q.peek() is b[1] and [q.pop() for _ in range(2)] == [b[1], b[2]]
    assert q.pop() is a[1]


def test_a_fair_queue_without_counters_is_the_plain_rotation() -> None:
    fq = FairQueue()
    a = [make_seq(4, fairness_key="a") for _ in range(2)]
    b = make_seq(4, fairness_key="b")
    for s in (*a, b):
        fq.push(s)
    assert [fq.pop() for _ in range(3)] == [a[0], b, a[1]]


# ---- two tenants in a closed loop: long prompts against short ones ------------------------------------


@dataclass
class Tenant:
    key: str
    clients: int
    prompt_len: int
    max_tokens: int
    waits: list[int] = field(default_factory=list)  # steps from arrival to the first token, each request
    tokens: int = 0  # prompt and output tokens computed for it
    live: dict[str, int] = field(default_factory=dict)  # request id -> arrival step


def run_closed_loop(sched: SchedulerCore, tenants: list[Tenant], num_steps: int) -> None:
    """Each tenant keeps `clients` requests in flight: a request that ends is replaced at once."""
    seqs: dict[str, tuple[Tenant, Sequence]] = {}
    waiting: set[str] = set()  # no first token yet

    def arrive(tenant: Tenant, step: int) -> None:
        seq = make_seq(tenant.prompt_len, tenant.max_tokens, PAID, fairness_key=tenant.key)
        seqs[seq.request_id] = (tenant, seq)
        tenant.live[seq.request_id] = step
        waiting.add(seq.request_id)
        sched.add(seq)

    for tenant in tenants:
        for _ in range(tenant.clients):
            arrive(tenant, 0)
    for step in range(num_steps):
        out = run_step(sched)
        for chunk in out.chunks:
            seqs[chunk.seq.request_id][0].tokens += chunk.num_tokens
        for request_id in [r for r in waiting if seqs[r][1].num_output_tokens > 0]:
            waiting.discard(request_id)
            tenant = seqs[request_id][0]
            tenant.waits.append(step + 1 - tenant.live[request_id])
        for request_id, (tenant, seq) in list(seqs.items()):
            if seq.finished:
                del seqs[request_id]
                del tenant.live[request_id]
                arrive(tenant, step + 1)


def two_tenants(with_long: bool, length_buckets: tuple[int, ...] = ()) -> tuple[Tenant, Tenant]:
    """A: 2,000-token prompts at 32 concurrent (scaled to the fake cache: 8 of 200 tokens); B: 2
    of 2-token prompts; one class, steps of 64 tokens."""
    sched = make_scheduler(
        num_blocks=1024,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        length_buckets=length_buckets,
    )
    a, b = Tenant("long", 8, 200, 4), Tenant("short", 2, 2, 4)
    run_closed_loop(sched, [a, b] if with_long else [b], 600)
    return a, b


@pytest.mark.parametrize("length_buckets", [(), (16, 64)])
def test_a_tenant_of_long_prompts_takes_no_more_than_its_share_of_the_steps(
    length_buckets: tuple[int, ...],
) -> None:
    _, alone = two_tenants(with_long=False, length_buckets=length_buckets)
    long, short = two_tenants(with_long=True, length_buckets=length_buckets)
    # B waits for its first token about as long as alone (within one step or 2x), though A's
    # prompts fill every step's budget; by request turns it waited for each of A's prompts.
    wait_alone, wait = statistics.median(alone.waits), statistics.median(short.waits)
    assert wait <= max(2 * wait_alone, wait_alone + 1), (wait, wait_alone)
    assert len(short.waits) >= 0.5 * len(alone.waits)
    # A gets at least its fair share of the work: all that B, which asks for little, leaves.
    total = long.tokens + short.tokens
    assert long.tokens >= 0.5 * total and total >= 0.9 * 600 * 64

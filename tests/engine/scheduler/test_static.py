"""Static batching (engine/scheduler/static.py) without a model, driven through `run_step`."""

from __future__ import annotations

from tests.engine.factories import (
    assert_all_done,
    make_scheduler,
    make_seq,
    run_step,
    run_until_done,
)

# ---- static batching -------------------------------------------------------------------------------


def test_static_batching_admits_nobody_until_the_batch_has_drained() -> None:
    # Budget 8 and 6-token prompts: the first batch of three forms over two steps.
    sched = make_scheduler(
        num_blocks=256, max_num_seqs=3, max_num_batched_tokens=8, batching="static", length_buckets=()
    )
    seqs = [make_seq(6, max_tokens=n) for n in (2, 9, 4, 3, 3)]
    for s in seqs:
        sched.add(s)
    batches: list[set[str]] = []  # who was admitted, grouped by "nothing was running before"
    for step in range(200):
        if not sched.has_unfinished():
            break
        if step == 4:  # arrives while the first batch runs: it must wait for the next batch
            seqs.append(make_seq(2, max_tokens=2))
            sched.add(seqs[-1])
        was_running = {s.request_id for s in sched.running}
        out = run_step(sched)
        new = {c.seq.request_id for c in out.prefills} - was_running
        if new and not was_running:
            batches.append(set())
        if new:
            batches[-1] |= new
    assert batches == [{s.request_id for s in seqs[:3]}, {s.request_id for s in seqs[3:]}]
    assert_all_done(sched, seqs)


def test_static_batching_takes_more_steps_than_continuous() -> None:
    steps = {}
    for mode in ("continuous", "static"):
        sched = make_scheduler(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, batching=mode)
        seqs = [make_seq(4, max_tokens=n) for n in (2, 30, 3, 4, 30, 2, 3, 30)]
        for s in seqs:
            sched.add(s)
        steps[mode] = len(run_until_done(sched))
        assert_all_done(sched, seqs)
    assert steps["static"] > 1.5 * steps["continuous"]

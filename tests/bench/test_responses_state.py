"""bench/responses_state.py, in brief: every row's spans are of lookups that resolved the whole
conversation (the bench asserts the history's length in each span), for both stores, both stored
formats and both kinds of reference; and its bytes table shows a chain and a conversation each
within 2x of its items in format 2."""

from __future__ import annotations

import pytest

from bench import responses_state


async def test_each_row_times_lookups_that_resolve_the_conversation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    await responses_state.main([3], 5, 20, "this tree")
    out = capsys.readouterr().out
    lookups, stored = out.split("A chain of 20 turns")
    rows = [line for line in lookups.splitlines() if line.startswith(("| SQLite", "| Redis"))]
    assert [r.split(" | ")[:4] for r in rows] == [
        [store, version, how, "3"]
        for store in ("| SQLite (file)", "| Redis")
        for version in ("1", "2")
        for how in ("previous_response_id", "conversation")
    ]
    assert all(float(r.split(" | ")[5]) > 0 for r in rows)  # a lookup's p50, in ms
    ratios = {
        tuple(r.split(" | ")[:3]): float(r.split(" | ")[4].rstrip(" |"))
        for r in stored.splitlines()
        if r.startswith(("| SQLite", "| Redis"))
    }
    for store in ("| SQLite (file)", "| Redis"):
        for how in ("previous_response_id", "conversation"):
            assert ratios[(store, "2", how)] <= 2
            assert ratios[(store, "1", how)] > 5  # quadratic

"""bench/responses_state.py, in brief: every row's spans are of lookups that resolved the whole
conversation (the bench asserts the history's length in each span), for both stores and both
kinds of reference."""

from __future__ import annotations

import pytest

from bench import responses_state


async def test_each_row_times_lookups_that_resolve_the_conversation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    await responses_state.main([3], 5, "this tree")
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| SQLite", "| Redis"))]
    assert [r.split(" | ")[:3] for r in rows] == [
        ["| SQLite (file)", "previous_response_id", "3"],
        ["| SQLite (file)", "conversation", "3"],
        ["| Redis", "previous_response_id", "3"],
        ["| Redis", "conversation", "3"],
    ]
    assert all(float(r.split(" | ")[4]) > 0 for r in rows)  # a lookup's p50, in ms

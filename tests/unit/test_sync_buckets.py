"""How a `distributed` weight sync cuts the model into update requests (`plan_buckets`)."""

from __future__ import annotations

import pytest

from grpoflow.engine.update_group import plan_buckets


@pytest.mark.parametrize(
    "sizes, limit, want",
    [
        ([4, 4, 4, 4], 8, [range(0, 2), range(2, 4)]),  # filled to the limit, not past it
        ([4, 4, 4], 100, [range(0, 3)]),  # everything in one
        ([3, 20, 3, 3], 8, [range(0, 1), range(1, 2), range(2, 4)]),  # one larger than the limit goes alone
        ([20], 8, [range(0, 1)]),
        ([], 8, []),
    ],
)
def test_buckets_are_consecutive_runs_within_the_limit(sizes, limit, want):
    got = plan_buckets(sizes, limit)
    assert got == want
    assert [i for b in got for i in b] == list(range(len(sizes)))  # every tensor once, in order

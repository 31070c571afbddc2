"""The rollout ledger's arithmetic on hand-made samples: each token counted once, by the first reason."""

import pytest

from grpoflow.ledger import REASONS, rollout_discards, run_ledger, time_ledger, token_ledger, unaccounted
from tests.fakes.samples import make_sample


def _s(group, k, status="COMPLETED", n=3, reward=1.0):
    return make_sample(group, k, None if status == "FAILED" else reward, status, mask=[0] + [1] * n)


def test_rollout_discards_count_stale_then_failed_then_their_groups():
    stale = [_s("a", 0, n=5), _s("a", 1, n=5)]
    failed_group = [_s("b", 0, "FAILED", n=2), _s("b", 1, n=4)]
    engine_down = [_s("d", 0, "FAILED", n=7), _s("d", 1, n=3)]
    failed_group[0].exit_status = "AgentError"  # the policy's (or its agent's) failure
    engine_down[0].exit_status = "EngineError"  # the engine did not answer: its own reason, not the policy's
    kept = [_s("c", 0, n=1), _s("c", 1, n=1)]
    rolled = stale + failed_group + engine_down + kept
    fresh = failed_group + engine_down + kept
    out = rollout_discards(rolled, fresh, kept)
    assert out == {"stale": 10.0, "infrastructure": 7.0, "failed_trial": 2.0, "dropped_group": 7.0}


def test_a_step_row_balances_and_the_train_counts_move_into_the_ledger():
    rollout = {"rollout/tokens_generated": 30.0, "rollout/tokens_after_truncation": 0.0}
    train = {
        "train/tokens_trained": 12,
        "train/discarded/zero_std_group": 6,
        "train/discarded/mismatch_masked": 2,
        "train/loss": 0.1,
    }
    ledger, own = token_ledger(rollout, train, {"stale": 0.0, "failed_trial": 4.0, "dropped_group": 6.0})
    assert own == {"train/loss": 0.1}  # the counts are the ledger's now, not the update's columns
    row = ledger.metrics()
    assert row["ledger/trained"] == 12 and row["ledger/discarded/zero_std_group"] == 6
    assert list(ledger.discarded) == list(REASONS)  # every reason a column, in one order
    assert unaccounted(row) == 0
    seconds = {"rollout/tool_time_s": 1.0, "rollout/overhead_time_s": 0.25}
    times = time_ledger(2.5, seconds, engine_busy_s=4.0)
    assert times == {"ledger/trainer_s": 2.5, "ledger/sandbox_s": 1.25, "ledger/engine_s": 4.0}
    assert time_ledger(2.5, seconds, None, train_ranks=2) == {"ledger/trainer_s": 5.0, "ledger/sandbox_s": 1.25}
    total = run_ledger([row | times, row | times], gpu_hour=3.6, sandbox_hour=36.0)
    # (2 x (4 + 2.5) s) / 3600 x 3.6 + (2 x 1.25 s) / 3600 x 36 = 0.013 + 0.025
    assert total["ledger/cost"] == pytest.approx(0.038)
    assert total["ledger/cost_per_million_trained_tokens"] == pytest.approx(0.038 / 24 * 1e6)
    assert "ledger/cost" not in run_ledger([row | times], None, None)

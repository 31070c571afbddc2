"""A step's record: each section says what the step computed and what it took, and the two rows keep them apart."""

from grpoflow.figures import Figures
from grpoflow.ledger import token_ledger
from grpoflow.run.record import StepRecord


def _record() -> StepRecord:
    record = StepRecord(3)
    record.evaluation = {"eval/trained/pass_at_1": 0.5}
    record.rollout = Figures({"tokens_generated": 20.0, "reward_mean": 0.25}, {"wall_time_s": 7.0}).prefixed("rollout/")
    train = Figures({"loss": 0.1, "tokens_trained": 20}, {"tokens_per_s": 90.0}).prefixed("train/")
    record.tokens, train.computed = token_ledger(record.rollout.computed, train.computed, {})
    record.train = train
    record.times.train, record.times.wall = 2.0, 9.0
    return record


def test_the_rows_keep_computed_figures_and_seconds_apart():
    record = _record()
    metrics, timings = record.metrics(), record.timings()
    assert record.weight_version == "4"  # the updates in the weights after step 3
    assert list(metrics)[:4] == [
        "eval/trained/pass_at_1",
        "rollout/tokens_generated",
        "rollout/reward_mean",
        "train/loss",
    ]
    assert metrics["ledger/trained"] == 20.0 and "train/tokens_trained" not in metrics
    assert timings == {
        "time/eval_s": 0.0,
        "time/rollout_s": 0.0,
        "time/rollout_run_s": 0.0,
        "time/train_s": 2.0,
        "time/step_s": 0.0,
        "time/commit_s": 0.0,
        "time/wall_s": 9.0,
        "rollout/wall_time_s": 7.0,
        "train/tokens_per_s": 90.0,
    }  # no sync yet and no engine busy time: absent, not zero
    assert not set(metrics) & set(timings)
    assert record.to_json() == {"step": 3, "metrics": metrics, "timings": timings}


def test_every_sync_of_a_step_counts_its_bytes_and_seconds():
    record = _record()
    record.add_sync({"sync/bytes": 100.0, "sync/probe_gap": 0.5}, 1.5)
    record.add_sync({"sync/bytes": 50.0, "sync/probe_gap": 0.25}, 0.5)
    assert record.sync == {"sync/bytes": 150.0, "sync/probe_gap": 0.25}  # the last probe's gap
    assert record.timings()["time/sync_s"] == 2.0
    assert list(record.metrics())[-2:] == ["sync/bytes", "sync/probe_gap"]

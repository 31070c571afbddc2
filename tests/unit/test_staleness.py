"""`drop_stale`: which samples a step may train on under `train.max_staleness`, and what it reports."""

from grpoflow.samples import Sample
from grpoflow.scoring.groups import drop_foreign, drop_stale, sample_version
from tests.fakes.samples import make_sample


def _sample(group: str, k: int, version: str | None, generated: int = 2) -> Sample:
    return make_sample(group, k, mask=[0] + [1] * generated, weight_version=version)


def test_a_group_with_one_sample_past_the_bound_is_dropped_whole_and_counted():
    samples = [_sample("g", 0, "5"), _sample("g", 1, "3", generated=40), _sample("h", 0, "5"), _sample("h", 1, "4")]
    kept, m = drop_stale(samples, step=6, max_staleness=2)
    assert [s.rollout_id for s in kept] == ["h-0", "h-1"]
    assert m == {
        "staleness/1": 2.0,
        "staleness/2": 1.0,
        "staleness/3": 1.0,
        "stale_dropped": 2.0,
        "stale_dropped_groups": 1.0,
        "stale_dropped_tokens_mean": 21.0,  # the long episode shows in what was dropped
        "stale_dropped_tokens_max": 40,
    }


def test_within_the_bound_nothing_is_dropped():
    samples = [_sample("g", 0, "3"), _sample("g", 1, "4")]
    kept, m = drop_stale(samples, step=4, max_staleness=1)
    assert kept == samples and m == {
        "staleness/0": 1.0,
        "staleness/1": 1.0,
        "stale_dropped": 0.0,
        "stale_dropped_groups": 0.0,
    }
    assert drop_stale(samples, step=5, max_staleness=1)[0] == []


def test_a_sample_of_unknown_version_is_past_any_bound():
    """A replica that restarted on its own weights reports a version that is no number (SGLang's "default"): its
    samples are not the run's policy's, so their group does not train, and the count says why."""
    samples = [_sample("g", 0, "default"), _sample("g", 1, "4"), _sample("h", 0, "4"), _sample("h", 1, None)]
    assert sample_version(samples[0]) is None and sample_version(samples[1]) == 4
    kept, m = drop_stale(samples, step=4, max_staleness=16)
    assert kept == [] and m["staleness/unknown"] == 2.0 and m["stale_dropped_groups"] == 2.0


def test_synchronous_training_drops_a_group_generated_on_weights_not_the_trainer_s():
    """max_staleness 0: a replica restarted on its own weights ("default") or still on the last step's serves a
    group; that group is dropped whole and counted, never trained on as fresh."""
    samples = [
        _sample("g", 0, "3"),
        _sample("g", 1, "default", generated=9),
        _sample("h", 0, "3"),
        _sample("h", 1, "3"),
        _sample("k", 0, "2"),
    ]
    kept, m = drop_foreign(samples, step=3)
    assert [s.rollout_id for s in kept] == ["h-0", "h-1"]
    assert m == {
        "stale_dropped": 3.0,
        "stale_dropped_groups": 2.0,
        "stale_dropped_tokens_mean": 13 / 3,
        "stale_dropped_tokens_max": 9,
    }


def test_synchronous_training_keeps_fresh_and_failed_samples_and_reports_nothing():
    samples = [_sample("g", 0, "3"), _sample("g", 1, None, generated=0)]  # a trial that failed before generating
    assert drop_foreign(samples, step=3) == (samples, {})

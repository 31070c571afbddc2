"""The evaluation inside a train run: fixed seeds for every evaluation, intervals that cover, paired changes with
intervals clustered by instance or family."""

import math
import random

import pytest

from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.trials import plan_group_trials
from grpoflow.samples import Sample
from grpoflow.scoring.evaluation import (
    MIN_CLUSTERS,
    GraderNoise,
    base_pass_rates,
    before_after_lines,
    clustered_change,
    eval_metrics,
    eval_prompts,
    eval_specs,
    judge_change,
    reward_gain,
    task_rewards,
    wilson_interval,
)


def _prompt(name: str, split: str) -> PromptRecord:
    return PromptRecord(instance_id=name, task_path=f"/t/{name}", instruction="do it", split=split)


def _sample(task: str, k: int, reward: float | None, exit_status: str = "Submitted") -> Sample:
    return Sample(
        run_id="r",
        step=0,
        instance_id=task,
        group_id=f"g-{task}",
        sample_index=k,
        rollout_id=f"{task}-{k}",
        tokens=[1, 2],
        loss_mask=[0, 1],
        rollout_logprobs=[0.0, -1.0],
        prompt_len=1,
        reward=reward,
        status="FAILED" if reward is None else "COMPLETED",
        exit_status=exit_status,
    )


def test_every_evaluation_runs_the_same_trials_and_none_of_the_training_ones():
    prompts = [_prompt("a", "train"), _prompt("b", "train"), _prompt("c", "eval")]
    splits = eval_prompts(prompts)
    assert {k: [p.instance_id for p in v] for k, v in splits.items()} == {"trained": ["a", "b"], "heldout": ["c"]}
    first, later = (eval_specs("trained", splits["trained"], v, 3, seed=7) for v in (0, 12))
    assert [s.seed for s in first] == [s.seed for s in later]  # only the weights differ between them
    assert len({s.seed for s in first}) == 6
    assert first[0].rollout_id == "eval0-trained-a-0" and later[0].rollout_id == "eval12-trained-a-0"
    training = {s.seed for step in range(50) for s in plan_group_trials(splits["trained"], step, 3, 7)}
    assert not training & {s.seed for s in first}


def test_wilson_interval_is_inside_0_1_and_covers_at_about_95_percent():
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    lo, hi = wilson_interval(5, 10)
    assert lo < 0.5 < hi and hi - lo < 0.6
    rng = random.Random(0)
    p, n, runs = 0.3, 40, 2000
    covered = sum(
        lo <= p <= hi for lo, hi in (wilson_interval(sum(rng.random() < p for _ in range(n)), n) for _ in range(runs))
    )
    assert 0.93 <= covered / runs <= 0.97


def test_clustered_change_covers_the_true_difference_when_clusters_differ():
    # 20 clusters of 4 pairs; each cluster's gain probability is its own (0 or 0.5, half each): pairs within a
    # cluster are alike, so the truth is the mean over clusters, 0.25 of the pairs that failed before (all here)
    rng = random.Random(1)
    runs, hits = 150, 0
    for _ in range(runs):
        clusters = {}
        for c in range(20):
            p = rng.choice((0.0, 0.5))
            clusters[f"c{c}"] = [(False, rng.random() < p) for _ in range(4)]
        _, lo, hi = clustered_change(clusters, resamples=400, seed=rng.randrange(10**6))
        hits += lo <= 0.25 <= hi
    assert 0.88 <= hits / runs <= 0.99
    # the same pairs give the same interval (the verdict of a rerun is the verdict of the run)
    pairs = {f"c{c}": [(False, c < 3), (True, c != 9)] + [(c % 2 == 0, True)] * (c % 4) for c in range(10)}
    orders = [list(pairs.items()) for _ in range(5)]
    for i, order in enumerate(orders):
        random.Random(i).shuffle(order)
    assert {clustered_change(dict(order)) for order in orders} == {clustered_change(pairs)}
    # every cluster gained: an interval of one point, far from zero
    assert clustered_change({f"c{c}": [(False, True)] for c in range(10)}) == (1.0, 1.0, 1.0)


def test_gains_in_a_few_instances_are_significant_per_trial_and_not_clustered():
    """Ten instances of four trials; two instances gained all four, none lost: eight of forty pairs gained. Counted
    as forty independent pairs the gain clears zero; resampled by instance (two of ten clusters carry it) it does
    not, and the verdict says so."""
    base = [_sample(f"i{i}", k, 0.0) for i in range(10) for k in range(4)]
    now = [_sample(f"i{i}", k, float(i < 2)) for i in range(10) for k in range(4)]
    per_trial = {f"{i}-{k}": [(False, i < 2)] for i in range(10) for k in range(4)}
    change, lo, _ = clustered_change(per_trial)
    assert change == 0.2 and lo > 0
    m = eval_metrics("trained", now, base)
    assert m["eval/trained/pass_at_1_change"] == 0.2 and m["eval/trained/clusters"] == 10
    assert m["eval/trained/pass_at_1_change_ci95_low"] <= 0 < m["eval/trained/pass_at_1_change_ci95_high"]
    [line] = before_after_lines(eval_metrics("trained", base), m)
    assert line.endswith(": no significant change (40 paired trials in 10 clusters)")


def test_held_out_sides_cluster_by_family_and_too_few_clusters_are_not_judged():
    base = [_sample(f"i{i}", k, 0.0) for i in range(10) for k in range(2)]
    now = [_sample(f"i{i}", k, 1.0) for i in range(10) for k in range(2)]
    families = {f"i{i}": f"f{i % 5}" for i in range(10)}  # ten instances of five families
    by_instance = eval_metrics("trained", now, base, families)
    by_family = eval_metrics("heldout", now, base, families)
    assert (by_instance["eval/trained/clusters"], by_family["eval/heldout/clusters"]) == (10, 5)
    assert "eval/heldout/pass_at_1_change_ci95_low" not in by_family and 5 < MIN_CLUSTERS
    [line] = before_after_lines(eval_metrics("heldout", base, None, families), by_family)
    assert "change +1.000 [too few clusters]: not judged (20 paired trials in 5 clusters)" in line
    # a split by task names no family: each held-out instance is its own cluster
    assert eval_metrics("heldout", now, base)["eval/heldout/clusters"] == 10


def test_eval_metrics_pass_rates_exits_tasks_and_change_since_the_base():
    base = [_sample("a", 0, 0.0), _sample("a", 1, 1.0), _sample("b", 0, 0.0), _sample("b", 1, 0.0)]
    now = [_sample("a", 0, 1.0), _sample("a", 1, 1.0), _sample("b", 0, 1.0), _sample("b", 1, None, "SandboxError")]
    m = eval_metrics("trained", now, base)
    assert m["eval/trained/trials"] == 4 and m["eval/trained/scored"] == 3
    assert m["eval/trained/pass_at_1"] == 1.0 and m["eval/trained/pass_at_k"] == 1.0
    assert m["eval/trained/exit/Submitted"] == 3 and m["eval/trained/exit/SandboxError"] == 1
    assert m["eval/trained/task/a"] == 1.0 and m["eval/trained/task/b"] == 1.0
    # the failed trial is left out of the pairing and counted: 3 pairs, changes 1, 0, 1, over 2 instances
    assert m["eval/trained/pass_at_1_change"] == pytest.approx(2 / 3) and m["eval/trained/paired_trials"] == 3
    assert m["eval/trained/unpaired_trials"] == 1 and m["eval/trained/clusters"] == 2
    assert "eval/trained/pass_at_1_change_ci95_low" not in m  # two clusters: no interval to sign
    assert "eval/trained/pass_at_1_change" not in eval_metrics("trained", base)
    first = eval_metrics("trained", base)
    assert base_pass_rates(first) == {"a": 0.5, "b": 0.0}
    [line] = before_after_lines(first, m)
    assert line.startswith("trained tasks:") and "0.250 [" in line and "-> 1.000 [" in line
    assert line.endswith(
        "+0.667 [too few clusters]: not judged (3 paired trials in 2 clusters, 1 unpaired (a failed side))"
    )


def test_task_rewards_are_per_task_means_of_the_scored_trials():
    samples = [_sample("a", 0, 1.0), _sample("a", 1, 0.0), _sample("b", 0, 0.5), _sample("b", 1, None, "AgentError")]
    assert task_rewards(samples) == {"a": 0.5, "b": 0.5}


def test_reward_gain_takes_the_task_difficulty_out():
    rates = {"easy": 0.75, "hard": 0.0}
    base_like = [_sample("easy", k, float(k < 3)) for k in range(4)] + [_sample("hard", k, 0.0) for k in range(4)]
    assert reward_gain(base_like, rates) == 0.0  # whichever tasks the step drew
    assert reward_gain(base_like[:4], rates) == 0.0
    better = [_sample("hard", 0, 1.0), _sample("hard", 1, 0.0)]
    assert reward_gain(better, rates) == 0.5
    assert math.isnan(reward_gain([_sample("unseen", 0, 1.0)], rates))


def _split_rows(names: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Metrics rows of a base evaluation and a later one, for each named side: 20 trials of ten tasks each (two
    trials a task), 4 passed at first, then 14, 4 and 0."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for name, passed in zip(names, (14, 4, 0)):
        base = [_sample(f"{name}-t{k // 2}", k % 2, float(k < 4)) for k in range(20)]
        now = [_sample(f"{name}-t{k // 2}", k % 2, float(k < passed)) for k in range(20)]
        first |= eval_metrics(name, base)
        last |= eval_metrics(name, now, base)
    return first, last


def test_the_verdict_has_three_rows_with_unseen_families_and_two_as_before_without():
    first, last = _split_rows(["trained", "heldout", "unseen"])
    lines = before_after_lines(first, last)
    assert [line.split(":")[0] for line in lines] == [
        "trained tasks",
        "held-out instances of trained families",
        "unseen families",
    ]
    assert len({line.index("pass@1") for line in lines}) == 1  # the rows line up
    assert lines[0].endswith(": better (20 paired trials in 10 clusters)") and "-> 0.700 [" in lines[0]
    assert lines[1].endswith(": no significant change (20 paired trials in 10 clusters)")
    assert "change +0.000 [+0.000, +0.000]" in lines[1]
    assert "pass@1 0.200 [0.081, 0.416] -> 0.000 [0.000, 0.161], change -0.200 [" in lines[2]
    # a split by task: the two rows exactly as before, titles padded to 16
    first, last = _split_rows(["trained", "heldout"])
    two = before_after_lines(first, last)
    assert [line[:23] for line in two] == ["trained tasks:   pass@1", "held-out tasks:  pass@1"]
    assert two[0] == lines[0].replace("trained tasks:" + " " * 26, "trained tasks:   ")


def test_a_change_is_judged_against_twice_its_rows_grader_noise():
    noise = GraderNoise(2, 20)  # a tenth of the regrades disagreed: either pass rate may be off by 0.1
    assert judge_change(0.21, 0.5, noise) == "better" and judge_change(-0.5, -0.21, noise) == "worse"
    assert judge_change(0.2, 0.5, noise) == "within grader noise"  # clears 0, not 0.2
    assert judge_change(-0.5, -0.05, noise) == "within grader noise"
    assert judge_change(-0.1, 0.5, noise) == "no significant change"
    assert judge_change(0.01, 0.5, None) == "better"  # not measured: zero, as without regrades
    assert judge_change(0.01, 0.5, GraderNoise(0, 40)) == "better"
    assert judge_change(None, None, noise) == "not judged"


def test_the_verdict_prints_each_rows_grader_noise_and_weighs_the_change_by_it():
    """A verifier that alternates (every other regrade disagrees) makes the trained row's gain, clear of zero,
    "within grader noise"; a deterministic one (no disagreement) leaves it "better"; a side not regraded says so."""
    first, last = _split_rows(["trained", "heldout"])
    assert last["eval/trained/pass_at_1_change_ci95_low"] > 0
    quiet = before_after_lines(first, last, {"trained": GraderNoise(0, 40)})
    assert quiet[0].endswith(
        ": better (20 paired trials in 10 clusters; grader noise 0.000 (0 of 40 regrades disagreed))"
    )
    assert quiet[1].endswith("(20 paired trials in 10 clusters; grader noise not measured)")
    alternating = before_after_lines(first, last, {"trained": GraderNoise(20, 40), "heldout": GraderNoise(0, 40)})
    assert alternating[0].endswith(
        ": within grader noise (20 paired trials in 10 clusters; grader noise 0.500 (20 of 40 regrades disagreed))"
    )
    assert before_after_lines(first, last)[0].endswith(": better (20 paired trials in 10 clusters)")  # no regrades


def test_eval_prompts_separate_unseen_families_from_held_out_instances():
    def marked(name: str, split: str, side: str) -> PromptRecord:
        return _prompt(name, split).model_copy(update={"metadata": {"split_family": "f", "split_side": side}})

    prompts = [marked("a", "train", "trained"), marked("b", "eval", "heldout"), marked("c", "eval", "unseen")]
    splits = eval_prompts(prompts)
    assert {k: [p.instance_id for p in v] for k, v in splits.items()} == {
        "trained": ["a"],
        "heldout": ["b"],
        "unseen": ["c"],
    }

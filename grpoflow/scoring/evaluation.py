"""Evaluating the policy inside a train run: fixed prompts and seeds, so two evaluations differ only by the weights.

An evaluation runs `train.eval.samples_per_prompt` trials per prompt of each side of the split
(`grpoflow.prepare.prompts.side_of`): `trained` (the train split, the tasks the run trains on), `heldout` (the
eval split, never trained on) and, when the split is by task family, `unseen` (the eval split's instances of
families none of whose instances is trained; `heldout` then holds the held-out instances of trained families).
Seeds depend on the prompt and the sample only (`EVAL_SEED_STEP`), so the run's first evaluation (the base policy) and every later one run the same
trials. Its figures go into the metrics row of the step whose weights it measured (`step` = updates so far):
pass@1 with a 95 % Wilson interval, pass@k, exit-status counts, per-task pass rates and, against the first
evaluation, the change in pass@1 over the paired trials with a clustered 95 % interval.

What each row's change estimates: `trained`, the change on the trained instances themselves (a new draw of
sampling noise on the same tasks); `heldout` and `unseen`, the change on other instances of the task families
behind them (trained families, families never trained). Trials of one instance share its difficulty, and
instances of one family share their template, so pairs are not independent: the interval is a cluster bootstrap
(`clustered_change`) that resamples instances for `trained` and families for the held-out sides (instances again
where the split is by task). With fewer than `MIN_CLUSTERS` clusters it gives none ("too few clusters"): a
percentile bootstrap over a handful of clusters is too narrow to sign. Trials with a failed side (no verifier
reward before or after) are counted (`unpaired_trials`), never paired.

Grader noise: a verifier can give one trial another verdict when graded again (it is flaky, or it reads state the
trial did not leave behind). The run regrades its verdict's evaluation trials (`grpoflow.run.regrade`); the share
that disagreed is each row's noise rate r. Each of the two pass rates a change compares can be off by up to r, so
their difference by up to 2r: a change is called better or worse only when its interval clears 2r on that side
(`judge_change`), and "within grader noise" when it clears 0 but not 2r.

The rollout's own reward depends on which prompts a step drew; `reward_gain` takes each task's base pass rate
away, so its curve shows what the training changed.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from grpoflow.config import RunConfig
from grpoflow.paths import RunPaths
from grpoflow.prepare.prompts import PromptRecord, family_of, side_of
from grpoflow.rollout.journal import SAMPLES, read_samples
from grpoflow.rollout.step import RolloutHooks, RolloutSetup, collect_with
from grpoflow.rollout.trials import EVAL_SEED_STEP, TrialSpec, plan_group_trials
from grpoflow.samples import PASS, Sample

# metric-key name of an evaluated side of the split -> the prompts.jsonl split its prompts are in
EVAL_SPLITS = {"trained": "train", "heldout": "eval", "unseen": "eval"}
Z95 = 1.959963984540054
MIN_CLUSTERS = 8
BOOTSTRAP_RESAMPLES = 4000


def eval_prompts(prompts: Sequence[PromptRecord]) -> dict[str, list[PromptRecord]]:
    """The prompts of each evaluated side (in prompts.jsonl order); sides without prompts are left out."""
    out = {name: [p for p in prompts if side_of(p) == name] for name in EVAL_SPLITS}
    return {name: ps for name, ps in out.items() if ps}


def eval_specs(name: str, prompts: Sequence[PromptRecord], version: int, n: int, seed: int) -> list[TrialSpec]:
    """The trials of split `name`'s evaluation of weight version `version`: the same seeds for every version."""
    return plan_group_trials(prompts, EVAL_SEED_STEP, n, seed, prefix=f"eval{version}-{name}")


def eval_plan(prompts: Sequence[PromptRecord], version: int, n: int, seed: int) -> dict[str, list[TrialSpec]]:
    """Split name -> the trials of its evaluation of weight version `version`."""
    return {name: eval_specs(name, ps, version, n, seed) for name, ps in eval_prompts(prompts).items()}


def eval_families(prompts: Sequence[PromptRecord]) -> dict[str, str]:
    """Instance id -> its task family, for the prompts a split by family marked (the held-out sides' clusters)."""
    return {p.instance_id: family for p in prompts if (family := family_of(p)) is not None}


def plan_metrics(
    plan: Mapping[str, Sequence[TrialSpec]],
    samples: Sequence[Sample],
    base: Sequence[Sample] | None,
    families: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """The `eval/<split>/...` metrics of an evaluation's samples, each split compared with the same split of the
    run's first evaluation (`base`, its samples; None: nothing to compare with), clustered by `families`."""
    metrics: dict[str, float] = {}
    for name, group in plan.items():
        ids = {s.rollout_id for s in group}
        baseline = [s for s in base if s.group_id.startswith(f"eval0-{name}-")] if base is not None else None
        metrics |= eval_metrics(name, [s for s in samples if s.rollout_id in ids], baseline, families)
    return metrics


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95 % score interval of a binomial proportion (sound at 0 and n successes, unlike the normal one)."""
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))  # p inside, whatever the rounding


def clustered_change(
    clusters: Mapping[str, Sequence[tuple[bool, bool]]], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float | None, float | None]:
    """Change in pass rate over paired trials (passed before, passed after) grouped by cluster, and its 95 %
    percentile interval from a cluster bootstrap: `resamples` draws of as many clusters as there are, with
    replacement, each draw's change the pooled one of its clusters' pairs. Seeded: the same pairs give the same
    interval. With fewer than `MIN_CLUSTERS` clusters the interval is (None, None)."""
    # in cluster-name order: the draws must not depend on the order the trials were recorded in
    per = [(sum(a - b for b, a in pairs), len(pairs)) for _, pairs in sorted(clusters.items()) if pairs]
    n = sum(size for _, size in per)
    if n == 0:
        return float("nan"), None, None
    change = sum(d for d, _ in per) / n
    if len(per) < MIN_CLUSTERS:
        return change, None, None
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        picked = rng.choices(per, k=len(per))
        draws.append(sum(d for d, _ in picked) / sum(size for _, size in picked))
    draws.sort()
    return change, draws[int(0.025 * (resamples - 1))], draws[int(math.ceil(0.975 * (resamples - 1)))]


def _passed(s: Sample) -> float:
    return float(s.reward is not None and s.reward >= PASS)


def _trials(samples: Sequence[Sample]) -> dict[tuple[str, int], Sample]:
    """One sample per trial (the first segment stands for a compacted one), keyed by (task, sample index): the
    key pairs a trial with the same trial of another evaluation."""
    out: dict[tuple[str, int], Sample] = {}
    for s in samples:
        out.setdefault((s.instance_id, s.sample_index), s)
    return out


def eval_metrics(
    name: str,
    samples: Sequence[Sample],
    baseline: Sequence[Sample] | None = None,
    families: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """`eval/<name>/...` figures of one split's evaluation; with `baseline` (the run's first evaluation of the
    split) also the change in pass@1 over the trials both scored, its interval clustered by instance (`trained`)
    or by family (the held-out sides; `families`: instance id -> family, the instance itself where absent). A
    trial without a verifier reward (FAILED) is counted under its exit status and left out of pass rates."""
    trials = _trials(samples)
    scored = [s for s in trials.values() if s.reward is not None]
    wins = int(sum(_passed(s) for s in scored))
    lo, hi = wilson_interval(wins, len(scored))
    by_task: dict[str, list[Sample]] = defaultdict(list)
    for s in scored:
        by_task[s.instance_id].append(s)
    p = f"eval/{name}/"
    m: dict[str, float] = {
        p + "trials": float(len(trials)),
        p + "scored": float(len(scored)),
        p + "pass_at_1": wins / len(scored) if scored else float("nan"),
        p + "pass_at_1_ci95_low": lo,
        p + "pass_at_1_ci95_high": hi,
        p + "pass_at_k": statistics.fmean(any(map(_passed, g)) for g in by_task.values()) if by_task else float("nan"),
        p + "reward_mean": statistics.fmean(s.reward for s in scored) if scored else float("nan"),
    }
    for status, count in sorted(Counter(s.exit_status for s in trials.values()).items()):
        m[f"{p}exit/{status}"] = float(count)
    for task, group in sorted(by_task.items()):
        m[f"{p}task/{task}"] = statistics.fmean(map(_passed, group))
    if baseline is not None:
        base = _trials(baseline)
        keys = [k for k, s in trials.items() if s.reward is not None and k in base and base[k].reward is not None]
        of = (families or {}) if name != "trained" else {}  # instance -> its cluster, where not itself
        clusters: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
        for k in keys:
            clusters[of.get(k[0], k[0])].append((_passed(base[k]) > 0, _passed(trials[k]) > 0))
        mean, low, high = clustered_change(clusters)
        m.update(
            {
                p + "pass_at_1_change": mean,
                p + "paired_trials": float(len(keys)),
                p + "unpaired_trials": float(len(set(trials) | set(base)) - len(keys)),
                p + "clusters": float(len(clusters)),
            }
        )
        if low is not None and high is not None:
            m |= {p + "pass_at_1_change_ci95_low": low, p + "pass_at_1_change_ci95_high": high}
    return m


def base_pass_rates(row: Mapping[str, float]) -> dict[str, float]:
    """Per-task pass rates of the `trained` split from an evaluation's metrics row."""
    prefix = "eval/trained/task/"
    return {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)}


def task_rewards(samples: Sequence[Sample]) -> dict[str, float]:
    """Mean reward per task of a rollout step's scored trials: each task's own curve across the steps."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for s in _trials(samples).values():
        if s.reward is not None:
            by_task[s.instance_id].append(s.reward)
    return {task: statistics.fmean(rewards) for task, rewards in sorted(by_task.items())}


def reward_gain(samples: Sequence[Sample], base_rates: Mapping[str, float]) -> float:
    """Mean over a rollout step's scored trials of (passed - the task's pass rate under the base policy): zero
    while the policy is the base one, whichever prompts the step drew."""
    scored = [s for s in _trials(samples).values() if s.reward is not None and s.instance_id in base_rates]
    return statistics.fmean(_passed(s) - base_rates[s.instance_id] for s in scored) if scored else float("nan")


SPLIT_LABELS = {"trained": "trained tasks", "heldout": "held-out tasks", "unseen": "unseen families"}
# `heldout` of a split by family (one with unseen families): the eval instances whose families are trained
FAMILY_HELDOUT_LABEL = "held-out instances of trained families"


def split_labels(*rows: Mapping[str, float]) -> dict[str, str]:
    """Each evaluated side's title; `heldout` says what it holds when the rows have an `unseen` side (a split by
    family, which always makes one when it holds anything out: `grpoflow.prepare.split`)."""
    if any("eval/unseen/pass_at_1" in row for row in rows):
        return SPLIT_LABELS | {"heldout": FAMILY_HELDOUT_LABEL}
    return SPLIT_LABELS


def _interval(row: Mapping[str, float], key: str, signed: bool = False) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    if key + "_ci95_low" not in row:  # a change over too few clusters: no interval to sign
        return f"{f.format(row[key])} [too few clusters]"
    return f"{f.format(row[key])} [{f.format(row[key + '_ci95_low'])}, {f.format(row[key + '_ci95_high'])}]"


def _pairs(row: Mapping[str, float], p: str) -> str:
    """How many paired trials a change rests on, in how many clusters, and how many trials had a failed side."""
    out = f"{int(row.get(p + 'paired_trials', row[p + 'scored']))} paired trials"
    if p + "clusters" in row:
        out += f" in {int(row[p + 'clusters'])} clusters"
    if row.get(p + "unpaired_trials"):
        out += f", {int(row[p + 'unpaired_trials'])} unpaired (a failed side)"
    return out


def evaluation_lines(row: Mapping[str, float], label: str) -> list[str]:
    """One line per evaluated split of an evaluation's metrics: pass@1 with its 95 % interval, and the change
    since the base policy when the row has it."""
    lines = []
    for name, title in split_labels(row).items():
        p = f"eval/{name}/"
        if p + "pass_at_1" not in row:
            continue
        line = (
            f"evaluation, {label}: {title} pass@1 {_interval(row, p + 'pass_at_1')} "
            f"({int(row[p + 'scored'])} trials), pass@k {row[p + 'pass_at_k']:.2f}"
        )
        if p + "pass_at_1_change" in row:
            line += f"; change since the base policy {_interval(row, p + 'pass_at_1_change', signed=True)}"
        lines.append(line)
    return lines


@dataclass(frozen=True)
class GraderNoise:
    """Regrades of one side's evaluation trials: how many gave another reward than the run recorded, of how many."""

    disagreed: int
    regraded: int

    @property
    def rate(self) -> float:
        return self.disagreed / self.regraded

    def __str__(self) -> str:
        return f"grader noise {self.rate:.3f} ({self.disagreed} of {self.regraded} regrades disagreed)"


def judge_change(low: float | None, high: float | None, noise: GraderNoise | None) -> str:
    """The word for a change with 95 % interval [low, high]: `better`/`worse` when the interval clears twice the
    grader-noise rate on that side (zero when the noise was not measured), `within grader noise` when it clears
    zero but not that, `not judged` without an interval (too few clusters)."""
    if low is None or high is None:
        return "not judged"
    margin = 2 * noise.rate if noise is not None else 0.0
    if low > margin:
        return "better"
    if high < -margin:
        return "worse"
    return "within grader noise" if low > 0 or high < 0 else "no significant change"


def before_after_lines(
    first: Mapping[str, float], last: Mapping[str, float], noise: Mapping[str, GraderNoise] | None = None
) -> list[str]:
    """The run's verdict: per side of the split (two rows, or three with unseen families), pass@1 of the base
    policy -> the trained one, the paired change and the verdict on it (`judge_change`) with the side's grader
    noise (`noise`: side -> its regrades; None: the run regraded nothing, and the lines say nothing of it; a side
    missing from it: not measured); the titles padded to one width, 16 as with two rows."""
    lines = []
    titles = {
        name: title
        for name, title in split_labels(first, last).items()
        if f"eval/{name}/pass_at_1" in first and f"eval/{name}/pass_at_1_change" in last
    }
    width = max([16, *(len(title) + 1 for title in titles.values())])  # title and colon
    for name, title in titles.items():
        p = f"eval/{name}/"
        low, high = last.get(p + "pass_at_1_change_ci95_low"), last.get(p + "pass_at_1_change_ci95_high")
        side_noise = noise.get(name) if noise is not None else None
        said = "" if noise is None else f"; {side_noise or 'grader noise not measured'}"
        lines.append(
            f"{title + ':':{width}s} pass@1 {_interval(first, p + 'pass_at_1')} -> "
            f"{_interval(last, p + 'pass_at_1')}, change {_interval(last, p + 'pass_at_1_change', signed=True)}: "
            f"{judge_change(low, high, side_noise)} ({_pairs(last, p)}{said})"
        )
    return lines


def evaluate_policy(
    cfg: RunConfig,
    version: int,
    prompts: Sequence[PromptRecord],
    setup: RolloutSetup,
    paths: RunPaths,
    base: Path | None = None,
    hooks: RolloutHooks | None = None,
) -> dict[str, float]:
    """Evaluate the engine's weights (version `version`: updates so far) on the train tasks and the held-out
    ones (each side of the split), with the same trials as every other evaluation of the run; returns the `eval/...` metrics, each split
    compared with the evaluation whose details dir is `base` (default: the run's first one, version 0)."""
    plan = eval_plan(prompts, version, cfg.train.eval.samples_per_prompt, cfg.seed)
    specs = [s for group in plan.values() for s in group]
    trials, details = paths.eval_trials(version), paths.eval_details(version)
    result = asyncio.run(collect_with(cfg, version, specs, setup, trials, details, f"eval-{version}", hooks))
    if base is None and version > 0:
        base = paths.eval_details(0)
    baseline = read_samples(base) if base is not None and (base / SAMPLES).is_file() else None
    return plan_metrics(plan, result.samples, baseline, eval_families(prompts))

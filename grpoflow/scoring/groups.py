"""Which of a step's groups train: within the staleness bound, of the trainer's own weights; and the guard that
stops a run whose every trial fails (which samples a failed trial takes out: `samples.select_trainable`)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from grpoflow.errors import RolloutError
from grpoflow.samples import Sample


def sample_version(sample: Sample) -> int | None:
    """The number of updates in the weights that generated `sample`: its recorded `weight_version`; None when that
    is no number (a replica restarted on its own weights, SGLang's "default": they are not the run's)."""
    try:
        return int(sample.weight_version or "")
    except ValueError:
        return None


def drop_stale(samples: Sequence[Sample], step: int, max_staleness: int) -> tuple[list[Sample], dict[str, float]]:
    """The samples step `step` (whose trainer holds `step` updates) may train on: whole groups whose every sample
    is at most `max_staleness` updates old, so GRPO's group statistics stay whole; a sample of unknown version is
    past any bound. Metrics: how many samples each staleness had (`staleness/<k>`, `staleness/unknown`), and of
    the dropped ones how many, their groups, and their episode lengths (generated tokens), so a bound that starves
    long episodes shows."""
    age = {id(s): step - v if (v := sample_version(s)) is not None else None for s in samples}
    stale = {s.group_id for s in samples if age[id(s)] is None or age[id(s)] > max_staleness}
    counts = Counter(age.values())
    metrics = {f"staleness/{k}": float(counts[k]) for k in sorted(k for k in counts if k is not None)}
    if None in counts:
        metrics["staleness/unknown"] = float(counts[None])
    kept, dropped = _without_groups(samples, stale)
    return kept, metrics | dropped


def drop_foreign(samples: Sequence[Sample], step: int) -> tuple[list[Sample], dict[str, float]]:
    """Synchronous training's check (`train.max_staleness` 0): the samples step `step` may train on are those of
    the trainer's own weights, version `step`. A group with a sample generated on other weights (a replica
    restarted on its own, SGLang's "default") is dropped whole and counted as stale, never trained on as fresh; a
    sample that generated nothing (no version: a failed trial) is left to the failure policy. Metrics only when
    something was dropped."""
    foreign = {s.group_id for s in samples if s.weight_version is not None and sample_version(s) != step}
    if not foreign:
        return list(samples), {}
    return _without_groups(samples, foreign)


def _without_groups(samples: Sequence[Sample], groups: set[str]) -> tuple[list[Sample], dict[str, float]]:
    """`samples` less `groups`; how many samples and groups went, and their episode lengths (generated tokens),
    so a bound that starves long episodes shows."""
    kept = [s for s in samples if s.group_id not in groups]
    dropped = [s.n_generated for s in samples if s.group_id in groups]
    metrics = {"stale_dropped": float(len(dropped)), "stale_dropped_groups": float(len(groups))}
    if dropped:
        metrics |= {"stale_dropped_tokens_mean": statistics.fmean(dropped), "stale_dropped_tokens_max": max(dropped)}
    return kept, metrics


@dataclass
class FailedSteps:
    """Counts the steps in a row whose every trial failed (nothing was scored). A run whose sandboxes,
    agent or template fail every trial would otherwise commit checkpoints of unchanged weights and "succeed";
    after `limit` such steps it stops, naming the most common reasons."""

    limit: int
    streak: int = 0

    def record(self, step: int, samples: Sequence[Sample], trainable: Sequence[Sample]) -> None:
        if trainable or not samples or any(s.status != "FAILED" for s in samples):
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= self.limit:
            reasons = Counter(
                f"{s.exit_status}: {(s.exit_reason or '')[:120]}" for s in samples if s.status == "FAILED"
            )
            top = "; ".join(f"{n}x {r}" for r, n in reasons.most_common(3))
            raise RolloutError(
                f"steps {step - self.streak + 1}..{step}: every trial failed, nothing was trained "
                f"(train.max_failed_steps={self.limit}); most common: {top}"
            )

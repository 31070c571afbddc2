"""One training step's record, typed: each part of the step fills its own section as it runs, and the record
writes itself out as the step's metrics.jsonl row (what the step computed) and timings.jsonl row (what it took).

    record = StepRecord(step)            # weight_version: the updates in the weights after it
    record.evaluation = evaluate(...)    # `eval/...`, on evaluation steps
    record.rollout = ...                 # `rollout/...`: the trials, and what the filter left out
    record.train, record.tokens = ...    # `train/...`, and the token ledger (`grpoflow.ledger`)
    record.add_sync(moved, seconds)      # `sync/...`, once per weight sync of the step
    record.metrics(), record.timings()
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from grpoflow.figures import Figures
from grpoflow.ledger import TokenLedger


@dataclass
class StepTimes:
    """Wall-clock seconds of a step's parts (`time/<part>_s` in timings.jsonl)."""

    sync: float | None = None  # its weight syncs; None when it made none
    eval: float = 0.0
    rollout: float = 0.0  # the step waited for its rollout (one started ahead may have run beside the update)
    rollout_run: float = 0.0  # the rollout itself ran
    train: float = 0.0
    step: float = 0.0  # from the step's start to the end of its update
    commit: float = 0.0
    engine_busy: float | None = None  # the engines' compute, where they report it (the embedded engine)
    wall: float = 0.0  # the whole step, its syncs and commit included

    def timings(self) -> dict[str, float]:
        return {f"time/{part}_s": s for part, s in asdict(self).items() if s is not None}


@dataclass
class StepRecord:
    step: int
    weight_version: str = ""
    evaluation: dict[str, float] = field(default_factory=dict)
    rollout: Figures = field(default_factory=Figures)
    train: Figures = field(default_factory=Figures)
    tokens: TokenLedger | None = None
    sync: dict[str, float] = field(default_factory=dict)
    times: StepTimes = field(default_factory=StepTimes)
    ledger_seconds: dict[str, float] = field(default_factory=dict)  # `grpoflow.ledger.time_ledger`

    def __post_init__(self) -> None:
        self.weight_version = self.weight_version or str(self.step + 1)  # GRPO updates in the weights after it

    def add_sync(self, moved: dict[str, float], seconds: float) -> None:
        """A weight sync of the step: the bytes of every sync count, the other figures are the last sync's."""
        total = self.sync.get("sync/bytes", 0.0) + moved["sync/bytes"]
        self.sync |= moved
        self.sync["sync/bytes"] = total
        self.times.sync = (self.times.sync or 0.0) + seconds

    def metrics(self) -> dict[str, Any]:
        """The metrics.jsonl row: what the step computed, reproduced byte for byte by a deterministic rerun."""
        return {
            **self.evaluation,
            **self.rollout.computed,
            **self.train.computed,
            "weight_version": self.weight_version,
            **(self.tokens.metrics() if self.tokens is not None else {}),
            **self.sync,
        }

    def timings(self) -> dict[str, float]:
        """The timings.jsonl row: wall-clock seconds and rates."""
        return {**self.times.timings(), **self.rollout.seconds, **self.train.seconds, **self.ledger_seconds}

    def to_json(self) -> dict[str, Any]:
        """What `checkpoints/step_<N>/step.json` holds."""
        return {"step": self.step, "metrics": self.metrics(), "timings": self.timings()}

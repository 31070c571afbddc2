"""The rollout ledger: where every generated token of a step went, and what the step's parts took.

Every token the policy generated in a step's trials (`rollout/tokens_generated`) is either trained (it entered a
loss the optimizer stepped on) or discarded for one reason, the first that applies in the order the step applies
them:

- `stale`: its group had a sample older than `train.max_staleness` allows (`scoring.drop_stale`);
- `infrastructure`: its trial FAILED for the sandbox or the engine, after its retries (`SandboxError`,
  `EngineError`); `failed_trial`: its trial FAILED otherwise (no verifier reward); `dropped_group`: another trial
  of its group failed (`rollout.sandbox.on_retries_exhausted=drop_group`);
- `masked_overlong`: its trial was TRUNCATED and `train.loss.truncated=mask`;
- `zero_std_group`: its group's rewards were all equal (`train.loss.filter_zero_std`);
- `zero_advantage`, `nonfinite`: its optimizer minibatch was skipped (every advantage zero; a gradient norm not
  finite);
- `mismatch_masked`: trainer and engine disagreed on it beyond `train.loss.mismatch_band`.

So `ledger/generated` = `ledger/trained` + the sum of `ledger/discarded/<reason>` on every step (counts, in
metrics.jsonl). `ledger/after_truncation` says how many of the generated tokens came after a turn was cut off
(always 0 with the early exit). Seconds (timings.jsonl): `ledger/engine_s` (the engines' own compute),
`ledger/sandbox_s` (trials' commands and sandbox overhead, summed over trials), `ledger/trainer_s` (update,
commit, sync; once per trainer rank). With hourly rates (`report.cost_per_gpu_hour` for engine and trainer seconds,
`report.cost_per_sandbox_hour`) the run's summary prices a trained token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpoflow.samples import INFRASTRUCTURE_STATUSES, Sample

REASONS = (
    "stale",
    "infrastructure",
    "failed_trial",
    "dropped_group",
    "masked_overlong",
    "zero_std_group",
    "zero_advantage",
    "nonfinite",
    "mismatch_masked",
)
TRAIN_KEY = "discarded/"  # the prefix of the train step's own discard counts, and of `ledger/discarded/<reason>`


def tokens(samples: Sequence[Sample]) -> int:
    return sum(s.n_generated for s in samples)


def rollout_discards(
    rolled: Sequence[Sample], fresh: Sequence[Sample], trainable: Sequence[Sample]
) -> dict[str, float]:
    """What the rollout side discarded: `rolled` (every sample of the step), less the stale groups (`fresh`),
    less the failed trials and their groups (`trainable`)."""
    kept = {id(s) for s in trainable}
    dropped = [s for s in fresh if id(s) not in kept]
    infra = [s for s in dropped if s.status == "FAILED" and s.exit_status in INFRASTRUCTURE_STATUSES]
    return {
        "stale": float(tokens(rolled) - tokens(fresh)),
        "infrastructure": float(tokens(infra)),
        "failed_trial": float(tokens([s for s in dropped if s.status == "FAILED"]) - tokens(infra)),
        "dropped_group": float(tokens([s for s in dropped if s.status != "FAILED"])),
    }


@dataclass
class TokenLedger:
    """Where a step's generated tokens went: `generated` = `trained` + the sum of `discarded` (by reason)."""

    generated: float
    trained: float
    discarded: dict[str, float]  # every reason of REASONS, in its order
    after_truncation: float

    def metrics(self) -> dict[str, float]:
        return {
            "ledger/generated": self.generated,
            "ledger/trained": self.trained,
            **{f"ledger/{TRAIN_KEY}{r}": n for r, n in self.discarded.items()},
            "ledger/after_truncation": self.after_truncation,
        }


def token_ledger(
    rollout: dict[str, float], train: dict[str, float], rollout_discarded: dict[str, float]
) -> tuple[TokenLedger, dict[str, float]]:
    """The step's token ledger from its rollout's figures (`rollout/...`), the train step's (`train/...`, with
    its own counts: `train/tokens_trained`, `train/discarded/<reason>`) and the rollout side's discards; and the
    train step's figures without the counts the ledger took."""
    discarded = dict.fromkeys(REASONS, 0.0) | rollout_discarded
    counts = {"train/tokens_trained"}
    for key in [k for k in train if k.startswith(f"train/{TRAIN_KEY}")]:
        discarded[key.removeprefix(f"train/{TRAIN_KEY}")] += train[key]
        counts.add(key)
    ledger = TokenLedger(
        generated=rollout.get("rollout/tokens_generated", 0.0),
        trained=float(train.get("train/tokens_trained", 0.0)),
        discarded={r: float(n) for r, n in discarded.items()},
        after_truncation=rollout.get("rollout/tokens_after_truncation", 0.0),
    )
    return ledger, {k: v for k, v in train.items() if k not in counts}


def time_ledger(
    trainer_s: float, rollout_seconds: dict[str, float], engine_busy_s: float | None, train_ranks: int = 1
) -> dict[str, float]:
    """The seconds of the ledger: the trainer's (its update, commit and syncs) once per rank
    (`cluster.train_ranks`): each holds its device for the update; the sandboxes' from the rollout's
    (`rollout/tool_time_s` and `rollout/overhead_time_s`, summed over trials); the engines' compute
    (`engine_busy_s`, summed over replicas already), where they report it."""
    out = {
        "ledger/trainer_s": trainer_s * train_ranks,
        "ledger/sandbox_s": rollout_seconds.get("rollout/tool_time_s", 0.0)
        + rollout_seconds.get("rollout/overhead_time_s", 0.0),
    }
    if engine_busy_s is not None:
        out["ledger/engine_s"] = engine_busy_s
    return out


def unaccounted(row: dict[str, Any]) -> float:
    """Generated tokens neither trained nor discarded for a reason: 0 on a balanced row."""
    discarded = sum(v for k, v in row.items() if k.startswith(f"ledger/{TRAIN_KEY}"))
    return row.get("ledger/generated", 0.0) - row.get("ledger/trained", 0.0) - discarded


def run_ledger(rows: Sequence[dict[str, Any]], gpu_hour: float | None, sandbox_hour: float | None) -> dict[str, float]:
    """The run's totals over its steps' rows (metrics and timings merged), and with rates its cost per trained
    token. Engine seconds count only where the engine reported them (the embedded engine; SGLang does not)."""
    total: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            if k.startswith("ledger/"):
                total[k] = total.get(k, 0.0) + float(v)
    if total.get("ledger/trained") and (gpu_hour is not None or sandbox_hour is not None):
        gpu_s = total.get("ledger/engine_s", 0.0) + total.get("ledger/trainer_s", 0.0)
        cost = gpu_s / 3600 * (gpu_hour or 0.0) + total.get("ledger/sandbox_s", 0.0) / 3600 * (sandbox_hour or 0.0)
        total["ledger/cost"] = cost
        total["ledger/cost_per_million_trained_tokens"] = cost / total["ledger/trained"] * 1e6
    return total


def ledger_table(total: dict[str, float]) -> list[dict[str, Any]]:
    """Rows for the run's ledger table artifact: tokens by fate, then seconds and cost."""
    generated = total.get("ledger/generated", 0.0)
    rows = [{"item": "generated tokens", "value": generated, "share": 1.0 if generated else None}]
    rows.append({"item": "trained tokens", "value": total.get("ledger/trained", 0.0), "share": None})
    for r in REASONS:
        rows.append({"item": f"discarded: {r}", "value": total.get(f"ledger/{TRAIN_KEY}{r}", 0.0), "share": None})
    for row in rows[1:]:
        row["share"] = row["value"] / generated if generated else None
    rows.append({"item": "of the generated, after a truncation", "value": total.get("ledger/after_truncation", 0.0)})
    for key, label in (
        ("engine_s", "engine seconds"),
        ("sandbox_s", "sandbox seconds"),
        ("trainer_s", "trainer seconds"),
    ):
        if f"ledger/{key}" in total:
            rows.append({"item": label, "value": total[f"ledger/{key}"]})
    for key, label in (("cost", "cost"), ("cost_per_million_trained_tokens", "cost per million trained tokens")):
        if f"ledger/{key}" in total:
            rows.append({"item": label, "value": total[f"ledger/{key}"]})
    if "ledger/cost" in total and "ledger/engine_s" not in total:
        rows.append(
            {"item": "cost leaves the engine out: it reported no busy seconds (SGLang does not)", "value": None}
        )
    return rows

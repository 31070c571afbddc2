"""What a person reads about a run: metrics.jsonl (one line per step), timings.jsonl, TensorBoard scalars,
curves, a summary.

A step's row comes in two parts, as its stages made them (`grpoflow.run.record.StepRecord`): what the run
computed goes to `metrics.jsonl`, so a rerun on the deterministic path reproduces it byte for byte, and the
wall-clock figures (seconds, rates per second) to `timings.jsonl`; both files carry the same `step` key, and
TensorBoard gets both.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

from grpoflow.fileio import append_jsonl
from grpoflow.paths import RunPaths
from grpoflow.scoring.evaluation import SPLIT_LABELS, split_labels


def timings_path(metrics_path: Path) -> Path:
    return RunPaths(Path(metrics_path).parent).timings  # beside it, in the same run dir


def append_step(metrics_path: Path, step: int, metrics: dict[str, Any], timings: dict[str, float]) -> None:
    """Append the step's row to metrics.jsonl and to timings.jsonl."""
    append_jsonl(Path(metrics_path), {"step": step, **metrics})
    append_jsonl(timings_path(metrics_path), {"step": step, **timings})


class MetricsLog:
    """Appends one record per step to `metrics.jsonl` / `timings.jsonl` and mirrors its numbers as TensorBoard
    scalars."""

    def __init__(self, metrics_path: Path, tb_dir: Path):
        from tensorboardX import SummaryWriter

        self.path = Path(metrics_path)
        self.writer = SummaryWriter(logdir=str(tb_dir), flush_secs=10)

    def log(self, step: int, metrics: dict[str, Any], timings: dict[str, float]) -> None:
        append_step(self.path, step, metrics, timings)
        self.scalars(step, metrics | timings)

    def scalars(self, step: int, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl records; a torn last line (a crash mid-append) is skipped, any other bad line is an error."""
    lines = Path(path).read_text(encoding="utf-8").splitlines() if Path(path).exists() else []
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}:{i + 1}: not valid JSON") from None
    return out


def has_row(metrics_path: Path, step: int) -> bool:
    return any(r["step"] == step for r in read_metrics(metrics_path))


def read_step_records(metrics_path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows with their timings.jsonl row merged in (same step), for tables and summaries."""
    timings = {r["step"]: r for r in read_metrics(timings_path(metrics_path))}
    return [{**r, **timings.get(r["step"], {})} for r in read_metrics(metrics_path)]


CURVES = [
    ("rollout/reward_mean", "mean reward"),
    ("rollout/pass_at_k", "pass@k"),
    ("rollout/truncated_ratio", "truncated share"),
    ("rollout/first_command_top_share", "most common first command's share"),
]
# one curve per evaluated side of the split (`unseen` only with a split by family)
EVAL_CURVES = [(f"eval/{name}/pass_at_1", title) for name, title in SPLIT_LABELS.items()]
SMOOTHING = 4  # steps in the running mean of the reward curves


def training_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of training steps (the final evaluation has a row of its own, without rollout figures)."""
    return [r for r in records if "rollout/reward_mean" in r]


def evaluation_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if any(k in r for k, _ in EVAL_CURVES)]


def _running_mean(values: list[float], n: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - n + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


def plot_curves(records: list[dict[str, Any]], out_png: Path) -> Path:
    """Rollout curves (with a running mean, and the reward gain over the base policy on the same tasks), the
    evaluations with their 95 % intervals, and exit-status counts per step, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = training_rows(records), evaluation_rows(records)
    steps = [r["step"] for r in train]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 3.8))
    for key, label in CURVES:
        (line,) = ax1.plot(steps, [r.get(key, float("nan")) for r in train], marker="o", ms=3, alpha=0.35, label=label)
        ax1.plot(
            steps,
            _running_mean([r.get(key, float("nan")) for r in train], SMOOTHING),
            color=line.get_color(),
            label=f"{label}, mean of {SMOOTHING}",
        )
    if any("rollout/reward_gain" in r for r in train):
        gain = _running_mean([r.get("rollout/reward_gain", float("nan")) for r in train], SMOOTHING)
        ax1.plot(steps, gain, color="black", linestyle="--", label=f"pass gain over base, mean of {SMOOTHING}")
        ax1.axhline(0.0, color="grey", linewidth=0.5)
    ax1.set_xlabel("step")
    ax1.set_ylim(-0.55, 1.05)
    ax1.legend(loc="best", fontsize=6)
    ax1.set_title("rollout")
    titles = split_labels(*evals)  # what `heldout` holds depends on the split
    for i, (name, label) in enumerate(titles.items()):
        key = f"eval/{name}/pass_at_1"
        rows = [r for r in evals if key in r]
        if not rows:
            continue
        x = [r["step"] + 0.08 * i for r in rows]
        y = [r[key] for r in rows]
        err = [
            [max(0.0, v - r[key + "_ci95_low"]) for v, r in zip(y, rows)],
            [max(0.0, r[key + "_ci95_high"] - v) for v, r in zip(y, rows)],
        ]
        ax2.errorbar(x, y, yerr=err, marker="o", capsize=4, label=label)
    ax2.set_xlabel("step (weights after that many updates)")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_title("evaluation: pass@1, 95 % interval")
    if evals:
        ax2.legend(loc="best", fontsize=8)
    statuses = sorted({k for r in train for k in r if k.startswith("rollout/exit/")})
    for key in statuses:
        ax3.plot(steps, [r.get(key, 0.0) for r in train], marker="o", label=key.removeprefix("rollout/exit/"))
    ax3.set_xlabel("step")
    ax3.set_title("trials by exit status")
    if statuses:
        ax3.legend(loc="best", fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def summary_markdown(
    run_id: str,
    run_dir: Path,
    records: list[dict[str, Any]],
    png: Path | None,
    verdict: list[str] | None = None,
    ledger: list[dict[str, Any]] | None = None,
    survived: list[str] | None = None,
) -> str:
    """The run's summary artifact: the verdict, the curves, the evaluations, the ledger (`grpoflow.ledger`'s
    table rows), what the run survived (`grpoflow.run.survived`'s section), then a row per step."""
    keys = [
        "rollout/reward_mean",
        "rollout/pass_at_k",
        "rollout/truncated_ratio",
        "rollout/retries",
        "train/loss",
        "train/grad_norm",
        "train/logprob_gap_mean",
        "time/step_s",
    ]
    head = "| step | " + " | ".join(k.split("/")[-1] for k in keys) + " |"
    sep = "|---" * (len(keys) + 1) + "|"
    rows = [f"| {r['step']} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in training_rows(records)]
    parts = [f"# Run `{run_id}`", "", f"Run dir: `{run_dir.resolve()}`", ""]
    if verdict:
        parts += ["## Before and after training (pass@1, 95 % intervals)", "", *[f"- {line}" for line in verdict], ""]
    if png is not None and png.exists():
        data = base64.b64encode(png.read_bytes()).decode()
        parts += [f"![curves](data:image/png;base64,{data})", "", f"(also `{png.resolve()}`)", ""]
    evals = evaluation_rows(records)
    if evals:
        ekeys = [
            k
            for k in (
                "eval/trained/pass_at_1",
                "eval/trained/pass_at_1_change",
                "eval/heldout/pass_at_1",
                "eval/heldout/pass_at_1_change",
                "eval/unseen/pass_at_1",
                "eval/unseen/pass_at_1_change",
            )
            if any(k in r for r in evals)
        ]
        parts += [
            "| after N steps | " + " | ".join(k.removeprefix("eval/") for k in ekeys) + " |",
            "|---" * (len(ekeys) + 1) + "|",
        ]
        parts += [f"| {r['step']} | " + " | ".join(_fmt(r.get(k)) for k in ekeys) + " |" for r in evals] + [""]
    if ledger:
        parts += ["## Ledger", "", "| | value | share of generated |", "|---|---|---|"]
        parts += [f"| {r['item']} | {_fmt(r['value'])} | {_fmt(r.get('share'))} |" for r in ledger] + [""]
    parts += survived or []
    return "\n".join(parts + [head, sep, *rows])


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)

"""What a person reads about a run: metrics.jsonl (one line per step), timings.jsonl, TensorBoard scalars,
curves, a summary.

One rule splits a step's record: a key ending in `_s` (seconds, or a rate per second) is a wall-clock figure and
goes to `timings.jsonl`; everything else goes to `metrics.jsonl`. So metrics.jsonl holds only what the run
computed, and a rerun on the deterministic path reproduces it byte for byte; both files carry the same `step`
key, and TensorBoard gets both.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

from grpoflow.fileio import append_jsonl


TIMINGS_FILE = "timings.jsonl"


def is_timing(key: str) -> bool:
    """Wall-clock keys (`time/step_s`, `train/tokens_per_s`, ...): they differ between identical runs."""
    return key.endswith("_s")


def split_record(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, timings) of one step's record, each without the `step` key."""
    metrics = {k: v for k, v in record.items() if k != "step" and not is_timing(k)}
    timings = {k: v for k, v in record.items() if k != "step" and is_timing(k)}
    return metrics, timings


def timings_path(metrics_path: Path) -> Path:
    return Path(metrics_path).with_name(TIMINGS_FILE)


def append_step(metrics_path: Path, step: int, record: dict[str, Any]) -> None:
    """Append the step's row to metrics.jsonl and to timings.jsonl (split by `is_timing`)."""
    metrics, timings = split_record(record)
    append_jsonl(Path(metrics_path), {"step": step, **metrics})
    append_jsonl(timings_path(metrics_path), {"step": step, **timings})


class MetricsLog:
    """Appends one record per step to `metrics.jsonl` / `timings.jsonl` and mirrors its numbers as TensorBoard
    scalars."""

    def __init__(self, metrics_path: Path, tb_dir: Path):
        from tensorboardX import SummaryWriter

        self.path = Path(metrics_path)
        self.writer = SummaryWriter(logdir=str(tb_dir), flush_secs=10)

    def log(self, step: int, record: dict[str, Any]) -> None:
        append_step(self.path, step, record)
        self.scalars(step, record)

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


def read_step_records(metrics_path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows with their timings.jsonl row merged in (same step), for tables and summaries."""
    timings = {r["step"]: r for r in read_metrics(timings_path(metrics_path))}
    return [{**r, **timings.get(r["step"], {})} for r in read_metrics(metrics_path)]


CURVES = [("rollout/reward_mean", "mean reward"), ("rollout/pass_at_k", "pass@k"),
          ("rollout/truncated_ratio", "truncated share")]  # fmt: skip


def plot_curves(records: list[dict[str, Any]], out_png: Path) -> Path:
    """Reward, truncation and exit-status counts per step, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, label in CURVES:
        ax1.plot(steps, [r.get(key, float("nan")) for r in records], marker="o", label=label)
    ax1.set_xlabel("step")
    ax1.set_ylim(-0.05, 1.05)
    ax1.legend(loc="best", fontsize=8)
    ax1.set_title("rollout")
    statuses = sorted({k for r in records for k in r if k.startswith("rollout/exit/")})
    for key in statuses:
        ax2.plot(steps, [r.get(key, 0.0) for r in records], marker="o", label=key.removeprefix("rollout/exit/"))
    ax2.set_xlabel("step")
    ax2.set_title("trials by exit status")
    if statuses:
        ax2.legend(loc="best", fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def summary_markdown(run_id: str, run_dir: Path, records: list[dict[str, Any]], png: Path | None) -> str:
    keys = ["rollout/reward_mean", "rollout/pass_at_k", "rollout/truncated_ratio", "rollout/retries",
            "train/loss", "train/grad_norm", "train/logprob_gap_mean", "time/step_s"]  # fmt: skip
    head = "| step | " + " | ".join(k.split("/")[-1] for k in keys) + " |"
    sep = "|---" * (len(keys) + 1) + "|"
    rows = [f"| {r['step']} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in records]
    parts = [f"# Run `{run_id}`", "", f"Run dir: `{run_dir.resolve()}`", ""]
    if png is not None and png.exists():
        data = base64.b64encode(png.read_bytes()).decode()
        parts += [f"![curves](data:image/png;base64,{data})", "", f"(also `{png.resolve()}`)", ""]
    return "\n".join(parts + [head, sep, *rows])


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)

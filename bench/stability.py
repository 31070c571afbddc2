"""Stability over many steps: resident memory and Prefect database growth of the train flow on the tiny model.

    python bench/stability.py [--steps 100] [--measure-at 10]

Runs the real train flow (Prefect, embedded engine, local bubblewrap sandbox, GRPO step, weight sync) with the
tiny random model and small rollouts (2 prompts x 2 samples, max_new_tokens 8, 1 turn), against a temporary
Prefect home (its own sqlite database, ephemeral server). A monitor thread watches `metrics.jsonl` and samples
the RSS of this process, of the embedded engine process and of any Prefect server child when step
`--measure-at` is recorded and when the last step is recorded. Prints the figures and the growth in %; the goal
is RSS growth under 10 % (exit code 1 when this process's RSS grows more, unless --no-check).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _mb(n: int) -> float:
    return n / 2**20


def _snapshot(db: Path) -> dict[str, float]:
    import psutil

    me = psutil.Process()
    snap = {"self": _mb(me.memory_info().rss), "engine": 0.0, "prefect_server": 0.0, "other_children": 0.0}
    for child in me.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            rss = _mb(child.memory_info().rss)
        except psutil.Error:
            continue
        if "grpoflow.embedded.engine.server" in cmd:
            snap["engine"] += rss
        elif "prefect" in cmd or "uvicorn" in cmd:
            snap["prefect_server"] += rss
        else:
            snap["other_children"] += rss
    snap["db"] = sum(_mb(p.stat().st_size) for p in db.parent.glob(db.name + "*") if p.is_file())
    return snap


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--measure-at", type=int, default=10, help="step count at which the baseline is taken")
    ap.add_argument("--no-check", action="store_true", help="exit 0 even when the RSS goal is missed")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (run dir, Prefect home)")
    args = ap.parse_args(argv)
    if args.steps <= args.measure_at:
        ap.error("--steps must be larger than --measure-at")

    tmp = Path(tempfile.mkdtemp(prefix="grpoflow-stability-"))
    home = tmp / "prefect-home"
    home.mkdir()
    # Before Prefect is imported: a private home, its own sqlite database, no analytics.
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.pop("PREFECT_API_URL", None)
    import flows  # noqa: F401  (the offline environment, before Prefect loads)

    db = home / "prefect.db"

    import torch

    torch.set_num_threads(1)
    from flows.train import train_flow
    from grpoflow.config import parse_run_config
    from tests.fakes.tiny_model import build_tiny_model

    model = build_tiny_model(tmp / "tiny-model", seed=0)
    cfg = parse_run_config(
        {
            "run_id": "stability",
            "output_dir": str(tmp / "runs"),
            "model": {"source": str(model)},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 2,
                "sampling": {"max_new_tokens": 8, "temperature": 1.0},
                "episode": {"max_turns": 1},
            },
            "train": {
                "steps": args.steps,
                "optimizer": {"learning_rate": 1e-4},
                "checkpoint": {"interval": args.steps},
                "eval": {"samples_per_prompt": 0},
            },
        }
    )
    metrics = cfg.run_dir / "metrics.jsonl"
    marks: dict[int, dict[str, float]] = {}
    times: dict[int, float] = {}
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            n = metrics.read_text().count("\n") if metrics.exists() else 0
            for mark in (args.measure_at, args.steps):
                if n >= mark and mark not in marks:
                    marks[mark] = _snapshot(db)
                    times[mark] = time.perf_counter()
            if len(marks) == 2:
                return
            time.sleep(0.05)

    t0 = time.perf_counter()
    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    try:
        train_flow(cfg)
    finally:
        stop.set()
        watcher.join(5)
    wall = time.perf_counter() - t0
    if len(marks) < 2:
        print(f"the run ended before step {args.steps} was recorded: marks taken at {sorted(marks)}")
        return 2
    a, b = marks[args.measure_at], marks[args.steps]

    def growth(key: str) -> str:
        return f"{100 * (b[key] - a[key]) / a[key]:+.1f} %" if a[key] else "n/a"

    span = args.steps - args.measure_at
    per_step = (times[args.steps] - times[args.measure_at]) / span
    print(
        f"\nstability: {args.steps} steps of the train flow in {wall:.0f} s "
        f"({per_step:.2f} s/step after step {args.measure_at})"
    )
    print(f"{'':16}{'step ' + str(args.measure_at):>12}{'step ' + str(args.steps):>12}{'growth':>12}")
    for key, label in (
        ("self", "RSS flow proc"),
        ("engine", "RSS engine"),
        ("prefect_server", "RSS prefect srv"),
        ("db", "prefect db"),
    ):
        print(f"{label:16}{a[key]:>9.1f} MB{b[key]:>9.1f} MB{growth(key):>12}")
    per_step_db = (b["db"] - a["db"]) / span
    print(f"prefect db growth per step: {per_step_db * 1024:.1f} KB")
    ok = (b["self"] - a["self"]) / a["self"] < 0.10
    print(f"goal RSS growth < 10 % (flow process): {'met' if ok else 'NOT met'}")
    if args.keep:
        print(f"kept: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok or args.no_check else 1


if __name__ == "__main__":
    sys.exit(main())

"""What flaky-verifier checks cost (`report.regrade_per_task`), side by side in one run: the same oracle trials of the
built-in easy tasks on the local sandbox, without and with each trial keeping its workdir for a regrade, then
Harbor's regrade of K trials per task.

    .venv/bin/python bench/regrade.py [--samples 4] [--per-task 2] [--repeats 3]

Printed: seconds per trial without and with the recorded workdir (Harbor copies it out after the agent and before
the verifier) and their ratio, the bytes it adds per trial, and seconds per regrade (a fresh verifier sandbox,
the workdir put back, the task's verifier) against seconds per trial. Trials run `rollout.concurrency` at once, as
a run's do. Beside it a baseline (HF `generate` tokens/s on one thread): this machine's speed varies from day to
day.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harbor.models.trial.config import AgentConfig  # noqa: E402

from bench.main_job import hf_generate_tok_s  # noqa: E402
from grpoflow.config import parse_run_config  # noqa: E402
from grpoflow.prepare.dataset import builtin_dataset_path, load_dataset  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.prepare.prompts import build_prompts  # noqa: E402
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config  # noqa: E402
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials
from grpoflow.run.regrade import pick_trials, regrade_trials  # noqa: E402


def trials(root: Path, prompts, samples: int, record: bool) -> float:
    """Seconds for one step of oracle trials of `prompts`, `samples` each, into `root`'s trial dirs."""
    cfg = parse_run_config({"rollout": {"n_samples_per_prompt": samples}})
    t0 = time.perf_counter()
    asyncio.run(
        collect_step(
            "bench",
            0,
            plan_group_trials(prompts, 0, cfg.rollout.n_samples_per_prompt, 0),
            cfg.rollout,
            PolicyAccess(lambda spec: AgentConfig(name="oracle")),
            sandbox_config(cfg.rollout),
            root / "trials" / "step_0",
            root / "details" / "step_0",
            record_workdir=record,
        )
    )
    return time.perf_counter() - t0


def artifact_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.glob("trials/*/*/artifacts/**/*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=4, help="trials per task")
    ap.add_argument("--per-task", type=int, default=2, help="trials regraded per task")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    model = prepare_model("smollm2-135m-instruct")
    print(f"baseline: HF generate {hf_generate_tok_s(model.path):.1f} tok/s (one thread)")
    dataset = load_dataset(str(builtin_dataset_path()))
    prompts = build_prompts(dataset, 0, 0.0, None, ["easy"])
    n = len(prompts) * args.samples
    concurrency = parse_run_config({}).rollout.concurrency
    plain, kept, regraded, added = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-regrade-") as tmp:
        for r in range(args.repeats):
            plain.append(trials(Path(tmp) / f"plain-{r}", prompts, args.samples, record=False) / n)
            root = Path(tmp) / f"kept-{r}"
            kept.append(trials(root, prompts, args.samples, record=True) / n)
            root.joinpath("prompts.jsonl").write_text("".join(p.model_dump_json() + "\n" for p in prompts))
            added.append(artifact_bytes(root) / n)
            stored, _ = pick_trials(root, args.per_task)
            t0 = time.perf_counter()
            rows = asyncio.run(regrade_trials(root, stored, sandbox_config(parse_run_config({}).rollout), concurrency))
            regraded.append((time.perf_counter() - t0) / len(rows))
            assert not any(x.differs or x.regraded is None for x in rows), rows  # oracle trials: same verdicts
    med = statistics.median
    print(f"{len(prompts)} easy tasks x {args.samples} oracle trials, {concurrency} at once, median of {args.repeats}:")
    print(f"  per trial, workdir not kept:  {med(plain):.3f} s")
    print(
        f"  per trial, workdir kept:      {med(kept):.3f} s  ({med(kept) / med(plain):.2f}x), +{med(added):.0f} bytes"
    )
    print(
        f"  per regrade ({args.per_task} per task):  {med(regraded):.3f} s  ({med(regraded) / med(plain):.2f}x a trial)"
    )


if __name__ == "__main__":
    main()

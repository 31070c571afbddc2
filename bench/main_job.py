"""The main job's figures, side by side for one or more finished runs, beside this machine's speed of the day.

    .venv/bin/python bench/main_job.py runs/RUN_ID [runs/RUN_ID ...] [--wall 512 530 ...] [--no-baseline]

Per run: seconds per stage per step (mean, min-max), the share of commit + sync in a step's wall time, bytes
written per step (checkpoint dirs: the weights every step, the optimizer state on full checkpoints only), and the
before/after evaluation, computed from the evaluations' trial records. `--wall` gives the runs' whole wall
times (as `time ./run.sh main` printed them), in the order of the run dirs, for min/median/max. The baseline is
HF `generate` on the run's model: fp32, greedy, one thread, 64 new tokens; this machine's speed varies 2-3x
between days, so absolute times mean little without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpoflow.config import read_config_file  # noqa: E402
from grpoflow.prepare.prompts import load_prompts  # noqa: E402
from grpoflow.rollout.journal import SAMPLES, read_samples
from grpoflow.run.metrics import evaluation_rows, read_step_records, training_rows  # noqa: E402
from grpoflow.run.regrade import grader_noise, read_regrades, verdict_evaluations  # noqa: E402
from grpoflow.scoring.evaluation import EVAL_SPLITS, before_after_lines, eval_families, eval_metrics  # noqa: E402
from grpoflow.train.checkpoint import holds_optimizer  # noqa: E402

STAGES = ["time/eval_s", "time/rollout_s", "time/train_s", "time/commit_s", "time/sync_s"]
WEIGHTS_FILES = ("*.safetensors",)


def hf_generate_tok_s(model_path: str, new_tokens: int = 64) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "Write a bash command that lists /app."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def step_bytes(run_dir: Path, steps: int, save_interval: int, weights: int, optimizer: int) -> float:
    """Mean bytes a step writes into checkpoints/: the weights every step, the optimizer state on full ones."""
    from grpoflow.run.commit import is_full_checkpoint

    full = sum(is_full_checkpoint(s, steps, save_interval) for s in range(steps))
    return (steps * weights + full * optimizer) / steps


def verdict(run_dir: Path, evals: list[dict]) -> list[str]:
    """The before/after lines, computed again from the first and last evaluations' trial records (so a run made
    by earlier code is judged by this code's statistics), or taken from the metrics rows."""
    if len(evals) < 2:
        return []
    prompts = load_prompts(run_dir / "prompts.jsonl") if (run_dir / "prompts.jsonl").is_file() else []
    regrades = read_regrades(run_dir)
    noise = grader_noise(regrades, prompts, verdict_evaluations(run_dir)) if regrades else None
    first, last = (run_dir / "details" / f"eval_{r['step']}" for r in (evals[0], evals[-1]))
    if not ((first / SAMPLES).is_file() and (last / SAMPLES).is_file()):
        return before_after_lines(evals[0], evals[-1], noise)
    before, after = read_samples(first), read_samples(last)
    families = eval_families(prompts)
    rows = [{}, {}]
    for name in EVAL_SPLITS:
        # group ids are `eval<N>-<side>-<task>`: match the side, not a task name that holds it
        mine = [
            [s for s in samples if s.group_id.partition("-")[2].startswith(f"{name}-")] for samples in (before, after)
        ]
        if not mine[0]:  # a side this run's split does not have (`unseen` of a split by task)
            continue
        rows[0] |= eval_metrics(name, mine[0])
        rows[1] |= eval_metrics(name, mine[1], mine[0], families)
    return before_after_lines(*rows, noise)


def _bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def summarize(run_dir: Path) -> dict:
    cfg = read_config_file(run_dir / "config.json")  # today's layout, whatever the run saved
    records = read_step_records(run_dir / "metrics.jsonl")
    train, evals = training_rows(records), evaluation_rows(records)
    kept = sorted((run_dir / "checkpoints").glob("step_*"))
    full = [d for d in kept if holds_optimizer(d)]
    weights = sum(f.stat().st_size for d in kept[-1:] for pat in WEIGHTS_FILES for f in d.glob(pat))
    optimizer = sum(_bytes(p) for p in full[-1].glob("optimizer.*")) if full else 0  # .pt, or a sharded .dcp/
    stages = {k: [r.get(k, 0.0) for r in train] for k in STAGES}
    step_wall = [sum(r.get(k, 0.0) for k in STAGES) for r in train]
    final_eval = evals[-1].get("time/eval_s", 0.0) if evals and evals[-1]["step"] == len(train) else 0.0
    return {
        "run": run_dir.name,
        "steps": len(train),
        "trials": sum(int(r["rollout/trials"]) for r in train),
        "stages": stages,
        "step_wall": step_wall,
        "final_eval_s": final_eval,
        "commit_sync_share": sum(stages["time/commit_s"]) + sum(stages["time/sync_s"]),
        "bytes_per_step": step_bytes(run_dir, len(train), cfg["train"]["checkpoint"]["interval"], weights, optimizer),
        "bytes_every_step_before": weights + optimizer,  # the old commit: weights and AdamW state every step
        "verdict": verdict(run_dir, evals),
        "model": json.loads((run_dir / "run.json").read_text())["model"]["path"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--wall", nargs="*", type=float, default=[], help="each run's whole wall time, in seconds")
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args()
    runs = [summarize(r) for r in args.runs]
    if not args.no_baseline:
        print(f"baseline: HF generate, SmolLM2 fp32 greedy, 1 thread: {hf_generate_tok_s(runs[0]['model']):.1f} tok/s")
    if args.wall:
        w = sorted(args.wall)
        print(
            f"main job wall time over {len(w)} runs: min {w[0]:.0f} s, median {statistics.median(w):.0f} s, "
            f"max {w[-1]:.0f} s"
        )
    for r in runs:
        total = sum(r["step_wall"])
        print(
            f"\n{r['run']}: {r['steps']} steps, {r['trials']} training trials, steps {total:.0f} s "
            f"+ final evaluation {r['final_eval_s']:.0f} s"
        )
        for k, v in r["stages"].items():
            print(
                f"  {k.removeprefix('time/').removesuffix('_s'):8s} mean {statistics.fmean(v):6.2f} s/step "
                f"(min {min(v):.2f}, max {max(v):.2f}; {sum(v):.0f} s in all)"
            )
        print(f"  commit + sync: {100 * r['commit_sync_share'] / total:.1f} % of the steps' wall time")
        print(
            f"  bytes written per step: {r['bytes_per_step'] / 1e9:.2f} GB (weights and optimizer state every "
            f"step, as before: {r['bytes_every_step_before'] / 1e9:.2f} GB)"
        )
        for line in r["verdict"]:
            print(f"  {line}")


if __name__ == "__main__":
    main()

"""The main job's figures, side by side for one or more finished runs, beside this machine's speed of the day.

    .venv/bin/python bench/main_job.py runs/RUN_ID [runs/RUN_ID ...] [--wall 512 530 ...] [--no-baseline]

Per run: seconds per stage per step (mean, min-max), the share of commit + sync in a step's wall time, bytes
written per step (checkpoint dirs: the weights every step, the optimizer state on full checkpoints only), and the
before/after evaluation, computed from the evaluations' trial records; with several runs (seeds of one recipe), also
the verdict pooled over them (`pooled_verdict`). `--wall` gives the runs' whole wall
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
from grpoflow.run.regrade import read_regrades, run_grader_noise  # noqa: E402
from grpoflow.samples import Sample  # noqa: E402
from grpoflow.scoring.evaluation import (  # noqa: E402
    EVAL_SPLITS,
    GraderNoise,
    before_after_lines,
    eval_families,
    eval_metrics,
)
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


def side_samples(run_dir: Path, evals: list[dict]) -> dict[str, tuple[list[Sample], list[Sample]]] | None:
    """Side of the split -> (its trials in the run's first evaluation, in its last), from the trial records; None
    when the records are not there."""
    first, last = (run_dir / "details" / f"eval_{r['step']}" for r in (evals[0], evals[-1]))
    if not ((first / SAMPLES).is_file() and (last / SAMPLES).is_file()):
        return None
    before, after = read_samples(first), read_samples(last)
    sides = {}
    for name in EVAL_SPLITS:
        # group ids are `eval<N>-<side>-<task>`: match the side, not a task name that holds it
        mine = [
            [s for s in samples if s.group_id.partition("-")[2].startswith(f"{name}-")] for samples in (before, after)
        ]
        if mine[0]:  # else a side this run's split does not have (`unseen` of a split by task)
            sides[name] = (mine[0], mine[1])
    return sides


def verdict_lines(sides: dict, families: dict[str, str], noise: dict[str, GraderNoise] | None) -> list[str]:
    rows: list[dict[str, float]] = [{}, {}]
    for name, (before, after) in sides.items():
        rows[0] |= eval_metrics(name, before)
        rows[1] |= eval_metrics(name, after, before, families)
    return before_after_lines(*rows, noise)


def _prompts(run_dir: Path) -> list:
    return load_prompts(run_dir / "prompts.jsonl") if (run_dir / "prompts.jsonl").is_file() else []


def verdict(run_dir: Path, evals: list[dict]) -> list[str]:
    """The before/after lines, computed again from the first and last evaluations' trial records (so a run made
    by earlier code is judged by this code's statistics), or taken from the metrics rows."""
    if len(evals) < 2:
        return []
    prompts = _prompts(run_dir)
    noise = run_grader_noise(run_dir, read_regrades(run_dir))
    sides = side_samples(run_dir, evals)
    if sides is None:
        return before_after_lines(evals[0], evals[-1], noise)
    return verdict_lines(sides, eval_families(prompts), noise)


def pooled_verdict(run_dirs: list[Path]) -> list[str]:
    """The verdict over several runs of one recipe (seeds), pooled: on the trained row each run's instances are
    clusters of their own (`<run>/<instance>`); on the held-out rows a family is one cluster across the runs (its
    template is what transfers); the grader noise counts every run's regrades."""
    pooled: dict[str, tuple[list[Sample], list[Sample]]] = {}
    families: dict[str, str] = {}
    noise: dict[str, GraderNoise] = {}
    for run_dir in run_dirs:
        evals = evaluation_rows(read_step_records(run_dir / "metrics.jsonl"))
        sides = side_samples(run_dir, evals) if len(evals) > 1 else None
        if sides is None:
            raise SystemExit(f"{run_dir}: no first and last evaluation trial records to pool")
        tag = run_dir.name + "/"
        for name, (before, after) in sides.items():
            both = pooled.setdefault(name, ([], []))
            for into, samples in zip(both, (before, after)):
                into += [s.model_copy(update={"instance_id": tag + s.instance_id}) for s in samples]
        prompts = _prompts(run_dir)
        families |= {tag + instance: family for instance, family in eval_families(prompts).items()}
        for side, n in (run_grader_noise(run_dir, read_regrades(run_dir)) or {}).items():
            had = noise.get(side, GraderNoise(0, 0))
            noise[side] = GraderNoise(had.disagreed + n.disagreed, had.regraded + n.regraded)
    return verdict_lines(pooled, families, noise or None)


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
    if len(args.runs) > 1:
        print(f"\npooled over the {len(args.runs)} runs (clusters: instances of each run, families across runs):")
        for line in pooled_verdict(args.runs):
            print(f"  {line}")


if __name__ == "__main__":
    main()

"""Scale-out on this box: rollout on 1 vs 2 Ray rollout workers, 1 vs 2 engine replicas behind sglang-router,
and the GRPO update on 1 vs 2 trainer ranks, side by side in one run; then a worked estimate for 8 GPUs on
4 nodes from the per-component costs measured here.

    .venv/bin/python bench/scale.py [--samples 4] [--output-dir DIR] [--no-baseline]

Rollout: `grpoflow evaluate` on the `embedded-default` recipe (SmolLM2-135M, the built-in tasks, the local
sandbox), all prompts x `--samples` trials, each configuration in its own process on the same seeds: in the
flow's process with one engine; on a 2-node Ray cluster on loopback (ray.cluster_utils) with 1 and with 2
rollout workers; with 2 engines behind sglang-router. Printed: trials/s, the rollout's wall time, and the engine's
own busy seconds per trial. Train: one GRPO update on the trials of the first rollout, on 1 rank with every core
and on 2 gloo ranks. Beside it a baseline (HF `generate` tokens/s on one thread): this machine's speed varies
from day to day.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.main_job import hf_generate_tok_s  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.run.metrics import read_step_records  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def rollout(name: str, out: Path, samples: int, settings: list[str]) -> dict:
    run_id = f"scale-{name}-{int(time.time())}"
    cmd = [sys.executable, "-m", "flows.cli", "evaluate", "--preset", "embedded-default", "--output-dir", str(out)]
    cmd += ["--run-id", run_id, "--set", f"rollout.n_samples_per_prompt={samples}"]
    for s in settings:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: grpoflow evaluate failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    [row] = read_step_records(out / run_id / "metrics.jsonl")  # the rollout's metrics and timings
    return {"dir": out / run_id, **row}


def train(samples_path: Path, model: str, ranks: int) -> float:
    """Seconds and forward tokens of one GRPO update of these samples on `ranks` ranks, in a fresh process (torch
    threads are set at its start): the cores split evenly between the ranks. Rewards alternate 0/1 so every
    group trains."""
    code = f"""
import json, time, torch
from grpoflow.config import parse_run_config
from grpoflow.samples import Sample
from grpoflow.train.ranks import run_update, trainer_ranks
from grpoflow.train.trainer import load_trainer
ranks = {ranks}
torch.set_num_threads(max(1, (__import__("os").cpu_count() or 1) // ranks))
cfg = parse_run_config({{"run_id": "bench", "model": {{"source": {model!r}}},
    "train": {{"learning_rate": 5e-5, "filter_zero_std": False}}, "cluster": {{"train_ranks": ranks}}}})
samples = [Sample.model_validate_json(line) for line in open({str(samples_path)!r})]
samples = [s.model_copy(update={{"reward": float(i % 2), "status": "COMPLETED"}}) for i, s in enumerate(samples)]
state = load_trainer({model!r}, cfg.train, seed=0)
with trainer_ranks(state, {model!r}, cfg):
    run_update(state, samples, cfg, step=0)  # warm-up: first-touch allocations, the group's first collective
    t = time.perf_counter()
    m = run_update(state, samples, cfg, step=1)
    print(json.dumps({{"seconds": time.perf_counter() - t, "tokens": m.computed["n_forward_tokens"]}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train on {ranks} ranks failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=8, help="trials per prompt")
    p.add_argument("--gpu-engine-speedup", type=float, default=50.0, help="assumed: one H200 engine vs this box's")
    p.add_argument("--gpu-train-speedup", type=float, default=100.0, help="assumed: one H200 rank vs this box's")
    p.add_argument("--output-dir", help="keep the runs here (default: a temporary dir)")
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args(argv)
    model = prepare_model("smollm2-135m-instruct").path
    if not args.no_baseline:
        print(f"baseline: HF generate {hf_generate_tok_s(model):.1f} tok/s on one thread; {os.cpu_count()} cores")
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="grpoflow-scale-"))

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        ray = [f"cluster.ray_address={cluster.address}"]
        runs = {
            "in process, 1 engine": rollout("local", out, args.samples, []),
            "Ray, 1 worker, 1 engine": rollout("ray1", out, args.samples, [*ray, "cluster.rollout_workers=1"]),
            "Ray, 2 workers (2 nodes), 1 engine": rollout(
                "ray2", out, args.samples, [*ray, "cluster.rollout_workers=2"]
            ),
            "in process, 2 engines + router": rollout("engines2", out, args.samples, ["engine.embedded.replicas=2"]),
        }
    finally:
        cluster.shutdown()
    base = runs["in process, 1 engine"]
    print(f"\nrollout: {int(base['trials'])} trials (every prompt of the eval split x {args.samples})")
    print(f"{'configuration':38} {'trials/s':>9} {'wall s':>8} {'vs in process':>14}")
    for name, r in runs.items():
        rate = r["trials"] / r["wall_time_s"]
        print(f"{name:38} {rate:9.3f} {r['wall_time_s']:8.1f} {base['wall_time_s'] / r['wall_time_s']:13.2f}x")

    samples = base["dir"] / "details" / "step_0" / "samples.jsonl"
    one, two = train(samples, model, 1), train(samples, model, 2)
    print(f"\ntrain: one GRPO update of those trials ({int(one['tokens'])} forward tokens)")
    print(f"{'1 rank, every core':38} {one['seconds']:8.2f} s  {one['tokens'] / one['seconds']:8.0f} tok/s")
    print(
        f"{'2 gloo ranks, a core each':38} {two['seconds']:8.2f} s  {two['tokens'] / two['seconds']:8.0f} tok/s"
        f"  {one['seconds'] / two['seconds']:.2f}x"
    )
    print(
        "\nOn this box the two nodes, both engines and both ranks share the same 2 cores: a second worker or "
        "engine adds processes, not cores, so these ratios show the cost of the machinery, not a speed-up."
    )
    estimate(base, one, args.gpu_engine_speedup, args.gpu_train_speedup)
    return 0


def estimate(r: dict, t: dict, engine_x: float, train_x: float, trials: int = 512) -> None:
    """Step time on 8 H200s in 4 nodes (2 each: 4 SGLang replicas behind the router, 4 trainer ranks) for a step
    of `trials` trials, from what a trial and a trained token cost here. Measured: engine seconds per trial (its
    turns' generation, summed over trials that overlap on one engine), sandbox seconds per trial (commands and
    the trial's own overhead, which GPUs do not speed up), trainer seconds per forward token. Assumed: how much
    faster one GPU engine and one GPU rank are than this box (the flags), that a step's trials spread evenly, and
    that every trial has its sandbox at once (`rollout.concurrency` at least the trials per worker)."""
    n = r["trials"]
    # one engine serves every trial: the rollout's wall time, in the share the trials spent generating, is the
    # engine's time (trials overlap, so their own generation seconds add up to more than the wall)
    spent = r["generation_time_s"] + r["tool_time_s"] + r["overhead_time_s"]
    gen_per_trial = r["wall_time_s"] * r["generation_time_s"] / spent / n
    sandbox_per_trial = (r["tool_time_s"] + r["overhead_time_s"]) / n
    train_per_token = t["seconds"] / t["tokens"]
    tokens_per_trial = t["tokens"] / n
    engines, ranks, nodes = 4, 4, 4
    rollout_s = trials * gen_per_trial / (engines * engine_x)
    sandbox_s = sandbox_per_trial  # sandboxes run side by side, one per trial: each trial pays its own once
    train_s = trials * tokens_per_trial * train_per_token / (ranks * train_x)
    print("\nestimate, 8 H200 in 4 nodes (4 engine replicas, 4 trainer ranks, rollout workers on all 4 nodes):")
    print(
        f"  measured here: engine {gen_per_trial:.2f} s/trial, sandbox {sandbox_per_trial:.2f} s/trial, "
        f"trainer {train_per_token * 1e3:.2f} ms/token, {tokens_per_trial:.0f} tokens/trial"
    )
    print(f"  assumed: a GPU engine {engine_x:.0f}x and a GPU rank {train_x:.0f}x this box (--gpu-*-speedup)")
    print(
        f"  a step of {trials} trials: rollout ~{rollout_s + sandbox_s:.1f} s (engines {rollout_s:.1f} s + one "
        f"trial's sandbox time {sandbox_s:.1f} s), update ~{train_s:.1f} s on {ranks} ranks; with "
        f"max_staleness >= 1 the two overlap: ~{max(rollout_s + sandbox_s, train_s):.1f} s per step; "
        f"{trials // nodes} trials per rollout worker"
    )


if __name__ == "__main__":
    sys.exit(main())

"""Asynchronous rollout: the main job's recipe run synchronously and with `train.max_staleness` 1 and 2, side by
side, same seeds.

    .venv/bin/python bench/async.py [--steps 6] [--staleness 0 1 2] [--repeat 1] [--output-dir DIR] [--no-baseline]

Each run is `grpoflow main` (the `embedded-default` preset) in its own process, with a fresh run_id. Printed per
run, over the training loop (every step's wall time, its evaluation, update, commit and sync included; the final
evaluation left out): steps per hour and its ratio to the synchronous run, also without the evaluations' time
(they run alone, nothing overlaps them); the trainer's forward tokens per hour without them (the runs' policies
differ after the first update, so their steps train different amounts: this compares equal work); the engine's
busy fraction (its own prefill/decode seconds, `time/engine_busy_s`, over the loop's wall time), the trainer's
(update + commit + sync); the staleness of what was trained; the first evaluation's seconds (the same work in
every run, nothing beside it: how fast the machine was meanwhile, since its speed drifts within minutes); and the
reward and evaluation curves. `--repeat N` runs every setting N times, interleaved, and prints the median ratios.

Under the table, the most any overlap could give here, from the synchronous runs' own seconds: their rollouts
beside their updates, which run on the cores the engine leaves at a measured fraction of their speed on all of
them, then alone; their syncs alone. Beside it all a baseline (HF `generate` tokens/s on one thread), since this
machine's speed varies from day to day.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.main_job import hf_generate_tok_s  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.run.metrics import evaluation_rows, read_step_records, training_rows  # noqa: E402
from grpoflow.run.resume import load_saved_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run(k: int, steps: int, out: Path) -> tuple[Path, float]:
    run_id = f"async-{k}-{int(time.time())}"
    cmd = [sys.executable, "-m", "flows.cli", "main", "--output-dir", str(out), "--run-id", run_id]
    cmd += ["--set", f"train.steps={steps}", "--set", f"train.max_staleness={k}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"max_staleness={k}: grpoflow main failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return out / run_id, time.perf_counter() - t0


def update_seconds(model_path: str, threads: list[int]) -> list[float]:
    """Seconds of one forward and backward of the policy on a batch like a step's (8 x 200 tokens, the trainer's
    own logprob path), on each of `threads` torch threads: an update's speed beside the engine and alone."""
    from transformers import AutoModelForCausalLM

    from grpoflow.train.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (8, 200), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(8, 199, dtype=torch.bool)
    seconds = []
    for n in threads:
        torch.set_num_threads(n)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            logprobs, _ = token_logprobs(model, ids, mask)  # (8, 199)
            logprobs.sum().backward()
            best = min(best, time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        seconds.append(best)
    return seconds


def overlap_bound(serial: tuple[float, float, float], speed_beside: float) -> float:
    """How much faster a synchronous run's loop could be with its rollouts overlapping its updates, at best:
    (rollout, update, sync seconds) as it spent them one after the other; `speed_beside`, the update's speed on
    the cores the engine leaves over its speed on all of them. While the rollouts generate, the trainer does
    `speed_beside` of their seconds' worth of its work; the rest, and the syncs, run alone."""
    rollouts, updates, syncs = serial  # updates: commits too, counted as slowed alike (they are ~0 but the last)
    return sum(serial) / (max(rollouts, updates + (1 - speed_beside) * rollouts) + syncs)


def figures(run_dir: Path) -> dict:
    records = read_step_records(run_dir / "metrics.jsonl")  # metrics and timings merged, one row per step
    steps = training_rows(records)
    wall = sum(r["time/wall_s"] for r in steps)
    trainer = sum(r["time/train_s"] + r.get("time/commit_s", 0.0) + r.get("time/sync_s", 0.0) for r in steps)
    engine = sum(r.get("time/engine_busy_s", 0.0) for r in steps)
    ages = [
        (int(key.rsplit("/", 1)[1]), n) for r in steps for key, n in r.items() if key.startswith("rollout/staleness/")
    ]
    evaluating = sum(r.get("time/eval_s", 0.0) for r in steps)
    rollouts = sum(r["time/rollout_run_s"] for r in steps)
    updates = sum(r["time/train_s"] + r.get("time/commit_s", 0.0) for r in steps)
    syncs = sum(r.get("time/sync_s", 0.0) for r in steps)
    return {
        "run_id": run_dir.name,
        "wall": wall,
        "per_hour": 3600 * len(steps) / wall,
        "per_hour_training": 3600 * len(steps) / (wall - evaluating),
        "tokens_per_hour": 3600 * sum(r.get("train/n_forward_tokens", 0.0) for r in steps) / (wall - evaluating),
        "serial": (rollouts, updates, syncs),  # seconds over the loop
        "engine": engine / wall,
        "trainer": trainer / wall,
        "staleness": sum(a * n for a, n in ages) / sum(n for _, n in ages) if ages else 0.0,
        "dropped": sum(r.get("rollout/stale_dropped", 0.0) for r in steps),
        "reward": [r["rollout/reward_mean"] for r in steps],
        "evals": {r["step"]: r for r in evaluation_rows(records)},
        "first_eval_s": steps[0].get("time/eval_s", float("nan")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--output-dir", help="keep the runs here (default: a temporary dir)")
    p.add_argument("--repeat", type=int, default=1, help="run every setting this many times, interleaved")
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args(argv)
    if not args.no_baseline:
        model = prepare_model("smollm2-135m-instruct").path
        print(f"baseline: HF generate {hf_generate_tok_s(model):.1f} tok/s on one thread")
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="grpoflow-async-"))
    results: dict[tuple[int, int], dict] = {}
    for rep in range(args.repeat):  # interleaved, so a drift in the machine's speed touches every setting alike
        for k in args.staleness:
            run_dir, total = run(k, args.steps, out)
            results[k, rep] = figures(run_dir)
            print(f"max_staleness={k}: {run_dir} ({total:.0f} s with prepare and start-up)", flush=True)
    keys = ("per_hour", "per_hour_training", "tokens_per_hour")
    first = args.staleness[0]  # what the ratios are to: each run's own repeat of it
    ratio = {(k, rep): {key: r[key] / results[first, rep][key] for key in keys} for (k, rep), r in results.items()}
    print(
        f"\nratios: to max_staleness={first}'s run of the same repeat\n"
        f"{'max_staleness':>13} {'repeat':>6} {'loop s':>7} {'steps/h':>8} {'ratio':>6} {'w/o evals':>10} {'ratio':>6}"
        f" {'trained tok/h':>14} {'ratio':>6} {'engine busy':>12} {'trainer busy':>13} {'mean staleness':>15}"
        f" {'dropped':>8} {'first eval s':>13}"
    )
    for (k, rep), r in sorted(results.items()):
        x = ratio[k, rep]
        print(
            f"{k:13d} {rep:6d} {r['wall']:7.0f} {r['per_hour']:8.1f} {x['per_hour']:5.2f}x "
            f"{r['per_hour_training']:10.1f} {x['per_hour_training']:5.2f}x "
            f"{r['tokens_per_hour']:14.0f} {x['tokens_per_hour']:5.2f}x "
            f"{r['engine']:12.2f} {r['trainer']:13.2f} {r['staleness']:15.2f} {r['dropped']:8.0f}"
            f" {r['first_eval_s']:13.1f}"
        )
    print("(first eval s: the base policy's evaluation, the same work in every run with nothing beside it: how fast")
    print(" the machine was during each run)")
    if args.repeat > 1:
        for k in args.staleness[1:]:
            median = {key: statistics.median(ratio[k, rep][key] for rep in range(args.repeat)) for key in keys}
            print(
                f"max_staleness={k}, median ratio of {args.repeat}: steps/h {median['per_hour']:.2f}x, w/o evals"
                f" {median['per_hour_training']:.2f}x, trained tok/h {median['tokens_per_hour']:.2f}x"
            )
    if first == 0:
        config = load_saved_config(out / results[0, 0]["run_id"])
        alone = torch.get_num_threads()
        beside = max(
            1, alone - config.engine.embedded.threads * config.engine.embedded.replicas
        )  # as share_cores leaves it
        on_all, on_fewer = update_seconds(prepare_model(config.model.source).path, [alone, beside])
        speed = on_all / on_fewer
        bound = statistics.mean(overlap_bound(results[0, rep]["serial"], speed) for rep in range(args.repeat))
        print(
            f"\nthe most overlap can give here, from the synchronous runs' own seconds: {bound:.2f}x steps/h w/o"
            f" evals (the update runs at {speed:.2f} of its speed on {alone} threads on the {beside} the engine"
            f" leaves; rollouts and syncs as they were)"
        )
    results = {k: r for (k, rep), r in results.items() if rep == 0}  # the curves: a deterministic run's repeat is equal
    print("\nreward per step (rollout/reward_mean)")
    for k, r in results.items():
        print(f"  max_staleness={k}: " + " ".join(f"{x:.3f}" for x in r["reward"]))
    print("\nevaluations (pass@1 on the trained tasks / held-out tasks, after N updates)")
    for k, r in results.items():
        cells = [
            f"{n}: {m.get('eval/trained/pass_at_1', float('nan')):.3f}/{m.get('eval/heldout/pass_at_1', float('nan')):.3f}"
            for n, m in sorted(r["evals"].items())
        ]
        print(f"  max_staleness={k}: " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Rollout throughput: trials/s at concurrency 1, 4, 16 with the embedded engine and the shell agent, the engine's
busy fraction, and what the early truncation exit saves on a truncation-heavy mix — side by side in one run.

    .venv/bin/python bench/rollout.py [--model smollm2-135m-instruct] [--trials 16] [--threads 1]

Busy fraction = engine-side forward/sampling time (from `/get_server_info`) / rollout wall time: near 1 means
the engine never waits for sandboxes (tool time hidden behind other trials' generation).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import harbor.utils.logger  # noqa: E402

import flows  # noqa: E402, F401  (the offline environment, before Harbor loads)
from grpoflow.config import parse_run_config  # noqa: E402
from grpoflow.engine.launch import start_embedded_engine  # noqa: E402
from grpoflow.prepare.dataset import load_dataset  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.prepare.prompts import build_prompts  # noqa: E402
from grpoflow.rollout.harnesses import agent_factory
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials

harbor.utils.logger.logger.setLevel("WARNING")


def busy_time(client) -> float:
    return float(client.server_info()["internal_states"][0]["busy_time_s"])


def run(engine, model_path, prompts, work: Path, tag: str, **rollout) -> dict:
    cfg = parse_run_config({"rollout": rollout})
    busy0, t0 = busy_time(engine.client), time.perf_counter()
    res = asyncio.run(
        collect_step(
            "bench",
            0,
            plan_group_trials(prompts, 0, cfg.rollout.n_samples_per_prompt, 0),
            cfg.rollout,
            PolicyAccess(agent_factory(cfg.rollout, cfg.engine, engine.url, model_path)),
            sandbox_config(cfg.rollout, work_dir=str(work)),
            work / f"trials-{tag}",
            work / f"details-{tag}",
        )
    )
    wall = time.perf_counter() - t0
    m = res.figures.computed
    return {
        "trials": len(res.samples),
        "wall_s": wall,
        "trials_per_s": len(res.samples) / wall,
        "busy_fraction": (busy_time(engine.client) - busy0) / wall,
        "tokens": m["tokens_generated"],
        "after_trunc": m["tokens_after_truncation"],
        "truncated": m["truncated_ratio"],
        "reward": m["reward_mean"],
        "tool_s": res.figures.seconds["tool_time_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or HF model dir")
    ap.add_argument("--trials", type=int, default=16, help="trials per measurement")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", default="1,4,16")
    args = ap.parse_args()

    model_path = prepare_model(args.model).path
    tasks = [p for p in build_prompts(load_dataset("builtin-fixed"), 0, 0.0) if p.metadata["difficulty"] == "easy"]
    per_prompt = 4
    prompts = (tasks * args.trials)[: max(1, args.trials // per_prompt)]
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    base = {"n_samples_per_prompt": per_prompt, "max_turns": 3, "max_new_tokens": 64, "temperature": 0.5}
    print(f"model {args.model}, {len(prompts) * per_prompt} trials per row, engine threads {args.threads}")
    try:
        with start_embedded_engine(
            model_path, seed=0, threads=args.threads, max_batch_size=32, log_path=work / "engine.log"
        ) as engine:
            print("\n== throughput (shell agent, easy built-in tasks, local sandbox) ==")
            print(f"{'concurrency':>11} {'trials/s':>9} {'wall s':>7} {'busy frac':>9} {'tokens':>7} {'tool s':>7}")
            for c in (int(x) for x in args.concurrency.split(",")):
                r = run(engine, model_path, prompts, work, f"c{c}", concurrency=c, **base)
                print(
                    f"{c:>11} {r['trials_per_s']:>9.3f} {r['wall_s']:>7.1f} {r['busy_fraction']:>9.2f} "
                    f"{r['tokens']:>7.0f} {r['tool_s']:>7.1f}"
                )
            print("\n== truncation-heavy mix (max_new_tokens 12, 4 turns): early exit on vs off ==")
            heavy = {**base, "max_new_tokens": 12, "max_turns": 4, "concurrency": 16}
            rows = {
                flag: run(engine, model_path, prompts, work, f"exit-{flag}", early_truncation_exit=flag, **heavy)
                for flag in (True, False)
            }
            print(f"{'early exit':>10} {'truncated':>9} {'tokens':>7} {'after trunc':>11} {'share':>6} {'wall s':>7}")
            for flag, r in rows.items():
                share = r["after_trunc"] / r["tokens"] if r["tokens"] else 0.0
                print(
                    f"{str(flag):>10} {r['truncated']:>9.2f} {r['tokens']:>7.0f} {r['after_trunc']:>11.0f} "
                    f"{share:>6.2f} {r['wall_s']:>7.1f}"
                )
            on, off = rows[True], rows[False]
            print(
                f"\nwall time with early exit / without: {on['wall_s'] / off['wall_s']:.2f}; "
                f"tokens generated: {on['tokens'] / max(off['tokens'], 1):.2f}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

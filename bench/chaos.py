"""Engine outages mid-step: the embedded engine behind a proxy (the SGLang stand-in in front of it) that refuses
every connection for N seconds once the step's trials are generating. Per outage length, side by side with an
undisturbed step of the same trials: how many trials were scored, how many groups were dropped and why, and the
generation lengths of the trials that trained (a step that lost its long generations would show shorter ones).

    .venv/bin/python bench/chaos.py [--outages 0 5 60] [--prompts 4] [--samples 4]

Requests wait an outage out (`engine.outage_wait_s`); past it a trial fails as an infrastructure fault
(`EngineError`), is run again, and is counted in the ledger's `infrastructure` reason, never dropped silently.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flows  # noqa: E402, F401  (the offline environment, before Harbor loads)
from grpoflow.config import parse_run_config  # noqa: E402
from grpoflow.engine.launch import start_embedded_engine  # noqa: E402
from grpoflow.ledger import rollout_discards  # noqa: E402
from grpoflow.prepare.dataset import load_dataset  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.prepare.prompts import build_prompts  # noqa: E402
from grpoflow.rollout.harnesses import agent_factory  # noqa: E402
from grpoflow.rollout.policy import PolicyAccess  # noqa: E402
from grpoflow.rollout.sandbox import sandbox_config  # noqa: E402
from grpoflow.rollout.step import collect_step  # noqa: E402
from grpoflow.rollout.trials import plan_group_trials  # noqa: E402
from grpoflow.samples import select_trainable  # noqa: E402
from tests.fakes.sglang_standin import StandinServer  # noqa: E402


def one_step(engine_url: str, model_path: str, prompts, outage_s: float, work: Path, args) -> dict:
    cfg = parse_run_config(
        {
            "engine": {"backend": "sglang", "url": "http://unused", "outage_wait_s": args.wait},
            "rollout": {"n_samples_per_prompt": args.samples, "concurrency": 8, "sandbox": {"retry_backoff_s": 1.0}},
        }
    )
    with StandinServer(model_path, upstream=engine_url) as front:

        def outage() -> None:
            while front.count("/generate") < args.samples:  # once the step's trials are generating
                time.sleep(0.05)
            front.faults.inject("drop", times=None)
            time.sleep(outage_s)
            front.faults.clear()

        down = threading.Thread(target=outage, daemon=True)
        if outage_s:
            down.start()
        t0 = time.perf_counter()
        res = asyncio.run(
            collect_step(
                "chaos",
                0,
                plan_group_trials(prompts, 0, args.samples, 0),
                cfg.rollout,
                PolicyAccess(agent_factory(cfg.rollout, cfg.engine, front.url, model_path)),
                sandbox_config(cfg.rollout, work_dir=str(work)),
                work / f"trials-{outage_s}",
                work / f"details-{outage_s}",
            )
        )
        wall = time.perf_counter() - t0
        if outage_s:
            down.join()
    trainable, dropped = select_trainable(res.samples, "drop_group")
    lengths = sorted(s.n_generated for s in trainable)
    return {
        "wall_s": wall,
        "scored": int(res.figures.computed["scored"]),
        "trials": len(res.samples),
        "retries": int(res.figures.computed["retries"]),
        "dropped_groups": dropped,
        "discards": rollout_discards(res.samples, res.samples, trainable),
        "lengths": lengths,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--outages", type=float, nargs="+", default=[0, 5, 60])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--wait", type=float, default=600.0, help="engine.outage_wait_s")
    args = ap.parse_args()
    model_path = prepare_model(args.model).path
    prompts = [p for p in build_prompts(load_dataset("builtin-fixed"), 0, 0.0) if p.metadata["difficulty"] == "easy"]
    prompts = prompts[: args.prompts]
    with tempfile.TemporaryDirectory() as tmp, start_embedded_engine(model_path, seed=0, threads=1) as engine:
        rows = {o: one_step(engine.url, model_path, prompts, o, Path(tmp), args) for o in args.outages}
    print(f"{'outage s':>8} {'wall s':>7} {'scored':>7} {'retries':>7} {'dropped':>7}  discarded tokens by reason")
    for o, r in rows.items():
        why = ", ".join(f"{k} {v:.0f}" for k, v in r["discards"].items() if v) or "none"
        print(
            f"{o:8.0f} {r['wall_s']:7.1f} {r['scored']:>3}/{r['trials']:<3} {r['retries']:7d} {r['dropped_groups']:7d}  {why}"
        )
    print("\ngenerated tokens of the trials that train (min / median / mean / max):")
    for o, r in rows.items():
        ls = r["lengths"] or [0]
        print(f"  outage {o:4.0f} s: {min(ls)} / {statistics.median(ls):.0f} / {statistics.fmean(ls):.1f} / {max(ls)}")


if __name__ == "__main__":
    main()

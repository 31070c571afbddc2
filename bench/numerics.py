"""What MKL's reproducible mode costs the update, and what it buys: one SmolLM2 GRPO update (the main job's, one
micro-batch) per MKL_CBWR setting and thread count, each in a fresh process, side by side with the bits it gave.

    .venv/bin/python bench/numerics.py [--repeat 2]

Rows with the same `weights` ran the same arithmetic. `OFF` is MKL's default without grpoflow (thread-count and
alignment dependent on some CPUs); `AUTO,STRICT` is grpoflow's default; `COMPATIBLE` gives the same bits across CPU
families. The HF generate baseline (tok/s, one thread) says how fast the machine was during the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import json, sys, time
import torch
from tests.fakes.update_fingerprint import update_fingerprint
update_fingerprint(int(sys.argv[1]))  # warm: model conversion, allocator, first-call setup
t = time.perf_counter()
out = update_fingerprint(int(sys.argv[1]))
out["seconds"] = time.perf_counter() - t
from grpoflow.numerics import cpu_arithmetic
out["cpu"] = cpu_arithmetic()
print(json.dumps(out))
"""


def hf_generate_baseline() -> float:
    """Greedy tok/s of HF generate on SmolLM2, one thread."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpoflow.prepare.model import prepare_model

    torch.set_num_threads(1)
    path = prepare_model("smollm2-135m-instruct").path
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    ids = tok("List three colours:", return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=8, do_sample=False)
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t)


def run(mode: str, threads: int) -> dict:
    env = dict(os.environ, MKL_CBWR=mode)  # grpoflow's default applies only where the variable is unset
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads)], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per setting (interleaved); the median is shown")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(f"HF generate baseline: {hf_generate_baseline():.1f} tok/s (SmolLM2, one thread)")
    settings = [(mode, t) for mode in ("OFF", "AUTO,STRICT", "COMPATIBLE") for t in args.threads]
    seconds: dict = {s: [] for s in settings}
    bits: dict = {}
    for _ in range(args.repeat):
        for s in settings:
            out = run(*s)
            seconds[s].append(out["seconds"])
            bits[s] = out["weights"][:12]
            cpu = out["cpu"]
    print(f"CPU: {cpu.rsplit(' MKL', 1)[0]}")
    base = {t: statistics.median(seconds[("OFF", t)]) for t in args.threads}
    print(f"{'MKL_CBWR':12s} {'threads':>7s} {'update s':>9s} {'vs OFF':>7s}  weights")
    for mode, t in settings:
        sec = statistics.median(seconds[(mode, t)])
        print(f"{mode:12s} {t:7d} {sec:9.2f} {sec / base[t]:6.2f}x  {bits[(mode, t)]}")


if __name__ == "__main__":
    main()

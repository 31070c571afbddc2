"""Sharded vs replicated trainer ranks on this CPU, side by side in one run: peak memory per rank and tokens/s of
one GRPO update for 1, 2 and 4 ranks, `train.sharding` replicate vs fsdp, `train.precision` fp32 vs bf16.

    .venv/bin/python bench/fsdp.py [--models smollm2-135m,random-360m] [--ranks 1,2,4] [--samples 8 --tokens 256]

Models: SmolLM2-135M-Instruct (`prepare_model`) and a random model of SmolLM2-360M's shape (362M parameters,
built here from its transformers config). Each setting runs in a fresh process (its ranks are that process and
the workers `trainer_ranks` starts): a warm-up update, then a timed one on the same samples (`--samples` rollouts
of `--tokens` tokens, half of them trained, rewards alternating so every group trains). Memory is each rank's
peak resident set during the timed update (Linux `VmHWM`, reset just before it: `/proc/self/clear_refs`), and
rank 0's peak while loading (it holds the whole fp32 model in CPU memory before sharding it). Settings whose
estimated memory exceeds `--max-gb` are skipped and said so. Beside it a baseline (HF `generate` tokens/s on one
thread, SmolLM2-135M): this machine's speed varies from day to day. The ranks share this machine's cores
(torch threads: cores / ranks, at least 1), so tokens/s across rank counts measures overhead, not scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]

# HuggingFaceTB/SmolLM2-360M's shape (362M parameters, tied embeddings).
SMOLLM2_360M = dict(
    hidden_size=960,
    intermediate_size=2560,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
)


def reset_peak(state=None) -> None:
    """Reset this process's peak resident set (VmHWM) to its current one. Also a worker rank's job."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def report_peak(state, out_dir: str) -> None:
    """This rank's peak resident set into `out_dir/rank-<r>.json` (a worker rank's job)."""
    rank = state.dp.rank if state.dp is not None else 0
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps({"peak_gb": peak_gb()}))


def on_every_rank(state, fn, *args) -> None:
    from grpoflow.train.parallel import on_other_ranks

    with on_other_ranks(state, fn, *args):
        fn(state, *args)


def one_setting(model: str, ranks: int, sharding: str, precision: str, samples: int, tokens: int, out: str) -> dict:
    """In a fresh process: one warm-up and one timed update; rank 0 returns the figures."""
    import time

    import torch

    from grpoflow.config import parse_run_config
    from grpoflow.samples import Sample
    from grpoflow.train.ranks import run_update, trainer_ranks
    from grpoflow.train.trainer import load_trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    cfg = parse_run_config(
        {
            "run_id": "bench",
            "model": {"source": model},
            "train": {
                "sharding": sharding,
                "precision": precision,
                "optimizer": {"learning_rate": 1e-5},
                "loss": {"filter_zero_std": False},
                "batch": {"micro_batch_tokens": 2 * tokens},
            },
            "cluster": {"train_ranks": ranks},
        }
    )
    prompt = tokens // 2
    batch = []
    for i in range(samples):
        ids = [(7919 * (i + 1) * (t + 3)) % 40000 + 10 for t in range(tokens)]
        batch.append(
            Sample(
                run_id="bench",
                step=0,
                instance_id=f"t{i // 4}",
                group_id=f"g{i // 4}",
                sample_index=i % 4,
                rollout_id=f"r{i}",
                tokens=ids,
                loss_mask=[0] * prompt + [1] * (tokens - prompt),
                rollout_logprobs=[0.0] * prompt + [-10.0] * (tokens - prompt),
                prompt_len=prompt,
                reward=float(i % 2),
                status="COMPLETED",
                exit_status="Submitted",
            )
        )
    t = time.perf_counter()
    state = load_trainer(model, cfg.train, seed=0, sharded=cfg.sharding_mode() == "fsdp")
    with trainer_ranks(state, model, cfg):
        load_s = time.perf_counter() - t
        load_peak = peak_gb()
        run_update(state, batch, cfg, step=0)
        on_every_rank(state, reset_peak)
        t = time.perf_counter()
        m = run_update(state, batch, cfg, step=1)
        seconds = time.perf_counter() - t
        on_every_rank(state, report_peak, out)
    peaks = [json.loads(Path(out, f"rank-{r}.json").read_text())["peak_gb"] for r in range(ranks)]
    return {
        "tokens_per_s": m.computed["n_forward_tokens"] / seconds,
        "seconds": seconds,
        "peak_gb": peaks,
        "load_peak_gb": load_peak,
        "load_s": load_s,
        "grad_norm": m["grad_norm"],
    }


def run_setting(model: str, ranks: int, sharding: str, precision: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as out:
        code = (
            "import json, sys; sys.path.insert(0, '.'); from bench.fsdp import one_setting; "
            f"print('RESULT ' + json.dumps(one_setting({model!r}, {ranks}, {sharding!r}, {precision!r}, "
            f"{args.samples}, {args.tokens}, {out!r})))"
        )
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
        return json.loads(lines[-1].removeprefix("RESULT "))


def planned_gb(path: str, ranks: int, sharding: str, precision: str, tokens: int) -> float:
    """`grpoflow plan`'s GiB per rank for the setting (the bench trains micro-batches of 2 rollouts)."""
    from grpoflow.train.memory import ModelShape, TrainSetup, plan_memory

    setup = TrainSetup(ranks=ranks, sharding=sharding, precision=precision, micro_batch_tokens=2 * tokens)
    return plan_memory(ModelShape.from_dir(path), setup).total / 2**30


def estimate_gb(params: int, ranks: int, sharding: str) -> float:
    """What the setting needs on this machine in all, roughly, to skip what cannot run: the ranks' planned state
    plus rank 0's whole fp32 copy while loading."""
    per_model = 16 * params / 2**30
    weights = 4 * params / 2**30
    return (per_model * ranks if sharding == "replicate" else per_model + weights) + ranks


def build_random_360m(out_dir: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from grpoflow.prepare.model import prepare_model

    if (out_dir / "config.json").is_file():
        return out_dir
    tok = AutoTokenizer.from_pretrained(prepare_model("smollm2-135m-instruct").path)
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2_360M, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2-135m,random-360m")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--shardings", default="replicate,fsdp")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--samples", type=int, default=8, help="rollouts per update (groups of 4)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rollout (half of them trained)")
    p.add_argument(
        "--max-gb", type=float, default=None, help="skip settings estimated above this (default: 80%% of MemAvailable)"
    )
    p.add_argument("--random-dir", type=Path, default=Path(tempfile.gettempdir()) / "grpoflow-random-360m")
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args(argv)

    from transformers import AutoConfig

    from grpoflow.prepare.model import prepare_model

    paths = {"smollm2-135m": prepare_model("smollm2-135m-instruct").path}
    if "random-360m" in args.models:
        paths["random-360m"] = str(build_random_360m(args.random_dir))
    if args.max_gb is None:
        avail = next(
            int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable")
        )
        args.max_gb = 0.8 * avail / 2**20
    if not args.no_baseline:
        from bench.main_job import hf_generate_tok_s

        print(
            f"baseline: HF generate SmolLM2-135M fp32, 1 thread: {hf_generate_tok_s(paths['smollm2-135m']):.1f} tok/s"
        )
    print(
        f"{os.cpu_count()} cores; {args.samples} rollouts x {args.tokens} tokens per update; memory limit {args.max_gb:.1f} GB"
    )
    header = (
        f"{'model':<13} {'ranks':>5} {'sharding':<9} {'prec':<4} {'tok/s':>7} {'peak GiB per rank (update)':<27} "
        f"{'plan GiB':>8} {'peak/plan':>9} {'rank 0 load GiB':>15}"
    )
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        path = paths[name]
        cfg = AutoConfig.from_pretrained(path)
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            params = sum(t.numel() for t in AutoModelForCausalLM.from_config(cfg).parameters())
        for ranks in map(int, args.ranks.split(",")):
            for sharding in args.shardings.split(","):
                for precision in args.precisions.split(","):
                    row = f"{name:<13} {ranks:>5} {sharding:<9} {precision:<4}"
                    need = estimate_gb(params, ranks, sharding)
                    if need > args.max_gb:
                        print(f"{row} skipped: needs ~{need:.0f} GB, limit {args.max_gb:.0f} GB")
                        continue
                    r = run_setting(path, ranks, sharding, precision, args)
                    if "error" in r:
                        print(f"{row} FAILED: {r['error']}")
                        continue
                    peaks = " ".join(f"{g:.2f}" for g in r["peak_gb"])
                    plan = planned_gb(path, ranks, sharding, precision, args.tokens)
                    ratio = max(r["peak_gb"]) / plan
                    print(
                        f"{row} {r['tokens_per_s']:>7.0f} {peaks:<27} {plan:>8.2f} {ratio:>9.2f} "
                        f"{r['load_peak_gb']:>15.2f}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

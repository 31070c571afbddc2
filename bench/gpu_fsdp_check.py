"""One-GPU check of the sharded (FSDP2) GRPO update: NCCL, bf16 layers with fp32 master weights and reductions,
tokens/s, peak memory and MFU; then the weight sync's gather from the shards.

    python3 bench/gpu_fsdp_check.py                  # Qwen2-0.5B shape, random init, 16 x 2048 tokens, 1 + 4 steps
    python3 bench/gpu_fsdp_check.py --size 1.5b      # Qwen2.5-1.5B shape
    python3 bench/gpu_fsdp_check.py --cpu            # the same path on the CPU (gloo), a tiny model, 1 step

Runs where only torch and transformers are installed (the device machine): it imports grpoflow's FSDP module
(`grpoflow.train.fsdp`: `shard_model`, `clip_gradients`, `serving_stream`), its logprob path and its GRPO loss,
which need nothing else, and drives them as `grpoflow.train.step` does: micro-batches of
`--micro-batch-tokens`, each loss divided by the whole batch's trained tokens (token aggregation), dual-clip on,
one clipped AdamW step per update. World size 1 (NCCL refuses two ranks on one GPU): every FSDP collective runs,
over one rank. Activation checkpointing is on for samples longer than `--checkpoint-above` (the trainer's
default).

Model FLOPs per step as in bench/gpu_check.py: 6 x matmul params x forward tokens (headline), and a detailed count
(the LM head only on trained tokens, causal attention). MFU = model FLOPs / step time / --peak-tflops (H200 dense
bf16: 989). The LM head runs in fp32, so MFU understates how busy the tensor cores are.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpoflow.train.fsdp import clip_gradients, mesh_of, serving_stream, shard_model  # noqa: E402
from grpoflow.train.grpo import LossInputs, policy_loss  # noqa: E402

# grpoflow's default loss settings (LossConfig's), without the config's dependencies
LOSS = SimpleNamespace(
    eps_low=0.2, eps_high=0.28, loss_aggregation="token", dual_clip=3.0, tis_cap=None, mismatch_band=None, kl_coef=0.0
)
from grpoflow.train.logprobs import token_logprobs  # noqa: E402

SIZES = {  # Qwen2 shapes (tied embeddings below 3B)
    "0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936},
    "1.5b": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960, "vocab": 151936},
    "3b": {"hidden": 2048, "layers": 36, "heads": 16, "kv_heads": 2, "intermediate": 11008, "vocab": 151936},
}
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 1024}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_fsdp_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--batch", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--checkpoint-above", type=int, default=4096, help="activation checkpointing above this length")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--time-budget-s", type=float, default=420.0, help="stop timed steps before this wall time")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU with a tiny model, 1 step: checks the path")
    return p


def build_model(shape: dict, seq_len: int, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max(seq_len, 2048),
        tie_word_embeddings=shape["hidden"] < 2048,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).float()
    model.train()
    # transformers' older name for it, on the device machine's older transformers
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return model


def batch(shape: dict, n: int, seq_len: int, prompt_len: int, device: torch.device):
    """(ids (n, L), mask (n, L-1), advantages (n,), old logprobs (n, L-1)): random tokens, a trained completion."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, shape["vocab"], (n, seq_len), generator=g)
    mask = torch.zeros(n, seq_len - 1, dtype=torch.bool)
    mask[:, prompt_len - 1 :] = True
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(n)])
    old = torch.full((n, seq_len - 1), -math.log(shape["vocab"]))
    return ids.to(device), mask.to(device), adv.to(device), old.to(device)


def step(model, optimizer, data, rows_per_micro: int, checkpoint_above: int) -> dict:
    ids, mask, adv, old = data
    denom = int(mask.sum())
    for layer in [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]:
        layer.gradient_checkpointing = ids.shape[1] > checkpoint_above
    loss_sum = 0.0
    for s in range(0, ids.shape[0], rows_per_micro):
        sl = slice(s, s + rows_per_micro)
        logp, ent = token_logprobs(model, ids[sl], mask[sl])
        inputs = LossInputs(logp, old[sl], adv[sl], mask[sl], entropy=ent, denominator=denom)
        loss, _ = policy_loss(inputs, LOSS)
        loss.backward()
        loss_sum += loss.item()
    grad_norm = clip_gradients([p for group in optimizer.param_groups for p in group["params"]], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_sum, "grad_norm": grad_norm}


def flops(shape: dict, n_params: int, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    h, v, layers = shape["hidden"], shape["vocab"], shape["layers"]
    tied = h < 2048
    t_fwd = ids.shape[0] * (ids.shape[1] - 1)
    t_trained = int(mask.sum())
    n_body = n_params - v * h * (1 if tied else 2)
    attn_fwd = 2 * layers * h * ids.shape[0] * (ids.shape[1] - 1) ** 2
    matmul_params = n_params - (0 if tied else v * h)
    return {
        "simple": 6 * matmul_params * t_fwd,
        "detailed": 6 * n_body * t_fwd + 6 * h * v * t_trained + 3 * attn_fwd,
        "tokens_fwd": t_fwd,
    }


def run(a: argparse.Namespace) -> dict:
    cpu = a.cpu
    device = torch.device("cpu" if cpu else "cuda:0")
    if not cpu:
        torch.cuda.set_device(device)
    shape = TINY if cpu else SIZES[a.size]
    seq_len, prompt_len, n = (64, 8, 4) if cpu else (a.seq_len, a.prompt_len, a.batch)
    dist.init_process_group("gloo" if cpu else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    t0 = time.perf_counter()
    try:
        model = build_model(shape, seq_len, device)
        n_params = sum(p.numel() for p in model.parameters())
        shard_model(model, mesh_of(dist.group.WORLD, device), torch.bfloat16 if a.precision == "bf16" else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        data = batch(shape, n, seq_len, prompt_len, device)
        f = flops(shape, n_params, data[0], data[1])
        rows = max(1, a.micro_batch_tokens // seq_len)
        warmup, steps = (0, 1) if cpu else (a.warmup, a.steps)
        times, metrics = [], {}
        for i in range(warmup + steps):
            if i >= warmup and times and time.perf_counter() - t0 + max(times) > a.time_budget_s:
                break
            if not cpu:
                torch.cuda.synchronize()
                if i == warmup:
                    torch.cuda.reset_peak_memory_stats()
            ts = time.perf_counter()
            metrics = step(model, optimizer, data, rows, a.checkpoint_above)
            if not cpu:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - ts)
        peak = torch.cuda.max_memory_allocated() / 2**30 if not cpu else None
        # the weight sync's side: every tensor gathered whole from the shards, cast to bf16, one at a time
        before = torch.cuda.memory_allocated() if not cpu else 0
        if not cpu:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        ts = time.perf_counter()
        moved = 0
        for _, t in serving_stream(model):
            moved += t.to(torch.bfloat16).numel() * 2
        if not cpu:
            torch.cuda.synchronize()
        gather_s = time.perf_counter() - ts
        gather_extra = (torch.cuda.max_memory_allocated() - before) / 2**30 if not cpu else None
        master = {p.to_local().dtype for p in model.parameters()}
    finally:
        dist.destroy_process_group()
    step_s = statistics.median(times)
    return {
        "device": "cpu" if cpu else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "shape": shape,
        "n_params": n_params,
        "batch": n,
        "seq_len": seq_len,
        "precision": a.precision,
        "master_dtypes": sorted(str(d) for d in master),
        "steps_timed": len(times),
        "step_s": times,
        "step_s_median": step_s,
        "tokens_per_s": f["tokens_fwd"] / step_s,
        "mfu_simple": f["simple"] / step_s / (a.peak_tflops * 1e12),
        "mfu_detailed": f["detailed"] / step_s / (a.peak_tflops * 1e12),
        "peak_memory_gb": peak,
        "sync_gather_s": gather_s,
        "sync_gather_gb": moved / 2**30,
        "sync_gather_extra_memory_gb": gather_extra,
        "loss": metrics.get("loss"),
        "grad_norm": metrics.get("grad_norm"),
        "total_s": time.perf_counter() - t0,
    }


def report(r: dict) -> str:
    mem = f"{r['peak_memory_gb']:.1f} GB" if r["peak_memory_gb"] is not None else "n/a (CPU)"
    extra = f"{r['sync_gather_extra_memory_gb']:.2f} GB" if r["sync_gather_extra_memory_gb"] is not None else "n/a"
    return "\n".join(
        [
            f"fsdp-check: {r['device']} (torch {r['torch']}) | random Qwen2 {r['n_params'] / 1e6:.0f}M params | "
            f"{r['batch']} x {r['seq_len']} tokens | layers {r['precision']}, master weights {r['master_dtypes']}",
            f"step s median {r['step_s_median']:.3f} over {r['steps_timed']} | tokens/s {r['tokens_per_s']:,.0f} | "
            f"MFU {100 * r['mfu_simple']:.3g}% (6*N*T), {100 * r['mfu_detailed']:.3g}% (detailed)",
            f"peak memory {mem} | loss {r['loss']:.5f} grad_norm {r['grad_norm']:.4f}",
            f"sync gather: {r['sync_gather_gb']:.2f} GB bf16 in {r['sync_gather_s']:.2f} s, extra memory {extra}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_fsdp_check.py: error: no CUDA device here; --cpu runs the same path on the CPU", file=sys.stderr)
        return 2
    r = run(args)
    print(report(r))
    print("RESULT " + json.dumps(r))
    return 0 if all(math.isfinite(r[k]) for k in ("loss", "grad_norm")) else 1


if __name__ == "__main__":
    sys.exit(main())

"""One-GPU check of grpoflow's GRPO train step at ~0.5B scale: tokens/s and MFU, bf16 autocast on CUDA.

    python bench/gpu_check.py                 # Qwen2-0.5B shape, random init, 32 x 2048 tokens, 1 + 5 steps
    python bench/gpu_check.py --dry-run       # same path and report on CPU with a tiny model (what CI runs)

What runs is the trainer the flows use: `grpoflow.train.load_trainer` (fp32 weights, AdamW, bf16 autocast on
CUDA) and `train_step` (advantages, micro-batches, chunked fp32 LM head, clip, optimizer step). Nothing is
downloaded: the model is a Qwen2 built from its config with random weights, saved to a temp dir (with a
placeholder tokenizer, which the step never uses) and loaded back by `load_trainer`; the batch is synthetic
`Sample`s (random prompt and completion tokens, rewards that vary inside every group, rollout logprobs
-log(V), near what a random model gives, so PPO ratios start near 1).

Model FLOPs per optimizer step (fwd + bwd, so 3x forward):
- headline, as usual: 6 x params x forward tokens (the tied embedding counted once, as the LM-head matmul);
- detailed, for this trainer: 6 x non-embedding params x forward tokens + 6 x hidden x vocab x trained tokens
  (the LM head runs only where the loss does) + causal attention 6 x layers x hidden x sum(L^2) (+ the reference
  forward when --kl-coef > 0). Backward's recomputation of LM-head chunks is work, not model FLOPs.
MFU = model FLOPs / step time / --peak-tflops (H200 bf16 dense: 989). The LM head runs in fp32 (TF32 off unless
torch is told otherwise), so MFU against the bf16 peak understates how busy the tensor cores are.
The default size finishes well inside 8 minutes on one H200 (setup ~1 min, a few seconds per step);
--time-budget-s stops timed steps early if it would not.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpoflow.config import TrainConfig  # noqa: E402
from grpoflow.samples import Sample  # noqa: E402

# Qwen2-0.5B (hidden 896, 24 layers, 14 query / 2 KV heads, MLP 4864, vocab 151936, tied embeddings).
FULL = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936}
# The dry run's stand-in: same structure (GQA, tied head), small enough for one CPU step in about a second.
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 1024}
TINY_SEQ, TINY_PROMPT = 64, 8


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    for name, default in FULL.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"model shape ({default})")
    p.add_argument("--untied", action="store_true", help="separate LM head (Qwen2-0.5B ties it to the embedding)")
    p.add_argument("--batch", type=int, default=32, help="samples per optimizer step (one step per train_step)")
    p.add_argument("--group-size", type=int, default=8, help="samples per GRPO group")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (prompt + completion)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sample (not trained)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384, help="train.batch.micro_batch_tokens")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the frozen reference model's forward")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (allocator, kernels)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H200: 989)")
    p.add_argument("--time-budget-s", type=float, default=480.0, help="stop timed steps before this wall time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the arguments, then 1 step of a tiny model on CPU, with the same report",
    )
    return p


def validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse impossible shapes and batches with one line (argparse's exit status 2)."""
    if min(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate) < 1 or a.vocab < 4:
        p.error("model sizes must be positive and --vocab at least 4")
    if a.hidden % a.heads or (a.hidden // a.heads) % 2:
        p.error(f"--hidden {a.hidden} must split into --heads {a.heads} heads of an even size (rotary embeddings)")
    if a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} must be a multiple of --kv-heads {a.kv_heads} (grouped-query attention)")
    if not 1 <= a.prompt_len <= a.seq_len - 2:
        p.error(f"--prompt-len {a.prompt_len} must be in 1..seq_len-2 ({a.seq_len - 2}): a completion must remain")
    if a.group_size < 2 or a.batch % a.group_size:
        p.error(f"--batch {a.batch} must be a multiple of --group-size {a.group_size} (at least 2: GRPO compares)")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    if a.peak_tflops <= 0 or a.time_budget_s <= 0 or a.kl_coef < 0:
        p.error("--peak-tflops and --time-budget-s must be positive, --kl-coef not negative")
    if a.micro_batch_tokens < 64:
        p.error(f"--micro-batch-tokens {a.micro_batch_tokens} must be at least 64 (train.batch.micro_batch_tokens)")


def train_config(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        optimizer={"learning_rate": 1e-6},
        batch={
            "global_batch_size": a.batch,
            "micro_batch_tokens": a.micro_batch_tokens,
            "gradient_checkpointing": a.gradient_checkpointing,
        },
        loss={"kl_coef": a.kl_coef, "filter_zero_std": False},
    )


def build_model_dir(shape: dict, tied: bool, seq_len: int, out: Path, device: torch.device, seed: int) -> Path:
    """A random Qwen2 of `shape` saved as an HF dir, plus a one-token placeholder tokenizer (never used)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the report is the output; shard-writing bars only clutter it

    cfg = Qwen2Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max(seq_len, 2048),
        tie_word_embeddings=tied,
        dtype="float32",
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialise where it will train: random init of 0.5B on CPU alone takes a while
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    del model
    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)
    return out


def make_samples(a: argparse.Namespace, vocab: int, seq_len: int, prompt_len: int, batch: int) -> list[Sample]:
    rng = random.Random(a.seed)
    old_lp = -math.log(vocab)  # a random model's next-token logprob is about this: ratios start near 1
    samples = []
    for i in range(batch):
        g, j = divmod(i, a.group_size)
        if j == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        completion = [rng.randrange(3, vocab) for _ in range(seq_len - prompt_len)]
        samples.append(
            Sample(
                run_id="gpu-check",
                step=0,
                instance_id=f"task-{g}",
                group_id=f"g{g}",
                sample_index=j,
                rollout_id=f"r{i}",
                tokens=prompt + completion,
                loss_mask=[0] * prompt_len + [1] * len(completion),
                rollout_logprobs=[0.0] * prompt_len + [old_lp] * len(completion),
                prompt_len=prompt_len,
                reward=float(j % 2),
                status="COMPLETED",
                exit_status="Submitted",
            )
        )
    return samples


def model_flops(shape: dict, tied: bool, n_params: int, samples: list[Sample], kl: bool) -> dict[str, float]:
    h, v, layers = shape["hidden"], shape["vocab"], shape["layers"]
    fwd_lens = [len(s.tokens) - 1 for s in samples]  # the model reads tokens[:-1]
    t_fwd = sum(fwd_lens)
    t_trained = sum(sum(s.loss_mask[1:]) for s in samples)
    n_body = n_params - v * h * (1 if tied else 2)  # embedding lookup (and the head) out of the body
    attn_fwd = 2 * layers * h * sum(n * n for n in fwd_lens)  # causal QK^T and AV: half of 4 L^2 d per layer
    detailed = 6 * n_body * t_fwd + 6 * h * v * t_trained + 3 * attn_fwd
    if kl:  # the frozen reference model: forward only
        detailed += 2 * n_body * t_fwd + 2 * h * v * t_trained + attn_fwd
    matmul_params = n_params - (0 if tied else v * h)  # the input embedding is a lookup, not a matmul
    return {"simple": 6 * matmul_params * t_fwd, "detailed": detailed, "tokens_fwd": t_fwd, "tokens_trained": t_trained}


def run(a: argparse.Namespace) -> dict:
    from grpoflow.train.step import train_step
    from grpoflow.train.trainer import load_trainer

    dry = a.dry_run
    shape = TINY if dry else {k: getattr(a, k) for k in FULL}
    seq_len, prompt_len = (TINY_SEQ, TINY_PROMPT) if dry else (a.seq_len, a.prompt_len)
    batch = a.group_size if dry else a.batch  # one group is enough to exercise the step
    device = torch.device("cpu" if dry else "cuda")
    tied = not a.untied
    cfg = train_config(a)
    cfg = cfg.model_copy(update={"batch": cfg.batch.model_copy(update={"global_batch_size": batch})})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpoflow-gpu-check-") as tmp:
        model_dir = build_model_dir(shape, tied, seq_len, Path(tmp) / "model", device, a.seed)
        state = load_trainer(model_dir, cfg, seed=a.seed, device=str(device))
    n_params = sum(p.numel() for p in state.model.parameters())  # a tied weight is one parameter
    samples = make_samples(a, shape["vocab"], seq_len, prompt_len, batch)
    flops = model_flops(shape, tied, n_params, samples, kl=a.kl_coef > 0)
    setup_s = time.perf_counter() - t0

    warmup, steps = (0, 1) if dry else (a.warmup, a.steps)
    times: list[float] = []
    metrics: dict = {}
    stopped_early = False
    for i in range(warmup + steps):
        if i >= warmup and times and time.perf_counter() - t0 + max(times) > a.time_budget_s:
            stopped_early = True
            break
        if device.type == "cuda":
            torch.cuda.synchronize()
        ts = time.perf_counter()
        metrics = train_step(state, samples, cfg, seed=a.seed + i)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the optimizer step is queued, not done, when train_step returns
        if i >= warmup:
            times.append(time.perf_counter() - ts)
    step_s = statistics.median(times)
    return {
        "dry_run": dry,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": shape,
        "tied": tied,
        "n_params": n_params,
        "batch": batch,
        "seq_len": seq_len,
        "prompt_len": prompt_len,
        "micro_batch_tokens": cfg.batch.micro_batch_tokens,
        "gradient_checkpointing": cfg.batch.gradient_checkpointing,
        "kl_coef": cfg.loss.kl_coef,
        "autocast": str(state.autocast_dtype),
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "warmup": warmup,
        "steps_timed": len(times),
        "stopped_early": stopped_early,
        "step_s": times,
        "step_s_median": step_s,
        "tokens_per_s": flops["tokens_fwd"] / step_s,
        **{f"flops_{k}": v for k, v in flops.items()},
        "tflops_simple": flops["simple"] / step_s / 1e12,
        "tflops_detailed": flops["detailed"] / step_s / 1e12,
        "peak_tflops": a.peak_tflops,
        "mfu_simple": flops["simple"] / step_s / (a.peak_tflops * 1e12),
        "mfu_detailed": flops["detailed"] / step_s / (a.peak_tflops * 1e12),
        "peak_memory_gb": metrics.get("peak_memory_gb"),
        "loss": metrics.get("loss"),
        "grad_norm": metrics.get("grad_norm"),
        "optimizer_steps": metrics.get("optimizer_steps"),
        "setup_s": setup_s,
        "total_s": time.perf_counter() - t0,
    }


def report(r: dict) -> str:
    s = r["shape"]
    finite = all(math.isfinite(x) for x in (r["loss"], r["grad_norm"]))
    lines = []
    if r["dry_run"]:
        lines.append("DRY RUN on CPU with a tiny Qwen2: checks the path and the report, not a GPU's speed")
    mem = f"{r['peak_memory_gb']:.1f} GB" if r["peak_memory_gb"] is not None else "n/a (CPU)"
    lines += [
        f"gpu-check: {r['device']} | random-init Qwen2: {r['n_params'] / 1e6:.1f}M params "
        f"({'tied' if r['tied'] else 'untied'} head), hidden {s['hidden']}, {s['layers']} layers, "
        f"{s['heads']}/{s['kv_heads']} heads, MLP {s['intermediate']}, vocab {s['vocab']}",
        f"batch {r['batch']} x {r['seq_len']} tokens (prompt {r['prompt_len']}): {r['flops_tokens_fwd']} forward "
        f"tokens/step, {r['flops_tokens_trained']} trained | micro-batch {r['micro_batch_tokens']} tokens | autocast "
        f"{r['autocast']}, fp32 matmul precision {r['fp32_matmul_precision']} | grad ckpt "
        f"{r['gradient_checkpointing']} | kl {r['kl_coef']}",
        f"steps: {r['warmup']} warm-up + {r['steps_timed']} timed{' (time budget hit)' if r['stopped_early'] else ''}"
        f"; step s median {r['step_s_median']:.3f} (min {min(r['step_s']):.3f}, max {max(r['step_s']):.3f})",
        f"tokens/s: {r['tokens_per_s']:,.0f}",
        f"model TFLOP/step: {r['flops_simple'] / 1e12:.4g} (6*N*T) | {r['flops_detailed'] / 1e12:.4g} (detailed)",
        f"achieved: {r['tflops_simple']:.4g} TFLOP/s | MFU {100 * r['mfu_simple']:.3g}% (6*N*T), "
        f"{100 * r['mfu_detailed']:.3g}% (detailed) of {r['peak_tflops']:g} TFLOP/s peak",
        f"peak memory: {mem} | loss {r['loss']:.6f}, grad_norm {r['grad_norm']:.4f} "
        f"({'finite' if finite else 'NOT FINITE'}), optimizer steps {r['optimizer_steps']} | setup "
        f"{r['setup_s']:.1f} s, total {r['total_s']:.1f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(parser, args)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check.py: error: no CUDA device here; --dry-run runs the same path on CPU with a tiny model",
            file=sys.stderr,
        )
        return 2
    result = run(args)
    print(report(result))
    print("RESULT " + json.dumps(result))
    finite = all(math.isfinite(result[k]) for k in ("loss", "grad_norm"))
    return 0 if finite and result["optimizer_steps"] else 1


if __name__ == "__main__":
    sys.exit(main())

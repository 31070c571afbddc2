"""Throughput and peak memory of grpoflow's GRPO train step next to TRL's GRPO loss, on one model and one batch.

    .venv/bin/python bench/train.py                                   # tiny random Qwen2, 8 x 256 tokens
    .venv/bin/python bench/train.py --model-path /tmp/gfcache/models/b179c9523d0e6a0f   # SmolLM2-135M

What is compared (one optimizer step each, same weights, same inputs, same hyper-parameters):
- ours: `grpoflow.train.train_step` on `Sample`s (advantages, packing, forward, backward, clip, AdamW);
- TRL:  `GRPOTrainer.compute_loss` (TRL 1.16: its fused LM head via `_get_per_token_logps_and_entropies`, then
  the clipped loss) on the equivalent prepared inputs dict, then `loss.backward()`, `clip_grad_norm_` and
  the optimizer `GRPOTrainer.create_optimizer()` builds. Generation and reward scoring are not timed on
  either side. Token aggregation maps to TRL's `bnpo`, sample aggregation to `grpo`; advantages are computed
  once (grpoflow's population-std group advantages) and fed to both.

Each side runs in its own subprocess so its peak RSS (or CUDA peak allocation) is its own. tokens/s counts
the real (non-pad) tokens of the batch on both sides. TRL is a benchmark-only dependency (`trl==1.16.0`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP = 4  # samples per GRPO group


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def make_spec(args, model_path: Path) -> dict:
    """One batch: equal-length prompts, completions of varying length (right padding), rollout logprobs =
    the model's own + small noise, binary rewards that vary inside every group."""
    from transformers import AutoModelForCausalLM

    from grpoflow.train.grpo import group_advantages
    from grpoflow.train.logprobs import token_logprobs

    rng = random.Random(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    vocab = model.config.vocab_size
    max_c = args.seq_len - args.prompt_len
    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
    samples = []
    for i in range(args.batch):
        c = max_c if i % 2 == 0 else rng.randint(max_c // 2, max_c)
        tokens = prompt + [rng.randrange(3, vocab) for _ in range(c)]
        mask = torch.tensor([[0] * (args.prompt_len - 1) + [1] * c], dtype=torch.bool)  # (1, L-1)
        with torch.no_grad():
            lp, _ = token_logprobs(model, torch.tensor([tokens]), mask)
        lp = lp[0, args.prompt_len - 1 :] + 0.02 * torch.randn(c, generator=torch.Generator().manual_seed(i))
        reward = float(i % 2 == 0 or i % 3 == 0)  # varies inside every group of 4
        samples.append({"tokens": tokens, "completion_logprobs": lp.tolist(), "reward": reward})
    rewards = torch.tensor([s["reward"] for s in samples])
    groups = [f"g{i // GROUP}" for i in range(args.batch)]
    adv = group_advantages(rewards, groups, scale_by_std=True)
    plain_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {
        "model_path": str(model_path),
        "prompt_len": args.prompt_len,
        "samples": samples,
        "groups": groups,
        "advantages": adv.tolist(),
        "args": plain_args,
    }


def _train_config(a: dict):
    from grpoflow.config import TrainConfig

    return TrainConfig(
        optimizer={"learning_rate": a["lr"], "max_grad_norm": 1.0},
        loss={"loss_aggregation": a["aggregation"], "filter_zero_std": False},
        batch={"gradient_checkpointing": a["gradient_checkpointing"], "micro_batch_tokens": a["batch"] * a["seq_len"]},
    )


def run_ours(spec: dict, device: str) -> dict:
    from grpoflow.samples import Sample
    from grpoflow.train.step import train_step
    from grpoflow.train.trainer import load_trainer

    a, P = spec["args"], spec["prompt_len"]
    cfg = _train_config(a)
    state = load_trainer(spec["model_path"], cfg, seed=0, device=device)
    samples = []
    for i, s in enumerate(spec["samples"]):
        n, c = len(s["tokens"]), len(s["tokens"]) - P
        samples.append(
            Sample(
                run_id="bench",
                step=0,
                instance_id="x",
                group_id=spec["groups"][i],
                sample_index=i,
                rollout_id=str(i),
                tokens=s["tokens"],
                loss_mask=[0] * P + [1] * c,
                rollout_logprobs=[0.0] * P + s["completion_logprobs"],
                prompt_len=P,
                reward=s["reward"],
                status="COMPLETED",
                exit_status="Submitted",
            )
        )
        assert len(samples[-1].tokens) == n

    def step(i: int) -> float:
        return train_step(state, samples, cfg, seed=i)["loss"]

    return _measure(step, a, state.device)


def run_trl(spec: dict, device: str) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpoflow.train.trainer import disable_dropout

    a, P = spec["args"], spec["prompt_len"]
    dev = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32).to(dev)
    disable_dropout(model)
    B, C = len(spec["samples"]), max(len(s["tokens"]) for s in spec["samples"]) - P
    args = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl-out"),
        per_device_train_batch_size=B,
        num_generations=GROUP,
        max_completion_length=C,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=a["lr"],
        loss_type={"token": "bnpo", "sample": "grpo"}[a["aggregation"]],
        max_grad_norm=1.0,
        weight_decay=0.0,
        report_to="none",
        use_cpu=dev.type == "cpu",
        bf16=dev.type == "cuda",
        activation_checkpointing=a["gradient_checkpointing"],
        disable_dropout=True,
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * B),
        processing_class=AutoTokenizer.from_pretrained(spec["model_path"]),
    )
    if a["gradient_checkpointing"]:  # what `Trainer.train()` does before the first step
        model.activation_checkpointing_enable()
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which we do not run
    optimizer = trainer.create_optimizer()

    # TRL's batch layout: prompts (B, P) and right-padded completions (B, C) with their masks
    comp = torch.zeros(B, C, dtype=torch.long)
    comp_mask = torch.zeros(B, C, dtype=torch.long)
    old = torch.zeros(B, C)
    for i, s in enumerate(spec["samples"]):
        c = len(s["tokens"]) - P
        comp[i, :c], comp_mask[i, :c] = torch.tensor(s["tokens"][P:]), 1
        old[i, :c] = torch.tensor(s["completion_logprobs"])
    inputs = {
        "prompt_ids": torch.tensor([s["tokens"][:P] for s in spec["samples"]]),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": comp,
        "completion_mask": comp_mask,
        "advantages": torch.tensor(spec["advantages"]),
        "old_per_token_logps": old,
    }
    inputs = {k: v.to(dev) for k, v in inputs.items()}

    def step(_: int) -> float:
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    out = _measure(step, a, dev)
    out["optimizer"] = type(optimizer).__name__
    return out


def _measure(step, a: dict, dev: torch.device) -> dict:
    rss_loaded = _rss_mb()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first_loss = step(0)  # warm-up; the loss at the shared initial weights, to check both compute the same thing
    times = []
    for i in range(a["steps"]):
        t0 = time.perf_counter()
        step(i + 1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {
        "first_loss": first_loss,
        "step_s": min(times),
        "step_s_all": times,
        "rss_loaded_mb": rss_loaded,
        "peak_rss_mb": _peak_rss_mb(),
    }
    if dev.type == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", type=Path, help="HF model dir (default: build the tiny random model)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256, help="prompt + longest completion")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--aggregation", choices=["token", "sample"], default="token")
    p.add_argument("--gradient-checkpointing", action="store_true", help="on both sides")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (best is reported)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steady figures on a shared machine)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    if args.worker:
        spec = json.loads(args.spec.read_text())
        result = (run_ours if args.worker == "ours" else run_trl)(spec, args.device)
        print("RESULT " + json.dumps(result))
        return

    with tempfile.TemporaryDirectory(prefix="grpoflow-bench-") as tmp:
        model_path = args.model_path
        if model_path is None:
            from tests.fakes.tiny_model import build_tiny_model

            model_path = build_tiny_model(Path(tmp) / "tiny", seed=0)
        spec_path = Path(tmp) / "spec.json"
        spec = make_spec(args, model_path) | {"workdir": tmp}
        spec_path.write_text(json.dumps(spec))
        results = {}
        for worker in ("ours", "trl"):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                worker,
                "--spec",
                str(spec_path),
                "--threads",
                str(args.threads),
                "--device",
                args.device,
            ]
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"{worker} worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
            results[worker] = json.loads(lines[-1][len("RESULT ") :])

    _report(args, model_path, spec, results)


def _report(args, model_path, spec: dict, results: dict) -> None:
    n_tokens = sum(len(s["tokens"]) for s in spec["samples"])
    n_trained = sum(len(s["completion_logprobs"]) for s in spec["samples"])
    cuda = args.device.startswith("cuda")
    mem_key = "cuda_peak_mb" if cuda else "peak_rss_mb"
    print(
        f"model {model_path} | batch {args.batch} x <= {args.seq_len} tokens (prompt {args.prompt_len}): "
        f"{n_tokens} real tokens, {n_trained} trained | aggregation {args.aggregation} | "
        f"grad ckpt {args.gradient_checkpointing} | {args.device}, {args.threads} thread(s)"
    )
    print(
        f"one optimizer step (forward + backward + clip + AdamW), best of {args.steps} after 1 warm-up; "
        f"memory: {'CUDA peak allocated' if cuda else 'peak RSS of the worker process'}"
    )
    print(f"{'':6} {'tokens/s':>9} {'step s':>8} {'peak MB':>8} {'peak-loaded MB':>15} {'step-1 loss':>12}")
    step_mem = {}
    for name, r in results.items():
        step_mem[name] = r[mem_key] - (0 if cuda else r["rss_loaded_mb"])  # what the step adds to the loaded model
        print(
            f"{name:6} {n_tokens / r['step_s']:9.1f} {r['step_s']:8.3f} {r[mem_key]:8.0f} {step_mem[name]:15.0f} "
            f"{r['first_loss']:12.6f}"
        )
    ours, trl = results["ours"], results["trl"]
    print(
        f"ratio ours/TRL: tokens/s {trl['step_s'] / ours['step_s']:.2f}x | peak memory "
        f"{ours[mem_key] / trl[mem_key]:.2f}x (step's own: {step_mem['ours'] / step_mem['trl']:.2f}x) | "
        f"TRL optimizer: {trl.get('optimizer')}"
    )


if __name__ == "__main__":
    main()

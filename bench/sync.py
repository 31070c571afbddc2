"""Weight sync and checkpoints: what each way of getting a step's weights into the engine writes and costs.

    .venv/bin/python bench/sync.py [--model smollm2-135m-instruct] [--steps 10] [--threads 1]

One embedded engine, one trainer (AdamW state filled by a step), then `--steps` steps (one `train.checkpoint.interval`:
the last writes the full checkpoint) of each path, side by side:
- `every step a full checkpoint`: the first round's path: fp32 weights + AdamW state + counters, fsynced, then
  `/update_weights_from_disk`.
- `disk`: `engine.weight_sync.mode=disk`: the step's weights, unsynced, then `/update_weights_from_disk`; the full
  checkpoint at the end of the interval.
- `distributed (gloo)`: `engine.weight_sync.mode=distributed`: the weights broadcast in memory; the full checkpoint at
  the end of the interval.
- `tensor (shared memory)`: `engine.weight_sync.mode=tensor`: the weights copied into shared memory that the engine
  maps (`/update_weights_from_tensor`); the full checkpoint at the end of the interval.
- `LoRA r16, merged (distributed)`: `train.lora` (rank 16 on every linear of the blocks), the merged weights
  broadcast in memory (the default); full checkpoints hold the adapter and its optimizer state.
- `LoRA r16, adapter`: `engine.weight_sync.mode=adapter`: the adapter alone, written and loaded with
  `/load_lora_adapter`.
Printed per path: bytes written per step (full checkpoints spread over the interval), seconds per step of commit +
sync in the step's own time, the sync alone, and sync ÷ save-alone (the sync against writing the same weights to
disk once, unsynced), also without the embedded engine's re-packing of its weights that follows any full-weight
update (an adapter is merged instead), beside a baseline (HF `generate` tokens/s on one thread) since this machine's speed varies.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # "Writing model shards" and "Loading weights" on every save and load
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpoflow.config import LoraSettings, TrainConfig, parse_run_config  # noqa: E402
from grpoflow.engine.launch import start_embedded_engine  # noqa: E402
from grpoflow.prepare.model import prepare_model  # noqa: E402
from grpoflow.train.checkpoint import save_checkpoint  # noqa: E402
from grpoflow.train.sync import open_weight_sync  # noqa: E402
from grpoflow.train.trainer import load_trainer  # noqa: E402


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def baseline(model_dir: str) -> float:
    """HF generate tokens/s, greedy, one thread: the machine's speed today."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def nudge(trainer) -> None:
    """A real AdamW step on a random gradient: the weights change and the optimizer state is full-size."""
    for p in trainer.model.parameters():
        if p.requires_grad:  # a LoRA run's adapters alone
            p.grad = torch.randn_like(p) * 1e-3
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.optimizer_steps += 1


def run_path(name: str, trainer, engine_url: str, root: Path, steps: int) -> dict:
    written, foreground, sync_s = 0, 0.0, 0.0
    mode = name.split()[0] if name.split()[0] in ("distributed", "tensor", "adapter") else "disk"
    lora = {"lora": {}} if "LoRA" in name else {}
    cfg = parse_run_config({"engine": {"weight_sync": {"mode": mode}}, "train": lora})
    with open_weight_sync(cfg, engine_url, trainer, root / "sync") as sync:
        for step in range(steps):
            nudge(trainer)
            full = name.startswith("every step") or step == steps - 1
            ckpt = root / name.split()[0] / f"step_{step}"
            t0 = time.perf_counter()
            if full:
                save_checkpoint(
                    trainer.model,
                    trainer.tokenizer,
                    ckpt,
                    optimizer=trainer.optimizer,
                    counters={"step": step},
                    step_record={"step": step},
                    durable=True,
                    weights=sync.needs_dir,  # a LoRA run in memory: the adapter alone
                )
            elif sync.needs_dir:
                save_checkpoint(trainer.model, trainer.tokenizer, ckpt, step_record={"step": step}, durable=False)
            t1 = time.perf_counter()
            moved = sync.push(trainer, f"{name.split()[0]}-{step}", ckpt if ckpt.exists() else None)
            t2 = time.perf_counter()
            written += dir_bytes(ckpt) if ckpt.exists() else 0
            written += moved["bytes"] if mode == "adapter" else 0  # the adapter it wrote for the engine
            foreground += t2 - t0
            sync_s += t2 - t1
            shutil.rmtree(ckpt, ignore_errors=True)
    return {"bytes": written / steps, "step_s": foreground / steps, "sync_s": sync_s / steps}


def save_alone(trainer, root: Path, repeats: int = 3) -> float:
    """Writing the weights once (unsynced), best of `repeats`."""
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        save_checkpoint(trainer.model, None, root / f"alone_{i}", durable=False)
        best = min(best, time.perf_counter() - t0)
        shutil.rmtree(root / f"alone_{i}")
    return best


def engine_repack(model_dir: str, repeats: int = 3) -> float:
    """What the embedded engine itself spends after any weight update re-laying its oneDNN-packed linears
    (`repack_linears`), best of `repeats`: part of every path's sync here, not of the transfer."""
    from transformers import AutoModelForCausalLM

    from grpoflow.embedded.engine.packed_linear import pack_linears, repack_linears

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if not pack_linears(model):
        return 0.0
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        repack_linears(model)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a built-in model name or an HF dir")
    p.add_argument("--steps", type=int, default=10, help="steps per path: one save interval")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = prepare_model(args.model).path
    print(f"model {model_dir} | {args.steps} steps per path, the last writes the full checkpoint")
    print(f"baseline: HF generate {baseline(model_dir):.1f} tok/s on one thread")
    trainer = load_trainer(model_dir, TrainConfig(), seed=0)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    with tempfile.TemporaryDirectory(prefix="grpoflow-sync-") as tmp, start_embedded_engine(model_dir) as engine:
        root = Path(tmp)
        alone = save_alone(trainer, root)
        results = {
            name: run_path(name, trainer, engine.url, root, args.steps)
            for name in ("every step a full checkpoint", "disk", "distributed (gloo)", "tensor (shared memory)")
        }
        lora = load_trainer(model_dir, TrainConfig(lora=LoraSettings()), seed=0)
        results["LoRA r16, merged (distributed)"] = run_path("distributed LoRA", lora, engine.url, root, args.steps)
        results["LoRA r16, adapter"] = run_path("adapter LoRA", lora, engine.url, root, args.steps)
    today = results["every step a full checkpoint"]
    repack = engine_repack(model_dir)
    print(f"{n_params / 1e6:.0f}M parameters; writing the fp32 weights alone (unsynced): {alone:.2f} s")
    print(f"of each full-weight sync, the embedded engine re-packing its oneDNN linears: {repack:.2f} s\n")
    print(
        f"{'path':30} {'MB written/step':>16} {'÷ today':>8} {'commit+sync s/step':>19} {'sync s':>7} {'sync ÷ save':>12}"
        f" {'w/o repack':>11}"
    )
    for name, r in results.items():
        fewer = today["bytes"] / r["bytes"] if r["bytes"] else float("inf")
        print(
            f"{name:30} {r['bytes'] / 1e6:16.0f} {fewer:7.1f}x {r['step_s']:19.2f} {r['sync_s']:7.2f} "
            f"{r['sync_s'] / alone:12.2f} {(r['sync_s'] - (0 if 'adapter' in name else repack)) / alone:11.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

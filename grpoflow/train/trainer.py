"""The trainer: the policy (and a frozen reference for KL) loaded from an HF dir, with AdamW over fp32 weights.

Weights are fp32 everywhere; on CUDA the backbone runs under bf16 autocast (pure bf16 AdamW would round away
updates below the bf16 step of a weight, e.g. lr 1e-5 on a weight of 0.02). Dropout is off: train-time logprobs
must match the engine's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grpoflow.config import RunConfig, TrainConfig
from grpoflow.train.logprobs import check_logprob_path
from grpoflow.train.lora import add_lora

if TYPE_CHECKING:
    from grpoflow.train.ranks import DataParallel


@dataclass
class TrainerState:
    model: PreTrainedModel
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    ref_model: PreTrainedModel | None
    device: torch.device
    autocast_dtype: torch.dtype | None  # bf16 on CUDA, None (plain fp32) on CPU
    optimizer_steps: int = 0
    dp: DataParallel | None = None  # this process's rank among data-parallel trainers (`cluster.train_ranks`)


def load_trainer(model_path: str | Path, cfg: TrainConfig, seed: int = 0, device: str | None = None) -> TrainerState:
    """Load the policy (and a frozen reference when `kl_coef > 0`) from an HF dir, with an AdamW over it.

    Determinism: on CPU, torch kernels are deterministic for a fixed thread count, so seeding is enough (steps
    from the same seed give bitwise-equal weights; tested). On CUDA, SDPA/matmul backward may use atomics:
    equal up to rounding, not bitwise.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(dev)
    disable_dropout(model)
    model.train()  # activation checkpointing only runs in training mode; dropout is off anyway
    if cfg.lora is not None:
        model = add_lora(model, cfg.lora)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()
    ref = None
    if cfg.kl_coef > 0:
        # fp32 like the policy, under the same autocast: at step 0 the two score alike and the KL is exactly 0
        # (bf16 reference weights would put a rounding-sized KL in every step's loss).
        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(dev).eval().requires_grad_(False)
    check_logprob_path(model)
    trainable = [p for p in model.parameters() if p.requires_grad]  # the adapters alone under LoRA
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return TrainerState(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(model_path),
        optimizer=optimizer,
        ref_model=ref,
        device=dev,
        autocast_dtype=torch.bfloat16 if dev.type == "cuda" else None,
    )


def disable_dropout(model: torch.nn.Module) -> None:
    # Train-time logprobs must match the engine's (no dropout) or every ratio is noise.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def share_cores_with_engine(cfg: RunConfig) -> int | None:
    """With rollouts overlapping the trainer (`train.max_staleness` > 0) and the embedded engine computing on this
    machine's CPUs, the trainer takes the cores the engine leaves (`engine.threads`): torch's threads wait on
    each other at every op, so one of them sharing a core with the engine slows the whole update. Returns the
    thread count it set, or None when it left torch's own (a GPU trainer, or SGLang elsewhere). The same count on
    every run of a config keeps CPU training deterministic."""
    if not cfg.train.max_staleness or cfg.engine.backend != "embedded" or torch.cuda.is_available():
        return None
    threads = max(1, (os.cpu_count() or 1) - cfg.engine.threads)
    torch.set_num_threads(threads)
    return threads


def overlap_note(cfg: RunConfig, threads: int | None) -> str:
    """What an asynchronous run does differently, said once at its start."""
    note = f"max_staleness {cfg.train.max_staleness}: each step's rollout runs while the previous step trains"
    return note + (f"; the trainer uses {threads} CPU threads beside the engine's" if threads else "")

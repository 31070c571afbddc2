"""The trainer: the policy (and a frozen reference for KL) loaded from an HF dir, with AdamW over fp32 weights.

Weights are fp32 everywhere; on CUDA the backbone runs under bf16 autocast (pure bf16 AdamW would round away
updates below the bf16 step of a weight, e.g. lr 1e-5 on a weight of 0.02). Dropout is off: train-time logprobs
must match the engine's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grpoflow.config import TrainConfig
from grpoflow.numerics import mkl_mode
from grpoflow.train.logprobs import check_logprob_path
from grpoflow.train.lora import add_lora

if TYPE_CHECKING:
    from grpoflow.train.parallel import DataParallel


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

    Determinism: on the CPU, with MKL in its reproducible mode (`grpoflow.numerics`), seeding is enough: the same
    update gives the same bits on any thread count, switched within an update too, and in a fresh process
    (tested). On CUDA, SDPA/matmul backward may use atomics: equal up to rounding, not bitwise.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu" and mkl_mode() == "OFF":
        warnings.warn(
            "MKL's reproducible mode is off in this process (torch computed before grpoflow was imported, or "
            "MKL_CBWR=OFF): an update's bits may depend on the thread count and on the process's history",
            stacklevel=2,
        )
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

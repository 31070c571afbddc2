"""The trainer: the policy (and a frozen reference for KL) loaded from an HF dir, with AdamW over fp32 weights.

Weights are fp32 everywhere; with `train.precision` bf16 (the default on CUDA) the backbone runs under bf16
autocast (pure bf16 AdamW would round away updates below the bf16 step of a weight, e.g. lr 1e-5 on a weight of
0.02). Dropout is off: train-time logprobs must match the engine's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from grpoflow.config import TrainConfig
from grpoflow.numerics import mkl_mode
from grpoflow.train.logprobs import check_logprob_path
from grpoflow.train.lora import AdapterOff, add_lora

if TYPE_CHECKING:
    from grpoflow.train.parallel import DataParallel


@dataclass
class TrainerState:
    model: PreTrainedModel
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    ref_model: PreTrainedModel | AdapterOff | None  # AdapterOff: a LoRA policy's base, no second copy
    device: torch.device
    autocast_dtype: torch.dtype | None  # `train.precision`: bf16 (by default on CUDA), None (plain fp32); a
    # sharded model casts its layers itself (FSDP's mixed precision) and has None
    optimizer_steps: int = 0
    dp: DataParallel | None = None  # this process's rank among data-parallel trainers (`cluster.train_ranks`)
    sharded: bool = False  # loaded to be sharded (`load_trainer(sharded=True)`), or sharded already
    # a sharded checkpoint's AdamW state (`optimizer.dcp/`), which every rank reads its shards of once sharded
    pending_optimizer: Path | None = None


def trainer_device(name: str | None = None) -> torch.device:
    """The device a trainer rank computes on, never an index-less GPU: FSDP's `torch.cuda.set_device`, NCCL and
    the weight sync's tensors must each name one GPU. `name`: the run's plan's (`GpuPlan.rank_device`), or None
    for this process's own — GPU 0 of those it sees (the plan's rank 0, or the GPU Ray gave an actor), else the
    CPU."""
    dev = torch.device(name if name is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def load_trainer(
    model_path: str | Path, cfg: TrainConfig, seed: int = 0, device: str | None = None, sharded: bool = False
) -> TrainerState:
    """Load the policy (and a frozen reference when `kl_coef > 0`) from an HF dir, with an AdamW over it.

    `sharded` (`train.sharding` fsdp): the weights stay in CPU memory until `grpoflow.train.fsdp.shard_trainer`
    shards them onto the ranks' devices and makes the optimizer over the shards.

    Determinism: on the CPU, with MKL in its reproducible mode (`grpoflow.numerics`), seeding is enough: the same
    update gives the same bits on any thread count, switched within an update too, and in a fresh process
    (tested). On CUDA, SDPA/matmul backward may use atomics: equal up to rounding, not bitwise.
    """
    dev = trainer_device(device)
    if dev.type == "cpu" and mkl_mode() == "OFF":
        warnings.warn(
            "MKL's reproducible mode is off in this process (torch computed before grpoflow was imported, or "
            "MKL_CBWR=OFF): an update's bits may depend on the thread count and on the process's history",
            stacklevel=2,
        )
    where = torch.device("cpu") if sharded else dev
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(where)
    disable_dropout(model)
    model.train()  # activation checkpointing only runs in training mode; dropout is off anyway
    if cfg.lora is not None:
        model = add_lora(model, cfg.lora)
    if cfg.batch.gradient_checkpointing or cfg.batch.checkpoint_above_tokens is not None:
        model.activation_checkpointing_enable()
        # on for every forward only with `gradient_checkpointing`; per micro-batch: `use_activation_checkpointing`
        _checkpoint_layers(model, cfg.batch.gradient_checkpointing)
    ref = None
    if cfg.loss.kl_coef > 0 and cfg.lora is not None:
        ref = AdapterOff(model)  # the base model is the policy with its adapters off: no second copy
    elif cfg.loss.kl_coef > 0:
        # fp32 like the policy, under the same autocast: at step 0 the two score alike and the KL is exactly 0
        # (bf16 reference weights would put a rounding-sized KL in every step's loss).
        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(where).eval()
        ref.requires_grad_(False)
    check_logprob_path(model)
    trainable = [p for p in model.parameters() if p.requires_grad]  # the adapters alone under LoRA
    optimizer = torch.optim.AdamW(trainable, lr=cfg.optimizer.learning_rate, weight_decay=cfg.optimizer.weight_decay)
    return TrainerState(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(model_path),
        optimizer=optimizer,
        ref_model=ref,
        device=dev,
        autocast_dtype=compute_dtype(cfg, dev),
        sharded=sharded,
    )


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The decoder layers' compute dtype (`train.precision`): bf16, or None for plain fp32."""
    if cfg.precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return torch.bfloat16 if cfg.precision == "bf16" else None


@contextmanager
def use_activation_checkpointing(model: torch.nn.Module, longest: int, cfg: TrainConfig) -> Iterator[None]:
    """For the block (one micro-batch whose longest row has `longest` tokens), the decoder layers recompute
    their activations in backward when `train.batch.gradient_checkpointing` is on or the rows are longer than
    `train.batch.checkpoint_above_tokens`; the layers' setting is restored after."""
    above = cfg.batch.checkpoint_above_tokens
    on = cfg.batch.gradient_checkpointing or (above is not None and longest > above)
    before = _checkpoint_layers(model, on)
    try:
        yield
    finally:
        for m, was in before:
            m.gradient_checkpointing = was


def _checkpoint_layers(model: torch.nn.Module, on: bool) -> list[tuple[torch.nn.Module, bool]]:
    """Switch the decoder layers' activation checkpointing (those `activation_checkpointing_enable` prepared);
    returns each layer's setting before."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    before = [(m, m.gradient_checkpointing) for m in layers]
    for m in layers:
        m.gradient_checkpointing = on and hasattr(m, "_gradient_checkpointing_func")
    return before


def disable_dropout(model: torch.nn.Module) -> None:
    # Train-time logprobs must match the engine's (no dropout) or every ratio is noise.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0

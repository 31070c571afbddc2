"""The trainer: the policy (and a frozen reference for KL) loaded from an HF dir, with AdamW over fp32 weights.

Weights are fp32 everywhere; on CUDA the backbone runs under bf16 autocast (pure bf16 AdamW would round away
updates below the bf16 step of a weight, e.g. lr 1e-5 on a weight of 0.02). Dropout is off: train-time logprobs
must match the engine's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from grpoflow.config import RunConfig, TrainConfig
from grpoflow.numerics import mkl_mode
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


class CoreShare:
    """The torch threads the trainer may use, on CPUs it shares with the embedded engine: the cores the engine's
    replicas leave (`engine.threads` each) until the rollout task run beside the update is done, all of torch's
    own after. torch's threads wait on each other at every op, so one of them sharing a core with the engine
    slows the whole update; an update kept at the fewer threads would leave a core idle once the rollout is done.
    The count is set again before each transformer layer's forward and backward (hooks on the policy, for the
    block of `share_cores_with_engine`), so an update takes the cores back within a micro-batch; the LM head,
    the reference model and the optimizer step run at the count the last layer set."""

    def __init__(self, beside: int, alone: int, generating: Callable[[], bool]):
        self.beside, self.alone, self.generating = beside, alone, generating

    def apply(self) -> None:
        # in the training thread itself: OpenMP's thread count belongs to the thread that sets it
        n = self.beside if self.generating() else self.alone
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def hook(self, model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        def before_backward(output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:  # the layer's backward starts once this grad is in
                out.register_hook(lambda grad: self.apply())

        handles = []
        # transformers' decoder layers (under a LoRA wrapper too); the whole model, once per micro-batch, if none
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)] or [model]
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(lambda module, args: self.apply()))
            handles.append(layer.register_forward_hook(lambda module, args, output: before_backward(output)))
        return handles


@contextmanager
def share_cores_with_engine(
    cfg: RunConfig, model: torch.nn.Module, generating: Callable[[], bool]
) -> Iterator[CoreShare | None]:
    """For the block, the policy's updates share this machine's CPUs with the embedded engine (a CoreShare) when
    rollouts overlap them (`train.max_staleness` > 0); nothing is shared (None) for a GPU trainer, SGLang
    elsewhere, or a synchronous run, whose trainer keeps torch's own thread count. However the block ends, the
    hooks go and torch has all its threads back."""
    if not cfg.train.max_staleness or cfg.engine.backend != "embedded" or torch.cuda.is_available():
        yield None
        return
    alone = torch.get_num_threads()
    cores = CoreShare(threads_beside_engine(cfg, alone), alone, generating)
    handles = cores.hook(model)
    try:
        yield cores
    finally:
        for handle in handles:
            handle.remove()
        torch.set_num_threads(alone)


def threads_beside_engine(cfg: RunConfig, alone: int) -> int:
    """The torch threads an update gets beside the embedded engine's replicas (`engine.threads` each), out of the
    `alone` it has to itself."""
    return max(1, alone - cfg.engine.threads * cfg.engine.replicas)


def overlap_note(cfg: RunConfig, cores: CoreShare | None) -> str:
    """What an asynchronous run does differently, said once at its start."""
    note = f"max_staleness {cfg.train.max_staleness}: each step's rollout runs while the previous step trains"
    if cores is None:
        return note
    return (
        note + f"; the trainer's torch threads: {cores.beside} while a rollout runs beside it, {cores.alone} otherwise"
    )

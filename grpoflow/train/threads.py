"""The trainer's torch threads on CPUs it shares with an engine on the same host (the embedded engine; SGLang or
vLLM on the CPU): while a rollout runs beside an update (`train.max_staleness` > 0) the update gets the cores the
engine leaves, and all of them once the rollout is done.

torch's threads wait on each other at every op, so one of them sharing a core with the engine slows the whole
update; an update kept at the fewer threads would leave a core idle once the rollout is done. So the count is set
again before each transformer layer's forward and backward (hooks on the policy for the block of `share_cores`),
and an update takes the cores back within a micro-batch; the LM head, the reference model and the optimizer step
run at the count the last layer set. The count does not change an update's bits (`grpoflow.numerics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.modeling_layers import GradientCheckpointingLayer


class CoreShare:
    """The torch threads the trainer may use: `beside` while `generating()` says a rollout runs beside it,
    `alone` after."""

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
def share_cores(model: torch.nn.Module, engine_threads: int, generating: Callable[[], bool]) -> Iterator[CoreShare]:
    """For the block, the policy's updates leave `engine_threads` of torch's threads to an engine on this host
    while `generating()`; however the block ends, the hooks go and torch has all its threads back."""
    alone = torch.get_num_threads()
    cores = CoreShare(max(1, alone - engine_threads), alone, generating)
    handles = cores.hook(model)
    try:
        yield cores
    finally:
        for handle in handles:
            handle.remove()
        torch.set_num_threads(alone)

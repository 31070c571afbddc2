"""Sharded training (`train.sharding` fsdp): the policy, its gradients and its AdamW state sharded across the
trainer ranks with torch's FSDP2 (`fully_shard`); the data-parallel split of every minibatch is `replicate`'s.

Units: every decoder layer is an FSDP unit, the rest of the model (embedding, final norm, LM head, tied or not)
the root unit. A unit's parameters are DTensors sharded on dim 0 across the ranks, fp32 (the master weights; AdamW
keeps its moments beside each shard). A forward all-gathers one unit at a time and frees it after; backward
gathers it again and reduce-scatters its gradients into the ranks' shards once they are complete, summed (every
rank's loss is already divided by the whole minibatch's count), so no rank ever holds a flat copy of all
gradients. Precision (`train.precision`): with bf16 the layers compute on bf16 copies of the gathered weights
(FSDP's MixedPrecisionPolicy) and their gradients are reduced in fp32; the root unit stays fp32, so the LM head
and its log-softmax run in fp32 as in the unsharded trainer.

Loading: rank 0 holds the whole model in CPU memory (`load_trainer(sharded=True)`, a resumed checkpoint restored
into it); the other ranks build the same modules without weights (`skeleton_trainer`, the meta device). After
`fully_shard` every rank keeps its shard of what rank 0 broadcasts (torch's `set_model_state_dict`,
`broadcast_from_rank0`). A resumed run's AdamW state is read by every rank from the sharded checkpoint, its own
shards only (`grpoflow.train.dcp`), or broadcast from rank 0 when an unsharded run wrote it.

Collectives pair up pass by pass, so every rank runs as many forward (and backward) passes per minibatch: a rank
with fewer rows adds passes over a 2-token dummy whose loss is multiplied by 0 (`idle_passes`, `idle_pass`).

Imports torch and transformers only at module level (`bench/gpu_fsdp_check.py` runs it where grpoflow's other
dependencies are not installed).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from transformers.modeling_layers import GradientCheckpointingLayer

from grpoflow.train.logprobs import OWN_LOGPROBS, plain_token_logprobs, token_logprobs

OPTIMIZER_DCP = "optimizer.dcp"  # a sharded trainer's AdamW state in a full checkpoint, each rank's shards

if TYPE_CHECKING:
    from grpoflow.config import TrainConfig
    from grpoflow.train.trainer import TrainerState

_LORA_BASE = ".base_layer."  # PEFT's name part for the wrapped linear of an adapted module


def is_sharded(model: Any) -> bool:
    return isinstance(model, FSDPModule)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' decoder layers (under a LoRA wrapper too): one FSDP unit each."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, dtype: torch.dtype | None) -> None:
    """Shard `model` in place over `mesh`: a unit per decoder layer computing in `dtype` (None: fp32) with fp32
    gradient reductions, the rest an fp32 root unit. Gradients are summed across the ranks, not averaged; a
    forward through `token_logprobs` gathers the root unit around the whole pass, LM head included."""
    layers = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=layers)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
    # `token_logprobs` calls the backbone and reads the LM head's weight itself: FSDP's hooks run around a forward
    # method, so the whole pass is one (its root unit gathered before, its gradients reduced after backward).
    setattr(model, OWN_LOGPROBS, MethodType(_sharded_logprobs, model))
    register_fsdp_forward_method(model, OWN_LOGPROBS)
    hooked = getattr(model, OWN_LOGPROBS)

    def own(input_ids, mask, autocast_dtype=None, temperature=1.0):
        out = hooked(input_ids, mask, autocast_dtype, temperature)
        if not torch.is_grad_enabled():
            # FSDP keeps the root unit gathered after a forward, for the backward that follows; with none to
            # follow it is freed, else the model's parameters stay the gathered tensors instead of its shards
            model.reshard()
        return out

    setattr(model, OWN_LOGPROBS, own)


def _sharded_logprobs(self, input_ids, mask, autocast_dtype=None, temperature=1.0):
    return plain_token_logprobs(self, input_ids, mask, autocast_dtype, temperature)


def mesh_of(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    return DeviceMesh.from_group(group, device.type)


def shard_and_fill(model: torch.nn.Module, mesh: DeviceMesh, dtype: torch.dtype | None, device: torch.device) -> None:
    """Shard `model` (whole on rank 0, weightless on the others) and give every rank its shard of rank 0's
    weights and buffers."""
    rank = mesh.get_local_rank()
    full = model.state_dict() if rank == 0 else {}  # kept alive past fully_shard: the tensors rank 0 broadcasts
    shard_model(model, mesh, dtype)
    if rank != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    group = mesh.get_group()
    for buf in model.buffers():  # non-persistent ones (rotary inv_freq) are in no state dict
        dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)


def shard_trainer(state: TrainerState, cfg: TrainConfig, checkpoint: str | Path | None = None) -> None:
    """Make `state` (rank 0's whole trainer or another rank's `skeleton_trainer`) this rank's shard of the
    sharded trainer, over `state.dp`'s group: the policy, a full fine-tune's reference, and a new AdamW (the same
    settings) over the policy's shards. Its state, when resuming: each rank's shards read from a sharded
    checkpoint's `optimizer.dcp/` (rank 0's `pending_optimizer`, the other ranks' `checkpoint` dir), or rank 0's
    whole AdamW state broadcast (an unsharded run's checkpoint). Every rank calls it at once."""
    import torch.distributed.checkpoint as dcp

    from grpoflow.train.trainer import compute_dtype

    dp = state.dp
    assert dp is not None, "shard_trainer needs the trainer ranks' group (state.dp)"
    if dp.device.type == "cuda":
        torch.cuda.set_device(dp.device)
    mesh = mesh_of(dp.group, dp.device)
    dtype = compute_dtype(cfg, dp.device)
    old = state.optimizer
    # what rank 0 resumes from: 0 nothing, 1 its own AdamW state (broadcast), 2 a sharded checkpoint's (DCP)
    how = 2 if state.pending_optimizer is not None else int(len(old.state) > 0)
    resumed = torch.tensor([how if dp.rank == 0 else 0], dtype=torch.uint8, device=dp.device)
    dist.broadcast(resumed, src=dist.get_global_rank(dp.group, 0), group=dp.group)
    how = int(resumed.item())
    moments: dict = {}
    if how == 1 and dp.rank == 0:  # by parameter name, before the names' tensors are replaced by shards
        moments = get_optimizer_state_dict(state.model, old, options=StateDictOptions(full_state_dict=True))
    if how == 2 and dp.rank != 0:
        if checkpoint is None or not (Path(checkpoint) / OPTIMIZER_DCP).is_dir():
            raise ValueError(f"rank 0 resumes a sharded checkpoint's AdamW state; this rank has none ({checkpoint})")
        state.pending_optimizer = Path(checkpoint) / OPTIMIZER_DCP
    shard_and_fill(state.model, mesh, dtype, dp.device)
    ref = state.ref_model
    if isinstance(ref, torch.nn.Module):  # a full fine-tune's frozen copy; LoRA's is the policy itself
        shard_and_fill(ref, mesh, dtype, dp.device)
    accepted = inspect.signature(type(old)).parameters  # a param group also holds settings derived from these
    settings = {k: v for k, v in old.param_groups[0].items() if k in accepted and k != "params"}
    optimizer = type(old)([p for p in state.model.parameters() if p.requires_grad], **settings)
    if how == 1:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(state.model, optimizer, moments, options=options)
    elif how == 2:  # each rank reads its own shards (DCP reshards: any number of ranks may have written them)
        osd = get_optimizer_state_dict(state.model, optimizer)
        dcp.load({"optimizer": osd}, checkpoint_id=str(state.pending_optimizer), process_group=dp.group)
        set_optimizer_state_dict(state.model, optimizer, osd)
        state.pending_optimizer = None
    state.optimizer = optimizer
    state.sharded = True
    state.device = dp.device
    state.autocast_dtype = None  # the layers' dtype is FSDP's MixedPrecisionPolicy now


def skeleton_trainer(model_path: str, cfg: TrainConfig, device: torch.device) -> TrainerState:
    """A worker rank's trainer before `shard_trainer`: the policy's modules (LoRA adapters, checkpointing and
    reference as `load_trainer` sets them up) with no weights (the meta device), which rank 0's fill."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpoflow.train.lora import AdapterOff, add_lora
    from grpoflow.train.trainer import TrainerState, _checkpoint_layers, disable_dropout

    config = AutoConfig.from_pretrained(model_path)

    def empty() -> torch.nn.Module:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    model = empty()
    disable_dropout(model)
    model.train()
    if cfg.lora is not None:
        model = add_lora(model, cfg.lora)
    if cfg.batch.gradient_checkpointing or cfg.batch.checkpoint_above_tokens is not None:
        model.activation_checkpointing_enable()
        _checkpoint_layers(model, cfg.batch.gradient_checkpointing)
    ref = None
    if cfg.loss.kl_coef > 0:
        ref = AdapterOff(model) if cfg.lora is not None else empty().eval().requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.optimizer.learning_rate, weight_decay=cfg.optimizer.weight_decay)
    return TrainerState(
        model=model,
        tokenizer=None,
        optimizer=optimizer,
        ref_model=ref,
        device=device,
        autocast_dtype=None,
        sharded=True,
    )


def idle_passes(n: int, state: TrainerState) -> int:
    """How many idle passes this rank adds after its `n` so that every rank runs as many (the most any rank
    runs): 0 unless the trainer is sharded over several ranks. A collective: call it on every rank before the
    passes, whose gathers it would otherwise meet out of order."""
    dp = state.dp
    if dp is None or dp.world == 1 or not is_sharded(state.model):
        return 0
    most = torch.tensor([n], dtype=torch.int64, device=dp.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=dp.group)
    return int(most.item()) - n


def reduce_gradients_after(state: TrainerState, cfg: TrainConfig, last: bool) -> None:
    """Before a minibatch's backward pass: with `train.batch.reduce_gradients_once`, a sharded model keeps this
    pass's gradients whole, added to the earlier passes', unless it is the `last` (every rank's last is its
    same-numbered pass), whose backward reduce-scatters the sum into the shards. Otherwise every pass reduces."""
    if cfg.batch.reduce_gradients_once and is_sharded(state.model):
        state.model.set_requires_gradient_sync(last)


def idle_pass(state: TrainerState, temperature: float, backward: bool) -> None:
    """One pass with the collectives of a micro-batch's and nothing else: the policy's forward over a 2-token
    dummy (and the reference's, in a backward pass), then a backward of 0 x its logprob, which adds exact zeros to
    every gradient shard. `backward` False: the forward alone, without gradients (recomputed old logprobs)."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=state.device)
    mask = torch.ones(1, 1, dtype=torch.bool, device=state.device)
    with torch.set_grad_enabled(backward):
        logp, _ = token_logprobs(state.model, ids, mask, state.autocast_dtype, temperature)
    if not backward:
        return
    if state.ref_model is not None:
        with torch.no_grad():
            token_logprobs(state.ref_model, ids, mask, state.autocast_dtype, temperature)
    (logp.sum() * 0.0).backward()


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> float:
    """`clip_grad_norm_` over sharded gradients: the global norm (every rank's shards), each shard scaled by the
    same factor on every rank; returns the norm before clipping. `params`: the shards (the optimizer's)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the sum of the ranks' partial squared norms
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.item()


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank calls it); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _serving_entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, Any]]:
    """(served name, tensor, its LoRA layer or None) for every tensor an engine loads, as
    `grpoflow.train.lora.serving_tensors` names them: a tied tensor once, the adapters' own left out, an adapted
    linear's base weight under the base model's name."""
    from peft.tuners.lora import LoraLayer

    adapted = {f"{name}{_LORA_BASE}weight": m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if ".lora_" in name or id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name.replace(_LORA_BASE, "."), t, adapted.get(name)))
    return out


def serving_specs(model: torch.nn.Module) -> list[tuple[str, list[int]]]:
    """Names and whole shapes of the tensors `serving_stream` yields, in its order (no collective)."""
    return [(name, list(t.shape)) for name, t, _ in _serving_entries(model)]


@torch.no_grad()
def serving_stream(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors an engine loads, whole, one at a time: a sharded model's are gathered as they are yielded
    (every rank must iterate them alike), so no rank holds more than one beyond its shards. `dtype`: the engine's,
    each shard cast to it before its gather (the same bits as casting the whole after; half the bytes moved and
    held for bf16). A LoRA model's are merged in the weights' own dtype, then cast: base + scaling x B @ A, as
    PEFT's `get_delta_weight` for a linear."""
    for name, t, lora in _serving_entries(model):
        if lora is None:
            yield name, full(t.to(dtype) if dtype is not None and t.is_floating_point() else t)
            continue
        if getattr(lora, "fan_in_fan_out", False) or lora.use_dora.get("default", False):
            raise NotImplementedError(f"{name}: merging a fan-in-fan-out or DoRA adapter is not supported")
        a, b = full(lora.lora_A["default"].weight), full(lora.lora_B["default"].weight)
        whole = full(t) + ((b @ a) * lora.scaling["default"]).to(t.dtype)
        yield name, whole if dtype is None else whole.to(dtype)


def drain_serving(state: TrainerState, dtype: torch.dtype | None = None) -> None:
    """A worker rank's side of rank 0's `serving_stream`: the same gathers, the tensors dropped."""
    for _ in serving_stream(state.model, dtype):
        pass


def served(
    state: TrainerState, dtype: torch.dtype | None = None
) -> tuple[list[str], list[list[int]], Iterator[torch.Tensor]]:
    """What a weight sync sends: the engine's tensor names, their shapes, and the tensors in that order. A
    sharded trainer's are gathered one at a time as the iterator is consumed (the worker ranks join each gather,
    as a job), so the whole model is never held twice on rank 0; in `dtype` (the engine's) when given, cast
    before the gather. An unsharded trainer's come as they are: the sender casts them as it copies."""
    if not is_sharded(state.model):
        from grpoflow.train.lora import serving_tensors

        named = serving_tensors(state.model)
        return list(named), [list(t.shape) for t in named.values()], iter(named.values())
    specs = serving_specs(state.model)

    def gathered() -> Iterator[torch.Tensor]:
        from grpoflow.train.parallel import on_other_ranks

        with on_other_ranks(state, drain_serving, dtype):
            for _, t in serving_stream(state.model, dtype):
                yield t

    return [n for n, _ in specs], [s for _, s in specs], gathered()


def drain_parameters(state: TrainerState) -> None:
    """A worker rank's side of rank 0's `full_parameters`."""
    for p in state.model.parameters():
        full(p)


def full_parameters(state: TrainerState) -> dict[str, torch.Tensor]:
    """Every parameter of the policy by name, whole (on rank 0; the worker ranks join each gather as a job)."""
    from grpoflow.train.parallel import on_other_ranks

    with on_other_ranks(state, drain_parameters):
        return {n: full(p).detach().clone() for n, p in state.model.named_parameters()}


def idle_forward(state: TrainerState, temperature: float) -> None:
    """A worker rank's side of rank 0's `scored`: a forward's gathers, over a dummy."""
    idle_pass(state, temperature, backward=False)


@torch.no_grad()
def scored(state: TrainerState, ids: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """`token_logprobs` of the policy without gradients, on rank 0 alone (the probes): the worker ranks of a
    sharded trainer join its gathers with a forward of their own."""
    from grpoflow.train.parallel import on_other_ranks

    if not is_sharded(state.model):
        return token_logprobs(state.model, ids, mask, state.autocast_dtype, temperature)[0]
    with on_other_ranks(state, idle_forward, temperature):
        return token_logprobs(state.model, ids, mask, state.autocast_dtype, temperature)[0]


def drain_adapter(state: TrainerState) -> None:
    """A worker rank's side of rank 0's `gathered_adapter`."""
    gathered_adapter(state)


def gathered_adapter(state: TrainerState) -> dict[str, torch.Tensor] | None:
    """A sharded LoRA policy's adapter tensors, whole (on rank 0 the worker ranks join the gathers as a job);
    None for an unsharded policy, whose adapter is read as it is."""
    from grpoflow.train.lora import adapter_tensors
    from grpoflow.train.parallel import on_other_ranks

    if not is_sharded(state.model):
        return None
    if state.dp is not None and state.dp.rank != 0:
        return {k: full(v) for k, v in adapter_tensors(state.model).items()}
    with on_other_ranks(state, drain_adapter):
        return {k: full(v) for k, v in adapter_tensors(state.model).items()}

"""The weight-update process group between a trainer (rank 0) and an engine's workers, as SGLang builds it.

SGLang's `/init_weights_update_group` makes its workers join a group the trainer hosts: a TCP store at the
trainer's `master_address:master_port`, the group's keys under `<group_name>/` (its `init_custom_process_group`,
like verl's and slime's, goes through torch's `_new_process_group_helper`). `/update_weights_from_distributed`
then receives each named tensor by a broadcast from rank 0, in the order of the request's `names`. Both ends here
build the group the same way, so the trainer side talks to SGLang over NCCL and to the embedded engine over
gloo, and neither end touches torch's default process group (a trainer may use it for its own data parallelism).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _new_process_group_helper, _world

# How long one end of a collective waits for the other: a sync waits for the engine to finish the requests in
# flight before it receives, so this is generous.
UPDATE_GROUP_TIMEOUT_S = 1800.0


def host_update_store(address: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's store, hosted by rank 0 on a free port of `address` (`.port`)."""
    return dist.TCPStore(
        address, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_update_group(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Join the group whose store is at address:port (rank 0 passes the `store` it hosts); returns once every
    rank has joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    # SGLang's init_custom_process_group prefixes the rendezvous store with the group name (and torch's helper
    # adds `<group_name>/` again): both ends must, or their keys never meet.
    store = dist.PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group ranks are global ranks here
    return group


def leave_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def broadcast_tensors(group: dist.ProcessGroup, tensors: Iterable[torch.Tensor]) -> int:
    """Send `tensors` (rank 0), in order; returns the bytes sent."""
    sent = 0
    for t in tensors:
        dist.broadcast(t.contiguous(), src=0, group=group)
        sent += t.numel() * t.element_size()
    return sent


def receive_tensors(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Receive the tensors rank 0 broadcasts, named as announced, into tensors on `device` (the receiver's own
    accelerator over NCCL, which refuses CPU tensors; the CPU over gloo)."""
    out = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=device)
        dist.broadcast(t, src=0, group=group)
        out[name] = t
    return out


def plan_buckets(sizes: Sequence[int], limit: int) -> list[range]:
    """Consecutive runs of tensors (by index) of at most `limit` bytes each, in order: one update request each.
    A tensor larger than `limit` goes alone, so no run is empty."""
    buckets: list[range] = []
    start, filled = 0, 0
    for i, size in enumerate(sizes):
        if i > start and filled + size > limit:
            buckets.append(range(start, i))
            start, filled = i, 0
        filled += size
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


def torch_dtype(name: str) -> torch.dtype:
    """`bfloat16` (or `torch.bfloat16`) -> torch.bfloat16; a ValueError names anything else."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

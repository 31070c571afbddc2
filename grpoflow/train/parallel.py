"""Data-parallel maths of a GRPO update: which rows of a minibatch each trainer rank computes, and the sums of
the ranks' gradients and metric sums.

Every optimizer minibatch is split between the ranks by rollout (a rollout's segments stay on one rank), balanced
by tokens. Each rank scales its loss by the *whole* minibatch's count (tokens or rollouts, `train.loss.loss_aggregation`),
so the sum of the ranks' gradients is the single-process gradient; one all-reduce (sum) per optimizer step gives
every rank that sum, and every rank then clips and steps alike: the replicas stay equal, as under DDP. The
sums behind the step's metrics are reduced the same way, so the metrics are the single-process ones too (but
`n_micro_batches`, which counts every rank's). The processes themselves: `grpoflow.train.ranks`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DataParallel:
    """This process's place among the trainer ranks."""

    group: dist.ProcessGroup
    rank: int
    world: int
    device: torch.device  # this rank's: NCCL reduces only tensors on its GPU
    workers: Any = None  # on rank 0: the other ranks' processes (`ranks.RankWorkers`), which it hands each update to
    note: str = ""  # on rank 0: where the ranks run, said once at the start


def split_rollouts(lengths: dict[str, int], world: int) -> list[list[str]]:
    """Rollout ids (with their trained-token counts) per rank: longest first to the least loaded rank (the
    lowest on a tie), so every rank computes about the same number of tokens. Deterministic."""
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for rid in sorted(lengths, key=lambda r: -lengths[r]):
        r = min(range(world), key=lambda i: (load[i], i))
        shares[r].append(rid)
        load[r] += lengths[rid]
    return shares


def local_rows(rollout_ids: Sequence[str], token_counts: Sequence[int], dp: DataParallel | None) -> list[int]:
    """Indices of the rows (samples of one minibatch) this rank computes: all of them without data parallelism."""
    if dp is None:
        return list(range(len(rollout_ids)))
    per_rollout: dict[str, int] = {}
    for rid, n in zip(rollout_ids, token_counts, strict=True):
        per_rollout[rid] = per_rollout.get(rid, 0) + n
    mine = set(split_rollouts(per_rollout, dp.world)[dp.rank])
    return [i for i, rid in enumerate(rollout_ids) if rid in mine]


def all_reduce_grads(params: Sequence[torch.Tensor], dp: DataParallel | None) -> None:
    """Sum the ranks' gradients into every rank's `.grad`, as one flat buffer (one collective per step). A
    parameter a rank left without a gradient (no rows of its own) counts as zeros."""
    if dp is None:
        return
    # which parameters got a gradient on some rank: one that none gave one keeps None, as in one process (AdamW
    # skips it; a zero gradient would still move it by its momentum)
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=dp.device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=dp.group)
    params = [p for p, h in zip(params, has.tolist(), strict=True) if h]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def all_reduce_sums(sums: dict[str, float], max_keys: Sequence[str], dp: DataParallel | None) -> dict[str, float]:
    """The minibatch's metric sums over every rank: maxima for `max_keys`, totals for the rest."""
    if dp is None:
        return sums
    keys = sorted(sums)  # the same order on every rank
    total = [k for k in keys if k not in max_keys]
    peak = [k for k in keys if k in max_keys]
    out = dict(sums)
    for names, op in ((total, dist.ReduceOp.SUM), (peak, dist.ReduceOp.MAX)):
        if names:
            t = torch.tensor([float(sums[k]) for k in names], dtype=torch.float64, device=dp.device)
            dist.all_reduce(t, op=op, group=dp.group)
            # counts stay ints, as a single process reports them
            out.update({k: int(v) if isinstance(sums[k], int) else v for k, v in zip(names, t.tolist(), strict=True)})
    return out


class RankError(RuntimeError):
    """A trainer rank failed; the message carries its traceback."""


@contextmanager
def on_other_ranks(state, fn, *args) -> Iterator[None]:
    """`fn(state, *args)` on the worker ranks (a job) while the block runs here: for work whose collectives
    every rank joins (a sharded model's gathers, a sharded checkpoint). `fn` is a module-level function. Ends once
    they are done; a broken collective (a worker died) is reported with the worker's own error."""
    workers = state.dp.workers if state.dp is not None else None
    if workers is None:
        yield
        return
    n = workers.send("call", (fn.__module__, fn.__name__, args))
    with workers.blame():
        yield
    workers.wait(n)

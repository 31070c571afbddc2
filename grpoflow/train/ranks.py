"""Data-parallel GRPO updates: `cluster.train_ranks` processes, each with a replica of the policy and its optimizer.

Every optimizer minibatch is split between the ranks by rollout (a rollout's segments stay on one rank), balanced
by tokens. Each rank scales its loss by the *whole* minibatch's count (tokens or rollouts, `train.loss_aggregation`),
so the sum of the ranks' gradients is the single-process gradient; one all-reduce (sum) per optimizer step gives
every rank that sum, and every rank then clips and steps alike: the replicas stay equal, as under DDP. The
sums behind the step's metrics are reduced the same way, so the metrics are the single-process ones too (but
`n_micro_batches`, which counts every rank's).

Rank 0 is the flow's own trainer: it alone commits checkpoints and syncs the engine (its weights are every
rank's). Ranks 1.. are processes started here (`python -m grpoflow.train.ranks`, one GPU each when rank 0 is on a
GPU), or Ray actors spread over the run's cluster when it has one (`cluster.ray_address`; with NCCL each asks
Ray for a GPU). They meet rank 0 in a process group built like the weight-update group (a TCP store rank 0
hosts, at this node's address for Ray ranks; gloo on the CPU, NCCL on GPUs), and take their jobs from that
store: the step's samples, pickled. A rank that fails writes its
traceback there and exits, which breaks the collective rank 0 waits in, so the step fails at once with that
traceback, not at the group's timeout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from grpoflow.engine.update_group import (
    UPDATE_GROUP_TIMEOUT_S,
    host_update_store,
    join_update_group,
    leave_update_group,
)

ADDRESS = "127.0.0.1"  # the ranks started here run on this machine
IDLE_TIMEOUT = datetime.timedelta(days=1)  # how long a rank waits for its next job (a step's rollout runs between)
POLL = datetime.timedelta(seconds=1)  # how often rank 0, waiting on the others, checks they are alive


class RankError(RuntimeError):
    """A trainer rank failed; the message carries its traceback."""


@dataclass
class DataParallel:
    """This process's place among the trainer ranks."""

    group: dist.ProcessGroup
    rank: int
    world: int
    device: torch.device  # this rank's: NCCL reduces only tensors on its GPU
    workers: RankWorkers | None = None  # on rank 0: the other ranks' processes, which it hands each update to
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


def rank_device(rank: int, world: int) -> str:
    """`cuda:<rank>` when every rank has a GPU of its own, else the CPU (gloo)."""
    return f"cuda:{rank}" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"


@dataclass
class RankWorkers:
    """Ranks 1 .. world-1 (processes here, or Ray actors), and the store their jobs go through."""

    store: dist.TCPStore
    procs: list  # subprocess.Popen, or RayRank: poll(), wait(), kill(), returncode
    jobs: int = 0

    def send(self, kind: str, payload: object = None) -> int:
        """Hand every worker rank the next job; returns its number."""
        n = self.jobs
        self.store.set(f"job/{n}", pickle.dumps((kind, payload)))
        self.jobs += 1
        return n

    def wait(self, n: int) -> None:
        """Every worker rank finished job `n`, or a RankError with the failed rank's traceback, as soon as one
        has failed or exited (not at the store's timeout). The job's keys are dropped after: each held a copy
        of the step's samples."""
        for rank in range(1, len(self.procs) + 1):
            key = f"done/{n}/{rank}"
            while True:
                try:
                    self.store.wait([key], POLL)
                    break
                except RuntimeError:  # not there yet: still working, unless it died
                    cause = self.failure(grace_s=0.0)
                    if cause is not None:
                        raise RankError(cause) from None
            reply = self.store.get(key)
            if reply != b"ok":
                raise RankError(f"trainer rank {rank} failed:\n{reply.decode(errors='replace')}")
        for key in [f"job/{n}", *(f"done/{n}/{r}" for r in range(1, len(self.procs) + 1))]:
            self.store.delete_key(key)

    def failure(self, grace_s: float = 5.0) -> str | None:
        """Why a worker rank failed: the traceback it left, or its exit; None while every one still runs. A
        rank that fails writes its traceback, then exits, which breaks the collective rank 0 is in: `grace_s`
        gives that traceback time to arrive."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank in range(1, len(self.procs) + 1):
                if self.store.check([f"error/{rank}"]):
                    return f"trainer rank {rank} failed:\n{self.store.get(f'error/{rank}').decode(errors='replace')}"
            exited = [(r, p) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if exited and time.monotonic() >= deadline:
                rank, proc = exited[0]
                return f"trainer rank {rank} exited with status {proc.returncode}"
            if not exited and time.monotonic() >= deadline:
                return None
            time.sleep(0.1)


def run_update(state, samples, cfg, step: int) -> dict[str, float]:
    """`grpo_update` on every rank: rank 0 hands the workers the same samples first. A broken collective (a
    worker died) is reported with the worker's own error."""
    from grpoflow.train.step import grpo_update

    dp = state.dp
    workers = dp.workers if dp is not None else None
    if workers is None:
        return grpo_update(state, samples, cfg, step)
    n = workers.send("update", (samples, cfg, step))
    try:
        metrics = grpo_update(state, samples, cfg, step)
    except RuntimeError as err:
        cause = workers.failure()
        if cause is None:
            raise
        raise RankError(cause) from err
    workers.wait(n)
    return metrics


@contextmanager
def trainer_ranks(state, model_path: str | Path, cfg, checkpoint: Path | None = None) -> Iterator[None]:
    """With `cluster.train_ranks` > 1: start the other ranks (each loads the policy from `model_path` and, when
    resuming, `checkpoint`, as rank 0 did), join them in a process group and make `state` rank 0 of it until the
    block ends. A no-op for one rank."""
    world = cfg.cluster.train_ranks
    if world <= 1:
        yield
        return
    on_ray = bool(cfg.cluster.ray_address)
    backend = "nccl" if state.device.type == "cuda" else "gloo"
    if backend == "nccl" and not on_ray and torch.cuda.device_count() < world:
        raise ValueError(
            f"cluster.train_ranks={world}: needs a GPU per rank on this machine, found {torch.cuda.device_count()} "
            "(or set cluster.ray_address to place ranks on the cluster's GPUs)"
        )
    # ranks on other nodes meet rank 0 at this node's address; ranks started here, on loopback
    address = _node_address() if on_ray else ADDRESS
    group_name = f"grpoflow-train-{uuid.uuid4().hex[:12]}"
    store = host_update_store(address, world, UPDATE_GROUP_TIMEOUT_S)
    spec = {
        "address": address,
        "port": store.port,
        "world": world,
        "group": group_name,
        "backend": backend,
        "model": str(model_path),
        "config": cfg.model_dump(mode="json"),
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "threads": torch.get_num_threads(),
    }
    procs = _start_on_ray(spec, world, backend) if on_ray else _start_here(spec, world)
    workers = RankWorkers(store, procs)
    try:
        group = _join_watching(workers, address, store, world, group_name, backend)
    except BaseException:
        _stop(procs)
        raise
    state.dp = DataParallel(group, 0, world, state.device, workers)
    where = "as Ray actors" if on_ray else "as processes of this machine"
    state.dp.note = f"{world} trainer ranks over {backend}: rank 0 here, the other {world - 1} {where}"
    try:
        yield
        workers.send("stop")
        for p in procs:
            p.wait(timeout=60)
    finally:
        state.dp = None
        _stop(procs)
        leave_update_group(group)


def _join_watching(workers: RankWorkers, address, store, world: int, group_name: str, backend: str):
    """Rank 0 joins the group, in a thread, while this one watches the other ranks start: one that fails first
    (an import error, a device it cannot have, a Ray actor that cannot be placed) fails the join with its cause
    at once, not at the group's timeout."""
    joined: dict = {}

    def join() -> None:
        try:
            joined["group"] = join_update_group(
                address, store.port, 0, world, group_name, backend, UPDATE_GROUP_TIMEOUT_S, store
            )
        except BaseException as err:  # noqa: BLE001  (raised in the caller's thread)
            joined["error"] = err

    t = threading.Thread(target=join, name="trainer-ranks-join", daemon=True)
    t.start()
    while t.is_alive():
        t.join(POLL.total_seconds())
        if t.is_alive() and (cause := workers.failure(grace_s=0.0)) is not None:
            raise RankError(f"{cause}\n(while the trainer ranks were joining)")
    if "error" in joined:
        raise joined["error"]
    return joined["group"]


def _stop(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _start_here(spec: dict, world: int) -> list[subprocess.Popen]:
    """Ranks 1.. as processes of this machine, each on `rank_device`."""
    return [
        subprocess.Popen([sys.executable, "-m", "grpoflow.train.ranks", json.dumps(spec), str(rank)])
        for rank in range(1, world)
    ]


class _RankActor:
    """A worker rank as a Ray actor: `run` is the rank's whole life (it returns when rank 0 says stop)."""

    def run(self, spec: dict, rank: int) -> None:
        _worker(spec, rank, "cuda" if torch.cuda.is_available() else "cpu")  # Ray gave it its own GPU, if any


class RayRank:
    """A worker rank on a Ray actor, seen as a process (`poll`, `wait`, `kill`, `returncode`)."""

    def __init__(self, spec: dict, rank: int, backend: str):
        import ray

        from grpoflow.cluster import forwarded_env

        self.actor = (
            ray.remote(_RankActor)
            .options(
                num_cpus=0 if backend == "gloo" else 1,
                num_gpus=1 if backend == "nccl" else 0,  # NCCL: a GPU of its own
                scheduling_strategy="SPREAD",
                max_restarts=0,
                runtime_env={"env_vars": forwarded_env()},
            )
            .remote()
        )
        self.done = self.actor.run.remote(spec, rank)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None and ray.wait([self.done], timeout=0)[0]:
            try:
                ray.get(self.done)
                self.returncode = 0
            except ray.exceptions.RayError:
                self.returncode = 1
            ray.kill(self.actor)  # its one job is over: free its process (and GPU)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        import ray

        ray.wait([self.done], timeout=timeout)
        return self.poll()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


def _start_on_ray(spec: dict, world: int, backend: str) -> list[RayRank]:
    return [RayRank(spec, rank, backend) for rank in range(1, world)]


def _node_address() -> str:
    """This node's address as the Ray cluster knows it: where ranks on other nodes reach rank 0's store."""
    import ray.util

    return ray.util.get_node_ip_address()


def _worker(spec: dict, rank: int, device: str) -> None:
    """A worker rank: join the group, load the policy like rank 0 onto `device`, then run the jobs rank 0 hands
    out."""
    from grpoflow.config import parse_run_config
    from grpoflow.run.checkpoint import restore_training_state
    from grpoflow.train.step import grpo_update
    from grpoflow.train.trainer import load_trainer

    torch.set_num_threads(spec["threads"])
    address = spec["address"]
    store = dist.TCPStore(address, spec["port"], spec["world"], is_master=False, timeout=IDLE_TIMEOUT)
    n = 0
    try:
        group = join_update_group(
            address, spec["port"], rank, spec["world"], spec["group"], spec["backend"], UPDATE_GROUP_TIMEOUT_S, store
        )
        cfg = parse_run_config(spec["config"])
        state = load_trainer(spec["model"], cfg.train, seed=cfg.seed, device=device)
        if spec["checkpoint"]:
            restore_training_state(state, spec["checkpoint"])
        state.dp = DataParallel(group, rank, spec["world"], state.device)
        while True:
            kind, payload = pickle.loads(store.get(f"job/{n}"))
            if kind == "stop":
                break
            samples, job_cfg, step = payload
            grpo_update(state, samples, job_cfg, step)
            store.set(f"done/{n}/{rank}", b"ok")
            n += 1
        leave_update_group(group)
    except BaseException:
        # rank 0 reads this when the collective it waits in breaks (error/), or as the job's reply (done/)
        failed = traceback.format_exc()
        store.set(f"error/{rank}", failed.encode())
        store.set(f"done/{n}/{rank}", failed.encode())
        print(failed, file=sys.stderr, flush=True)
        # Leave at once, whatever holds the group open (a Ray actor's process lives on after its method): the
        # closed sockets fail the collective rank 0 waits in.
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A worker rank of grpoflow's data-parallel trainer.")
    parser.add_argument("spec", help="the group and the policy to load (JSON, from trainer_ranks)")
    parser.add_argument("rank", type=int)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(args.spec)
    _worker(spec, args.rank, rank_device(args.rank, spec["world"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

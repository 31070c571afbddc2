"""Data-parallel GRPO updates: `cluster.train_ranks` processes, each with a replica of the policy and its optimizer
(the maths of splitting and summing: `grpoflow.train.parallel`).

Rank 0 is the flow's own trainer: it alone commits checkpoints and syncs the engine (its weights are every
rank's). Ranks 1.. are processes started here (`python -m grpoflow.train.ranks`, one GPU each when rank 0 is on a
GPU), or Ray actors spread over the run's cluster when it has one (`cluster.ray_address`; with NCCL each asks
Ray for a GPU). They meet rank 0 in a process group built like the weight-update group (a TCP store rank 0
hosts, at this node's address for Ray ranks; gloo on the CPU, NCCL on GPUs), and take their jobs from that
store: the step's samples, pickled. A rank that fails writes its
traceback there and exits, which breaks the collective rank 0 waits in, so the step fails at once with that
traceback, not at the group's timeout. A rank that goes quiet without failing (stopped, frozen, lost with its
node) stops raising its heartbeat counter there: rank 0 kills it after `cluster.failure_timeout_s`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pickle
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from grpoflow.engine.update_group import (
    UPDATE_GROUP_TIMEOUT_S,
    host_update_store,
    join_update_group,
)
from grpoflow.errors import one_line
from grpoflow.figures import Figures
from grpoflow.lifeline import Lifeline, exit_status
from grpoflow.placement import machine_gpus, plan_gpus
from grpoflow.train.checkpoint import restore_training_state
from grpoflow.train.parallel import DataParallel, RankError
from grpoflow.train.step import grpo_update
from grpoflow.train.trainer import load_trainer, trainer_device

ADDRESS = "127.0.0.1"  # the ranks started here run on this machine
IDLE_TIMEOUT = datetime.timedelta(days=1)  # how long a rank waits for its next job (a step's rollout runs between)
POLL = datetime.timedelta(seconds=1)  # how often rank 0, waiting on the others, checks they are alive


@dataclass
class RankWorkers:
    """Ranks 1 .. world-1 (processes here, or Ray actors), and the store their jobs go through."""

    store: dist.TCPStore
    procs: list  # Lifeline, or RayRank: poll(), wait(), kill(), returncode
    timeout_s: float  # the group's bound on one collective (`cluster.collective_timeout_s`)
    jobs: int = 0
    lost: str | None = None  # why a rank was given up for lost (its heartbeat stopped), once it was

    def watch_heartbeats(self, address: str, failure_timeout_s: float) -> threading.Event:
        """Watch every worker rank's heartbeat (`beat/<rank>`, a counter it raises every `beat_interval_s`
        seconds) from a thread; returns the event that stops it. A rank whose counter stays still for
        `failure_timeout_s` after its first beat is killed, which breaks any collective rank 0 waits in with it,
        and `lost` says why: the step fails in `failure_timeout_s`, not at the collective's bound. Counted on
        this clock, so ranks on other nodes need no common time."""
        stop = threading.Event()
        # a connection of its own: the store's client is not shared across threads
        store = dist.TCPStore(address, self.store.port, is_master=False, timeout=POLL * 10)
        seen: dict[int, tuple[int, float]] = {}

        def watch() -> None:
            while not stop.wait(POLL.total_seconds()):
                now = time.monotonic()
                for rank, proc in enumerate(self.procs, start=1):
                    try:
                        beats = store.add(f"beat/{rank}", 0)
                    except RuntimeError:  # the store went with the group: only once the block has ended
                        if stop.is_set():
                            return
                        raise
                    if beats == 0 or proc.poll() is not None:
                        continue  # not started yet (the join watches that), or gone (its exit says why)
                    if seen.get(rank, (None,))[0] != beats:
                        seen[rank] = (beats, now)
                    elif now - seen[rank][1] >= failure_timeout_s:
                        self.lost = (
                            f"trainer rank {rank} sent no heartbeat for cluster.failure_timeout_s="
                            f"{failure_timeout_s:g} s (stopped, frozen or lost with its node): killed"
                        )
                        proc.kill()
                        return

        threading.Thread(target=watch, name="trainer-ranks-heartbeats", daemon=True).start()
        return stop

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

    @contextmanager
    def blame(self) -> Iterator[None]:
        """A collective that breaks in the block, as the RankError of the worker rank that failed first (its
        traceback, or its exit); one that timed out with every rank still running, as that."""
        try:
            yield
        except RuntimeError as err:
            cause = self.failure()
            if cause is not None:
                raise RankError(cause) from err
            if "timed out" in str(err).lower():
                raise RankError(
                    f"a trainer collective got no answer within cluster.collective_timeout_s={self.timeout_s:g} s, "
                    f"every rank still running (one is hung, stopped or lost with its node): {one_line(err)}"
                ) from err
            raise

    def failure(self, grace_s: float = 5.0) -> str | None:
        """Why a worker rank failed: the traceback it left, or its exit; None while every one still runs. A
        rank that fails writes its traceback, then exits, which breaks the collective rank 0 is in: `grace_s`
        gives that traceback time to arrive."""
        deadline = time.monotonic() + grace_s
        while True:
            if self.lost is not None:
                return self.lost
            for rank in range(1, len(self.procs) + 1):
                if self.store.check([f"error/{rank}"]):
                    return f"trainer rank {rank} failed:\n{self.store.get(f'error/{rank}').decode(errors='replace')}"
            exited = [(r, p) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if exited and time.monotonic() >= deadline:
                rank, proc = exited[0]
                return f"trainer rank {rank} {exit_status(proc.returncode)}"
            if not exited and time.monotonic() >= deadline:
                return None
            time.sleep(0.1)


def run_update(state, samples, cfg, step: int) -> Figures:
    """`grpo_update` on every rank: rank 0 hands the workers the same samples first. A broken collective (a
    worker died) is reported with the worker's own error."""
    dp = state.dp
    workers = dp.workers if dp is not None else None
    if workers is None:
        return grpo_update(state, samples, cfg, step)
    n = workers.send("update", (samples, cfg, step))
    with workers.blame():
        metrics = grpo_update(state, samples, cfg, step)
    workers.wait(n)
    return metrics


@contextmanager
def trainer_ranks(state, model_path: str | Path, cfg, checkpoint: Path | None = None) -> Iterator[None]:
    """With `cluster.train_ranks` > 1: start the other ranks (each loads the policy from `model_path` and, when
    resuming, `checkpoint`, as rank 0 did), join them in a process group and make `state` rank 0 of it until the
    block ends. A no-op for one rank, unless it is sharded (`train.sharding` fsdp: a group of one).

    Sharded, the group is torch's default one (FSDP's and the distributed checkpoint's), and every rank's trainer
    becomes its shard (`grpoflow.train.fsdp.shard_trainer`: the other ranks build the model without weights and
    receive rank 0's, the resumed checkpoint's included); after the block `state` is unusable."""
    world = cfg.cluster.train_ranks
    sharded = cfg.sharding_mode() == "fsdp"
    if world <= 1 and not sharded:
        yield
        return
    if world <= 1:
        with _sharded_alone(state, cfg):
            yield
        return
    on_ray = bool(cfg.cluster.ray_address)
    backend = "nccl" if state.device.type == "cuda" else "gloo"
    # A GPU per rank here was checked by the run's GPU plan (`grpoflow.placement`) before the engine started.
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
        "sharded": sharded,
        "beat_interval_s": min(cfg.cluster.failure_timeout_s / 4, 5.0),  # a few beats within the allowance
        # ranks started here: each on its GPU of the run's plan (the one the engine's GPUs were placed beside)
        "devices": [] if on_ray else [plan_gpus(cfg, machine_gpus()).rank_device(r) for r in range(world)],
    }
    procs = _start_on_ray(spec, world, backend) if on_ray else _start_here(spec, world)
    workers = RankWorkers(store, procs, cfg.cluster.collective_timeout_s)
    watching = workers.watch_heartbeats(address, cfg.cluster.failure_timeout_s)
    try:
        group = _join_watching(workers, address, store, world, group_name, backend, sharded)
    except BaseException:
        watching.set()
        _stop(procs)
        raise
    bound_collectives(group, cfg.cluster.collective_timeout_s)
    state.dp = DataParallel(group, 0, world, state.device, workers)
    where = "as Ray actors" if on_ray else "as processes of this machine"
    how = "weights, gradients and AdamW state sharded (FSDP)" if sharded else "each with the whole model"
    state.dp.note = f"{world} trainer ranks over {backend}: rank 0 here, the other {world - 1} {where}; {how}"
    try:
        if sharded:
            _shard_watching(state, cfg, workers)
        yield
        workers.send("stop")
        for p in procs:
            p.wait(timeout=60)
    finally:
        watching.set()
        state.dp = None
        _stop(procs)
        leave_trainer_group(group)


def _shard_watching(state, cfg, workers: RankWorkers) -> None:
    """Rank 0's side of every rank's `shard_trainer`; a worker that fails first fails it with its cause."""
    from grpoflow.train.fsdp import shard_trainer

    with workers.blame():
        shard_trainer(state, cfg.train)


@contextmanager
def _sharded_alone(state, cfg) -> Iterator[None]:
    """A sharded trainer of one rank (FSDP's mixed precision and layout on one device): a default group of one."""
    from grpoflow.train.fsdp import shard_trainer

    backend = "nccl" if state.device.type == "cuda" else "gloo"
    group = sharded_group(backend, dist.HashStore(), 0, 1)
    try:
        state.dp = DataParallel(group, 0, 1, state.device)
        state.dp.note = f"1 trainer rank over {backend}, sharded (FSDP)"
        shard_trainer(state, cfg.train)
        yield
    finally:
        state.dp = None
        leave_trainer_group(dist.group.WORLD)


def join_trainer_group(address, port: int, rank: int, world: int, group_name: str, backend: str, store, sharded):
    """The trainer ranks' group: the weight-update kind for replicas; torch's default group, sharded
    (`sharded_group`)."""
    if not sharded:
        return join_update_group(address, port, rank, world, group_name, backend, UPDATE_GROUP_TIMEOUT_S, store)
    timeout = datetime.timedelta(seconds=UPDATE_GROUP_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
    return sharded_group(backend, dist.PrefixStore(group_name, store), rank, world, timeout)


def bound_collectives(group: dist.ProcessGroup, seconds: float) -> None:
    """Bound every later collective of the group (the join had the long rendezvous timeout: a rank may take
    minutes to start and load). On gloo a collective past the bound raises in its caller; on NCCL torch's
    watchdog aborts the communicator."""
    dist.set_timeout(datetime.timedelta(seconds=seconds), group)


def sharded_group(backend: str, store, rank: int, world: int, timeout=None) -> dist.ProcessGroup:
    """torch's default group for sharded trainer ranks, always named "0" on every rank.

    torch names a default group by its process's count of groups made so far (`_world.group_count`) and meets
    the other ranks under that name in the store: rank 0, a long-lived process, may have made groups before
    (earlier trainer ranks), fresh worker ranks none, and under different names they would wait for each other
    until the timeout. And DTensor caches its sharding decisions by device mesh, where meshes of one shape
    compare equal whatever their group, then resolves the group by name: a later group under another name would
    have its collectives sent to a destroyed one."""
    _world.group_count = 0
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.group.WORLD


def leave_trainer_group(group: dist.ProcessGroup) -> None:
    """Destroy the trainer ranks' group alone. torch destroys every process group with its default one, and a
    weight-update group beside the trainer ranks (`DistributedSync`'s) must outlive them: the default group is
    unset first, so that it is destroyed as any other."""
    from torch.distributed.distributed_c10d import _update_default_pg

    if group is dist.group.WORLD:
        _update_default_pg(None)
    dist.destroy_process_group(group)


def _join_watching(workers: RankWorkers, address, store, world: int, group_name: str, backend: str, sharded: bool):
    """Rank 0 joins the group, in a thread, while this one watches the other ranks start: one that fails first
    (an import error, a device it cannot have, a Ray actor that cannot be placed) fails the join with its cause
    at once, not at the group's timeout."""
    joined: dict = {}

    def join() -> None:
        try:
            joined["group"] = join_trainer_group(address, store.port, 0, world, group_name, backend, store, sharded)
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


def _start_here(spec: dict, world: int) -> list[Lifeline]:
    """Ranks 1.. as processes of this machine, each on its device of the run's GPU plan (`spec["devices"]`)."""
    # behind the lifeline: a flow killed with SIGKILL does not leave its ranks holding their GPUs
    return [
        Lifeline([sys.executable, "-m", "grpoflow.train.ranks", json.dumps(spec), str(rank)])
        for rank in range(1, world)
    ]


class _RankActor:
    """A worker rank as a Ray actor: `run` is the rank's whole life (it returns when rank 0 says stop)."""

    def run(self, spec: dict, rank: int) -> None:
        _worker(spec, rank, None)  # Ray gave it its own GPU, if any: the one it sees


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


def _worker(spec: dict, rank: int, device: str | None) -> None:
    """A worker rank: join the group, load the policy like rank 0 onto `device` (None: this process's own,
    `trainer_device`), then run the jobs rank 0 hands out."""
    from grpoflow.config import parse_run_config
    from grpoflow.train.fsdp import shard_trainer, skeleton_trainer

    torch.set_num_threads(spec["threads"])
    dev = trainer_device(device)
    address = spec["address"]
    store = dist.TCPStore(address, spec["port"], spec["world"], is_master=False, timeout=IDLE_TIMEOUT)
    _beat(address, spec["port"], rank, spec["beat_interval_s"])
    n = 0
    try:
        sharded = spec["sharded"]
        group = join_trainer_group(
            address,
            spec["port"],
            rank,
            spec["world"],
            spec["group"],
            spec["backend"],
            None,
            sharded,
        )
        cfg = parse_run_config(spec["config"])
        bound_collectives(group, cfg.cluster.collective_timeout_s)
        if sharded:  # the weights (a resumed checkpoint's too) come from rank 0
            state = skeleton_trainer(spec["model"], cfg.train, dev)
            state.dp = DataParallel(group, rank, spec["world"], state.device)
            shard_trainer(state, cfg.train, spec["checkpoint"])
        else:
            state = load_trainer(spec["model"], cfg.train, seed=cfg.seed, device=str(dev))
            if spec["checkpoint"]:
                restore_training_state(state, spec["checkpoint"])
            state.dp = DataParallel(group, rank, spec["world"], state.device)
        while True:
            kind, payload = pickle.loads(store.get(f"job/{n}"))
            if kind == "stop":
                break
            if kind == "call":  # rank 0's `on_other_ranks`
                module, name, args = payload
                getattr(importlib.import_module(module), name)(state, *args)
            else:
                samples, job_cfg, step = payload
                grpo_update(state, samples, job_cfg, step)
            store.set(f"done/{n}/{rank}", b"ok")
            n += 1
        leave_trainer_group(group)
    except BaseException:
        # rank 0 reads this when the collective it waits in breaks (error/), or as the job's reply (done/)
        failed = traceback.format_exc()
        store.set(f"error/{rank}", failed.encode())
        store.set(f"done/{n}/{rank}", failed.encode())
        print(failed, file=sys.stderr, flush=True)
        # Leave at once, whatever holds the group open (a Ray actor's process lives on after its method): the
        # closed sockets fail the collective rank 0 waits in.
        os._exit(1)


def _beat(address: str, port: int, rank: int, interval_s: float) -> None:
    """Raise this rank's heartbeat counter every `interval_s` seconds, from a daemon thread on a connection of
    its own, for as long as the process runs: rank 0 gives up a rank whose counter stops."""
    store = dist.TCPStore(address, port, is_master=False, timeout=POLL * 10)

    def beat() -> None:
        while True:
            try:
                store.add(f"beat/{rank}", 1)
            except RuntimeError:  # rank 0 and its store are gone: the rank's own wait for work fails with it
                return
            time.sleep(interval_s)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A worker rank of grpoflow's data-parallel trainer.")
    parser.add_argument("spec", help="the group and the policy to load (JSON, from trainer_ranks)")
    parser.add_argument("rank", type=int)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(args.spec)
    _worker(spec, args.rank, spec["devices"][args.rank])
    return 0


if __name__ == "__main__":
    sys.exit(main())

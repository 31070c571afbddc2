"""The weight sync: each step's new weights into the engine, by `engine.weight_sync.mode`.

- `disk`: the step's checkpoint dir (written by the commit, `grpoflow.run.commit.save_step`) is loaded with
  `/update_weights_from_disk`.
- `adapter` (LoRA runs): the adapter alone, loaded with `/load_lora_adapter` (`AdapterSync`).
- `distributed`: in memory. At the start the trainer hosts a process group (rank 0) that the engine joins
  (`/init_weights_update_group`); each sync sends the weights in buckets of at most `engine.weight_sync.bucket_mb`:
  one `/update_weights_from_distributed` per bucket announces its tensors (name, dtype, shape), and the trainer
  broadcasts them in that order, in the engine's dtype; the engine receives a bucket on its device and loads it
  before the next, so neither side holds a second copy of the model. The last bucket carries the weight version.
  No generation runs while a sync does (the loop syncs between rollouts), so none sees half-loaded weights.
  Nothing is written for the sync; full checkpoints are still written every `train.checkpoint.interval` steps.
- `tensor`: in memory, for an engine on the same host (on the same GPU with SGLang). Each sync copies the weights,
  in the engine's dtype, bucket by bucket (as `distributed`) into one flat buffer the engine can map (shared memory
  on the CPU; CUDA IPC on a GPU), the size of the largest bucket, and one `/update_weights_from_tensor` per bucket
  tells the engine where each tensor lies (`grpoflow.engine.shared_tensors`); the engine copies them into its own
  before it answers, so the buffer takes the next bucket. Nothing is written for the sync.

SGLang takes the two in-memory updates only inside its weight-update session (`/begin_weight_update` ...
`/end_weight_update`, `update_session`). Every sync says what it moved (`bytes`; in memory, in how many
`buckets`), so the step's record shows the cost of the sync, and ends by reading the engine's weight version back
(`check_served_version`).
"""

from __future__ import annotations

import logging
import math
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch

from grpoflow.config import Engine, RunConfig
from grpoflow.engine.client import EngineClient, SglangClient
from grpoflow.engine.clients import client_of
from grpoflow.engine.protocol import WEIGHT_SESSION_ALREADY_OPEN
from grpoflow.engine.router import add_worker, remove_worker
from grpoflow.engine.shared_tensors import serialize_named_tensors, shared_buffer
from grpoflow.engine.update_group import (
    UPDATE_GROUP_TIMEOUT_S,
    broadcast_tensors,
    dtype_name,
    host_update_store,
    join_update_group,
    leave_update_group,
    plan_buckets,
)
from grpoflow.errors import EngineError
from grpoflow.fileio import publish_dir
from grpoflow.train.fsdp import gathered_adapter, served
from grpoflow.train.lora import save_adapter
from grpoflow.train.probe import SyncProbe, check_logprob_agreement
from grpoflow.train.trainer import TrainerState

T = TypeVar("T")
logger = logging.getLogger(__name__)

# The name a LoRA run's adapter is loaded under in the engine (one per engine: each sync replaces it).
SERVED_ADAPTER = "grpoflow-policy"


class DiskSync:
    """The engine loads the step's checkpoint dir."""

    needs_dir = True

    def __init__(self, client: EngineClient):
        self.client = client

    def close(self) -> None:
        self.client.close()

    def push(self, trainer: TrainerState, version: str, ckpt: Path | None) -> dict[str, float]:
        if ckpt is None:
            raise ValueError("a disk weight sync needs the step's checkpoint dir")
        self.client.update_weights_from_disk(str(ckpt), weight_version=version)
        check_served_version(self.client, version)
        return {"bytes": float(sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors")))}


class DistributedSync:
    """The trainer broadcasts its weights to the engine over a process group they share (see the module doc)."""

    needs_dir = False

    def __init__(self, client: EngineClient, cfg: Engine, device: torch.device):
        self.client = client
        self.dtype = sync_dtype(cfg)
        self.bucket_bytes = cfg.weight_sync.bucket_bytes
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        # A name of its own: torch keeps group names per process, and an engine may outlive one run's sync.
        self.group_name = f"grpoflow-{uuid.uuid4().hex[:12]}"
        self.broken = False  # a failed update left one side of a collective waiting: the group is unusable
        address, timeout = cfg.weight_sync.address, UPDATE_GROUP_TIMEOUT_S
        # the trainer (rank 0), then the engine's workers as the server counts them (an attached server may
        # run another layout than engine.tp_size says; a group sized from the config would wait for ranks never
        # coming, or refuse one)
        world = 1 + client.weight_update_ranks()
        store = host_update_store(address, world, timeout)
        self.group = self._paired(
            lambda: join_update_group(address, store.port, 0, world, self.group_name, self.backend, timeout, store),
            lambda: self.client.init_weights_update_group(address, store.port, 1, world, self.group_name, self.backend),
        )

    def push(self, trainer: TrainerState, version: str, ckpt: Path | None = None) -> dict[str, float]:
        if self.broken:
            raise EngineError("the weight update group is unusable after an earlier failed update")
        # a sharded model's gathered one at a time in the engine's dtype, as they are sent
        names, shapes, tensors = served(trainer, self.dtype)
        buckets = _buckets(shapes, self.dtype, self.bucket_bytes)
        dtype = dtype_name(self.dtype)

        def send(n: int) -> int:
            with torch.no_grad():
                return broadcast_tensors(self.group, (t.to(self.device, self.dtype) for t in islice(tensors, n)))

        def announce(b: range, last: bool) -> object:
            # The version and the cache flush with the last bucket: the engine serves the new weights from then on.
            return self.client.update_weights_from_distributed(
                names[b.start : b.stop],
                [dtype] * len(b),
                shapes[b.start : b.stop],
                self.group_name,
                version if last else None,
                flush_cache=last,
            )

        sent = 0
        with update_session(self.client):
            for i, b in enumerate(buckets):
                last = i + 1 == len(buckets)
                sent += self._paired(partial(send, len(b)), partial(announce, b, last))
        _all_sent(tensors, len(names))
        check_served_version(self.client, version)
        return {"bytes": float(sent), "buckets": float(len(buckets))}

    def _paired(self, ours: Callable[[], T], engines: Callable[[], object]) -> T:
        """Our side of a collective and the engine's request (behind which it does its side, answering once
        done), each in a thread. The first to fail raises at once: a refused request, or our side failing (a
        dtype cast out of memory), would leave the other waiting until the group's timeout. The group is
        unusable after a failure."""
        results: queue.Queue[tuple[str, bool, Any]] = queue.Queue()

        def run(side: str, call: Callable[[], Any]) -> None:
            try:
                results.put((side, True, call()))
            except BaseException as e:  # noqa: BLE001  (raised in the caller's thread)
                results.put((side, False, e))

        for side, call in (("ours", ours), ("engine", engines)):
            threading.Thread(target=run, args=(side, call), name=f"weight-sync-{side}", daemon=True).start()
        value: Any = None
        for _ in range(2):
            side, ok, out = results.get()
            if not ok:
                self.broken = True
                raise out
            if side == "ours":
                value = out
        return value

    def close(self) -> None:
        try:
            if not self.broken:
                leave_update_group(self.group)
        finally:
            self.client.close()


class TensorSync:
    """The engine maps the trainer's weights from a buffer on this host (see the module doc)."""

    needs_dir = False

    def __init__(self, client: SglangClient, cfg: Engine, device: torch.device):
        self.client, self.dtype, self.device = client, sync_dtype(cfg), device
        self.bucket_bytes = cfg.weight_sync.bucket_bytes
        # SGLang reads entry i on tensor-parallel rank i; each takes its shard itself
        self.ranks = client.weight_update_ranks()
        self._flat: torch.Tensor | None = None  # (the largest bucket's numel,) in self.dtype; kept across syncs

    def push(self, trainer: TrainerState, version: str, ckpt: Path | None = None) -> dict[str, float]:
        names, shapes, tensors = served(trainer, self.dtype)  # a sharded model's gathered one at a time
        numels = [math.prod(s) for s in shapes]
        buckets = _buckets(shapes, self.dtype, self.bucket_bytes)
        largest = max((sum(numels[i] for i in b) for b in buckets), default=0)
        if self._flat is None or self._flat.numel() != largest:
            self._flat = shared_buffer(largest, self.dtype, self.device)
        moved = 0
        with update_session(self.client):
            for i, b in enumerate(buckets):
                views, at = [], 0
                with torch.no_grad():
                    for name, t in zip(names[b.start : b.stop], islice(tensors, len(b)), strict=True):
                        view = self._flat[at : at + t.numel()].view(t.shape)
                        view.copy_(t)
                        views.append((name, view))
                        at += t.numel()
                # The engine answers once it copied every tensor: the buffer is free for the next bucket then.
                # One dump per rank: torch counts each dump's handles as one reference that one reader gives back.
                entries = [serialize_named_tensors(views) for _ in range(self.ranks)]
                last = i + 1 == len(buckets)
                self.client.update_weights_from_tensor(entries, version if last else None, flush_cache=last)
                moved += at * self.dtype.itemsize
        _all_sent(tensors, len(names))
        check_served_version(self.client, version)
        return {"bytes": float(moved), "buckets": float(len(buckets))}

    def close(self) -> None:
        self._flat = None
        self.client.close()


def _buckets(shapes: list[list[int]], dtype: torch.dtype, limit_bytes: int) -> list[range]:
    """The in-memory syncs' update requests: runs of the served tensors of at most `limit_bytes` in `dtype`."""
    return plan_buckets([math.prod(s) * dtype.itemsize for s in shapes], limit_bytes)


def _all_sent(tensors: Iterator[torch.Tensor], announced: int) -> None:
    """The served tensors are spent once the buckets took theirs; stepping past the last also ends a sharded
    model's gathers on the other ranks."""
    if next(tensors, None) is not None:
        raise EngineError(f"the trainer served more tensors than the {announced} it announced")


def sync_dtype(cfg: Engine) -> torch.dtype:
    if cfg.weight_sync.dtype != "auto":
        return getattr(torch, cfg.weight_sync.dtype)
    return getattr(torch, cfg.serves_dtype)


class AdapterSync:
    """A LoRA run's adapter alone: written to `sync_dir` in PEFT's format and loaded into the engine under one
    name (`SERVED_ADAPTER`: each sync replaces the one before), which every generation request names; then the
    engine's weight version is set. From the start the engine serves the run's adapter (B = 0 at first: the base
    model), so every request of the run can name it."""

    needs_dir = False

    def __init__(self, client: SglangClient, sync_dir: Path, trainer: TrainerState, dtype: torch.dtype):
        self.client, self.dir, self.dtype = client, Path(sync_dir), dtype  # the engine's dtype
        self._current: Path | None = None
        self.push(trainer, None)

    def push(self, trainer: TrainerState, version: str | None, ckpt: Path | None = None) -> dict[str, float]:
        out = self.dir / f"adapter-{version or 'start'}"
        with publish_dir(out, replace=True) as tmp:
            save_adapter(trainer.model, tmp, self.dtype, tensors=gathered_adapter(trainer))  # None: unsharded
        if self._current is not None:
            self.client.unload_lora_adapter(SERVED_ADAPTER)
        self.client.load_lora_adapter(SERVED_ADAPTER, str(out.resolve()))
        if version is not None:
            self.client.update_weight_version(version)
            check_served_version(self.client, version)
        previous, self._current = self._current, out
        if previous is not None and previous != out:
            shutil.rmtree(previous, ignore_errors=True)  # loaded into the engine's memory: the files are spent
        return {"bytes": float(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()))}

    def close(self) -> None:
        self.client.close()


class ReplicaSyncs:
    """One sync per engine (one, or each replica: `engine.embedded.replicas`, or the servers behind a router): each push
    reaches every live engine, and each must then report the new weight version, or the sync fails naming it. A
    replica that no longer answers /health is left out from then on (the router stops routing to it too), and
    said so; with none left the sync fails. `reopen` replaces one engine's sync (the engine was restarted);
    `readmit` takes a lost one back once it is restored."""

    def __init__(self, urls: list[str], open_one: Callable[[int, str], WeightSync], router: str | None = None):
        self._open_one = open_one
        self.urls = urls
        self._opened: list[WeightSync] = []  # each engine's latest, as `urls`, lost or not
        try:
            for i, url in enumerate(urls):
                self._opened.append(open_one(i, url))
        except BaseException:
            self.close()
            raise
        self.syncs = list(self._opened)  # each live engine's
        self.router = router  # taken out of it too: else its health check could take back a replica on old weights
        self.needs_dir = any(s.needs_dir for s in self.syncs)
        self.lost: list[str] = []  # replicas left out, by URL

    def client_of(self, i: int) -> EngineClient:
        """Engine `i`'s client (as `urls`)."""
        return self._opened[i].client

    def reopen(self, i: int) -> WeightSync:
        """A new sync to engine `i` (as `urls`), whose process was restarted: what the old one set up there (an
        update group, a loaded adapter) went with it. Not yet pushed to."""
        old = self._opened[i]
        if isinstance(old, DistributedSync):
            old.broken = True  # its peer is gone: tearing the group down would wait on it
        new = self._open_one(i, self.urls[i])
        self._opened[i] = new
        if old in self.syncs:
            self.syncs[self.syncs.index(old)] = new
        old.close()
        return new

    def readmit(self, i: int) -> None:
        """Engine `i`, left out as lost and now restored on the run's weights through its reopened sync: back in
        the syncs, and in the router's rotation (which takes it up in the background)."""
        s = self._opened[i]
        if s in self.syncs:
            return
        self.syncs.append(s)
        self.lost.remove(s.client.base_url)
        if self.router is None:
            return
        try:
            add_worker(self.router, s.client.base_url)
        except httpx.HTTPError as err:  # it serves on; the router's own clients just do not reach it
            logger.warning("engine replica %s could not be put back into the router: %s", s.client.base_url, err)

    @property
    def client(self) -> EngineClient:
        return self.syncs[0].client

    @property
    def clients(self) -> list[EngineClient]:
        return [s.client for s in self.syncs]

    def push(self, trainer: TrainerState, version: str, ckpt: Path | None = None) -> dict[str, float]:
        for s in [s for s in self.syncs if not _answers(s.client)]:
            self.syncs.remove(s)
            self.lost.append(s.client.base_url)
            if self.router is not None:
                remove_worker(self.router, s.client.base_url)
            logger.warning(
                "engine replica %s does not answer /health: left out of the weight sync%s",
                s.client.base_url,
                " and taken out of the router" if self.router else "",
            )
        if not self.syncs:
            raise EngineError(f"no engine replica answers /health (lost: {', '.join(self.lost)})")
        moved: dict[str, float] = {}
        for s in self.syncs:  # each reads its replica's weight version back
            for key, value in s.push(trainer, version, ckpt).items():
                # bytes over every replica; the bucket count is each replica's
                moved[key] = moved.get(key, 0.0) + value if key == "bytes" else value
        if len(self.syncs) + len(self.lost) == 1:  # one engine: nothing to count
            return moved
        return moved | {"replicas": float(len(self.syncs)), "replicas_lost": float(len(self.lost))}

    def label(self, version: str) -> None:
        """Every engine reports `version` for the weights it serves now (SGLang's /update_weight_version)."""
        for s in self.syncs:
            s.client.update_weight_version(version)
            check_served_version(s.client, version)

    def busy_seconds(self) -> float | None:
        busy = [s.client.busy_seconds() for s in self.syncs]
        return None if any(b is None for b in busy) else sum(busy)

    def close(self) -> None:
        with ExitStack() as stack:
            for s in self._opened:
                stack.callback(s.close)


@contextmanager
def update_session(client: EngineClient) -> Iterator[None]:
    """SGLang's weight-update session around an in-memory update (`/begin_weight_update` ...
    `/end_weight_update`): it refuses `/update_weights_from_distributed` and `/update_weights_from_tensor` outside
    one, and finalizes the loaded weights at the end.

    A session an earlier sync left open (a run stopped between the two calls) is closed and a new one opened,
    with a warning. The session is closed only when the update succeeded: after a failed one the engine may still
    wait for its side of the broadcast, and an end request would queue behind it until the group's timeout."""
    try:
        client.begin_weight_update()
    except EngineError as e:
        if WEIGHT_SESSION_ALREADY_OPEN not in str(e):
            raise
        logger.warning(
            "engine %s had a weight-update session open (an earlier sync stopped): closing it", client.base_url
        )
        client.end_weight_update()
        client.begin_weight_update()
    yield
    client.end_weight_update()


def check_served_version(client: EngineClient, version: str) -> None:
    """The engine reports `version` after the sync to it, or EngineError naming the engine."""
    served = client.model_info().weight_version
    if served != version:
        raise EngineError(f"engine {client.base_url} serves weight version {served} after the sync to {version}")


def _answers(client: EngineClient, tries: int = 3) -> bool:
    """/health answers within a few tries a second apart (one slow answer does not lose a replica)."""
    for i in range(tries):
        if client.health():
            return True
        if i + 1 < tries:
            time.sleep(1.0)
    return False


WeightSync = DiskSync | DistributedSync | TensorSync | AdapterSync


def sync_weights(
    syncs: ReplicaSyncs, trainer: TrainerState, ckpt: Path | None, version: str, probe: SyncProbe | None
) -> dict[str, float]:
    """The trainer's weights into every engine as weight version `version` (the number of GRPO updates in them),
    from the step's checkpoint dir or in memory (`engine.weight_sync.mode`); each engine must then report that
    version, and with `probe` prove that it serves them. Returns the `sync/...` metrics."""
    moved = syncs.push(trainer, version, ckpt)
    checked: dict[str, float] = {}
    for client in syncs.clients if probe is not None else []:
        gap = probe.check(client, trainer, version)["probe_gap"]
        checked["probe_gap"] = max(gap, checked.get("probe_gap", 0.0))
    return {f"sync/{k}": v for k, v in moved.items()} | {f"sync/{k}": v for k, v in checked.items()}


def probe_engines(
    trainer: TrainerState, syncs: ReplicaSyncs, cfg: RunConfig, sync_probe: SyncProbe | None
) -> dict[str, float]:
    """Before the first step: engine and trainer score a probe reply alike (`check_logprob_agreement`), or the
    run fails here; the sync probe takes its first reading of every engine. Through the weight sync's client: it
    names the adapter a LoRA run's engine serves. {} when the run has no probe."""
    if cfg.train.max_probe_logprob_gap is None:
        return {}
    gap = check_logprob_agreement(syncs.client, trainer, cfg)
    for client in syncs.clients if sync_probe is not None else []:
        sync_probe.check(client, trainer, "start")
    return gap


@contextmanager
def open_weight_sync(
    cfg: RunConfig,
    engine_urls: str | list[str],
    trainer: TrainerState,
    sync_dir: Path | None = None,
    router: str | None = None,
) -> Iterator[ReplicaSyncs]:
    """The run's weight sync (`RunConfig.weight_sync_mode`) to each engine at `engine_urls` (one, or several
    replicas behind `router`), for the block. `sync_dir`: where an adapter sync writes the adapter (the run's
    `sync/`; one subdir per replica when there are several)."""
    engine_urls = [engine_urls] if isinstance(engine_urls, str) else list(engine_urls)
    several = len(engine_urls) > 1

    def open_one(i: int, url: str) -> WeightSync:
        return _open_one(cfg, url, trainer, sync_dir / f"replica-{i}" if sync_dir and several else sync_dir)

    syncs = ReplicaSyncs(engine_urls, open_one, router)
    try:
        yield syncs
    finally:
        syncs.close()


def _open_one(cfg: RunConfig, engine_url: str, trainer: TrainerState, sync_dir: Path | None) -> WeightSync:
    """The sync to one engine (its `close` closes its client)."""
    e = cfg.engine
    mode = cfg.weight_sync_mode()
    # with the adapter alone synced, every generation names it: `sync.client.lora_path` says which
    served = SERVED_ADAPTER if mode == "adapter" else None
    client = client_of(e, engine_url, lora_path=served)
    try:
        if mode == "disk":
            sync: WeightSync = DiskSync(client)
        elif mode == "adapter":
            where = sync_dir or Path(tempfile.mkdtemp(prefix="grpoflow-sync-"))
            sync = AdapterSync(client, where, trainer, sync_dtype(e))
        elif mode == "tensor":
            sync = TensorSync(client, e, trainer.device)
        else:
            sync = DistributedSync(client, e, trainer.device)
    except BaseException:
        client.close()
        raise
    return sync

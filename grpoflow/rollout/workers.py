"""Rollout workers on a Ray cluster (`cluster.ray_address`): a step's trials run on actors spread over the nodes.

The step itself stays in the flow's process: it plans the trials, builds each attempt's Harbor config, journals
each finished trial and retries sandbox failures exactly as without Ray (`grpoflow.rollout.trials.run_trial`).
Only an attempt's `Trial.create(config).run()` goes to a worker: one async Ray actor per worker, each running
up to `rollout.concurrency` trials at once in its own event loop, and its result (Harbor's `TrialResult`)
comes back to the step as that trial finishes. Attempts go to the worker with the fewest in flight.

A worker that dies (its process, or its node) fails the attempts it was running with Ray's actor error; they
become `WorkerLost` and run again, in a fresh trial dir, on a worker still alive — not counted as sandbox
retries. Finished trials were journaled by the step when they finished, so nothing finished is lost; with no
worker left the step fails.

What a worker needs of the machine it runs on: this package and Harbor (the same environment), the run dir
at the same path (a shared filesystem across nodes: Harbor writes each trial's dir there), and the engine's
and the session server's URLs reachable from its sandboxes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from harbor.models.trial.config import TrialConfig
from harbor.models.trial.result import TrialResult

from grpoflow.cluster import forwarded_env
from grpoflow.config import ClusterConfig
from grpoflow.errors import EngineError, one_line
from grpoflow.rollout.trials import SandboxGate, WorkerLost

log = logging.getLogger(__name__)
REACH_TIMEOUT_S = 5.0  # a worker's wait for the engine's /health before the first trial


class _Worker:
    """The actor: runs trial attempts in its own event loop."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": self.pid, "node": ray.get_runtime_context().get_node_id()}

    async def reach(self, url: str) -> str | None:
        """None when `url` answers `GET /health` from this worker's node (any status: it is there); else why
        not, in one line."""
        import httpx

        try:
            async with httpx.AsyncClient(timeout=REACH_TIMEOUT_S) as client:
                await client.get(f"{url.rstrip('/')}/health")
        except httpx.HTTPError as err:
            return one_line(err, 200)
        return None

    async def run(self, cfg: TrialConfig) -> TrialResult:
        from harbor.trial.trial import Trial

        trial = await Trial.create(cfg)
        return await trial.run()


@dataclass
class _Slot:
    actor: Any
    name: str
    info: dict[str, Any] = field(default_factory=dict)
    in_flight: int = 0
    alive: bool = True


class RolloutWorkers:
    """Ray actors that run trial attempts: `run` is a `TrialRunner` for `run_trials`."""

    def __init__(self, n: int, trials_per_worker: int):
        # trials_per_worker: the most attempts one worker runs at once (its actor's max_concurrency)
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = sorted(node["NodeID"] for node in ray.nodes() if node.get("Alive"))
        actor = ray.remote(_Worker)

        def on(node: str):
            return actor.options(
                num_cpus=0,  # trials wait on sandboxes and the engine; the node's CPUs are theirs
                max_concurrency=trials_per_worker,
                # worker i on node i (round robin): Ray's SPREAD alone may put two on one node
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                runtime_env={"env_vars": forwarded_env()},
                max_restarts=0,  # a dead worker stays dead: its attempts move to the others
            ).remote()

        self.slots = [_Slot(on(nodes[i % len(nodes)]), f"rollout-worker-{i}") for i in range(n)]
        for slot, info in zip(self.slots, ray.get([s.actor.info.remote() for s in self.slots]), strict=True):
            slot.info = info
        self.lost: list[str] = []

    @property
    def nodes(self) -> int:
        return len({s.info["node"] for s in self.slots if s.alive})

    def describe(self) -> str:
        return f"trials run on {len(self.slots)} rollout workers on {self.nodes} Ray nodes"

    async def run(self, cfg: TrialConfig, sandbox_gate: SandboxGate | None = None) -> TrialResult:
        """One attempt on the live worker with the fewest in flight. `sandbox_gate` is not taken here: Harbor's
        start hooks fire in the worker's process (`rollout.concurrency` bounds the step's attempts)."""
        import ray
        import ray.exceptions

        live = [s for s in self.slots if s.alive]
        if not live:
            raise RuntimeError(f"no rollout worker left (lost: {', '.join(self.lost)})")
        # a worker's cwd is its own: Harbor must get the trial's paths absolute
        cfg = cfg.model_copy(
            update={
                "trials_dir": cfg.trials_dir.resolve(),
                "task": cfg.task.model_copy(update={"path": cfg.task.path.resolve()}),
            }
        )
        slot = min(live, key=lambda s: s.in_flight)
        slot.in_flight += 1
        try:
            return await slot.actor.run.remote(cfg)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
            if slot.alive:
                slot.alive = False
                self.lost.append(slot.name)
                # unreachable is not always dead: make sure its trials stop talking to their sessions
                ray.kill(slot.actor)
                log.warning("rollout worker %s (pid %s) died: %s", slot.name, slot.info.get("pid"), type(err).__name__)
            raise WorkerLost(f"{slot.name} died while running {cfg.trial_name}") from None
        finally:
            slot.in_flight -= 1

    def unreachable(self, urls: list[str]) -> list[str]:
        """One line per (worker, URL) where the worker's node cannot reach the URL: trials there would fail."""
        import ray

        asks = [(s, url, s.actor.reach.remote(url)) for s in self.slots for url in urls]
        return [
            f"{s.name} (node {s.info['node'][:12]}) cannot reach {url}: {why}"
            for s, url, ref in asks
            if (why := ray.get(ref)) is not None
        ]

    def close(self) -> None:
        import ray

        for s in self.slots:
            ray.kill(s.actor)


@contextmanager
def rollout_workers(
    cluster: ClusterConfig, concurrency: int, reach: tuple[str, ...] = ()
) -> Iterator[RolloutWorkers | None]:
    """The run's rollout workers for the block, on the Ray cluster the run holds (`grpoflow.cluster.ray_session`);
    None without one (`cluster.ray_address` empty): the trials run in this process. `cluster.rollout_workers`
    actors (default: one per alive node), each taking up to `concurrency` trials. Every worker must reach the
    URLs in `reach` (the engine) from its node before the first trial, else `EngineError` in one line: on a node
    that cannot, every trial would fail and its group be dropped."""
    if not cluster.ray_address:
        yield None
        return
    import ray

    n = cluster.rollout_workers or len([node for node in ray.nodes() if node.get("Alive")])
    workers = RolloutWorkers(n, concurrency)
    try:
        if problems := workers.unreachable(list(reach)):
            raise EngineError(
                f"rollout workers cannot reach the engine: {problems[0]} ({len(problems)} of "
                f"{len(workers.slots) * len(reach)} checks failed); every Ray node must reach it: set "
                "cluster.listen_host to an address they all reach, or attach an engine there (engine.url)"
            )
        yield workers
    finally:
        workers.close()

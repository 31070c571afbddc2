"""Prefect tasks of the train stage: the GRPO update, the step's checkpoint, the weight sync and the probes.

The trainer state (model, optimizer) lives in the flow's process and is handed to these tasks in memory; results
are not cached or persisted by Prefect — the checkpoint on disk is the durable record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from grpoflow.config import RunConfig
from grpoflow.run.commit import StepDir, save_step
from grpoflow.run.paths import RunPaths
from grpoflow.samples import Sample
from grpoflow.train.probe import SyncProbe, check_logprob_agreement
from grpoflow.train.ranks import run_update
from grpoflow.train.sync import ReplicaSyncs, WeightSync, sync_clients
from grpoflow.train.trainer import TrainerState


@task(name="grpo-step", cache_policy=NO_CACHE, task_run_name="grpo-step-{step}")
def grpo_step_task(trainer: TrainerState, samples: list[Sample], cfg: RunConfig, step: int) -> dict[str, float]:
    metrics = run_update(trainer, samples, cfg, step)  # on every trainer rank (`cluster.train_ranks`)
    if not samples:
        get_run_logger().warning("step %d: no trainable samples (all groups dropped): weights unchanged", step)
    return metrics


@task(name="save-step", cache_policy=NO_CACHE, task_run_name="save-step-{step}")
def save_step_task(trainer: TrainerState, paths: RunPaths, step: int, record: dict[str, Any], plan: StepDir) -> Path:
    """`checkpoints/step_<step>` (atomic) as `plan` says: weights for the engine or a full checkpoint, step.json."""
    return save_step(trainer, paths, step, record, plan)


@task(name="sync-weights", cache_policy=NO_CACHE, task_run_name="sync-weights-{version}")
def sync_weights_task(
    sync: WeightSync | ReplicaSyncs, trainer: TrainerState, ckpt: Path | None, version: str, probe: SyncProbe | None
) -> dict[str, float]:
    """The trainer's weights into the engine as weight version `version` (the number of GRPO updates in them),
    from the step's checkpoint dir or in memory (`engine.weight_sync`); then, with `probe`, proof that the engine
    serves them. Returns the `sync/...` metrics."""
    moved = sync.push(trainer, version, ckpt)
    checked: dict[str, float] = {}
    for client in sync_clients(sync) if probe is not None else []:  # every replica serves them
        gap = probe.check(client, trainer, version)["probe_gap"]
        checked["probe_gap"] = max(gap, checked.get("probe_gap", 0.0))
    return {f"sync/{k}": v for k, v in moved.items()} | {f"sync/{k}": v for k, v in checked.items()}


@task(name="probe-logprobs", cache_policy=NO_CACHE)
def probe_task(
    trainer: TrainerState, sync: WeightSync | ReplicaSyncs, cfg: RunConfig, sync_probe: SyncProbe | None
) -> dict[str, float]:
    """Engine and trainer score a probe reply alike (`grpoflow.train.probe`), or the run fails here; the sync
    probe takes its first reading of every replica. Through the weight sync's client: it names the adapter a
    LoRA run's engine serves."""
    if cfg.train.max_probe_logprob_gap is None:
        return {}
    client = sync.client
    gap = check_logprob_agreement(client, trainer, cfg)
    for replica in sync_clients(sync) if sync_probe is not None else []:
        sync_probe.check(replica, trainer, "start")
    get_run_logger().info(
        "engine vs trainer on a %d-token probe: mean |logprob gap| %.2e, max %.2e",
        gap["tokens"],
        gap["mean"],
        gap["max"],
    )
    return gap

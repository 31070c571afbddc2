"""Prefect tasks of the train stage: the GRPO update and the weight sync (checkpoint + engine reload).

The trainer state (model, optimizer) lives in the flow's process and is handed to these tasks in memory; results
are not cached or persisted by Prefect — the checkpoint on disk is the durable record.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from grpoflow.config import RunConfig
from grpoflow.engine.client import EngineClient
from grpoflow.rundir import RunPaths
from grpoflow.samples import Sample
from grpoflow.train import TrainerState, prune_checkpoints, save_checkpoint, train_step


@task(name="grpo-step", cache_policy=NO_CACHE, task_run_name="grpo-step-{step}")
def grpo_step_task(trainer: TrainerState, samples: list[Sample], cfg: RunConfig, step: int) -> dict[str, float]:
    if not samples:
        get_run_logger().warning("step %d: no trainable samples (all groups dropped): weights unchanged", step)
        return {"n_samples": 0.0, "optimizer_steps": 0.0}
    return train_step(trainer, samples, cfg.train, seed=cfg.seed * 1_000_003 + step, temperature=cfg.rollout.temperature)


@task(name="sync-weights", cache_policy=NO_CACHE, task_run_name="sync-weights-{step}")
def sync_weights_task(trainer: TrainerState, paths: RunPaths, step: int, engine_url: str, cfg: RunConfig) -> str:
    """Save `checkpoints/step_<step>`, prune older ones, load it into the engine; returns the new weight version."""
    ckpt = save_checkpoint(trainer.model, trainer.tokenizer, paths.checkpoint(step))
    prune_checkpoints(ckpt.parent, cfg.train.save_interval, latest=step)
    version = str(step + 1)  # number of GRPO updates in the weights; rollout samples carry it
    with EngineClient(engine_url, timeout=cfg.engine.request_timeout_s, retries=cfg.engine.retries) as client:
        client.update_weights_from_disk(str(ckpt), weight_version=version)
    return version

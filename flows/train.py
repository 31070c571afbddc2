"""The train flow — the main job: prepare, then per step rollout -> evaluate -> GRPO update -> commit -> weight
sync.

Everything a step produced is on disk under runs/<run_id>/ (trials/, details/, checkpoints/, metrics.jsonl,
timings.jsonl, tb/) before the next step starts. `train_steps` is the loop body shared with the resume flow.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from flows.common import flow_run_name, prepare_stage, run_events, serving_engine, start_run
from grpoflow.collect import select_step_prompts
from grpoflow.config import RunConfig
from grpoflow.evaluate import select_trainable
from grpoflow.prepare import PreparedRun, update_run_info
from grpoflow.prompts import load_prompts
from grpoflow.reporting import MetricsLog, plot_curves, read_step_records, summary_markdown
from grpoflow.resume import run_lock
from grpoflow.train import TrainerState, load_trainer
from tasks.rollout import run_trials_task
from tasks.train import commit_step_task, grpo_step_task, sync_weights_task


@flow(name="train", flow_run_name=flow_run_name("train"), log_prints=True)
def train_flow(config: RunConfig = RunConfig()) -> dict:
    """GRPO training of the policy on agent trials; returns the last step's metrics and timings."""
    cfg = start_run(config, "train")
    with run_events("train", cfg.run_id, cfg.run_dir):
        run = prepare_stage(cfg, "train")
        update_run_info(run.paths, flow="train")  # resume and rerun take train runs only
        create_link_artifact(key=f"{cfg.run_id}-run-dir", link=run.paths.root.resolve().as_uri(), description="Run dir")
        trainer = load_trainer(run.model.path, cfg.train, seed=cfg.seed)
        with run_lock(run.paths.root):
            return train_steps(cfg, run, trainer, start_step=0)


def train_steps(
    cfg: RunConfig, run: PreparedRun, trainer: TrainerState, start_step: int, weights: Path | None = None
) -> dict:
    """Steps `start_step` .. `train.steps - 1`; `weights` (a step checkpoint) is loaded into the engine first
    when resuming. Returns the last step's record (metrics and timings). The caller holds the run's lock."""
    model, paths = run.model, run.paths
    prompts = load_prompts(paths.prompts)
    log = MetricsLog(paths.metrics, paths.tb)
    record: dict = {}
    try:
        with serving_engine(cfg, run) as engine:
            if weights is not None:
                sync_weights_task(weights, engine.url, cfg, str(start_step))
            for step in range(start_step, cfg.train.steps):
                t0 = time.perf_counter()
                step_prompts = select_step_prompts(prompts, step, cfg.rollout.prompts_per_step)
                rollout = run_trials_task(cfg, step, step_prompts, engine.url, model.path, paths)
                trainable, dropped = select_trainable(rollout.samples, cfg.rollout.on_retries_exhausted)
                t1 = time.perf_counter()
                train_m = grpo_step_task(trainer, trainable, cfg, step)
                version = str(step + 1)  # number of GRPO updates in the weights; rollout samples carry it
                record = {
                    **{f"rollout/{k}": v for k, v in rollout.metrics.items()},
                    "rollout/dropped_groups": float(dropped),
                    **{f"train/{k}": v for k, v in train_m.items()},
                    "weight_version": version,
                    "time/rollout_s": t1 - t0,
                    "time/train_s": time.perf_counter() - t1,
                    "time/step_s": time.perf_counter() - t0,
                }
                ckpt = commit_step_task(trainer, paths, step, record, log, cfg)
                sync_weights_task(ckpt, engine.url, cfg, version)
                print(
                    f"step {step + 1}/{cfg.train.steps}: reward {record['rollout/reward_mean']:.3f} "
                    f"pass@k {record['rollout/pass_at_k']:.2f} truncated {record['rollout/truncated_ratio']:.2f} "
                    f"loss {train_m.get('loss', float('nan')):.4f} ({record['time/step_s']:.0f}s)"
                )
    finally:
        log.close()
    report(cfg.run_id, paths)
    return record


def report(run_id: str, paths) -> None:
    records = read_step_records(paths.metrics)
    if not records:
        return
    keys = ["step", "rollout/reward_mean", "rollout/pass_at_k", "rollout/truncated_ratio", "rollout/retries",
            "rollout/dropped_groups", "train/loss", "train/grad_norm", "train/n_samples", "time/step_s"]  # fmt: skip
    create_table_artifact(
        key=f"{run_id}-steps", table=[{k: r.get(k) for k in keys} for r in records], description="Per-step metrics"
    )
    png = plot_curves(records, paths.root / "summary.png")
    create_markdown_artifact(
        key=f"{run_id}-summary", markdown=summary_markdown(run_id, paths.root, records, png), description="Run summary"
    )

"""The train flow — the main job: prepare, then per step rollout -> evaluate -> GRPO update -> weight sync.

Everything a step produced is on disk under runs/<run_id>/ (trials/, details/, checkpoints/, metrics.jsonl, tb/)
before the next step starts.
"""

from __future__ import annotations

import time

from prefect import flow
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from flows.common import flow_run_name, prepare_stage, serving_engine, start_run
from grpoflow.collect import select_step_prompts
from grpoflow.config import RunConfig
from grpoflow.evaluate import select_trainable
from grpoflow.prompts import load_prompts
from grpoflow.reporting import MetricsLog, plot_curves, read_metrics, summary_markdown
from grpoflow.train import load_trainer
from tasks.rollout import run_trials_task
from tasks.train import grpo_step_task, sync_weights_task


@flow(name="train", flow_run_name=flow_run_name("train"), log_prints=True)
def train_flow(config: RunConfig = RunConfig()) -> dict:
    """GRPO training of the policy on agent trials; returns the last step's metrics."""
    cfg = start_run(config, "train")
    run = prepare_stage(cfg, "train")
    model, paths = run.model, run.paths
    create_link_artifact(key=f"{cfg.run_id}-run-dir", link=paths.root.resolve().as_uri(), description="Run dir")
    prompts = load_prompts(paths.prompts)
    trainer = load_trainer(model.path, cfg.train, seed=cfg.seed)
    log = MetricsLog(paths.metrics, paths.tb)
    record: dict = {}
    try:
        with serving_engine(cfg, run) as engine:
            for step in range(cfg.train.steps):
                t0 = time.perf_counter()
                step_prompts = select_step_prompts(prompts, step, cfg.rollout.prompts_per_step)
                rollout = run_trials_task(cfg, step, step_prompts, engine.url, model.path, paths)
                trainable, dropped = select_trainable(rollout.samples, cfg.rollout.on_retries_exhausted)
                t1 = time.perf_counter()
                train_m = grpo_step_task(trainer, trainable, cfg, step)
                version = sync_weights_task(trainer, paths, step, engine.url, cfg)
                record = {
                    **{f"rollout/{k}": v for k, v in rollout.metrics.items()},
                    "rollout/dropped_groups": float(dropped),
                    **{f"train/{k}": v for k, v in train_m.items()},
                    "weight_version": version,
                    "time/rollout_s": t1 - t0,
                    "time/train_s": time.perf_counter() - t1,
                    "time/step_s": time.perf_counter() - t0,
                }
                log.log(step, record)
                print(
                    f"step {step + 1}/{cfg.train.steps}: reward {record['rollout/reward_mean']:.3f} "
                    f"pass@k {record['rollout/pass_at_k']:.2f} truncated {record['rollout/truncated_ratio']:.2f} "
                    f"loss {train_m.get('loss', float('nan')):.4f} ({record['time/step_s']:.0f}s)"
                )
    finally:
        log.close()
    _report(cfg.run_id, paths)
    return record


def _report(run_id: str, paths) -> None:
    records = read_metrics(paths.metrics)
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

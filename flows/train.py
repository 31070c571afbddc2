"""The train flow — the main job: prepare, then per step rollout -> evaluate -> GRPO update -> commit -> weight
sync.

Everything a step produced is on disk under runs/<run_id>/ (trials/, details/, checkpoints/, metrics.jsonl,
timings.jsonl, tb/) before the next step starts. `train_steps` is the loop body shared with the resume flow.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)

from flows.common import (
    flow_run_name,
    prepare_stage,
    run_events,
    serving_engine,
    start_run,
)
from grpoflow.config import RunConfig, TrainConfig
from grpoflow.evaluation import (
    base_pass_rates,
    before_after_lines,
    evaluation_lines,
    reward_gain,
    task_rewards,
)
from grpoflow.prepare.prompts import load_prompts
from grpoflow.prepare.stage import PreparedRun
from grpoflow.rollout.step import select_step_prompts
from grpoflow.run.commit import StepCommits, is_full_checkpoint, step_dir
from grpoflow.run.info import update_run_info
from grpoflow.run.metrics import (
    MetricsLog,
    evaluation_rows,
    has_row,
    plot_curves,
    read_metrics,
    read_step_records,
    summary_markdown,
    training_rows,
)
from grpoflow.run.resume import run_lock
from grpoflow.scoring import FailedSteps, select_trainable
from grpoflow.train.probe import SyncProbe
from grpoflow.train.sync import open_weight_sync, sync_dtype
from grpoflow.train.trainer import TrainerState, load_trainer
from tasks.rollout import evaluate_policy_task, run_trials_task
from tasks.train import grpo_step_task, probe_task, save_step_task, sync_weights_task


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
    when resuming. The policy is evaluated before the steps of `evaluation_versions` and after the last one (its
    own metrics row, `step` = `train.steps`). Returns the last step's record (metrics and timings). The caller
    holds the run's lock."""
    model, paths = run.model, run.paths
    prompts = load_prompts(paths.prompts)
    pool = [p for p in prompts if p.split == "train"]  # what dynamic sampling draws new groups from
    log = MetricsLog(paths.metrics, paths.tb)
    commits = StepCommits(paths, log)
    evals = evaluation_versions(cfg.train)
    failed_steps = FailedSteps(cfg.train.max_failed_steps)
    record: dict = {}
    try:
        limit = cfg.train.max_probe_logprob_gap
        sync_probe = SyncProbe(limit) if limit is not None else None
        with (
            serving_engine(cfg, run) as engine,
            open_weight_sync(cfg, engine.url, trainer, paths.root / "sync") as sync,
        ):
            if weights is not None:  # the trainer holds the resumed checkpoint's weights
                sync_weights_task(sync, trainer, weights, str(start_step), None)
            lora = sync.client.lora_path  # the adapter the engine serves the policy as, when only it is synced
            probe_task(trainer, sync.client, cfg, sync_probe)
            earlier = read_metrics(paths.metrics) if start_step > 0 else []
            base = base_pass_rates(earlier[0]) if earlier else {}
            for step in range(start_step, cfg.train.steps):
                t0 = time.perf_counter()
                record = {}
                if step in evals:
                    record |= _evaluate(cfg, step, prompts, engine.url, model.path, paths, lora)
                    base = base or base_pass_rates(record)
                t_rollout = time.perf_counter()
                step_prompts = select_step_prompts(prompts, step, cfg.rollout.prompts_per_step)
                rollout = run_trials_task(
                    cfg, step, step_prompts, engine.url, model.path, paths, pool=pool, lora_path=lora
                )
                trainable, dropped = select_trainable(rollout.samples, cfg.rollout.on_retries_exhausted)
                failed_steps.record(step, rollout.samples, trainable)
                t1 = time.perf_counter()
                train_m = grpo_step_task(trainer, trainable, cfg, step)
                version = str(step + 1)  # number of GRPO updates in the weights; rollout samples carry it
                record |= {
                    **{f"rollout/{k}": v for k, v in rollout.metrics.items()},
                    "rollout/dropped_groups": float(dropped),
                    **({"rollout/reward_gain": reward_gain(rollout.samples, base)} if base else {}),
                    **{f"rollout/task/{k}": v for k, v in task_rewards(rollout.samples).items()},
                    **{f"train/{k}": v for k, v in train_m.items()},
                    "weight_version": version,
                    "time/eval_s": t_rollout - t0,
                    "time/rollout_s": t1 - t_rollout,
                    "time/train_s": time.perf_counter() - t1,
                    "time/step_s": time.perf_counter() - t0,
                }
                t2 = time.perf_counter()
                commits.flush()  # the previous full checkpoint is durable (it had the whole step to finish)
                full = is_full_checkpoint(step, cfg.train.steps, cfg.train.save_interval)
                last = step == cfg.train.steps - 1
                plan = step_dir(full, last, sync.needs_dir, sync_dtype(cfg.engine))  # None: an in-memory sync's
                ckpt = save_step_task(trainer, paths, step, record, plan) if plan else None
                t3 = time.perf_counter()
                record |= sync_weights_task(sync, trainer, ckpt, version, sync_probe)
                record |= {"time/commit_s": t3 - t2, "time/sync_s": time.perf_counter() - t3}
                commits.finish(trainer, ckpt, step, record, full)
                print(
                    f"step {step + 1}/{cfg.train.steps}: reward {record['rollout/reward_mean']:.3f} "
                    f"pass@k {record['rollout/pass_at_k']:.2f} truncated {record['rollout/truncated_ratio']:.2f} "
                    f"loss {train_m.get('loss', float('nan')):.4f} ({time.perf_counter() - t0:.0f}s)"
                )
            final = cfg.train.steps
            if final in evals and not has_row(paths.metrics, final):
                t0 = time.perf_counter()
                evaluation = _evaluate(cfg, final, prompts, engine.url, model.path, paths, lora)
                row = {"weight_version": str(final), **evaluation}
                commits.flush()  # the last step's row comes first
                log.log(final, row | {"time/eval_s": time.perf_counter() - t0})
            commits.flush()
    except BaseException:
        # However the loop ended, the last full checkpoint is completed and its rows logged; if that fails too,
        # the error that ended the loop is the one raised.
        try:
            commits.flush()
        except Exception as err:  # noqa: BLE001  (reported, then the loop's own error propagates)
            print(f"completing the last full checkpoint failed as well: {type(err).__name__}: {err}")
        raise
    finally:
        log.close()
    report(cfg.run_id, paths)
    return record


def evaluation_versions(train: TrainConfig) -> set[int]:
    """Weight versions (updates so far) the run evaluates: the base policy, every `eval_interval`-th, the last."""
    if train.eval_samples_per_prompt == 0:
        return set()
    every = set(range(0, train.steps, train.eval_interval)) if train.eval_interval else set()
    return {0, train.steps} | every


def _evaluate(
    cfg: RunConfig, version: int, prompts, engine_url: str, tokenizer_path: str, paths, lora: str | None
) -> dict:
    metrics = evaluate_policy_task(cfg, version, prompts, engine_url, tokenizer_path, paths, lora)
    for line in evaluation_lines(metrics, f"after {version} steps" if version else "base policy"):
        print(line)
    return metrics


def report(run_id: str, paths) -> None:
    records = read_step_records(paths.metrics)
    if not records:
        return
    keys = [
        "step",
        "rollout/reward_mean",
        "rollout/reward_gain",
        "rollout/pass_at_k",
        "rollout/truncated_ratio",
        "rollout/retries",
        "rollout/dropped_groups",
        "train/loss",
        "train/grad_norm",
        "train/n_samples",
        "time/step_s",
    ]
    create_table_artifact(
        key=f"{run_id}-steps",
        table=[{k: r.get(k) for k in keys} for r in training_rows(records)],
        description="Per-step metrics",
    )
    evals = evaluation_rows(records)
    verdict = before_after_lines(evals[0], evals[-1]) if len(evals) > 1 else []
    if verdict:
        print(
            "\n".join(
                [
                    "before -> after training (pass@1, 95 % intervals; the same trials, only the weights differ):",
                    *verdict,
                ]
            )
        )
    png = plot_curves(records, paths.root / "summary.png")
    create_markdown_artifact(
        key=f"{run_id}-summary",
        markdown=summary_markdown(run_id, paths.root, records, png, verdict),
        description="Run summary",
    )

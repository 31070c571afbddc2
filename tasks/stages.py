"""The training loop's stages as Prefect tasks (`grpoflow.run.loop.Stages`): each call of the loop is a task run of
its own. The train, resume and evaluate flows hand the loop these."""

from __future__ import annotations

from grpoflow.run.loop import Stages
from tasks.preflight import engine_preflight_task
from tasks.rollout import evaluate_policy_task, run_trials_task
from tasks.train import grpo_step_task, probe_task, save_step_task, sync_weights_task

PREFECT_STAGES = Stages(
    rollout=run_trials_task,
    evaluate=evaluate_policy_task,
    update=grpo_step_task,
    save=save_step_task,
    sync=sync_weights_task,
    probe=probe_task,
    check_engine=engine_preflight_task,
)

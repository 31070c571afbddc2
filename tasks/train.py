"""Prefect tasks of the train stage: the GRPO update, the step's checkpoint, the weight sync and the probes, each
the core function of the same name as a task run of its own.

The trainer state (model, optimizer) lives in the flow's process and is handed to these tasks in memory; results
are not cached or persisted by Prefect — the checkpoint on disk is the durable record.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.run.commit import save_step
from grpoflow.train.ranks import run_update
from grpoflow.train.sync import probe_engines, sync_weights

grpo_step_task = task(name="grpo-step", cache_policy=NO_CACHE, task_run_name="grpo-step-{step}")(run_update)
save_step_task = task(name="save-step", cache_policy=NO_CACHE, task_run_name="save-step-{step}")(save_step)
sync_weights_task = task(name="sync-weights", cache_policy=NO_CACHE, task_run_name="sync-weights-{version}")(
    sync_weights
)
probe_task = task(name="probe-logprobs", cache_policy=NO_CACHE)(probe_engines)

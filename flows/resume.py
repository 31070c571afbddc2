"""The resume flow: pick a killed train run up under its own run_id, from its last complete step.

Finished steps are never redone, and trials of the interrupted step that had finished are reused from its
journal; see `grpoflow.run.resume` for what a complete step is and what is repaired on disk.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from uuid import UUID

import httpx
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run
from pydantic import PositiveInt

from flows.common import RunId, run_events
from flows.report import finish
from grpoflow.errors import one_line
from grpoflow.paths import RunPaths
from grpoflow.run.loop import train_steps
from grpoflow.run.resume import (
    check_resume_budget,
    last_write,
    load_saved_config,
    plan_resume,
    record_resume,
    reopen_trainer,
    run_lock,
)
from tasks.preflight import preflight_task
from tasks.resume import reopen_run_task, resume_point_task
from tasks.stages import PREFECT_STAGES

# Prefect's last word on a flow run that a SIGKILL (an out-of-memory kill, a lost node) ended: it never reported.
_SILENT_END = "its process ended without reporting (killed: SIGKILL, out of memory, a lost node)"


def how_it_ended(flow_run_id: str | None) -> str | None:
    """The last state the Prefect server holds for the flow run ("Crashed: <message>"), in one line; None when
    there is no such flow run on this server (another server's, or a temporary one gone with its process)."""
    if flow_run_id is None:
        return None
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(flow_run_id)).state
    except (ObjectNotFound, ValueError, httpx.HTTPError) as err:
        logging.getLogger(__name__).debug("flow run %s not found: %s", flow_run_id, err)
        return None
    if state is None:
        return None
    if state.type == StateType.RUNNING:
        return f"{state.name}: {_SILENT_END}"
    message = one_line(state.message, 200)
    return f"{state.name}: {message}" if message else state.name


@flow(name="resume", flow_run_name="resume-{run_id}", log_prints=True)
def resume_flow(run_id: RunId, output_dir: str = "runs", max_resumes: PositiveInt | None = None) -> dict:
    """Continue a killed train run from its last complete step; returns the last step's metrics and timings.

    Args:
        run_id: The run to resume: the name of its dir under `output_dir`.
        output_dir: Directory holding the run dirs.
        max_resumes: Refuse (fail) when the run was resumed this many times in the last 24 hours already; empty:
            no bound. The resume deployment's trigger on crashed runs sets it.
    """
    root = Path(output_dir) / run_id
    stopped_at = last_write(root) if root.is_dir() else 0.0  # before this resume writes anything there
    with run_events("resume", run_id, root) as end:
        cfg = load_saved_config(root)
        if cfg.output_dir != output_dir or cfg.run_id != run_id:  # the dir was moved: it is where it is now
            cfg = cfg.model_copy(update={"output_dir": output_dir, "run_id": run_id})
        paths = RunPaths(root)
        with run_lock(root):
            point = resume_point_task(paths, cfg.train.steps)
            end.payload.update(resumed_from_step=point.next_step, repairs=point.repairs)
            plan = plan_resume(cfg, paths, point)
            if plan.action == "complete":
                print(plan.describe(paths))
                return plan.done
            if plan.info.deployment is not None:  # what follows its deployment's runs (nightly-evaluate) follows
                end.from_deployment(plan.info.deployment)
            if plan.action == "report":
                print(plan.describe(paths))
                finish(cfg, paths)
                return plan.done
            if max_resumes is not None:
                check_resume_budget(plan.info, max_resumes, datetime.now(timezone.utc))
            preflight_task(cfg, "resume")
            run = reopen_run_task(cfg)
            trainer = reopen_trainer(cfg, run.model.path, point)
            record_resume(
                paths,
                plan,
                str(flow_run.id) if flow_run.id else None,
                after=how_it_ended(plan.info.last_flow_run_id),
                stopped_at=stopped_at,
            )
            print(plan.describe(paths))
            record = train_steps(cfg, run, trainer, point.next_step, PREFECT_STAGES, weights=point.checkpoint)
            finish(cfg, paths)
            return record

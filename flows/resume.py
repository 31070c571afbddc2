"""The resume flow: pick a killed train run up under its own run_id, from its last complete step.

Finished steps are never redone, and trials of the interrupted step that had finished are reused from its
journal; see `grpoflow.run.resume` for what a complete step is and what is repaired on disk.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows.common import RunId, run_events
from flows.report import finish
from grpoflow.paths import RunPaths
from grpoflow.run.loop import train_steps
from grpoflow.run.resume import load_saved_config, plan_resume, record_resume, reopen_trainer, run_lock
from tasks.preflight import preflight_task
from tasks.resume import reopen_run_task, resume_point_task
from tasks.stages import PREFECT_STAGES


@flow(name="resume", flow_run_name="resume-{run_id}", log_prints=True)
def resume_flow(run_id: RunId, output_dir: str = "runs") -> dict:
    """Continue a killed train run from its last complete step; returns the last step's metrics and timings.

    Args:
        run_id: The run to resume: the name of its dir under `output_dir`.
        output_dir: Directory holding the run dirs.
    """
    root = Path(output_dir) / run_id
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
            preflight_task(cfg, "resume")
            run = reopen_run_task(cfg)
            trainer = reopen_trainer(cfg, run.model.path, point)
            record_resume(paths, plan, str(flow_run.id) if flow_run.id else None)
            print(plan.describe(paths))
            record = train_steps(cfg, run, trainer, point.next_step, PREFECT_STAGES, weights=point.checkpoint)
            finish(cfg, paths)
            return record

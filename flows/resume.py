"""The resume flow: pick a killed train run up under its own run_id, from its last complete step.

Finished steps are never redone, and trials of the interrupted step that had finished are reused from its
journal; see `grpoflow.run.resume` for what a complete step is and what is repaired on disk.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows.common import RunId, run_events
from flows.report import finish
from grpoflow.paths import RunPaths
from grpoflow.rollout.journal import read_journal
from grpoflow.run.info import Resume, read_run_info, update_run_info
from grpoflow.run.loop import evaluation_versions, train_steps
from grpoflow.run.metrics import has_row
from grpoflow.run.resume import (
    load_saved_config,
    run_lock,
)
from grpoflow.train.checkpoint import restore_training_state
from grpoflow.train.trainer import load_trainer
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
            final = cfg.train.steps
            final_eval_done = final not in evaluation_versions(cfg.train) or has_row(paths.metrics, final)
            info = read_run_info(paths)
            done = {**point.record["metrics"], **point.record["timings"]} if point.record else {}
            if point.next_step >= final and final_eval_done and info.ended is not None:
                n = cfg.train.steps
                print(f"run {run_id} is already complete ({n} of {n} steps): nothing to resume")
                return done
            if info.deployment is not None:  # what follows that deployment's runs (nightly-evaluate) follows this one
                end.from_deployment(info.deployment)
            if point.next_step >= final and final_eval_done:  # killed in its report: every step is recorded
                print(f"run {run_id} has all {final} steps but never ended: writing its report")
                finish(cfg, paths)
                return done
            preflight_task(cfg, "resume")
            run = reopen_run_task(cfg)
            trainer = load_trainer(run.model.path, cfg.train, seed=cfg.seed, sharded=cfg.sharding_mode() == "fsdp")
            if point.checkpoint is not None:
                restore_training_state(trainer, point.checkpoint)
            resume = Resume(
                at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                from_step=point.next_step,
                flow_run_id=str(flow_run.id) if flow_run.id else None,
            )
            update_run_info(paths, resumes=[*info.resumes, resume])
            reused = len(read_journal(paths.details(point.next_step)))
            at = f"step {point.next_step + 1}/{final}" if point.next_step < final else "its final evaluation"
            print(
                f"resuming run {run_id} at {at} ("
                + (f"checkpoint {point.checkpoint.name}" if point.checkpoint else "no step had completed")
                + (f"; {reused} finished trials of that step are kept" if reused else "")
                + ")"
            )
            record = train_steps(cfg, run, trainer, point.next_step, PREFECT_STAGES, weights=point.checkpoint)
            finish(cfg, paths)
            return record

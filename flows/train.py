"""The train flow — the main job: prepare, then the training loop (`grpoflow.run.loop`) with each stage a task
run of its own, then the run's report. The loop itself is the core's; this module hands it the tasks and shows
the run in Prefect (artifacts, events)."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_link_artifact

from flows.common import flow_run_name, prepare_stage, run_events, start_run
from flows.report import finish
from grpoflow.config import RunConfig
from grpoflow.run.info import update_run_info
from grpoflow.run.loop import train_steps
from grpoflow.run.resume import run_lock
from grpoflow.train.trainer import load_trainer
from tasks.stages import PREFECT_STAGES


@flow(name="train", flow_run_name=flow_run_name("train"), log_prints=True)
def train_flow(config: RunConfig = RunConfig()) -> dict:
    """GRPO training of the policy on agent trials; returns the last step's metrics and timings."""
    cfg = start_run(config, "train")
    with run_events("train", cfg.run_id, cfg.run_dir):
        run = prepare_stage(cfg, "train")
        update_run_info(run.paths, flow="train")  # resume and rerun take train runs only
        create_link_artifact(key=f"{cfg.run_id}-run-dir", link=run.paths.root.resolve().as_uri(), description="Run dir")
        trainer = load_trainer(run.model.path, cfg.train, seed=cfg.seed, sharded=cfg.sharding_mode() == "fsdp")
        with run_lock(run.paths.root):
            record = train_steps(cfg, run, trainer, 0, PREFECT_STAGES)
            finish(cfg, run.paths)
            return record

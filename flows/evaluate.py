"""The evaluate flow: run the policy on a prompt split, k trials each, no training — the nightly evaluation.

Same artifacts as a training step: per-trial traces under details/, Harbor trial dirs under trials/, one line in
metrics.jsonl, a table of trials and a markdown summary in Prefect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import Field

from flows.common import (
    flow_run_name,
    prepare_stage,
    run_events,
    serving_engine,
    start_run,
)
from grpoflow.cluster import ray_session
from grpoflow.config import DatasetConfig, PromptsConfig, RunConfig, read_config_file
from grpoflow.prepare.prompts import load_prompts
from grpoflow.rollout.workers import rollout_workers
from grpoflow.run.health import write_run_tasks
from grpoflow.run.info import final_checkpoint, update_run_info
from grpoflow.run.metrics import append_step
from tasks.rollout import regrade_trials_task, run_trials_task

Split = Literal["eval", "train", "all"]


@flow(name="evaluate", flow_run_name=flow_run_name("evaluate"), log_prints=True)
def evaluate_flow(
    config: RunConfig = RunConfig(),
    split: Split = Field("eval", description="Which prompts to evaluate: the `eval` split, `train`, or `all`."),
    from_run: str | None = Field(
        None,
        description="A train run whose final checkpoint to evaluate: its run_id in config.output_dir, or its run "
        "dir (it becomes the model; run.json records the run as the parent). Empty: config.model.",
    ),
) -> dict[str, float]:
    """Prepare, start the engine, run `rollout.n_samples_per_prompt` trials per prompt of `split`, score them."""
    if from_run:
        config = of_train_run(config, Path(from_run) if "/" in from_run else Path(config.output_dir) / from_run)
    cfg = start_run(config, "evaluate")
    with run_events("evaluate", cfg.run_id, cfg.run_dir):  # grpoflow.run.completed / failed when it ends
        return _evaluate(cfg, split)


def of_train_run(config: RunConfig, run_dir: Path) -> RunConfig:
    """`config` on a finished train run's final checkpoint, with that run's seed, dataset and prompt settings:
    its eval split is then the one the run held out (another seed or filter would split the tasks otherwise, and
    the evaluation would count tasks the run trained on)."""
    ckpt = final_checkpoint(run_dir)
    parent = read_config_file(run_dir / "config.json")
    return config.model_copy(
        update={
            "model": config.model.model_copy(update={"source": str(ckpt)}),
            "seed": parent.get("seed", config.seed),
            "dataset": DatasetConfig.model_validate(parent.get("dataset", {})),
            "prompts": PromptsConfig.model_validate(parent.get("prompts", {})),
        }
    )


def _evaluate(cfg: RunConfig, split: str) -> dict[str, float]:
    run = prepare_stage(cfg, "evaluate")
    update_run_info(run.paths, flow="evaluate")  # not a train run: resume and rerun refuse it
    prompts = [p for p in load_prompts(run.paths.prompts) if split == "all" or p.split == split]
    if not prompts:
        raise ValueError(f"split `{split}` has no prompts in {run.paths.prompts}")
    with (
        ray_session(cfg.cluster),
        serving_engine(cfg, run) as engine,
        rollout_workers(cfg.cluster, cfg.rollout.concurrency) as workers,
    ):
        result = run_trials_task(cfg, 0, prompts, engine.url, run.model.path, run.paths, workers=workers)
    metrics = {"step": 0, **result.metrics}
    append_step(run.paths.metrics, 0, result.metrics)  # wall-clock keys go to timings.jsonl
    if cfg.report.regrade_per_task:
        regrade_trials_task(cfg, run.paths)
    write_run_tasks(run.paths.root)  # what `grpoflow tasks` reads of this run
    create_markdown_artifact(
        key=f"{cfg.run_id}-evaluation",
        markdown=evaluation_summary(cfg, split, len(prompts), metrics),
        description=f"Evaluation {cfg.run_id}",
    )
    print(f"evaluated {len(prompts)} prompts x {cfg.rollout.n_samples_per_prompt}: reward {metrics['reward_mean']:.3f}")
    return metrics


def evaluation_summary(cfg: RunConfig, split: str, n_prompts: int, m: dict[str, float]) -> str:
    rows = "\n".join(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in m.items())
    return (
        f"# Evaluation `{cfg.run_id}`\n\nModel `{cfg.model.source}`, split `{split}`: {n_prompts} prompts x "
        f"{cfg.rollout.n_samples_per_prompt} trials, harness `{cfg.rollout.harness}`.\n\n"
        f"| metric | value |\n|---|---|\n{rows}\n"
    )

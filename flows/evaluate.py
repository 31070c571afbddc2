"""The evaluate flow — the nightly evaluation: the train run's own evaluation trials (`evaluate_policy`: the same
seeds, `train.eval.samples_per_prompt` trials per prompt, the same `eval/<split>/...` metrics) on a model, no
training. Of a train run's final checkpoint (`from_run`) it runs that run's trials and pairs each with the run's
evaluation of its base policy, so the nightly result says what the night's training changed.

Same artifacts as a training step: per-trial traces under details/, Harbor trial dirs under trials/, one line in
metrics.jsonl, a table of trials and a markdown summary in Prefect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import Field

from flows.common import flow_run_name, prepare_stage, run_events, start_run
from grpoflow.config import RunConfig, read_config_file
from grpoflow.paths import RunPaths, step_of
from grpoflow.prepare.prompts import load_prompts
from grpoflow.run.health import write_run_tasks
from grpoflow.run.info import final_checkpoint, update_run_info
from grpoflow.run.loop import evaluate_run
from grpoflow.scoring.evaluation import evaluation_lines
from tasks.rollout import regrade_trials_task
from tasks.stages import PREFECT_STAGES

Split = Literal["eval", "train", "all"]
# the train run's settings that decide which trials its evaluations ran
TRIAL_SETTINGS = ("seed", "dataset", "prompts", "rollout")


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
    """Prepare, start the engine, run the evaluation trials of `split`, score them against the base policy's."""
    parent = None
    if from_run:
        parent = Path(from_run) if "/" in from_run else Path(config.output_dir) / from_run
        config = of_train_run(config, parent)
    cfg = start_run(config, "evaluate")
    with run_events("evaluate", cfg.run_id, cfg.run_dir):  # grpoflow.run.completed / failed when it ends
        return _evaluate(cfg, split, parent)


def of_train_run(config: RunConfig, run_dir: Path) -> RunConfig:
    """`config` on a finished train run's final checkpoint, with the settings that made that run's evaluation
    trials (seed, dataset, prompt filters, rollout, evaluation trials per prompt): its eval split is then the one
    the run held out, and each trial is one the run ran on its base policy."""
    ckpt = final_checkpoint(run_dir)
    saved = read_config_file(RunPaths(run_dir).config, saved=True)  # the split the run made, whenever it ran
    update = {k: saved[k] for k in TRIAL_SETTINGS if k in saved}
    data = config.model_dump(mode="json") | update
    data["model"] = {**data["model"], "source": str(ckpt)}
    n = (saved.get("train", {}).get("eval") or {}).get("samples_per_prompt")
    if n:
        data["train"] = {**data["train"], "eval": {**data["train"]["eval"], "samples_per_prompt": n}}
    return RunConfig.model_validate(data)


def _evaluate(cfg: RunConfig, split: str, parent: Path | None) -> dict[str, float]:
    run = prepare_stage(cfg, "evaluate")
    update_run_info(run.paths, flow="evaluate")  # not a train run: resume and rerun refuse it
    prompts = [p for p in load_prompts(run.paths.prompts) if split == "all" or p.split == split]
    if not prompts:
        raise ValueError(f"split `{split}` has no prompts in {run.paths.prompts}")
    version, base = 0, None
    if parent is not None:  # the weights after the parent's last update, against its base policy's trials
        version = step_of(final_checkpoint(parent)) + 1
        base = RunPaths(parent).eval_details(0)
    metrics = evaluate_run(cfg, run, prompts, version, base, PREFECT_STAGES)
    if cfg.report.regrade_per_task:
        regrade_trials_task(cfg, run.paths)
    write_run_tasks(run.paths.root)  # what `grpoflow tasks` reads of this run
    lines = evaluation_lines(metrics, f"after {version} steps" if version else "the policy")
    create_markdown_artifact(
        key=f"{cfg.run_id}-evaluation",
        markdown=evaluation_summary(cfg, split, len(prompts), lines),
        description=f"Evaluation {cfg.run_id}",
    )
    for line in lines:
        print(line)
    return metrics


def evaluation_summary(cfg: RunConfig, split: str, n_prompts: int, lines: list[str]) -> str:
    body = "\n".join(f"- {line}" for line in lines)
    return (
        f"# Evaluation `{cfg.run_id}`\n\nModel `{cfg.model.source}`, split `{split}`: {n_prompts} prompts x "
        f"{cfg.train.eval.samples_per_prompt} trials, harness `{cfg.rollout.harness.name}`.\n\n{body}\n"
    )

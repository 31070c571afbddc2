"""The prepare flow: model, dataset and prompts for a run, recorded under runs/<run_id>/."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from flows.common import flow_run_name, start_run
from grpoflow.config import RunConfig
from grpoflow.prepare import PreparedRun
from tasks.preflight import preflight_task
from tasks.prepare import prepare_dataset_task, prepare_model_task, prepare_prompts_task


@flow(name="prepare", flow_run_name=flow_run_name("prepare"), log_prints=True)
def prepare_flow(config: RunConfig = RunConfig()) -> PreparedRun:
    """Resolve the model (converting the built-in GGUF once), validate the task set, write prompts.jsonl."""
    cfg = start_run(config, "prepare")
    preflight_task(cfg, "prepare")
    model = prepare_model_task(cfg.model.source)
    dataset = prepare_dataset_task(cfg.dataset.path)
    run = prepare_prompts_task(cfg, model, dataset, flow_run_id=str(flow_run.id) if flow_run.id else None)
    create_markdown_artifact(
        key=f"prepare-{cfg.run_id}", markdown=prepare_summary(run), description=f"Prepared run {cfg.run_id}"
    )
    print(f"prepared run {cfg.run_id}: {run.paths.root}")
    return run


def prepare_summary(run: PreparedRun) -> str:
    m = run.model
    splits = ", ".join(f"{k}: {v}" for k, v in sorted(run.n_prompts.items()))
    return "\n".join([
        f"# Prepared run `{run.paths.root.name}`",
        "",
        "| what | value |",
        "|---|---|",
        f"| run dir | `{run.paths.root.resolve()}` |",
        f"| model | `{m.source}` ({m.architecture}, vocab {m.vocab_size}) |",
        f"| model dir | `{m.path}` |",
        f"| weights sha256 | `{m.weights_sha256}` |",
        f"| GGUF sha256 | `{m.gguf_sha256 or '-'}` |",
        f"| converted now | {'yes' if m.converted else 'no (cache hit or HF dir)'} |",
        f"| tasks | {run.n_tasks} |",
        f"| dataset sha256 | `{run.dataset_sha256}` |",
        f"| prompts | {splits} |",
    ])

"""The prepare flow: model, dataset and prompts for a run, recorded under runs/<run_id>/."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.common import flow_run_name, prepare_stage, run_events, start_run
from grpoflow.config import RunConfig
from grpoflow.run.start import PreparedRun


@flow(name="prepare", flow_run_name=flow_run_name("prepare"), log_prints=True)
def prepare_flow(config: RunConfig = RunConfig()) -> PreparedRun:
    """Resolve the model (converting the built-in GGUF once), validate the task set, write prompts.jsonl."""
    cfg = start_run(config, "prepare")
    with run_events("prepare", cfg.run_id, cfg.run_dir):  # grpoflow.run.completed / failed when it ends
        run = prepare_stage(cfg, "prepare")
    print(f"prepared run {cfg.run_id}: {run.paths.root}")
    create_markdown_artifact(
        key=f"prepare-{cfg.run_id}", markdown=prepare_summary(run), description=f"Prepared run {cfg.run_id}"
    )
    return run


def prepare_summary(run: PreparedRun) -> str:
    m = run.model
    splits = ", ".join(f"{k}: {v}" for k, v in sorted(run.n_prompts.items()))
    return "\n".join(
        [
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
            f"| tasks | {run.n_tasks}"
            + (f" ({run.n_left_out} task dirs left out: see `gate.json`)" if run.n_left_out else "")
            + " |",
            f"| dataset sha256 | `{run.dataset_sha256}` |",
            f"| prompts | {splits} |",
        ]
    )

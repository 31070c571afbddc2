"""The end of a train run, as the train and resume flows write it: the report (the ledger, the per-step table, the
before/after verdict, task health, the trial viewer, the summary plot) as Prefect artifacts, then `ended`."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from grpoflow.config import RunConfig
from grpoflow.ledger import ledger_table, run_ledger
from grpoflow.paths import RunPaths
from grpoflow.run.health import health_markdown, task_health, write_run_tasks
from grpoflow.run.info import RunInfo, read_run_info, update_run_info
from grpoflow.run.metrics import evaluation_rows, plot_curves, read_step_records, summary_markdown, training_rows
from grpoflow.run.regrade import run_grader_noise
from grpoflow.run.survived import survived, survived_markdown
from grpoflow.run.viewer import write_viewer
from grpoflow.scoring.evaluation import before_after_lines
from tasks.rollout import regrade_trials_task


def finish(cfg: RunConfig, paths: RunPaths) -> None:
    """The end of a train run once its steps and evaluations are recorded: its report, then `ended` in run.json."""
    records, info = read_step_records(paths.metrics), read_run_info(paths)
    report(cfg, paths, records, info)
    update_run_info(
        paths, ended=datetime.now(timezone.utc).isoformat(timespec="seconds"), survived=survived(info, records)
    )


def report(cfg: RunConfig, paths: RunPaths, records: list[dict], info: RunInfo) -> None:
    run_id = cfg.run_id
    if not records:
        return
    ledger = run_ledger(training_rows(records), cfg.report.cost_per_gpu_hour, cfg.report.cost_per_sandbox_hour)
    create_table_artifact(
        key=f"{run_id}-ledger",
        table=ledger_table(ledger),
        description="Where the run's generated tokens went, and what its parts took",
    )
    keys = [
        "step",
        "rollout/reward_mean",
        "rollout/reward_gain",
        "rollout/pass_at_k",
        "rollout/truncated_ratio",
        "rollout/retries",
        "rollout/dropped_groups",
        "train/loss",
        "train/grad_norm",
        "train/n_samples",
        "time/step_s",
    ]
    create_table_artifact(
        key=f"{run_id}-steps",
        table=[{k: r.get(k) for k in keys} for r in training_rows(records)],
        description="Per-step metrics",
    )
    evals = evaluation_rows(records)
    noise = None
    if cfg.report.regrade_per_task:  # first: the verdict weighs each row's change against its grader noise
        noise = run_grader_noise(paths.root, regrade_trials_task(cfg, paths))
    verdict = before_after_lines(evals[0], evals[-1], noise) if len(evals) > 1 else []
    if verdict:
        print(
            "\n".join(
                [
                    "before -> after training (pass@1, 95 % intervals; the same trials, only the weights differ):",
                    *verdict,
                ]
            )
        )
    write_run_tasks(paths.root)
    unreadable: list[str] = []
    create_markdown_artifact(
        key=f"{run_id}-tasks",
        markdown=health_markdown(*task_health(Path(cfg.output_dir), unreadable), unreadable),
        description=f"Task health across the runs in {cfg.output_dir}",
    )
    viewer = write_viewer(paths, run_id)
    create_link_artifact(
        key=f"{run_id}-viewer", link=viewer.resolve().as_uri(), description="Best and worst trial of every group"
    )
    png = plot_curves(records, paths.summary_plot)
    create_markdown_artifact(
        key=f"{run_id}-summary",
        markdown=summary_markdown(
            run_id,
            paths.root,
            records,
            png,
            verdict,
            ledger_table(ledger),
            survived_markdown(info, records),
        ),
        description="Run summary",
    )

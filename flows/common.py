"""What every flow does first: validate its config again (the UI skips validators), fix the run_id, and name
the flow run after it."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

# Harbor sets its logger to DEBUG and logs every trial's internals; a run's console shows our per-step lines and
# Harbor's warnings (the full detail stays in each trial's trial.log).
import harbor.utils.logger  # noqa: E402
import transformers.utils.logging  # noqa: E402
from prefect.client.orchestration import get_client
from prefect.context import refresh_global_settings_context
from prefect.events import emit_event
from prefect.runtime import deployment, flow_run
from prefect.settings import get_current_settings
from pydantic import Field

from grpoflow.config import RunConfig, parse_run_config
from grpoflow.errors import GrpoflowError, one_line
from grpoflow.paths import RUN_ID_PATTERN, RunPaths
from grpoflow.prepare.clis import CLI_PACKAGES
from grpoflow.run.info import DeploymentRef
from grpoflow.run.metrics import evaluation_rows, read_metrics, training_rows
from grpoflow.run.start import PreparedRun
from tasks.preflight import preflight_task
from tasks.prepare import prepare_dataset_task, prepare_harness_task, prepare_model_task, prepare_prompts_task

harbor.utils.logger.logger.setLevel(logging.WARNING)
transformers.utils.logging.disable_progress_bar()  # per-load tqdm bars drown the per-step progress lines


# A run dir's name: checked before the flow starts (the UI form refuses others), never a path.
RunId = Annotated[str, Field(pattern=RUN_ID_PATTERN)]


# With no Prefect server configured, the first flow run starts a temporary one. Its first start in a fresh
# PREFECT_HOME creates and migrates the SQLite database, which can outlast Prefect's default wait of 20 s on a
# loaded 2-core machine: the very first run of a newcomer would die before its first task.
EPHEMERAL_STARTUP_TIMEOUT_S = 180


def fit_first_server_start() -> None:
    """Wait up to `EPHEMERAL_STARTUP_TIMEOUT_S` for the temporary server, unless the user set the wait anywhere
    Prefect reads settings from (environment, .env, prefect.toml, profile): their value wins."""
    if "startup_timeout_seconds" in get_current_settings().server.ephemeral.model_fields_set:
        return
    os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = str(EPHEMERAL_STARTUP_TIMEOUT_S)
    refresh_global_settings_context()  # Prefect read the environment when it was imported


fit_first_server_start()


class _OneLineForOurErrors(logging.Filter):
    """A GrpoflowError is bad input or an unreachable service, with a one-line message that names the culprit:
    Prefect still logs it (and marks the run Failed), but without a traceback through Prefect's engine."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], GrpoflowError):
            record.exc_info, record.exc_text = None, None
        return True


for _name in ("prefect.task_runs", "prefect.flow_runs"):
    logging.getLogger(_name).addFilter(_OneLineForOurErrors())


def flow_run_name(prefix: str):
    """A `flow_run_name` callable: `<prefix>-<run_id>`, or `<prefix>-pending` until the flow assigns one."""

    def name() -> str:
        cfg = flow_run.parameters.get("config")
        run_id = cfg.get("run_id") if isinstance(cfg, dict) else getattr(cfg, "run_id", None)
        return f"{prefix}-{run_id or 'pending'}"

    return name


def start_run(config: RunConfig | dict, prefix: str) -> RunConfig:
    cfg = parse_run_config(config, source="flow parameter `config`")
    given = config.get("run_id") if isinstance(config, dict) else config.run_id
    if not given and flow_run.id:  # generated here: rename the flow run so the UI shows the run_id
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=f"{prefix}-{cfg.run_id}")
    return cfg


def prepare_stage(cfg: RunConfig, stage: str) -> PreparedRun:
    """The first tasks of every flow: preflight, then the harness's CLI (claude-code, opencode in the local
    sandbox), dataset (and its gate), model and prompts, recorded in the run dir."""
    preflight_task(cfg, stage)
    if cfg.rollout.sandbox.local and cfg.rollout.harness.name in CLI_PACKAGES:
        prepare_harness_task(cfg.rollout.harness.name)
    dataset, gate = prepare_dataset_task(cfg)  # first: a bad task set needs no model
    model = prepare_model_task(cfg.model.source)
    return prepare_prompts_task(
        cfg,
        model,
        dataset,
        flow_run_id=str(flow_run.id) if flow_run.id else None,
        deployment=this_deployment(),
        gate=gate,
    )


def this_deployment() -> DeploymentRef | None:
    """The deployment this flow run was started from; None for a flow called directly (the CLI, tests)."""
    if not deployment.id:
        return None
    return DeploymentRef(id=str(deployment.id), name=deployment.name or "")


RUN_COMPLETED, RUN_FAILED = "grpoflow.run.completed", "grpoflow.run.failed"


def run_summary(flow: str, run_id: str, run_dir: Path, **extra: Any) -> dict[str, Any]:
    """What a flow's end event carries: run_id, flow, steps recorded, the last step's metrics, the final
    evaluation (train runs that evaluate), the run dir."""
    metrics = RunPaths(Path(run_dir)).metrics
    try:
        records = read_metrics(metrics)
    except ValueError:  # a corrupt log must not hide the event that reports the run's end
        records = []
    train = training_rows(records)
    final = _finite((train or records or [{}])[-1])  # the evaluate flow's one row has no rollout/ prefix
    summary = {
        "run_id": run_id,
        "flow": flow,
        "steps": len(train or records),
        "final_metrics": final,
        "run_dir": str(Path(run_dir).resolve()),
    }
    evals = evaluation_rows(records)
    if train and evals and evals[-1]["step"] == len(train):  # the train flow's evaluation after the last step
        summary["final_evaluation"] = _finite(evals[-1])
    return summary | extra


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()}


def emit_run_event(
    ok: bool, summary: dict[str, Any], error: BaseException | None = None, related: list[dict[str, str]] | None = None
) -> None:
    """`grpoflow.run.completed` / `grpoflow.run.failed` about resource `grpoflow.run.<run_id>`, related to the
    flow run (and to what Prefect adds of its context: flow, deployment, tags) and to `related`; automations match
    on the event name and the resource id or the `grpoflow.flow` label."""
    payload = dict(summary)
    if error is not None:
        payload["error"] = one_line(error, 500)
    related = list(related or [])
    if flow_run.id:
        related.append(
            {
                "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                "prefect.resource.role": "flow-run",
                "prefect.resource.name": flow_run.name or "",
            }
        )
    emit_event(
        event=RUN_COMPLETED if ok else RUN_FAILED,
        resource={
            "prefect.resource.id": f"grpoflow.run.{summary['run_id']}",
            "prefect.resource.name": summary["run_id"],
            "grpoflow.flow": summary["flow"],
        },
        related=related,
        payload=json.loads(json.dumps(payload, default=str)),
    )


@dataclass
class RunEnd:
    """What the block of `run_events` adds to the end event: payload items, related resources."""

    payload: dict[str, Any] = field(default_factory=dict)
    related: list[dict[str, str]] = field(default_factory=list)

    def from_deployment(self, ref: DeploymentRef) -> None:
        """Announce the run's end as from `ref` too (a resumed run: the deployment that started it)."""
        self.related.append(
            {"prefect.resource.id": f"prefect.deployment.{ref.id}", "prefect.resource.role": "deployment"}
            | {"prefect.resource.name": ref.name}
        )


@contextmanager
def run_events(flow: str, run_id: str, run_dir: Path) -> Iterator[RunEnd]:
    """Emit the flow's end event when the block ends, however it ends, with what the block put in the yielded
    `RunEnd`."""
    end = RunEnd()
    try:
        yield end
    except BaseException as err:
        emit_run_event(False, run_summary(flow, run_id, run_dir, **end.payload), err, end.related)
        raise
    emit_run_event(True, run_summary(flow, run_id, run_dir, **end.payload), related=end.related)

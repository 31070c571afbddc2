"""What every flow does first: validate its config again (the UI skips validators), fix the run_id, and name
the flow run after it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from grpoflow.config import RunConfig, parse_run_config
from grpoflow.errors import GrpoflowError
from grpoflow.prepare import PreparedRun
from grpoflow.serving import EngineHandle, open_engine
from tasks.preflight import engine_preflight_task, preflight_task
from tasks.prepare import prepare_dataset_task, prepare_model_task, prepare_prompts_task

# Harbor sets its logger to DEBUG and logs every trial's internals; a run's console shows our per-step lines and
# Harbor's warnings (the full detail stays in each trial's trial.log).
import harbor.utils.logger  # noqa: E402
import transformers.utils.logging  # noqa: E402

harbor.utils.logger.logger.setLevel(logging.WARNING)
transformers.utils.logging.disable_progress_bar()  # per-load tqdm bars drown the per-step progress lines


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
    """The first tasks of every flow: preflight, then model, dataset and prompts, recorded in the run dir."""
    preflight_task(cfg, stage)
    model = prepare_model_task(cfg.model.source)
    dataset = prepare_dataset_task(cfg.dataset.path)
    return prepare_prompts_task(cfg, model, dataset, flow_run_id=str(flow_run.id) if flow_run.id else None)


@contextmanager
def serving_engine(cfg: RunConfig, run: PreparedRun) -> Iterator[EngineHandle]:
    """The run's engine for the duration of the block. One the run starts itself is checked once it is up
    (an attached one was checked by preflight already)."""
    with open_engine(cfg.engine, run.model.path, cfg.seed, run.paths.root / "engine.log") as engine:
        if cfg.engine.backend != "sglang":
            engine_preflight_task(engine.url, run.model.path)
        yield engine

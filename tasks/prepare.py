"""Prefect tasks of the prepare stage: thin wrappers over grpoflow.prepare.model / dataset / prompts / prepare.

Caching is our own, on purpose: the model conversion is cached on disk by the GGUF's sha256 (so a rerun with
the same inputs never converts again, in or out of Prefect), the dataset gate's verdicts by each task's content
and the sandbox kind, and loading a dataset is cheap enough to redo.
Prefect result caching is off: its result files are not our output format.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.config import RunConfig
from grpoflow.prepare.clis import ensure_cli
from grpoflow.prepare.dataset import Dataset
from grpoflow.prepare.model import PreparedModel, prepare_model
from grpoflow.run.info import DeploymentRef
from grpoflow.run.start import PreparedRun, gate_dataset, make_prompts, record_run
from grpoflow.scoring.gate import GateReport


@task(name="prepare-model", cache_policy=NO_CACHE)
def prepare_model_task(source: str) -> PreparedModel:
    return prepare_model(source)


@task(name="prepare-dataset", cache_policy=NO_CACHE)
def prepare_dataset_task(cfg: RunConfig) -> tuple[Dataset, GateReport]:
    """The dataset's admitted tasks, after the dataset gate (`dataset.validate`), and every task dir's verdict."""
    return gate_dataset(cfg)


@task(name="prepare-harness", cache_policy=NO_CACHE)
def prepare_harness_task(harness: str) -> str:
    """The harness's pinned CLI in the cache, installed with npm the first time (local sandbox only)."""
    return str(ensure_cli(harness))


@task(name="prepare-prompts", cache_policy=NO_CACHE)
def prepare_prompts_task(
    cfg: RunConfig,
    model: PreparedModel,
    dataset: Dataset,
    flow_run_id: str | None = None,
    deployment: DeploymentRef | None = None,
    gate: GateReport | None = None,
) -> PreparedRun:
    return record_run(
        cfg, model, dataset, make_prompts(cfg, dataset), flow_run_id=flow_run_id, deployment=deployment, gate=gate
    )

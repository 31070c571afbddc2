"""What a rerun compares with: the recorded run's provenance as it would be now."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.config import RunConfig
from grpoflow.prepare.model import prepare_model
from grpoflow.run.info import Provenance
from grpoflow.run.start import load_run_dataset


@task(name="provenance-now", cache_policy=NO_CACHE)
def provenance_now_task(cfg: RunConfig) -> Provenance:
    """run.json's provenance as it would be now (model and dataset resolved again)."""
    return Provenance.now(prepare_model(cfg.model.source), load_run_dataset(cfg))

"""Prefect tasks of preflight: each flow's first task, failing the run in seconds with every problem listed.

The checks are `grpoflow.preflight`'s pure functions; this module only raises. No caching: the world they look at
(a server, a key file, an API) changes between runs.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.config import RunConfig
from grpoflow.preflight import (
    PreflightError,
    Stage,
    check_run,
    engine_preflight,
    format_problems,
)


@task(name="preflight", cache_policy=NO_CACHE, task_run_name="preflight-{stage}")
def preflight_task(cfg: RunConfig, stage: Stage) -> None:
    """What `stage` needs before it starts: run dir, harbor, sandbox (tools or key + API), an attached engine."""
    problems = check_run(cfg, stage)
    if problems:
        raise PreflightError(format_problems(problems))


engine_preflight_task = task(name="preflight-engine", cache_policy=NO_CACHE)(engine_preflight)

"""The resume flow's own steps as tasks: where the killed run picks up, and the run reopened."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.config import RunConfig
from grpoflow.paths import RunPaths
from grpoflow.run.resume import ResumePoint, find_resume_point, repair_run_dir
from grpoflow.run.start import PreparedRun, reopen_run


@task(name="resume-point", cache_policy=NO_CACHE)
def resume_point_task(paths: RunPaths, steps: int) -> ResumePoint:
    """The last full checkpoint, with the run dir repaired to agree with it."""
    point = find_resume_point(paths)
    repair_run_dir(paths, point, steps)
    for note in point.repairs:
        print(f"repaired: {note}")
    return point


@task(name="reopen-run", cache_policy=NO_CACHE)
def reopen_run_task(cfg: RunConfig) -> PreparedRun:
    return reopen_run(cfg)

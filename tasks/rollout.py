"""Prefect tasks of the rollout + evaluate stage: one task per step's batch of trials (trials run inside it with
asyncio, bounded), not one task per trial — Prefect costs tens of ms per task run and struggles with thousands.
Retries of sandbox failures happen per trial inside; they show up here as warnings in the task's log, a count in
the metrics, and rows in the step's trial table. Sandbox starts take a slot of the Prefect global concurrency
limit `rollout.sandbox.create_limit` when the server has one."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
from prefect import get_run_logger, task
from prefect.artifacts import (
    acreate_progress_artifact,
    acreate_table_artifact,
    aupdate_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.concurrency.asyncio import concurrency
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

from grpoflow.config import RunConfig
from grpoflow.credentials import export_sandbox_key
from grpoflow.errors import one_line
from grpoflow.paths import RunPaths
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.step import RolloutHooks, RolloutSetup, StepRollout, run_step_trials
from grpoflow.rollout.trials import (
    Attempt,
    SandboxGate,
    TrialOutcome,
    TrialSpec,
)
from grpoflow.run.regrade import Regrade, regrade_run, regrade_summary
from grpoflow.scoring.evaluation import evaluate_policy


@task(name="run-trials", cache_policy=NO_CACHE, task_run_name="run-trials-step-{step}")
def run_trials_task(
    cfg: RunConfig,
    step: int,
    prompts: list[PromptRecord],
    setup: RolloutSetup,
    paths: RunPaths,
    pool: list[PromptRecord] | None = None,
) -> StepRollout:
    """Run and score one step's trials (`run_step_trials`), shown as progress, retries and a trial table."""
    return run_step_trials(cfg, step, prompts, setup, paths, pool or (), PrefectHooks(cfg))


@task(name="evaluate-policy", cache_policy=NO_CACHE, task_run_name="evaluate-policy-{version}")
def evaluate_policy_task(
    cfg: RunConfig,
    version: int,
    prompts: list[PromptRecord],
    setup: RolloutSetup,
    paths: RunPaths,
    base: Path | None = None,
) -> dict[str, float]:
    """Evaluate the engine's weights (`evaluate_policy`), shown as the rollout task's are."""
    return evaluate_policy(cfg, version, prompts, setup, paths, base, PrefectHooks(cfg))


class PrefectHooks(RolloutHooks):
    """What Prefect shows of a step's trials: a progress bar, sandbox retries in the log, a table of the trials,
    and sandbox starts gated by the global concurrency limit `rollout.sandbox.create_limit`."""

    def __init__(self, cfg: RunConfig):
        self.cfg, self.logger = cfg, get_run_logger()
        self.progress, self.total, self.done = None, 0, 0

    async def started(self, label: str, total: int, done: int) -> None:
        self.total, self.done = total, done  # dynamic sampling may add trials: the bar then tops out at 100 %
        self.progress = await _best_effort(
            self.logger,
            acreate_progress_artifact,
            progress=0.0,
            key=f"{self.cfg.run_id}-rollout",
            description=f"Trials finished in {label} (of {total})",
        )

    async def trial_done(self, outcome: TrialOutcome) -> None:
        self.done += 1
        if self.progress is not None:
            pct = min(100.0, 100.0 * self.done / self.total)
            await _best_effort(self.logger, aupdate_progress_artifact, self.progress, pct)

    def retrying(self, spec: TrialSpec, attempt: Attempt) -> None:
        what = "rollout worker lost" if attempt.exception_type == "WorkerLost" else "sandbox failure"
        self.logger.warning(
            "%s in %s (%s: %s): running it again in a fresh sandbox",
            what,
            spec.rollout_id,
            attempt.exception_type,
            one_line(attempt.exception_message, 200),
        )

    async def sandbox_gate(self) -> SandboxGate | None:
        return await sandbox_create_gate(self.cfg.rollout.sandbox.create_limit, self.logger)

    async def finished(self, label: str, result: StepRollout) -> None:
        await _best_effort(
            self.logger,
            acreate_table_artifact,
            key=f"{self.cfg.run_id}-{label}-trials",
            table=[
                {
                    "instance": s.instance_id,
                    "sample": s.sample_index,
                    "reward": s.reward,
                    "exit_status": s.exit_status,
                    "status": s.status,
                    "turns": s.metrics.get("turns"),
                    "retries": s.metrics.get("retries"),
                    "segments": s.metrics.get("segments", 1.0),
                    "reason": s.exit_reason or "",
                }
                for s in result.samples
                if s.segment_index == 0  # one row per trial
            ],
            description=f"Trials of {label}: reward, exit status, retries",
        )
        m = result.figures.computed
        self.logger.info(
            "%s: %d trials, reward %.3f, pass@k %.2f, truncated %.2f, retries %d, %.1fs",
            label,
            m["trials"],
            m["reward_mean"],
            m["pass_at_k"],
            m["truncated_ratio"],
            m["retries"],
            result.figures.seconds["wall_time_s"],
        )


@task(name="regrade-trials", cache_policy=NO_CACHE)
def regrade_trials_task(cfg: RunConfig, paths: RunPaths) -> list[Regrade]:
    """Harbor's regrade of up to `report.regrade_per_task` of each task's stored trials, on the run's sandbox
    provider: the verdicts go to the run's regrades.jsonl, where task health reads them."""
    logger = get_run_logger()
    export_sandbox_key(cfg.rollout.sandbox.backend, cfg.rollout.sandbox.key_file())
    regrades = regrade_run(paths.root, cfg, cfg.report.regrade_per_task)
    head, *rows = regrade_summary(regrades)
    logger.info(head)
    for line in rows:
        logger.warning("%s", line)
    return regrades


_REPORTED_MISSING_LIMITS: set[str] = set()


async def sandbox_create_gate(
    limit_name: str | None, logger: logging.Logger | logging.LoggerAdapter
) -> SandboxGate | None:
    """A gate taking one slot of the global concurrency limit `limit_name` per sandbox start, or None when the
    name is empty or the server has no such limit (then `rollout.concurrency` alone bounds sandbox starts)."""
    if not limit_name:
        return None
    async with get_client() as client:
        try:
            await client.read_global_concurrency_limit_by_name(limit_name)
        except ObjectNotFound:
            if limit_name in _REPORTED_MISSING_LIMITS:  # said once per process, not once per step
                return None
            _REPORTED_MISSING_LIMITS.add(limit_name)
            logger.info(
                "no global concurrency limit `%s` on the Prefect server: sandbox starts are bounded by "
                "rollout.concurrency only (create one: prefect gcl create %s --limit 8)",
                limit_name,
                limit_name,
            )
            return None
        except httpx.HTTPError as err:
            # The Prefect server is down (a restart): it could not enforce the limit either. Go on, bounded by
            # rollout.concurrency, rather than fail the step over a throttle.
            logger.warning(
                "Prefect API unreachable (%s): sandbox starts this step are bounded by rollout.concurrency only", err
            )
            return None
    # strict=False: if the limit is deleted mid-run, starts go on ungated instead of failing every trial.
    return lambda: concurrency(limit_name, occupy=1, strict=False)


async def _best_effort(logger, create, *args, **kwargs):
    """Progress bars and tables are for people watching; trials must not die with them. These calls come from a
    fresh event loop whose Prefect client has never connected, and such a client does not retry a refused
    connection, so a Prefect server restarting mid-step would otherwise fail the whole step."""
    try:
        return await create(*args, **kwargs)
    except (httpx.HTTPError, PrefectHTTPStatusError) as err:
        logger.warning("Prefect API unreachable, artifact not recorded (%s: %s)", type(err).__name__, err)
        return None

"""Prefect task of the rollout + evaluate stage: one task per step's batch of trials (trials run inside it with
asyncio, bounded), not one task per trial — Prefect costs tens of ms per task run and struggles with thousands.
Retries of sandbox failures happen per trial inside; they show up here as warnings in the task's log, a count in
the metrics, and rows in the step's trial table.

Two things happen here because they belong to the process, not the core library: the sandbox key file (if any) is
exported into this process's environment for the provider's SDK, and sandbox starts take a slot of the Prefect
global concurrency limit `rollout.sandbox_create_limit` when the server has one."""

from __future__ import annotations

import asyncio
import logging
import time
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
from grpoflow.evaluation import eval_plan, plan_metrics
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.credentials import export_policy_key, export_sandbox_key
from grpoflow.rollout.journal import SAMPLES, read_journal, read_samples
from grpoflow.rollout.policy import policy_access
from grpoflow.rollout.step import GroupRefill, StepRollout, collect_step, sandbox_config
from grpoflow.rollout.trials import (
    Attempt,
    SandboxGate,
    TrialOutcome,
    TrialSpec,
    plan_group_trials,
    run_here,
)
from grpoflow.rollout.workers import RolloutWorkers
from grpoflow.run.paths import RunPaths
from grpoflow.run.regrade import Regrade, regrade_run, regrade_summary


@task(name="run-trials", cache_policy=NO_CACHE, task_run_name="run-trials-step-{step}")
def run_trials_task(
    cfg: RunConfig,
    step: int,
    prompts: list[PromptRecord],
    engine_url: str,
    tokenizer_path: str,
    paths: RunPaths,
    pool: list[PromptRecord] | None = None,
    lora_path: str | None = None,
    workers: RolloutWorkers | None = None,
) -> StepRollout:
    """Run and score one step's trials. Sync, so sync flows get a result; the trials run in their own loop.
    `pool`: the prompts dynamic sampling (`rollout.refill_rounds`) draws new groups from. `lora_path`: the
    adapter the engine serves the policy as (an adapter sync's), named by every generation. `workers`: the Ray
    rollout workers the trials run on (`cluster.ray_address`), else here."""
    r = cfg.rollout
    specs = plan_group_trials(prompts, step, r.n_samples_per_prompt, cfg.seed)
    refill = None
    if r.refill_rounds and pool:
        refill = GroupRefill(
            pool=pool,
            used=list(prompts),
            target=len(prompts),
            max_rounds=r.refill_rounds,
            n_samples=r.n_samples_per_prompt,
            seed=cfg.seed,
            step=step,
            on_retries_exhausted=r.on_retries_exhausted,
        )
    t0 = time.perf_counter()
    result = asyncio.run(
        _collect_with_progress(
            cfg,
            step,
            specs,
            engine_url,
            tokenizer_path,
            paths.trials(step),
            paths.details(step),
            label=f"step-{step}",
            refill=refill,
            lora_path=lora_path,
            workers=workers,
        )
    )
    result.seconds = time.perf_counter() - t0
    return result


@task(name="evaluate-policy", cache_policy=NO_CACHE, task_run_name="evaluate-policy-{version}")
def evaluate_policy_task(
    cfg: RunConfig,
    version: int,
    prompts: list[PromptRecord],
    engine_url: str,
    tokenizer_path: str,
    paths: RunPaths,
    lora_path: str | None = None,
    workers: RolloutWorkers | None = None,
) -> dict[str, float]:
    """Evaluate the engine's weights (version `version`: updates so far) on the train tasks and the held-out
    split, with the same trials as every other evaluation of the run; returns the `eval/...` metrics, each split
    compared with the run's first evaluation (version 0) when there is one."""
    plan = eval_plan(prompts, version, cfg.train.eval_samples_per_prompt, cfg.seed)
    specs = [s for group in plan.values() for s in group]
    result = asyncio.run(
        _collect_with_progress(
            cfg,
            version,
            specs,
            engine_url,
            tokenizer_path,
            paths.eval_trials(version),
            paths.eval_details(version),
            label=f"eval-{version}",
            lora_path=lora_path,
            workers=workers,
        )
    )
    first = paths.eval_details(0)
    base = read_samples(first) if version > 0 and (first / SAMPLES).is_file() else None
    return plan_metrics(plan, result.samples, base)


async def _collect_with_progress(
    cfg: RunConfig,
    step: int,
    specs: list[TrialSpec],
    engine_url: str,
    tokenizer_path: str,
    trials_dir: Path,
    details_dir: Path,
    label: str,
    refill: GroupRefill | None = None,
    lora_path: str | None = None,
    workers: RolloutWorkers | None = None,
) -> StepRollout:
    """`collect_step` on `specs`, with what Prefect shows of it: a progress bar, sandbox retries in the log, a
    table of the trials, and sandbox starts gated by the global concurrency limit."""
    logger = get_run_logger()
    total = len(specs)  # dynamic sampling may add trials: the bar then tops out at 100 %
    progress = await _best_effort(
        logger,
        acreate_progress_artifact,
        progress=0.0,
        key=f"{cfg.run_id}-rollout",
        description=f"Trials finished in {label} (of {total})",
    )
    done = len(read_journal(details_dir))  # a resumed step's trials that finished before the crash

    async def on_done(outcome: TrialOutcome) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            await _best_effort(logger, aupdate_progress_artifact, progress, min(100.0, 100.0 * done / total))

    def on_retry(spec: TrialSpec, attempt: Attempt) -> None:
        what = "rollout worker lost" if attempt.exception_type == "WorkerLost" else "sandbox failure"
        logger.warning(
            "%s in %s (%s: %s): running it again in a fresh sandbox",
            what,
            spec.rollout_id,
            attempt.exception_type,
            " ".join((attempt.exception_message or "").split())[:200],
        )

    export_sandbox_key(cfg.rollout.sandbox, cfg.rollout.sandbox_api_key_file)
    export_policy_key(cfg.rollout.policy_api_key_file)
    async with policy_access(cfg.rollout, cfg.engine, engine_url, tokenizer_path, lora_path) as policy:
        result = await collect_step(
            cfg.run_id,
            step,
            [],
            cfg.rollout,
            cfg.seed,
            policy,
            sandbox_config(cfg.rollout, **policy.sandbox_kwargs),
            trials_dir,
            details_dir,
            on_done=on_done,
            on_retry=on_retry,
            sandbox_gate=await sandbox_create_gate(cfg.rollout.sandbox_create_limit, logger)
            if workers is None
            else None,
            specs=specs,
            refill=refill,
            runner=workers.run if workers is not None else run_here,
            record_workdir=cfg.report.regrade_per_task > 0,
        )
    await _best_effort(
        logger,
        acreate_table_artifact,
        key=f"{cfg.run_id}-{label}-trials",
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
    m = result.metrics
    logger.info(
        "%s: %d trials, reward %.3f, pass@k %.2f, truncated %.2f, retries %d, %.1fs",
        label,
        m["trials"],
        m["reward_mean"],
        m["pass_at_k"],
        m["truncated_ratio"],
        m["retries"],
        m["wall_time_s"],
    )
    return result


@task(name="regrade-trials", cache_policy=NO_CACHE)
def regrade_trials_task(cfg: RunConfig, paths: RunPaths) -> list[Regrade]:
    """Harbor's regrade of up to `report.regrade_per_task` of each task's stored trials, on the run's sandbox
    provider: the verdicts go to the run's regrades.jsonl, where task health reads them."""
    logger = get_run_logger()
    export_sandbox_key(cfg.rollout.sandbox, cfg.rollout.sandbox_api_key_file)
    regrades = regrade_run(paths.root, cfg.rollout, cfg.report.regrade_per_task)
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

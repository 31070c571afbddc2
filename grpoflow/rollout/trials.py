"""Run a batch of Harbor trials concurrently (bounded), retrying sandbox failures in a fresh sandbox.

One trial = one agent episode on one task instance, in its own sandbox, verified by the task's tests.
`n_samples_per_prompt` trials of one prompt form a GRPO group. A trial whose sandbox fails to start, dies, or hits
an infrastructure error is run again from scratch (new trial dir, new sandbox) after a jittered backoff, up to
`retries` times; model and agent errors are final on the first attempt. Every attempt is kept in the outcome,
so retries are counted and a trial whose retries ran out keeps its exit status — it is never scored 0.

A step's attempts start through its `SandboxAdmission` (`grpoflow.rollout.breaker`): at most so many sandbox starts
per second, none while a provider outage holds the breaker open.

Sandbox creation can be bounded beyond `concurrency` by a `SandboxGate`: a factory of async context managers (the
Prefect task passes a global concurrency limit; this module knows nothing of Prefect). One gate slot is held from
the moment Harbor starts a trial's sandbox until the agent starts (or the trial ends), i.e. while the sandbox is
being created, booted and set up — the phase providers rate-limit.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from harbor.models.trial.config import (
    AgentConfig,
    EnvironmentConfig,
    TaskConfig,
    TrialConfig,
)
from harbor.models.trial.result import TrialResult
from harbor.trial.hooks import TrialEvent, TrialHookEvent
from harbor.trial.trial import Trial

from grpoflow.errors import one_line
from grpoflow.prepare.dataset import task_config
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.breaker import SandboxAdmission
from grpoflow.rollout.environments import is_infrastructure_failure
from grpoflow.rollout.record import TrialRecord
from grpoflow.seeds import trial_seed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialSpec:
    instance_id: str
    task_path: str
    group_id: str
    sample_index: int
    rollout_id: str
    seed: int


@dataclass
class Attempt:
    trial_dir: str
    exception_type: str | None
    exception_message: str | None
    wall_time_s: float


@dataclass
class TrialOutcome:
    spec: TrialSpec
    result: TrialResult
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def retries(self) -> int:
        return len(self.attempts) - 1


# Evaluations draw their seeds as this step, which no training step is: every evaluation of a run runs the same
# trials, so two of them differ only by the weights.
EVAL_SEED_STEP = -1


def plan_group_trials(
    prompts: Sequence[PromptRecord], step: int, n_samples: int, base_seed: int, prefix: str | None = None
) -> list[TrialSpec]:
    """`n_samples` trials per prompt; seeds are a function of (base seed, step, prompt, sample) only. Groups are
    named `<prefix>-<instance>` (`prefix` defaults to `step<step>`)."""
    specs = []
    for p_idx, p in enumerate(prompts):
        group = f"{prefix or f'step{step}'}-{p.instance_id}"
        for k in range(n_samples):
            seed = trial_seed(base_seed, step, p.instance_id, k)
            specs.append(TrialSpec(p.instance_id, p.task_path, group, k, f"{group}-{k}", seed))
    return specs


AgentFactory = Callable[[TrialSpec], AgentConfig]
# A fresh async context manager per sandbox start; entering it waits for a slot, leaving it frees the slot.
SandboxGate = Callable[[], AbstractAsyncContextManager[Any]]


class _StartSlot:
    """Holds one `SandboxGate` slot over a trial's sandbox start, through Harbor's trial hooks.

    Harbor runs environment start, healthcheck and agent setup inside `trial.run()`, so the slot is taken in the
    ENVIRONMENT_START hook and given back in the first of AGENT_START, END or CANCEL. The gate's context manager is
    entered and left inside one helper task (context managers such as Prefect's hold cancel scopes, which must
    be left in the task that entered them); the hooks only signal it.
    """

    def __init__(self, gate: SandboxGate):
        self._gate = gate
        self._holder: asyncio.Task[None] | None = None
        self._entered = False  # the gate's slot is held (its context manager was entered)
        self._release = asyncio.Event()

    def attach(self, trial: Trial) -> None:
        trial.add_hook(TrialEvent.ENVIRONMENT_START, self._take)
        for event in (TrialEvent.AGENT_START, TrialEvent.END, TrialEvent.CANCEL):
            trial.add_hook(event, self.release)

    async def _take(self, _event: TrialHookEvent) -> None:
        if self._holder is not None:  # already holding a slot for this trial
            return
        acquired = asyncio.get_running_loop().create_future()
        self._holder = asyncio.create_task(self._hold(acquired))
        # Raises if the gate itself fails (e.g. the limit's server is down): Harbor records it on the trial.
        await acquired

    async def _hold(self, acquired: asyncio.Future[None]) -> None:
        try:
            async with self._gate():
                self._entered = True
                if not acquired.done():  # done: the waiting trial was cancelled meanwhile
                    acquired.set_result(None)
                await self._release.wait()
        except Exception as err:  # handed to the trial waiting in _take; after acquisition only logged
            if not acquired.done():
                acquired.set_exception(err)
            else:
                log.warning("sandbox gate: giving back a slot failed: %s: %s", type(err).__name__, one_line(str(err)))

    async def release(self, _event: TrialHookEvent | None = None) -> None:
        """Give the slot back (or stop waiting for one); idempotent, so every end-of-start hook may call it."""
        if self._holder is None:
            return
        holder, self._holder = self._holder, None
        self._release.set()
        if not self._entered:
            holder.cancel()  # still queued for a slot and the trial is over: stop asking
        await asyncio.wait([holder])  # not `await holder`: that would re-raise the holder's cancellation here


@lru_cache(maxsize=4096)
def recorded_artifacts(task_path: str) -> tuple[str, ...]:
    """What a trial of this task records for a later regrade: the task's workdir (where the built-in tasks'
    verifiers, and most terminal tasks', read the agent's work). Nothing when the task names no workdir (or `/`):
    then there is nothing a regrade could replay, and a regrade leaves its trials out."""
    workdir = task_config(Path(task_path)).environment.workdir or ""
    workdir = workdir.rstrip("/")  # "/" would be the whole filesystem: not recorded
    return (workdir,) if workdir else ()


def trial_name(spec: TrialSpec, attempt: int) -> str:
    return f"{spec.instance_id[:40]}__{spec.sample_index}__a{attempt}"


def build_trial_config(
    spec: TrialSpec,
    attempt: int,
    agent: AgentConfig,
    environment: EnvironmentConfig,
    trials_dir: Path,
    record_workdir: bool = False,
) -> TrialConfig:
    """Harbor's config of one attempt. `record_workdir`: the trial also keeps its task's workdir as an artifact
    (in `<trial>/artifacts/`), so that Harbor can regrade it later (`grpoflow.run.regrade`)."""
    return TrialConfig(
        task=TaskConfig(path=Path(spec.task_path)),
        trial_name=trial_name(spec, attempt),
        trials_dir=trials_dir,
        agent=agent,
        environment=environment,
        artifacts=list(recorded_artifacts(spec.task_path)) if record_workdir else [],
    )


def backoff_delay(attempt: int, base_s: float, rng: random.Random, cap_s: float = 30.0) -> float:
    """Exponential backoff with full jitter in [0.5, 1.5) x base x 2^attempt, capped."""
    return min(cap_s, base_s * (2**attempt)) * (0.5 + rng.random())


class WorkerLost(Exception):
    """The process running a trial attempt elsewhere (a rollout worker) died before the trial ended: the attempt
    is run again on another worker, and that does not count as one of the trial's sandbox retries."""


# Runs one attempt's trial to its result, here or elsewhere (`grpoflow.rollout.workers`); raises `WorkerLost`
# when the attempt's process died. `SandboxGate` is honoured where the trial runs in this process.
TrialRunner = Callable[[TrialConfig, "SandboxGate | None"], Awaitable[TrialResult]]


async def run_here(cfg: TrialConfig, sandbox_gate: SandboxGate | None = None) -> TrialResult:
    """One attempt's trial in this process."""
    trial = await Trial.create(cfg)
    slot = _StartSlot(sandbox_gate) if sandbox_gate else None
    if slot:
        slot.attach(trial)
    try:
        return await trial.run()
    finally:
        if slot:  # normally given back by a hook already; this covers a run that ended in between
            await slot.release()


async def run_trial(
    spec: TrialSpec,
    make_agent: AgentFactory,
    environment: EnvironmentConfig,
    trials_dir: Path,
    retries: int,
    backoff_s: float,
    on_retry: Callable[[TrialSpec, Attempt], None] | None = None,
    sandbox_gate: SandboxGate | None = None,
    runner: TrialRunner = run_here,
    record_workdir: bool = False,
    admission: SandboxAdmission | None = None,
) -> TrialOutcome:
    """Run `spec` until an attempt ends for a reason of its own or its `retries` sandbox failures are spent.
    `admission` lets each attempt start (`SandboxAdmission.admit`) and hears how its sandbox started: a failure the
    breaker puts down to a provider outage is run again once the breaker lets it, and costs no retry."""
    rng = random.Random(spec.seed)  # jitter: deterministic per trial, different across trials
    attempts: list[Attempt] = []
    # Attempts of a run that was killed mid-trial left their dirs behind (resume): new attempts never reuse one.
    first = 0
    while (trials_dir / trial_name(spec, first)).exists():
        first += 1
    failures = 0  # sandbox failures so far: each costs one of `retries`
    while True:
        probe = await admission.admit() if admission else False
        cfg = build_trial_config(spec, first + len(attempts), make_agent(spec), environment, trials_dir, record_workdir)
        t0 = time.perf_counter()
        result: TrialResult | None = None
        try:
            result = await runner(cfg, sandbox_gate)
        except WorkerLost as lost:
            attempts.append(
                Attempt(str(trials_dir / cfg.trial_name), "WorkerLost", str(lost), time.perf_counter() - t0)
            )
            log.warning("trial %s: %s; running it again on another worker", spec.rollout_id, one_line(str(lost)))
            if on_retry:
                on_retry(spec, attempts[-1])
            continue
        finally:  # also when the attempt was lost or cancelled: a probe that says nothing lets the next one go
            outage = admission.record(result, probe) if admission else False
        exc = result.exception_info
        attempts.append(
            Attempt(
                trial_dir=str(trials_dir / cfg.trial_name),
                exception_type=exc.exception_type if exc else None,
                exception_message=exc.exception_message if exc else None,
                wall_time_s=time.perf_counter() - t0,
            )
        )
        infrastructure = exc is not None and is_infrastructure_failure(
            exc.exception_type, TrialRecord.of(result).end_reason
        )
        if not infrastructure:
            return TrialOutcome(spec, result, attempts)
        if outage:
            log.warning(
                "trial %s attempt %d: sandbox start failed while the sandbox breaker is open (%s); running it "
                "again once the breaker lets it, no retry spent",
                spec.rollout_id,
                len(attempts) - 1,
                exc.exception_type,
            )
            if on_retry:
                on_retry(spec, attempts[-1])
            continue
        if failures == retries:
            return TrialOutcome(spec, result, attempts)
        log.warning(
            "trial %s attempt %d: infrastructure failure %s: %s; retrying in a fresh sandbox",
            spec.rollout_id,
            len(attempts) - 1,
            exc.exception_type,
            one_line(exc.exception_message),
        )
        if on_retry:
            on_retry(spec, attempts[-1])
        await asyncio.sleep(backoff_delay(failures, backoff_s, rng))
        failures += 1


async def run_trials(
    specs: Sequence[TrialSpec],
    make_agent: AgentFactory,
    environment: EnvironmentConfig,
    trials_dir: Path,
    *,
    concurrency: int,
    retries: int,
    backoff_s: float = 0.5,
    on_done: Callable[[TrialOutcome], Any] | None = None,
    on_retry: Callable[[TrialSpec, Attempt], None] | None = None,
    sandbox_gate: SandboxGate | None = None,
    runner: TrialRunner = run_here,
    record_workdir: bool = False,
    admission: SandboxAdmission | None = None,
) -> list[TrialOutcome]:
    """Run every spec, at most `concurrency` at once; outcomes come back in the order of `specs`.

    `sandbox_gate`, if given, also bounds how many sandboxes are starting at once (see the module doc).
    `runner` runs each attempt: here, or on rollout workers elsewhere (`grpoflow.rollout.workers`).
    `record_workdir`: every trial keeps its task's workdir, for a later regrade (`build_trial_config`).
    `admission`: the step's bound on sandbox starts and its breaker (`run_trial`).
    """
    trials_dir.mkdir(parents=True, exist_ok=True)
    gate = asyncio.Semaphore(concurrency)

    async def one(spec: TrialSpec) -> TrialOutcome:
        async with gate:
            out = await run_trial(
                spec,
                make_agent,
                environment,
                trials_dir,
                retries,
                backoff_s,
                on_retry,
                sandbox_gate,
                runner,
                record_workdir,
                admission,
            )
        if on_done and inspect.isawaitable(ack := on_done(out)):  # async callbacks (e.g. progress updates)
            await ack
        return out

    return list(await asyncio.gather(*(one(s) for s in specs)))

"""One rollout step end to end, without Prefect: plan the GRPO groups, run the trials, score them, write traces.

`collect_step` is what the train and evaluate flows call (through a thin Prefect task) once per step.
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harbor.models.environment_type import EnvironmentType
from harbor.models.trial.config import AgentConfig, EnvironmentConfig

from grpoflow.config import RolloutConfig
from grpoflow.embedded.sandbox import LOCAL_SANDBOX_IMPORT_PATH
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.harnesses import get_binding, sandbox_allowed_hosts
from grpoflow.rollout.journal import append_trial, read_journal, write_samples
from grpoflow.rollout.policy import PolicyAccess, trial_sample
from grpoflow.rollout.trials import (
    Attempt,
    SandboxGate,
    TrialOutcome,
    TrialRunner,
    TrialSpec,
    plan_group_trials,
    run_here,
    run_trials,
)
from grpoflow.samples import Sample
from grpoflow.scoring import informative_groups, step_metrics


@dataclass
class StepRollout:
    samples: list[Sample]
    metrics: dict[str, float]
    details_path: Path
    seconds: float = 0.0  # wall time of the rollout itself (it may overlap the trainer's step)


def sandbox_config(rollout: RolloutConfig, **kwargs: Any) -> EnvironmentConfig:
    """Harbor's environment for `rollout.sandbox`: our bubblewrap `LocalSandbox`, or a Harbor environment type
    passed straight through. What the harness needs of the local sandbox (terminus-2: processes that live across
    execs), then `rollout.sandbox_kwargs`, then `kwargs` (which win) go to its constructor.

    No credentials here: Harbor writes this config into every trial dir. A provider's key reaches its SDK through
    the process environment (`grpoflow.rollout.credentials.export_sandbox_key`).
    """
    merged = {**rollout.sandbox_kwargs, **kwargs}
    hosts = sandbox_allowed_hosts(rollout)  # a CLI harness's session server (Harbor's network policy)
    if rollout.sandbox == "local":
        merged = {**get_binding(rollout.harness).local_sandbox_kwargs, **merged}
        return EnvironmentConfig(import_path=LOCAL_SANDBOX_IMPORT_PATH, kwargs=merged, extra_allowed_hosts=hosts)
    return EnvironmentConfig(type=EnvironmentType(rollout.sandbox), kwargs=merged, extra_allowed_hosts=hosts)


@dataclass
class GroupRefill:
    """Dynamic sampling (DAPO): after each round of a step's trials, the groups of new prompts to run in place
    of those that carry no GRPO signal, until `target` groups are informative (`informative_groups`), for at most
    `max_rounds` rounds or until the pool runs out.

    A round asks for exactly the missing number of groups, so a step never has more than `target` informative
    groups (the others stay, and `train.filter_zero_std` leaves out the flat ones).
    New prompts are drawn without replacement from the pool, less the step's own, seeded by (seed, step, round):
    a resumed step plans the same refill trials as long as the trials it reuses scored as before. Their groups
    and seeds continue the step's plan (`plan_group_trials` over all the step's prompts), so none collides.
    """

    pool: Sequence[PromptRecord]
    used: list[PromptRecord]
    target: int
    max_rounds: int
    n_samples: int
    seed: int
    step: int
    on_retries_exhausted: Literal["drop_group", "keep_group"] = "drop_group"
    rounds: int = 0
    groups: int = 0
    _taken: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self._taken = {p.instance_id for p in self.used}

    def __call__(self, samples: Sequence[Sample]) -> list[TrialSpec]:
        need = self.target - len(informative_groups(samples, self.on_retries_exhausted))
        unused = [p for p in self.pool if p.instance_id not in self._taken]
        if self.rounds >= self.max_rounds or need <= 0 or not unused:
            return []
        picked = random.Random(f"{self.seed}/{self.step}/{self.rounds}").sample(unused, min(need, len(unused)))
        before = len(self.used)
        self.used = [*self.used, *picked]
        self._taken.update(p.instance_id for p in picked)
        self.rounds += 1
        self.groups += len(picked)
        return plan_group_trials(self.used, self.step, self.n_samples, self.seed)[before * self.n_samples :]

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        return {
            "refill_rounds": float(self.rounds),
            "refill_groups": float(self.groups),
            "informative_groups": float(len(informative_groups(samples, self.on_retries_exhausted))),
        }


async def collect_step(
    run_id: str,
    step: int,
    prompts: Sequence[PromptRecord],
    rollout: RolloutConfig,
    seed: int,
    policy: PolicyAccess | Callable[[TrialSpec], AgentConfig],
    environment: EnvironmentConfig,
    trials_dir: Path,
    details_dir: Path,
    on_done: Callable[[TrialOutcome], Any] | None = None,
    on_retry: Callable[[TrialSpec, Attempt], None] | None = None,
    sandbox_gate: SandboxGate | None = None,
    specs: Sequence[TrialSpec] | None = None,
    refill: GroupRefill | None = None,
    runner: TrialRunner = run_here,
    record_workdir: bool = False,
) -> StepRollout:
    """Run and score one step's trials: `specs`, or by default `rollout.n_samples_per_prompt` per prompt (one
    GRPO group each). `policy` is a `PolicyAccess` (from `policy_access`), or just the shell agent's factory.
    Each finished trial's samples (`policy.to_samples`; several when a session was compacted into segments) are
    journaled as it finishes, so a step interrupted by a crash runs again only the trials that had not finished
    (resume); finished ones are reused. A retried trial's failed attempt is forgotten first (`policy.forget`):
    the retry starts a fresh session, and the failed attempt's turns never train. With `refill`, further rounds
    of trials follow until it asks for none (dynamic sampling); they are journaled like the first. `runner` runs
    each attempt's trial: here, or on rollout workers (`grpoflow.rollout.workers`). `record_workdir`: every trial
    keeps its task's workdir, so that it can be regraded (`grpoflow.run.regrade`)."""
    if not isinstance(policy, PolicyAccess):
        policy = PolicyAccess(policy, trial_sample, lambda spec: None)
    if specs is None:
        specs = plan_group_trials(prompts, step, rollout.n_samples_per_prompt, seed)
    specs = list(specs)
    done = read_journal(details_dir)

    async def finished(outcome: TrialOutcome) -> None:
        samples = policy.to_samples(outcome, run_id, step)
        rollout_id = outcome.spec.rollout_id
        append_trial(details_dir, rollout_id, samples)
        done[rollout_id] = samples
        if on_done and inspect.isawaitable(ack := on_done(outcome)):
            await ack

    def retrying(spec: TrialSpec, attempt: Attempt) -> None:
        policy.forget(spec)
        if on_retry:
            on_retry(spec, attempt)

    t0 = time.perf_counter()
    batch = specs
    while batch:
        await run_trials(
            [s for s in batch if s.rollout_id not in done],
            policy.make_agent,
            environment,
            trials_dir,
            concurrency=rollout.concurrency,
            retries=rollout.sandbox_retries,
            backoff_s=rollout.retry_backoff_s,
            on_done=finished,
            on_retry=retrying,
            sandbox_gate=sandbox_gate,
            runner=runner,
            record_workdir=record_workdir,
        )
        batch = refill([x for s in specs for x in done[s.rollout_id]]) if refill else []
        specs += batch
    wall = time.perf_counter() - t0
    samples = [x for s in specs for x in done[s.rollout_id]]
    metrics = step_metrics(samples, wall) | (refill.metrics(samples) if refill else {})
    return StepRollout(samples, metrics, write_samples(details_dir, samples))


def select_step_prompts(
    prompts: Sequence[PromptRecord], step: int, per_step: int, split: str = "train"
) -> list[PromptRecord]:
    """Prompts of one training step: walk the split's (already seed-shuffled) order cyclically."""
    pool = [p for p in prompts if p.split == split]
    if not pool:
        raise ValueError(f"no prompts in split `{split}`")
    start = (step * per_step) % len(pool)
    return [pool[(start + i) % len(pool)] for i in range(min(per_step, len(pool)))]

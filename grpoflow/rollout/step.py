"""One rollout step end to end, without Prefect: plan the GRPO groups, run the trials, score them, journal them.

`run_step_trials` is a training step's rollout, `grpoflow.scoring.evaluation.evaluate_policy` an evaluation's;
both run `collect_step` with the run's policy access and sandbox, and tell a `RolloutHooks` what happens (the
Prefect task shows it as progress, log lines and a table).
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harbor.models.trial.config import EnvironmentConfig

from grpoflow.config import RewardRule, RolloutConfig, RunConfig
from grpoflow.credentials import export_policy_key, export_sandbox_key
from grpoflow.figures import Figures
from grpoflow.paths import RunPaths
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.breaker import SandboxAdmission
from grpoflow.rollout.journal import append_trial, read_journal, write_samples
from grpoflow.rollout.metrics import step_metrics
from grpoflow.rollout.outcome import to_sample
from grpoflow.rollout.policy import PolicyAccess, policy_access
from grpoflow.rollout.sandbox import sandbox_config
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
from grpoflow.rollout.workers import RolloutWorkers
from grpoflow.samples import Sample, select_trainable
from grpoflow.seeds import refill_seed


@dataclass(frozen=True)
class RolloutSetup:
    """Where a run's trials reach the policy, and where they run."""

    engine_url: str
    tokenizer_path: str
    lora_path: str | None = None  # the adapter every generation names (a LoRA run's adapter sync)
    workers: RolloutWorkers | None = None  # Ray rollout workers (`cluster.ray_address`); None: in this process


class RolloutHooks:
    """What a caller watching a step's trials hears of them. These do nothing; the Prefect task's show progress,
    retries and a table of the trials."""

    async def started(self, label: str, total: int, done: int) -> None:
        """`label`'s `total` trials are about to run, `done` of them finished before (a resumed step)."""

    async def trial_done(self, outcome: TrialOutcome) -> None:
        pass

    def retrying(self, spec: TrialSpec, attempt: Attempt) -> None:
        pass

    async def sandbox_gate(self) -> SandboxGate | None:
        """What each sandbox start waits for (a slot of a concurrency limit); None: nothing."""
        return None

    async def finished(self, label: str, result: StepRollout) -> None:
        pass


@dataclass
class StepRollout:
    samples: list[Sample]
    figures: Figures  # `step_metrics`, and dynamic sampling's counts
    details_path: Path
    seconds: float = 0.0  # wall time of the rollout itself (it may overlap the trainer's step)


def informative_groups(samples: Sequence[Sample], policy: Literal["drop_group", "keep_group"]) -> set[str]:
    """The groups that give the trainer a GRPO signal: trainable under `policy` (`select_trainable`), with at
    least two scored trials whose rewards differ."""
    rewards: dict[str, set[float]] = defaultdict(set)
    for s in select_trainable(samples, policy)[0]:
        rewards[s.group_id].add(s.reward)
    return {g for g, r in rewards.items() if len(r) > 1}


@dataclass
class GroupRefill:
    """Dynamic sampling (DAPO): after each round of a step's trials, the groups of new prompts to run in place
    of those that carry no GRPO signal, until `target` groups are informative (`informative_groups`), for at most
    `max_rounds` rounds or until the pool runs out.

    A round asks for exactly the missing number of groups, so a step never has more than `target` informative
    groups (the others stay, and `train.loss.filter_zero_std` leaves out the flat ones).
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
        picked = random.Random(refill_seed(self.seed, self.step, self.rounds)).sample(unused, min(need, len(unused)))
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
    specs: Sequence[TrialSpec],
    rollout: RolloutConfig,
    policy: PolicyAccess,
    environment: EnvironmentConfig,
    trials_dir: Path,
    details_dir: Path,
    on_done: Callable[[TrialOutcome], Any] | None = None,
    on_retry: Callable[[TrialSpec, Attempt], None] | None = None,
    sandbox_gate: SandboxGate | None = None,
    refill: GroupRefill | None = None,
    runner: TrialRunner = run_here,
    record_workdir: bool = False,
    reward: RewardRule | None = None,
) -> StepRollout:
    """Run and score one step's trials (`specs`: GRPO groups of trials, `plan_group_trials`). Each finished
    trial is scored (`to_sample`), and its samples (`policy.to_samples`; several when a session was compacted
    into segments) are journaled as it finishes, so a step interrupted by a crash runs again only the trials that
    had not finished (resume); finished ones are reused. A retried trial's failed attempt is forgotten first
    (`policy.forget`): the retry starts a fresh session, and the failed attempt's turns never train. With
    `refill`, further rounds of trials follow until it asks for none (dynamic sampling); they are journaled like
    the first. `runner` runs each attempt's trial: here, or on rollout workers (`grpoflow.rollout.workers`).
    `record_workdir`: every trial keeps its task's workdir, so that it can be regraded
    (`grpoflow.run.regrade`). `reward`: which of several verifier rewards scores a trial (`dataset.reward`)."""
    specs = list(specs)
    done = read_journal(details_dir)

    async def finished(outcome: TrialOutcome) -> None:
        samples = policy.to_samples(outcome, to_sample(outcome, run_id, step, reward))
        rollout_id = outcome.spec.rollout_id
        append_trial(details_dir, rollout_id, samples)
        done[rollout_id] = samples
        if on_done and inspect.isawaitable(ack := on_done(outcome)):
            await ack

    def retrying(spec: TrialSpec, attempt: Attempt) -> None:
        policy.forget(spec)
        if on_retry:
            on_retry(spec, attempt)

    admission = SandboxAdmission(rollout.sandbox.breaker, rollout.sandbox.max_starts_per_s)
    t0 = time.perf_counter()
    batch = specs
    while batch:
        await run_trials(
            [s for s in batch if s.rollout_id not in done],
            policy.make_agent,
            environment,
            trials_dir,
            concurrency=rollout.concurrency,
            retries=rollout.sandbox.retries,
            backoff_s=rollout.sandbox.retry_backoff_s,
            on_done=finished,
            on_retry=retrying,
            sandbox_gate=sandbox_gate,
            runner=runner,
            record_workdir=record_workdir,
            admission=admission,
        )
        batch = refill([x for s in specs for x in done[s.rollout_id]]) if refill else []
        specs += batch
    wall = time.perf_counter() - t0
    samples = [x for s in specs for x in done[s.rollout_id]]
    figures = step_metrics(samples, wall)
    figures.seconds |= admission.figures()
    if refill:
        figures.computed |= refill.metrics(samples)
    return StepRollout(samples, figures, write_samples(details_dir, samples))


def select_step_prompts(
    prompts: Sequence[PromptRecord], step: int, per_step: int, split: str = "train"
) -> list[PromptRecord]:
    """Prompts of one training step: walk the split's (already seed-shuffled) order cyclically."""
    pool = [p for p in prompts if p.split == split]
    if not pool:
        raise ValueError(f"no prompts in split `{split}`")
    start = (step * per_step) % len(pool)
    return [pool[(start + i) % len(pool)] for i in range(min(per_step, len(pool)))]


def run_step_trials(
    cfg: RunConfig,
    step: int,
    prompts: Sequence[PromptRecord],
    setup: RolloutSetup,
    paths: RunPaths,
    pool: Sequence[PromptRecord] = (),
    hooks: RolloutHooks | None = None,
) -> StepRollout:
    """Run and score training step `step`'s trials: `rollout.n_samples_per_prompt` per prompt, and with
    `rollout.refill_rounds` groups of new prompts from `pool` in place of those without signal. Sync: the trials
    run in their own event loop. Its wall time is the result's `seconds`."""
    r = cfg.rollout
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
            on_retries_exhausted=r.sandbox.on_retries_exhausted,
        )
    specs = plan_group_trials(prompts, step, r.n_samples_per_prompt, cfg.seed)
    t0 = time.perf_counter()
    result = asyncio.run(
        collect_with(cfg, step, specs, setup, paths.trials(step), paths.details(step), f"step-{step}", hooks, refill)
    )
    result.seconds = time.perf_counter() - t0
    return result


async def collect_with(
    cfg: RunConfig,
    step: int,
    specs: Sequence[TrialSpec],
    setup: RolloutSetup,
    trials_dir: Path,
    details_dir: Path,
    label: str,
    hooks: RolloutHooks | None = None,
    refill: GroupRefill | None = None,
) -> StepRollout:
    """`collect_step` on `specs` with the run's policy access (`policy_access`), sandbox and keys, telling
    `hooks` what happens."""
    hooks = hooks or RolloutHooks()
    await hooks.started(label, len(specs), len(read_journal(details_dir)))
    export_sandbox_key(cfg.rollout.sandbox.backend, cfg.rollout.sandbox.key_file())
    export_policy_key(cfg.rollout.harness.policy_key_file())
    async with policy_access(
        cfg.rollout, cfg.engine, setup.engine_url, setup.tokenizer_path, setup.lora_path
    ) as policy:
        result = await collect_step(
            cfg.run_id,
            step,
            specs,
            cfg.rollout,
            policy,
            sandbox_config(cfg.rollout, cfg.dataset.base_images, **policy.sandbox_kwargs),
            trials_dir,
            details_dir,
            on_done=hooks.trial_done,
            on_retry=hooks.retrying,
            # a global limit bounds starts from this process only; on Ray workers `rollout.concurrency` does
            sandbox_gate=await hooks.sandbox_gate() if setup.workers is None else None,
            refill=refill,
            runner=setup.workers.run if setup.workers is not None else run_here,
            record_workdir=cfg.report.regrade_per_task > 0,
            reward=cfg.dataset.reward_rule(),
        )
    await hooks.finished(label, result)
    return result

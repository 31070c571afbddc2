"""One rollout step end to end, without Prefect: plan the GRPO groups, run the trials, score them, write traces.

`collect_step` is what the train and evaluate flows call (through a thin Prefect task) once per step.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor.models.environment_type import EnvironmentType
from harbor.models.trial.config import AgentConfig, EnvironmentConfig

from grpoflow.config import EngineConfig, RolloutConfig
from grpoflow.embedded.sandbox import LOCAL_SANDBOX_IMPORT_PATH
from grpoflow.fileio import append_jsonl, write_jsonl_atomic
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.harnesses import agent_factory, get_binding
from grpoflow.rollout.sessions.segments import segment_samples
from grpoflow.rollout.sessions.server import SessionServer
from grpoflow.rollout.trials import (
    Attempt,
    SandboxGate,
    TrialOutcome,
    TrialSpec,
    plan_group_trials,
    run_trials,
)
from grpoflow.samples import Sample
from grpoflow.scoring import step_metrics, to_sample


@dataclass
class StepRollout:
    samples: list[Sample]
    metrics: dict[str, float]
    details_path: Path


ToSamples = Callable[[TrialOutcome, str, int], list[Sample]]  # (outcome, run_id, step) -> the trial's samples


def trial_sample(outcome: TrialOutcome, run_id: str, step: int) -> list[Sample]:
    """The shell agent's trial: one sample, its exact tokens from the agent's own record."""
    return [to_sample(outcome, run_id, step)]


@dataclass
class PolicyAccess:
    """How one step's agents reach the policy, and how a finished trial becomes training samples."""

    make_agent: Callable[[TrialSpec], AgentConfig]
    to_samples: ToSamples
    forget: Callable[[TrialSpec], None]  # drop a failed attempt's record before its retry


@asynccontextmanager
async def policy_access(
    rollout: RolloutConfig, engine: EngineConfig, engine_url: str, tokenizer_path: str
) -> AsyncIterator[PolicyAccess]:
    """Our shell agent talks to the engine itself and keeps the exact tokens. Every OpenAI-speaking harness
    (terminus-2, claude-code, opencode) goes through a session server for the block: it keeps the exact tokens
    of each trial's session, and the session's segments become the trial's samples (`segment_samples`)."""
    if not get_binding(rollout.harness).via_session_server:
        yield PolicyAccess(agent_factory(rollout, engine, engine_url, tokenizer_path), trial_sample, lambda spec: None)
        return
    server = SessionServer(
        engine_url,
        tokenizer_path,
        max_new_tokens=rollout.max_new_tokens,
        context_length=rollout.max_context_tokens,
        request_timeout_s=engine.request_timeout_s,
        engine_retries=engine.retries,
    )
    async with server:

        def to_samples(outcome: TrialOutcome, run_id: str, step: int) -> list[Sample]:
            return segment_samples(to_sample(outcome, run_id, step), server.pop_session(outcome.spec.rollout_id))

        yield PolicyAccess(
            agent_factory(
                rollout,
                engine,
                engine_url,
                tokenizer_path,
                api_base_for=lambda spec: server.session_url(spec.rollout_id, seed=spec.seed),
            ),
            to_samples,
            lambda spec: server.pop_session(spec.rollout_id),
        )


def sandbox_config(rollout: RolloutConfig, **kwargs: Any) -> EnvironmentConfig:
    """Harbor's environment for `rollout.sandbox`: our bubblewrap `LocalSandbox`, or a Harbor environment type
    passed straight through. What the harness needs of the local sandbox (terminus-2: processes that live across
    execs), then `rollout.sandbox_kwargs`, then `kwargs` (which win) go to its constructor.

    No credentials here: Harbor writes this config into every trial dir. A provider's key reaches its SDK through
    the process environment (`grpoflow.rollout.credentials.export_sandbox_key`).
    """
    merged = {**rollout.sandbox_kwargs, **kwargs}
    if rollout.sandbox == "local":
        merged = {**get_binding(rollout.harness).local_sandbox_kwargs, **merged}
        return EnvironmentConfig(import_path=LOCAL_SANDBOX_IMPORT_PATH, kwargs=merged)
    return EnvironmentConfig(type=EnvironmentType(rollout.sandbox), kwargs=merged)


JOURNAL = "journal.jsonl"  # details/step_<N>/: one Sample per finished trial, appended as each one finishes
SAMPLES = "samples.jsonl"  # details/step_<N>/: every sample of the finished step, in plan order


def read_samples(details_dir: Path) -> list[Sample]:
    """The samples of a finished step (or evaluation), as `collect_step` wrote them."""
    path = Path(details_dir) / SAMPLES
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Sample.model_validate(json.loads(line)) for line in lines if line]  # json reads -Infinity back


def read_journal(details_dir: Path) -> dict[str, list[Sample]]:
    """Finished trials of a step that was interrupted: rollout_id -> the trial's samples (one line per trial, so
    a trial's segments are journaled together or not at all; a torn last line is skipped)."""
    path = Path(details_dir) / JOURNAL
    if not path.exists():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    out: dict[str, list[Sample]] = {}
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)  # json, as written: it reads -Infinity back
            samples = [Sample.model_validate(s) for s in record["samples"]]
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:  # a crash mid-append; the next append cuts it off
                continue
            raise ValueError(f"{path}:{i + 1}: not a valid trial record") from None
        out[record["rollout_id"]] = samples
    return out


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
) -> StepRollout:
    """Run and score one step's trials: `specs`, or by default `rollout.n_samples_per_prompt` per prompt (one
    GRPO group each). `policy` is a `PolicyAccess` (from `policy_access`), or just the shell agent's factory.
    Each finished trial's samples (`policy.to_samples`; several when a session was compacted into segments) are
    journaled as it finishes, so a step interrupted by a crash runs again only the trials that had not finished
    (resume); finished ones are reused. A retried trial's failed attempt is forgotten first (`policy.forget`):
    the retry starts a fresh session, and the failed attempt's turns never train."""
    if not isinstance(policy, PolicyAccess):
        policy = PolicyAccess(policy, trial_sample, lambda spec: None)
    if specs is None:
        specs = plan_group_trials(prompts, step, rollout.n_samples_per_prompt, seed)
    journal = Path(details_dir) / JOURNAL
    done = read_journal(details_dir)
    pending = [s for s in specs if s.rollout_id not in done]

    async def finished(outcome: TrialOutcome) -> None:
        samples = policy.to_samples(outcome, run_id, step)
        rollout_id = outcome.spec.rollout_id
        append_jsonl(journal, {"rollout_id": rollout_id, "samples": [x.model_dump(mode="json") for x in samples]})
        done[rollout_id] = samples
        if on_done and inspect.isawaitable(ack := on_done(outcome)):
            await ack

    def retrying(spec: TrialSpec, attempt: Attempt) -> None:
        policy.forget(spec)
        if on_retry:
            on_retry(spec, attempt)

    t0 = time.perf_counter()
    await run_trials(
        pending,
        policy.make_agent,
        environment,
        trials_dir,
        concurrency=rollout.concurrency,
        retries=rollout.sandbox_retries,
        backoff_s=rollout.retry_backoff_s,
        on_done=finished,
        on_retry=retrying,
        sandbox_gate=sandbox_gate,
    )
    wall = time.perf_counter() - t0
    samples = [x for s in specs for x in done[s.rollout_id]]
    details = details_dir / SAMPLES
    write_jsonl_atomic(details, (s.model_dump(mode="json") for s in samples))
    return StepRollout(samples, step_metrics(samples, wall), details)


def select_step_prompts(
    prompts: Sequence[PromptRecord], step: int, per_step: int, split: str = "train"
) -> list[PromptRecord]:
    """Prompts of one training step: walk the split's (already seed-shuffled) order cyclically."""
    pool = [p for p in prompts if p.split == split]
    if not pool:
        raise ValueError(f"no prompts in split `{split}`")
    start = (step * per_step) % len(pool)
    return [pool[(start + i) % len(pool)] for i in range(min(per_step, len(pool)))]

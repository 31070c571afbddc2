"""How a step's agents reach the policy, and how a finished trial becomes training samples.

Our shell agent talks to the engine itself and keeps the exact tokens. Every OpenAI-speaking harness goes through
a session server for the step: it keeps each trial's session token-exact, and the session's segments become the
trial's samples. A retried trial's failed attempt is forgotten (`PolicyAccess.forget`): its turns never train.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from harbor.models.trial.config import AgentConfig

from grpoflow.config import EngineConfig, RolloutConfig
from grpoflow.rollout.harnesses import agent_factory, get_binding
from grpoflow.rollout.sessions.segments import segment_samples
from grpoflow.rollout.sessions.server import SessionServer
from grpoflow.rollout.trials import TrialOutcome, TrialSpec
from grpoflow.samples import Sample
from grpoflow.scoring import to_sample

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
        sampling={"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k},
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

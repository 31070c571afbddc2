"""How a step's agents reach the policy, and how a finished trial's sample becomes training samples.

Our shell agent talks to the engine itself and keeps the exact tokens. Every OpenAI-speaking harness goes through
a session server for the step: it keeps each trial's session token-exact, and the session's segments become the
trial's samples. A retried trial's failed attempt is forgotten (`PolicyAccess.forget`): its turns never train.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from harbor.models.trial.config import AgentConfig

from grpoflow.config import ChatHarness, Engine, RolloutConfig
from grpoflow.engine.client import token_budget
from grpoflow.engine.clients import client_of
from grpoflow.prepare.clis import installed_cli
from grpoflow.rollout.environments import BRIDGE_HOST
from grpoflow.rollout.harnesses import agent_factory
from grpoflow.rollout.sessions.segments import segment_samples
from grpoflow.rollout.sessions.server import SessionServer, SessionSettings
from grpoflow.rollout.trials import TrialOutcome, TrialSpec
from grpoflow.samples import Sample

log = logging.getLogger(__name__)


def one_sample(outcome: TrialOutcome, sample: Sample) -> list[Sample]:
    """The shell agent's trial: one sample, its exact tokens from the agent's own record."""
    return [sample]


@dataclass
class PolicyAccess:
    """How one step's agents reach the policy, and how a finished trial's scored sample becomes its training
    samples (one, or one per segment of a compacted session)."""

    make_agent: Callable[[TrialSpec], AgentConfig]
    to_samples: Callable[[TrialOutcome, Sample], list[Sample]] = one_sample
    forget: Callable[[TrialSpec], None] = lambda spec: None  # drop a failed attempt's record before its retry
    # What the local sandbox needs for this harness (the CLI dir, the bridge to the session server): kwargs of
    # `grpoflow.rollout.sandbox.sandbox_config`.
    sandbox_kwargs: dict[str, Any] = field(default_factory=dict)


async def fit_to_engine(rollout: RolloutConfig, engine: Engine, engine_url: str) -> RolloutConfig:
    """`rollout` with `max_context_tokens` lowered to what the engine accepts, when it is not already below.

    SGLang refuses (400, which no client retries) a request whose prompt + max_new_tokens reaches the model's
    context length, and aborts one whose prompt comes within 6 tokens of it (`token_budget`), so an episode
    budget past that would turn the last turn of long episodes into failed trials, and their groups would be
    dropped. Within the engine's bound such an episode ends by its token budget (TRUNCATED) instead."""
    client = client_of(engine, engine_url)
    try:
        context = await client.acontext_length()
    finally:
        await client.aclose()
    if context is None or rollout.episode.max_context_tokens <= token_budget(context):
        return rollout
    log.warning(
        "rollout.episode.max_context_tokens=%d does not fit the engine's context length %d: episodes are bounded by %d",
        rollout.episode.max_context_tokens,
        context,
        token_budget(context),
    )
    episode = rollout.episode.model_copy(update={"max_context_tokens": token_budget(context)})
    return rollout.model_copy(update={"episode": episode})


@asynccontextmanager
async def policy_access(
    rollout: RolloutConfig, engine: Engine, engine_url: str, tokenizer_path: str, lora_path: str | None = None
) -> AsyncIterator[PolicyAccess]:
    """Our shell agent talks to the engine itself and keeps the exact tokens. Every OpenAI-speaking harness
    (terminus-2, claude-code, opencode) goes through a session server for the block: it keeps the exact tokens
    of each trial's session, and the session's segments become the trial's samples (`segment_samples`).
    Episodes are bounded by `rollout.episode.max_context_tokens` or the engine's context, whichever is smaller.
    `lora_path`: the adapter every generation names (a LoRA run's adapter sync, `grpoflow.train.sync`)."""
    rollout = await fit_to_engine(rollout, engine, engine_url)
    harness = rollout.harness
    if not isinstance(harness, ChatHarness):  # our shell agent: tokens in and out on the engine's /generate
        make = agent_factory(rollout, engine, engine_url, tokenizer_path, lora_path=lora_path)
        yield PolicyAccess(make)
        return
    settings = SessionSettings(
        engine_url, tokenizer_path, engine, rollout.sampling, rollout.episode, harness, lora_path=lora_path
    )
    server = SessionServer(settings, public_url=harness.session_server_url)
    async with server:
        sandbox_kwargs: dict[str, Any] = {}
        url_of = server.session_url
        if harness.in_sandbox_cli and rollout.sandbox.local:
            # The CLI runs in the sandbox: prepare's pinned install, shown read-only, and a bridge from the
            # sandbox's loopback port to the server (wherever it listens), so the harness's URL is the loopback one.
            at = urlsplit(server.url)
            sandbox_kwargs = {"cli_dir": str(installed_cli(rollout.harness.name)), "session_bridge": at.netloc}

            def url_of(session_id: str, seed: int | None = None) -> str:
                return server.session_url(session_id, seed).replace(server.url, f"http://{BRIDGE_HOST}:{at.port}", 1)

        # Each attempt of a trial has a session (and token) of its own: a harness left running in a lost worker's
        # sandbox cannot write into its retry's session, and its requests are refused once its session ended.
        attempts: dict[str, int] = {}

        def session(spec: TrialSpec) -> str:
            return f"{spec.rollout_id}.{attempts[spec.rollout_id]}"

        factory = agent_factory(
            rollout,
            engine,
            engine_url,
            tokenizer_path,
            api_base_for=lambda spec: url_of(session(spec), seed=spec.seed),
            token_for=lambda spec: server.session_token(session(spec)),
        )

        def make_agent(spec: TrialSpec) -> AgentConfig:
            attempts[spec.rollout_id] = attempts.get(spec.rollout_id, -1) + 1
            return factory(spec)

        def to_samples(outcome: TrialOutcome, sample: Sample) -> list[Sample]:
            return segment_samples(sample, server.pop_session(session(outcome.spec)))

        yield PolicyAccess(make_agent, to_samples, lambda spec: server.pop_session(session(spec)), sandbox_kwargs)

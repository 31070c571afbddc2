"""What an agent reports about its trial, and what scoring reads back: the agent -> scoring contract.

An agent keeps a `TrialRecord` and writes it into Harbor's `AgentContext.metadata["grpoflow"]` after every turn,
so it survives errors and timeouts; scoring reads it back from the trial's result. Typed both ways: a misspelt
field fails where it is written, not as a silent default where it is read. A harness that keeps no record (an
installed CLI) reads back as the defaults.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

METADATA_KEY = "grpoflow"

# Why an episode ended (`end_reason`), as the agents report it.
END_DONE = "done"  # the agent said it was done
END_NO_COMMAND = "no_command"  # a reply with no command to run
END_MAX_TURNS = "max_turns"
END_TRUNCATED = "truncated"  # a turn was cut off at the response length limit (the early exit)
END_TOKEN_BUDGET = "token_budget"  # the context window is full
# The agent's time ran out while its engine request was waiting out an engine that did not answer: the episode
# was cut by the outage, not by the policy (`grpoflow.rollout.environments.is_engine_outage`).
END_ENGINE_DOWN = "engine_down"


class TrialRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    end_reason: str | None = None
    turns: int = 0
    policy_calls: int = 0
    commands_run: int = 0
    truncated: bool = False  # a turn was cut off, whether or not the episode ended there
    generation_time_s: float = 0.0
    tool_time_s: float = 0.0
    tokens_after_truncation: int = 0  # generated after a cut-off turn (only with the early exit off)
    # The weight version the engine served each turn with (SGLang's meta_info.weight_version), in turn order; the
    # trial's `weight_version` is its oldest turn's, so a sample is as stale as its oldest turn.
    turn_weight_versions: list[str] = []
    weight_version: str | None = None
    # The exact token trajectory (shell agent; harnesses behind the session server leave these empty): aligned,
    # length T each.
    tokens: list[int] = []
    loss_mask: list[int] = []
    rollout_logprobs: list[float] = []
    prompt_len: int = 0
    messages: list[dict[str, Any]] = []

    def write(self, context: Any) -> None:
        """Into Harbor's `AgentContext` (kept in the trial's result)."""
        context.metadata = {**(context.metadata or {}), METADATA_KEY: self.model_dump(mode="json")}

    @classmethod
    def of(cls, result: Any) -> TrialRecord:
        """From a Harbor `TrialResult`."""
        meta = (result.agent_result.metadata if result.agent_result else None) or {}
        return cls.model_validate(meta.get(METADATA_KEY, {}))

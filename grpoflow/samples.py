"""The record a rollout produces and the trainer consumes: one `Sample` per trial (per segment, for harnesses
that compact their context).

Token layout of a sample, one flat sequence (length T):

    tokens           = prompt ids | turn 1 output ids | tool-output/template ids | turn 2 output ids | ...
    loss_mask        = 0 ...      | 1 ...             | 0 ...                   | 1 ...
    rollout_logprobs = 0.0 ...    | engine logprobs   | 0.0 ...                 | engine logprobs

Only positions with loss_mask 1 are trained; their rollout logprobs are the PPO "old" logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Why an episode ended, in the vocabulary the training side uses.
ExitStatus = Literal[
    "Submitted",  # the agent finished (said done, gave no command, or used its turns) and the verifier ran
    "TimeLimitExceeded",  # agent or environment-start timeout
    "SequenceLengthLimitExceeded",  # a turn hit the response-length limit (sample status TRUNCATED)
    "AgentError",  # the agent or the model failed (not retried)
    "SandboxError",  # the sandbox failed to start, died, or hit an infrastructure error (retried, then recorded)
    "EngineError",  # the engine did not answer for longer than a request waits it out (retried, then recorded)
    "VerifierError",  # the task's verifier crashed, timed out, or wrote no valid reward
]
# Exit statuses of trials that failed for the machinery around the policy (after their retries): never the
# policy's outcome, and counted apart from its failures.
INFRASTRUCTURE_STATUSES: frozenset[str] = frozenset({"SandboxError", "EngineError"})
# What the trainer does with it.
SampleStatus = Literal["COMPLETED", "TRUNCATED", "FAILED"]


class Sample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str
    step: int = Field(ge=0)
    instance_id: str
    group_id: str  # samples sharing it form one GRPO group (same prompt, same step)
    sample_index: int = Field(ge=0)  # index within the group
    rollout_id: str  # one per trial; every segment of a trial carries it
    segment_index: int = 0
    tokens: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    prompt_len: int = Field(ge=0)
    reward: float | None  # None only when the verifier did not produce one (see exit_status / exit_reason)
    status: SampleStatus
    exit_status: ExitStatus
    exit_reason: str | None = None
    weight_version: str | None = None
    messages: list[dict[str, Any]] = Field(default_factory=list)  # the conversation, for people reading traces
    metrics: dict[str, float] = Field(default_factory=dict)  # turns, generation_time_s, tool_time_s, ...

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        n = len(self.tokens)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"tokens ({n}), loss_mask ({len(self.loss_mask)}) and rollout_logprobs "
                f"({len(self.rollout_logprobs)}) must have the same length"
            )
        if self.status != "FAILED" and self.reward is None:
            raise ValueError(f"status {self.status} needs a reward (only FAILED samples may lack one)")
        return self

    @property
    def n_generated(self) -> int:
        return sum(self.loss_mask)


PASS = 1.0  # a reward at least this is a pass (pass@1, pass@k, task health, regrade verdicts)


def select_trainable(
    samples: Sequence[Sample], policy: Literal["drop_group", "keep_group"]
) -> tuple[list[Sample], int]:
    """Samples the trainer may use, and how many groups were dropped because a trial in them FAILED."""
    failed_groups = {s.group_id for s in samples if s.status == "FAILED"}
    if policy == "drop_group":
        return [s for s in samples if s.group_id not in failed_groups], len(failed_groups)
    return [s for s in samples if s.status != "FAILED"], 0

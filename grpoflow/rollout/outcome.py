"""A trial's outcome as a `Sample`: its exit status, the verifier's reward, and what the agent recorded.

The reward is the task verifier's, never invented: a trial without a valid verifier reward is a FAILED sample
with an exit status and a reason, and `select_trainable` (`grpoflow.scoring.groups`) keeps it (and by default
its whole group) out of training rather than scoring it 0.
"""

from __future__ import annotations

from grpoflow.config import RewardRule
from grpoflow.errors import one_line
from grpoflow.rollout.environments import is_engine_outage, is_sandbox_failure_type
from grpoflow.rollout.record import END_TOKEN_BUDGET, END_TRUNCATED, TrialRecord
from grpoflow.rollout.trials import TrialOutcome
from grpoflow.samples import ExitStatus, Sample, SampleStatus

_TIMEOUTS = {"AgentTimeoutError", "EnvironmentStartTimeoutError", "AgentSetupTimeoutError"}
_VERIFIER = {
    "VerifierTimeoutError",
    "RewardFileNotFoundError",
    "RewardFileEmptyError",
    "VerifierOutputParseError",
    "AddTestsDirError",
    "DownloadVerifierDirError",
}
# Length limits, by Harbor's names: a reply cut off at max_tokens (LiteLLM, claude-code's CLI) or a conversation
# past the context window (LiteLLM, installed CLIs). terminus-2 (ours) ends the episode on these without raising.
_LENGTH = {
    "OutputLengthExceededError",
    "OutputTokenExceededError",
    "ContextLengthExceededError",
    "ContextWindowExceededError",
}
# Harbor runs the verifier after these agent endings (`SingleStepTrial._run_agent`: AgentTimeoutError and
# NonZeroAgentExitCodeError with its subclasses, i.e. an installed CLI that exited non-zero), so a reward may stand.
_NON_ZERO_EXIT = {
    "NonZeroAgentExitCodeError",
    "ApiError",
    "ApiRateLimitError",
    "ApiUsageLimitError",
    "ApiInternalServerError",
    "ApiOverloadedError",
    "ApiConnectionClosedError",
    "ApiResponseStalledError",
    "OutputTokenExceededError",
    "ContextWindowExceededError",
    "UnknownApiError",
    "ApiProviderResourceNotFoundError",
    "AgentSafetyRefusalError",
    "AgentAuthenticationError",
    "ModelNotFoundError",
    "UnsupportedModelParametersError",
    "NetworkConnectionError",
}
_VERIFIED_ENDINGS = {"AgentTimeoutError"} | _NON_ZERO_EXIT
# Every Harbor exception name this module maps (a contract test checks each still exists in harbor).
HARBOR_EXCEPTION_NAMES = _TIMEOUTS | _VERIFIER | _LENGTH | _VERIFIED_ENDINGS


def verifier_reward(
    rewards: dict[str, float | int] | None, rule: RewardRule | None = None
) -> tuple[float | None, str | None]:
    """(reward, None) from Harbor's verifier result, or (None, why not). Several rewards need `rule`
    (`dataset.reward`), which then decides even where a `reward` key is among them."""
    if not rewards:
        return None, "verifier wrote no reward"
    if rule is not None and rule.key is not None:
        if rule.key in rewards:
            return float(rewards[rule.key]), None
        return None, f"reward.json has keys {sorted(rewards)}, not dataset.reward `{rule.key}`"
    if rule is not None and rule.weights:
        if missing := [k for k, _ in rule.weights if k not in rewards]:
            return None, f"reward.json has keys {sorted(rewards)}, not {missing} of dataset.reward"
        total = sum(w for _, w in rule.weights)
        return sum(w * float(rewards[k]) for k, w in rule.weights) / total, None
    if "reward" in rewards:
        return float(rewards["reward"]), None
    if len(rewards) == 1:
        return float(next(iter(rewards.values()))), None
    return None, (
        f"reward.json has keys {sorted(rewards)} but no `reward`: set dataset.reward to the key to train on, or "
        "to weights of a mean"
    )


def classify(
    outcome: TrialOutcome, rule: RewardRule | None = None
) -> tuple[ExitStatus, SampleStatus, float | None, str | None]:
    """(exit status, sample status, reward, reason) of one trial; `rule`: which of several verifier rewards
    (`dataset.reward`).

    A truncated turn (the agent's metadata says so: `truncated`, or `end_reason` `truncated`; an installed CLI's
    truncation reaches it through the session server's record) makes a verified sample TRUNCATED, whatever the
    harness did next: the shell agent and terminus-2 end the episode and return normally; an installed CLI dies
    on the session server's refusal (a non-zero exit, after which Harbor still verifies).
    """
    res = outcome.result
    rec = TrialRecord.of(res)
    exc = res.exception_info
    reward, why = verifier_reward(res.verifier_result.rewards if res.verifier_result else None, rule)
    truncated = rec.truncated or rec.end_reason == END_TRUNCATED
    if exc is not None:
        name, reason = exc.exception_type, f"{exc.exception_type}: {one_line(exc.exception_message)}"
        if is_engine_outage(name, rec.end_reason):
            return "EngineError", "FAILED", None, f"{reason} (after {outcome.retries} retries)"
        if name in _VERIFIED_ENDINGS and reward is not None:
            if truncated or name in _LENGTH:
                return "SequenceLengthLimitExceeded", "TRUNCATED", reward, reason
            if name == "AgentTimeoutError":  # cut by the wall clock: over-long, as a cut turn is (train.loss.truncated)
                return "TimeLimitExceeded", "TRUNCATED", reward, reason
            # The CLI failed (API error, auth, crash): the episode says little about the policy.
            return "AgentError", "FAILED", None, f"{reason} (the verifier gave {reward}; not trained)"
        if is_sandbox_failure_type(name):
            status: ExitStatus = "TimeLimitExceeded" if name in _TIMEOUTS else "SandboxError"
            return status, "FAILED", None, f"{reason} (after {outcome.retries} retries)"
        if name in _TIMEOUTS:
            return "TimeLimitExceeded", "FAILED", None, reason
        if name in _VERIFIER:
            return "VerifierError", "FAILED", None, reason
        if name in _LENGTH or truncated:
            return "SequenceLengthLimitExceeded", "FAILED", None, reason
        return "AgentError", "FAILED", None, reason
    if reward is None:
        return "VerifierError", "FAILED", None, why
    # A cut-off turn makes the sample TRUNCATED even when the early exit was off and the episode went on.
    if truncated:
        return "SequenceLengthLimitExceeded", "TRUNCATED", reward, "a turn hit the response length limit"
    # A full context window is over-long too: the episode did not end by itself.
    if rec.end_reason == END_TOKEN_BUDGET:
        return "SequenceLengthLimitExceeded", "TRUNCATED", reward, "the context window is full"
    return "Submitted", "COMPLETED", reward, rec.end_reason


def to_sample(outcome: TrialOutcome, run_id: str, step: int, rule: RewardRule | None = None) -> Sample:
    spec, res = outcome.spec, outcome.result
    rec = TrialRecord.of(res)
    exit_status, status, reward, reason = classify(outcome, rule)
    metrics = {
        "turns": float(rec.turns),
        "policy_calls": float(rec.policy_calls),
        "commands_run": float(rec.commands_run),
        "generation_time_s": rec.generation_time_s,
        "tool_time_s": rec.tool_time_s,
        "tokens_after_truncation": float(rec.tokens_after_truncation),
        "trial_wall_time_s": sum(a.wall_time_s for a in outcome.attempts),
        "retries": float(outcome.retries),
    }
    return Sample(
        run_id=run_id,
        step=step,
        instance_id=spec.instance_id,
        group_id=spec.group_id,
        sample_index=spec.sample_index,
        rollout_id=spec.rollout_id,
        tokens=rec.tokens,
        loss_mask=rec.loss_mask,
        rollout_logprobs=rec.rollout_logprobs,
        prompt_len=rec.prompt_len,
        reward=reward,
        status=status,
        exit_status=exit_status,
        exit_reason=reason,
        weight_version=rec.weight_version,
        messages=rec.messages,
        metrics=metrics,
    )

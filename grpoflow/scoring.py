"""Evaluate: Harbor trial outcomes -> `Sample` records (reward, exit status, metrics) -> per-step metrics.

The reward is the task verifier's, never invented: a trial without a valid verifier reward is a FAILED sample
with an exit status and a reason, and `select_trainable` keeps it (and by default its whole group) out of
training rather than scoring it 0.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from grpoflow.errors import RolloutError
from grpoflow.rollout.environments import is_sandbox_failure_type
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


PASS = 1.0  # a reward at least this is a pass (pass@k, task health, regrade verdicts)


def verifier_reward(rewards: dict[str, float | int] | None) -> tuple[float | None, str | None]:
    """(reward, None) from Harbor's verifier result, or (None, why not)."""
    if not rewards:
        return None, "verifier wrote no reward"
    if "reward" in rewards:
        return float(rewards["reward"]), None
    if len(rewards) == 1:
        return float(next(iter(rewards.values()))), None
    return None, f"reward.json has keys {sorted(rewards)} but no `reward`: cannot tell which one is the reward"


def classify(outcome: TrialOutcome) -> tuple[ExitStatus, SampleStatus, float | None, str | None]:
    """(exit status, sample status, reward, reason) of one trial.

    A truncated turn (the agent's metadata says so: `truncated`, or `end_reason` `truncated`; an installed CLI's
    truncation reaches it through the session server's record) makes a verified sample TRUNCATED, whatever the
    harness did next: the shell agent and terminus-2 end the episode and return normally; an installed CLI dies
    on the session server's refusal (a non-zero exit, after which Harbor still verifies).
    """
    res = outcome.result
    rec = TrialRecord.of(res)
    exc = res.exception_info
    reward, why = verifier_reward(res.verifier_result.rewards if res.verifier_result else None)
    truncated = rec.truncated or rec.end_reason == END_TRUNCATED
    if exc is not None:
        name, reason = exc.exception_type, f"{exc.exception_type}: {' '.join(exc.exception_message.split())[:300]}"
        if name in _VERIFIED_ENDINGS and reward is not None:
            if truncated or name in _LENGTH:
                return "SequenceLengthLimitExceeded", "TRUNCATED", reward, reason
            if name == "AgentTimeoutError":
                return "TimeLimitExceeded", "COMPLETED", reward, reason
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


def to_sample(outcome: TrialOutcome, run_id: str, step: int) -> Sample:
    spec, res = outcome.spec, outcome.result
    rec = TrialRecord.of(res)
    exit_status, status, reward, reason = classify(outcome)
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


def select_trainable(
    samples: Sequence[Sample], policy: Literal["drop_group", "keep_group"]
) -> tuple[list[Sample], int]:
    """Samples the trainer may use, and how many groups were dropped because a trial in them FAILED."""
    failed_groups = {s.group_id for s in samples if s.status == "FAILED"}
    if policy == "drop_group":
        return [s for s in samples if s.group_id not in failed_groups], len(failed_groups)
    return [s for s in samples if s.status != "FAILED"], 0


def sample_version(sample: Sample, launched: int) -> int:
    """The number of updates in the weights that generated `sample`: its recorded `weight_version` when that is
    a number, else `launched` (the version the step's rollout started on: an engine that labels its first
    weights otherwise, as SGLang's "default")."""
    try:
        return int(sample.weight_version or "")
    except ValueError:
        return launched


def drop_stale(
    samples: Sequence[Sample], step: int, launched: int, max_staleness: int
) -> tuple[list[Sample], dict[str, float]]:
    """The samples step `step` (whose trainer holds `step` updates) may train on: whole groups whose every sample
    is at most `max_staleness` updates old, so GRPO's group statistics stay whole. Metrics: how many samples each
    staleness had (`staleness/<k>`), and of the dropped ones how many, their groups, and their episode lengths
    (generated tokens), so a bound that starves long episodes shows."""
    age = {id(s): step - sample_version(s, launched) for s in samples}
    stale = {s.group_id for s in samples if age[id(s)] > max_staleness}
    kept = [s for s in samples if s.group_id not in stale]
    dropped = [s.n_generated for s in samples if s.group_id in stale]
    metrics = {f"staleness/{k}": float(n) for k, n in sorted(Counter(age.values()).items())}
    metrics |= {"stale_dropped": float(len(dropped)), "stale_dropped_groups": float(len(stale))}
    if dropped:
        metrics |= {"stale_dropped_tokens_mean": statistics.fmean(dropped), "stale_dropped_tokens_max": max(dropped)}
    return kept, metrics


def informative_groups(samples: Sequence[Sample], policy: Literal["drop_group", "keep_group"]) -> set[str]:
    """The groups that give the trainer a GRPO signal: trainable under `policy` (`select_trainable`), with at
    least two scored trials whose rewards differ."""
    rewards: dict[str, set[float]] = defaultdict(set)
    for s in select_trainable(samples, policy)[0]:
        rewards[s.group_id].add(s.reward)
    return {g for g, r in rewards.items() if len(r) > 1}


@dataclass
class FailedSteps:
    """Counts the steps in a row whose every trial failed (nothing was scored). A run whose sandboxes,
    agent or template fail every trial would otherwise commit checkpoints of unchanged weights and "succeed";
    after `limit` such steps it stops, naming the most common reasons."""

    limit: int
    streak: int = 0

    def record(self, step: int, samples: Sequence[Sample], trainable: Sequence[Sample]) -> None:
        if trainable or not samples or any(s.status != "FAILED" for s in samples):
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= self.limit:
            reasons = Counter(
                f"{s.exit_status}: {(s.exit_reason or '')[:120]}" for s in samples if s.status == "FAILED"
            )
            top = "; ".join(f"{n}x {r}" for r, n in reasons.most_common(3))
            raise RolloutError(
                f"steps {step - self.streak + 1}..{step}: every trial failed, nothing was trained "
                f"(train.max_failed_steps={self.limit}); most common: {top}"
            )


def step_metrics(samples: Sequence[Sample], wall_time_s: float, success_threshold: float = PASS) -> dict[str, float]:
    """Rollout/evaluate metrics of one step. Rewards are averaged over trials that have one.

    A trial is one rollout however many segments it trained as (a compacted session gives several samples with
    one rollout_id, each repeating the trial's reward and metrics): trial-level figures count each rollout once,
    and `tokens_generated` sums every sample's trained tokens (shared tokens are masked in all but one)."""
    tokens_generated = float(sum(s.n_generated for s in samples))
    trials: dict[str, Sample] = {}
    for s in samples:
        trials.setdefault(s.rollout_id, s)  # the first segment stands for its rollout
    samples = list(trials.values())
    n = len(samples)
    scored = [s for s in samples if s.reward is not None]
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in scored:
        groups[s.group_id].append(s)
    stds = [statistics.pstdev([s.reward for s in g]) for g in groups.values()]
    m: dict[str, float] = {
        "trials": float(n),
        "scored": float(len(scored)),
        "reward_mean": statistics.fmean(s.reward for s in scored) if scored else float("nan"),
        "pass_at_1": statistics.fmean(s.reward >= success_threshold for s in scored) if scored else float("nan"),
        "pass_at_k": statistics.fmean(any(s.reward >= success_threshold for s in g) for g in groups.values())
        if groups
        else float("nan"),
        "group_reward_std_mean": statistics.fmean(stds) if stds else float("nan"),
        "zero_std_group_share": statistics.fmean(sd == 0.0 for sd in stds) if stds else float("nan"),
        "truncated_ratio": sum(s.status == "TRUNCATED" for s in samples) / n if n else float("nan"),
        "tokens_after_truncation": sum(s.metrics.get("tokens_after_truncation", 0.0) for s in samples),
        "tokens_generated": tokens_generated,
        "retries": sum(s.metrics.get("retries", 0.0) for s in samples),
        "trials_retried": float(sum(s.metrics.get("retries", 0.0) > 0 for s in samples)),
        "wall_time_s": wall_time_s,
    }
    gen = sum(s.metrics.get("generation_time_s", 0.0) for s in samples)
    tool = sum(s.metrics.get("tool_time_s", 0.0) for s in samples)
    trial_wall = sum(s.metrics.get("trial_wall_time_s", 0.0) for s in samples)
    # Summed over trials (they overlap in time): what each trial spent generating, in tools, and in between.
    m.update({"generation_time_s": gen, "tool_time_s": tool, "overhead_time_s": max(0.0, trial_wall - gen - tool)})
    if any("requests" in s.metrics for s in samples):  # trials through the session server (grpoflow.rollout.sessions)
        requests = sum(s.metrics.get("requests", 0.0) for s in samples)
        m["session/requests"] = requests
        m["session/segments"] = sum(s.metrics.get("segments", 1.0) for s in samples)
        m["session/refused_requests"] = sum(s.metrics.get("refused_requests", 0.0) for s in samples)
        m["session/abandoned_turns"] = sum(s.metrics.get("abandoned_turns", 0.0) for s in samples)
        # how often tokenising the re-sent history would NOT have given the tokens the policy produced
        m["session/retokenize_mismatch_rate"] = (
            sum(s.metrics.get("retokenize_mismatches", 0.0) for s in samples) / requests if requests else 0.0
        )
    for status, count in Counter(s.exit_status for s in samples).items():
        m[f"exit/{status}"] = float(count)
    return m

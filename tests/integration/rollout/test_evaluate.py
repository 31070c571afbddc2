"""Evaluate maps real Harbor result models (not fakes) to samples; a drift in Harbor's fields breaks these."""

from datetime import datetime, timezone
from pathlib import Path

import pytest
from harbor.models.agent.context import AgentContext
from harbor.models.task.id import LocalTaskId
from harbor.models.trial.config import AgentConfig, TaskConfig, TrialConfig
from harbor.models.trial.result import AgentInfo, ExceptionInfo, TrialResult
from harbor.models.verifier.result import VerifierResult

from grpoflow.rollout.metrics import step_metrics
from grpoflow.rollout.outcome import to_sample, verifier_reward
from grpoflow.rollout.trials import Attempt, TrialOutcome, TrialSpec
from grpoflow.samples import select_trainable


def _outcome(reward=None, rewards=None, exc=None, end_reason="done", n_attempts=1, group="g", k=0, gen=3):
    meta = {
        "grpoflow": {
            "end_reason": end_reason,
            "turns": 1,
            "tokens": [1, 2, 3] + [4] * gen,
            "loss_mask": [0, 0, 0] + [1] * gen,
            "rollout_logprobs": [0.0] * 3 + [-0.5] * gen,
            "prompt_len": 3,
            "messages": [],
            "generation_time_s": 0.2,
            "tool_time_s": 0.1,
            "tokens_after_truncation": 0,
            "weight_version": "3",
        }
    }
    if reward is not None:
        rewards = {"reward": reward}
    res = TrialResult(
        task_name="t",
        trial_name="t__0",
        trial_uri="file:///x",
        task_id=LocalTaskId(path=Path("/x/t")),
        task_checksum="0",
        config=TrialConfig(task=TaskConfig(path=Path("/x/t")), agent=AgentConfig(name="nop")),
        agent_info=AgentInfo(name="grpoflow-shell", version="1"),
        agent_result=AgentContext(metadata=meta),
        verifier_result=VerifierResult(rewards=rewards) if rewards is not None else None,
        exception_info=None
        if exc is None
        else ExceptionInfo(
            exception_type=exc,
            exception_message="boom\nline two",
            exception_traceback="",
            occurred_at=datetime.now(timezone.utc),
        ),
    )
    attempts = [Attempt("d", None, None, 1.0) for _ in range(n_attempts)]
    return TrialOutcome(TrialSpec("t", "/x/t", group, k, f"{group}-{k}", 0), res, attempts)


def test_submitted_sample_carries_the_verifier_reward_and_tokens():
    s = to_sample(_outcome(reward=1.0), "r", 2)
    assert (s.exit_status, s.status, s.reward, s.step) == ("Submitted", "COMPLETED", 1.0, 2)
    assert s.tokens == [1, 2, 3, 4, 4, 4] and s.n_generated == 3 and s.weight_version == "3"


def test_truncated_episode_is_scored_and_marked():
    s = to_sample(_outcome(reward=0.0, end_reason="truncated"), "r", 0)
    assert (s.exit_status, s.status, s.reward) == ("SequenceLengthLimitExceeded", "TRUNCATED", 0.0)


@pytest.mark.parametrize(
    "exc, reward, exit_status, status",
    [
        ("AgentTimeoutError", 1.0, "TimeLimitExceeded", "TRUNCATED"),  # verifier ran: the reward stands, cut short
        ("EnvironmentStartTimeoutError", None, "TimeLimitExceeded", "FAILED"),
        ("SandboxStartError", None, "SandboxError", "FAILED"),
        ("EngineError", None, "AgentError", "FAILED"),
        ("RuntimeError", None, "AgentError", "FAILED"),
        ("VerifierOutputParseError", None, "VerifierError", "FAILED"),
        ("RewardFileNotFoundError", None, "VerifierError", "FAILED"),
    ],
)
def test_exceptions_map_to_the_exit_status_vocabulary(exc, reward, exit_status, status):
    s = to_sample(_outcome(reward=reward, exc=exc), "r", 0)
    assert (s.exit_status, s.status) == (exit_status, status)
    assert s.exit_reason.startswith(exc) and "\n" not in s.exit_reason
    if status == "FAILED":
        assert s.reward is None  # never a silent 0


def test_no_reward_without_exception_is_a_verifier_error_not_zero():
    s = to_sample(_outcome(rewards=None), "r", 0)
    assert (s.exit_status, s.status, s.reward) == ("VerifierError", "FAILED", None)


def test_reward_json_shapes():
    assert verifier_reward({"reward": 0.5}) == (0.5, None)
    assert verifier_reward({"accuracy": 1}) == (1.0, None)
    value, why = verifier_reward({"a": 1, "b": 0})
    assert value is None and "no `reward`" in why


def test_failed_trial_drops_its_group_by_default_or_only_itself():
    samples = [
        to_sample(_outcome(reward=1.0, group="a", k=0), "r", 0),
        to_sample(_outcome(exc="SandboxStartError", group="a", k=1, n_attempts=3), "r", 0),
        to_sample(_outcome(reward=0.0, group="b", k=0), "r", 0),
    ]
    kept, dropped = select_trainable(samples, "drop_group")
    assert [s.group_id for s in kept] == ["b"] and dropped == 1
    kept, dropped = select_trainable(samples, "keep_group")
    assert [(s.group_id, s.sample_index) for s in kept] == [("a", 0), ("b", 0)] and dropped == 0


def test_step_metrics():
    samples = [
        to_sample(_outcome(reward=1.0, group="a", k=0), "r", 0),
        to_sample(_outcome(reward=0.0, group="a", k=1, end_reason="truncated"), "r", 0),
        to_sample(_outcome(reward=0.0, group="b", k=0), "r", 0),
        to_sample(_outcome(reward=0.0, group="b", k=1), "r", 0),
        to_sample(_outcome(exc="SandboxStartError", group="c", k=0, n_attempts=3), "r", 0),
    ]
    m = step_metrics(samples, wall_time_s=2.0).computed
    assert m["trials"] == 5 and m["scored"] == 4
    assert m["reward_mean"] == 0.25 and m["pass_at_1"] == 0.25 and m["pass_at_k"] == 0.5
    assert m["zero_std_group_share"] == 0.5 and m["group_reward_std_mean"] == 0.25
    assert m["truncated_ratio"] == 0.2 and m["retries"] == 2 and m["trials_retried"] == 1
    assert m["exit/Submitted"] == 3 and m["exit/SequenceLengthLimitExceeded"] == 1 and m["exit/SandboxError"] == 1
    assert m["tokens_generated"] == 15  # a failed trial's tokens were still generated


def test_step_metrics_count_a_segmented_rollout_once():
    """A compacted session trains as several samples of one rollout: trial figures must not count it twice."""
    whole = [
        to_sample(_outcome(reward=1.0, group="a", k=0), "r", 0),
        to_sample(_outcome(reward=0.0, group="a", k=1), "r", 0),
    ]
    first = whole[0]
    # the same rollout split into two segments that each train half of its tokens
    half = len(first.tokens) // 2
    seg0 = first.model_copy(update={"loss_mask": [1 if i < half else 0 for i in range(len(first.tokens))]})
    seg1 = first.model_copy(
        update={"segment_index": 1, "loss_mask": [0 if i < half else 1 for i in range(len(first.tokens))]}
    )
    m_whole = step_metrics(whole, wall_time_s=1.0).computed
    m_split = step_metrics([seg0, seg1, whole[1]], wall_time_s=1.0).computed
    for key in ("trials", "scored", "reward_mean", "pass_at_1", "pass_at_k", "group_reward_std_mean", "retries"):
        assert m_split[key] == m_whole[key], key
    assert m_split["trials"] == 2
    assert m_split["tokens_generated"] == sum(s.n_generated for s in [seg0, seg1, whole[1]])


def test_the_trial_record_is_typed_both_ways():
    from types import SimpleNamespace

    from pydantic import ValidationError

    from grpoflow.rollout.record import TrialRecord

    with pytest.raises(ValidationError, match="turn"):
        TrialRecord(turn=3)  # a misspelt field fails where it is written, not as a default where it is read
    context = SimpleNamespace(metadata={"harbor": 1})
    TrialRecord(turns=2, truncated=True, tokens=[5, 6]).write(context)
    result = SimpleNamespace(agent_result=SimpleNamespace(metadata=context.metadata))
    assert TrialRecord.of(result) == TrialRecord(turns=2, truncated=True, tokens=[5, 6])
    assert context.metadata["harbor"] == 1
    assert TrialRecord.of(SimpleNamespace(agent_result=None)) == TrialRecord()  # an installed CLI keeps none


def test_steps_whose_every_trial_failed_stop_the_run_after_the_limit_with_the_reasons():
    from grpoflow.errors import RolloutError
    from grpoflow.scoring.groups import FailedSteps

    failed = [to_sample(_outcome(reward=None, group=g, exc="SandboxStartError"), "r", 0) for g in ("a", "b")]
    ok = [to_sample(_outcome(reward=1.0, group="c"), "r", 0)]
    guard = FailedSteps(limit=2)
    guard.record(0, failed, [])
    guard.record(1, failed + ok, ok)  # something trained: the streak starts again
    guard.record(2, failed, [])
    with pytest.raises(RolloutError, match=r"steps 2\.\.3: every trial failed.*2x SandboxError"):
        guard.record(3, failed, [])
    guard = FailedSteps(limit=1)
    guard.record(0, failed + ok, [])  # a group with a failure dropped the rest, but a trial was scored: not counted
    guard.record(1, [], [])  # nothing ran: not counted either


def test_a_full_context_window_is_an_over_long_ending():
    s = to_sample(_outcome(reward=0.0, end_reason="token_budget"), "r", 0)
    assert (s.exit_status, s.status, s.reward) == ("SequenceLengthLimitExceeded", "TRUNCATED", 0.0)
    assert s.exit_reason == "the context window is full"


def test_a_wall_clock_cut_is_masked_like_a_cut_turn():
    """An episode Harbor's agent timeout cut keeps its reward but did not end by itself: `truncated=mask` keeps
    its tokens out of the loss, as it does a turn cut at max_new_tokens."""
    from grpoflow.config import RunConfig
    from grpoflow.train.step import shape_overlong

    s = to_sample(_outcome(reward=1.0, exc="AgentTimeoutError"), "r", 0)
    assert s.status == "TRUNCATED" and s.reward == 1.0 and sum(s.loss_mask) > 0
    shaped, m = shape_overlong([s], RunConfig(train={"truncated": "mask"}))
    assert sum(shaped[0].loss_mask) == 0 and m == {"truncated_masked": 1.0}

"""terminus-2 through the session server (grpoflow.rollout.sessions) over a scripted /generate, wired as the rollout task
wires it (`grpoflow.rollout.step.policy_access`): each trial's session becomes its samples."""

from __future__ import annotations

import shutil

import pytest

from tests.fakes.rollout_step import scripted_task_step
from tests.fakes.scripted_engine import Reply
from tests.fakes.scripted_openai import terminus_json

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("tmux") is None, reason="needs bubblewrap and tmux"
)
sessions = pytest.importorskip("grpoflow.rollout.sessions.server")


def _run(tmp_path, tiny_model_dir, script):
    rollout = {"harness": "terminus-2", "max_context_tokens": 8192}
    res, engine = scripted_task_step(tiny_model_dir, script, rollout, tmp_path)
    return res.samples[0], res.samples[0].metrics, res.samples, engine


def test_a_solved_episode_is_one_token_exact_segment(tmp_path, tiny_model_dir):
    replies = [
        terminus_json(["echo hello > /app/hello.txt"]),
        terminus_json([], done=True),
        terminus_json([], done=True),
    ]
    s, stats, segs, engine = _run(tmp_path, tiny_model_dir, lambda ids, i: Reply(replies[min(i, 2)]))
    assert stats["segments"] == 1 and stats["retokenize_mismatches"] <= stats["requests"]
    assert (s.reward, s.exit_status, s.metrics["commands_run"]) == (1.0, "Submitted", 1.0)
    assert stats["requests"] == 3 == len(engine.calls) and stats["requests_extended"] == 2
    [seg] = segs
    # Each turn's prompt is the recorded tokens so far: the last engine call's input is a prefix of the segment.
    last_input = engine.calls[-1].input_ids
    assert seg.tokens[: len(last_input)] == last_input and seg.status == "COMPLETED"
    generated = sum(len(engine.tokenizer.encode(r, add_special_tokens=False)) + 1 for r in replies)  # + EOS each
    assert sum(seg.loss_mask) == generated


def test_a_truncated_turn_is_the_last_request_and_the_sample_is_truncated(tmp_path, tiny_model_dir):
    cut = terminus_json(["echo hello > /app/hello.txt"]) + ' {"analysis": "more'
    s, stats, segs, engine = _run(tmp_path, tiny_model_dir, lambda ids, i: Reply(cut, finish="length"))
    assert len(engine.calls) == 1 and stats["refused_requests"] == 0  # terminus-2 asked for nothing more
    assert (s.status, s.exit_status, s.reward) == ("TRUNCATED", "SequenceLengthLimitExceeded", 0.0)
    [seg] = segs
    assert seg.status == "TRUNCATED" and sum(seg.loss_mask) > 0

"""The shell agent in real Harbor trials, in the local sandbox, against a scripted policy."""

import asyncio
import json
import shutil

import pytest

from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import builtin_dataset_path, load_task
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.harnesses import agent_factory
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials
from grpoflow.scoring.groups import drop_stale
from tests.fakes.scripted_engine import Reply, ScriptedEngine

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def _prompt(name):
    t = load_task(builtin_dataset_path() / name)
    return PromptRecord(instance_id=name, task_path=str(t.path), instruction=t.instruction)


def _run(tmp_path, engine, tiny_model_dir, prompts, **rollout):
    cfg = parse_run_config({"rollout": {"n_samples_per_prompt": 1, "max_turns": 4, "retry_backoff_s": 0.0, **rollout}})
    make_agent = agent_factory(cfg.rollout, cfg.engine, engine.url, str(tiny_model_dir))
    return asyncio.run(
        collect_step(
            "t",
            0,
            plan_group_trials(prompts, 0, cfg.rollout.n_samples_per_prompt, 0),
            cfg.rollout,
            PolicyAccess(make_agent),
            sandbox_config(cfg.rollout),
            tmp_path / "trials",
            tmp_path / "details",
        )
    )


def test_solving_policy_scores_one_with_token_exact_trajectory(tmp_path, tiny_model_dir):
    replies = ["```bash\necho hello > /app/hello.txt\n```", "DONE"]
    engine = ScriptedEngine(str(tiny_model_dir), lambda ids, i: Reply(replies[min(i, 1)]))
    try:
        res = _run(tmp_path, engine, tiny_model_dir, [_prompt("hello-file")])
    finally:
        engine.stop()
    [s] = res.samples
    assert (s.reward, s.exit_status, s.status) == (1.0, "Submitted", "COMPLETED")
    assert s.metrics["turns"] == 2 and s.metrics["commands_run"] == 1
    # The second call's prompt is exactly the trajectory up to that point, and the sample ends with the 2nd reply.
    second = engine.calls[1].input_ids
    assert s.tokens[: len(second)] == second
    gen2 = s.tokens[len(second) :]
    assert s.loss_mask[len(second) :] == [1] * len(gen2) and s.rollout_logprobs[len(second) :] == pytest.approx(
        [-0.1 * (i + 1) for i in range(len(gen2))]
    )
    assert sum(s.loss_mask) == sum(len(engine.tokenizer.encode(r)) + 1 for r in replies)
    assert "exit code 0" in s.messages[3]["content"] and s.weight_version == "7"
    assert (res.details_path).read_text().count("\n") == 1


def test_each_turn_records_its_weight_version_and_the_sample_is_as_old_as_its_oldest(tmp_path, tiny_model_dir):
    """An engine whose weights change between two turns of one trial (an attached SGLang synced by another
    trainer, a router's replicas mid-sync): the trial records both versions, and its sample counts as the older."""
    replies = [
        Reply("```bash\necho hello > /app/hello.txt\n```", weight_version="3"),
        Reply("DONE", weight_version="4"),
    ]
    engine = ScriptedEngine(str(tiny_model_dir), lambda ids, i: replies[min(i, 1)])
    try:
        res = _run(tmp_path, engine, tiny_model_dir, [_prompt("hello-file")])
    finally:
        engine.stop()
    [s] = res.samples
    assert s.metrics["turns"] == 2 and s.weight_version == "3"
    [result] = (tmp_path / "trials").rglob("result.json")
    record = json.loads(result.read_text())["agent_result"]["metadata"]["grpoflow"]
    assert record["turn_weight_versions"] == ["3", "4"] and record["weight_version"] == "3"
    kept, metrics = drop_stale([s], step=4, max_staleness=0)
    assert not kept and metrics["staleness/1"] == 1.0  # the newer turn does not make the sample fresh


def test_truncated_turn_ends_episode_without_running_the_cut_command(tmp_path, tiny_model_dir):
    # Every turn is cut off mid-command: the half-written command would create the file the task asks for.
    cut = "```bash\necho hello > /app/hello.txt; touch /app/side-effect"
    engine = ScriptedEngine(str(tiny_model_dir), lambda ids, i: Reply(cut, finish="length"))
    try:
        res = _run(tmp_path, engine, tiny_model_dir, [_prompt("hello-file")] * 1, n_samples_per_prompt=3)
    finally:
        engine.stop()
    assert len(engine.calls) == 3  # one policy call per episode
    for s in res.samples:
        assert (s.status, s.exit_status) == ("TRUNCATED", "SequenceLengthLimitExceeded")
        assert s.reward == 0.0  # the verifier ran: the file was never written
        assert s.metrics["commands_run"] == 0 and s.metrics["tokens_after_truncation"] == 0
        assert s.messages[-1]["role"] == "assistant" and s.messages[-1]["content"] == cut  # the turn stays
    assert res.figures.computed["tokens_after_truncation"] == 0 and res.figures.computed["truncated_ratio"] == 1.0
    verifier_out = list((tmp_path / "trials").glob("*/verifier/reward.txt"))
    assert len(verifier_out) == 3


def test_without_early_exit_the_cut_command_runs_and_generation_continues(tmp_path, tiny_model_dir):
    cut = "```bash\necho hello > /app/hello.txt"
    engine = ScriptedEngine(str(tiny_model_dir), lambda ids, i: Reply(cut, finish="length"))
    try:
        res = _run(tmp_path, engine, tiny_model_dir, [_prompt("hello-file")], early_truncation_exit=False, max_turns=3)
    finally:
        engine.stop()
    [s] = res.samples
    assert len(engine.calls) == 3 and s.metrics["commands_run"] == 3
    assert s.metrics["tokens_after_truncation"] > 0 and s.reward == 1.0
    assert s.status == "TRUNCATED"  # a cut-off turn marks the sample even when the episode went on


def test_engine_failure_is_an_agent_error_not_a_zero_and_not_retried(tmp_path, tiny_model_dir):
    engine = ScriptedEngine(str(tiny_model_dir), lambda ids, i: Reply("", status=400))
    try:
        res = _run(tmp_path, engine, tiny_model_dir, [_prompt("hello-file")], sandbox_retries=2)
    finally:
        engine.stop()
    [s] = res.samples
    assert (s.status, s.exit_status, s.reward) == ("FAILED", "AgentError", None)
    assert "EngineError" in s.exit_reason and s.metrics["retries"] == 0

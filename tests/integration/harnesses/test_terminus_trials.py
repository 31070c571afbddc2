"""Real terminus-2 (Harbor's, through our binding) in real Harbor trials, in the local sandbox.

Against a scripted OpenAI endpoint: solving, the early truncation exit (both parsers), max_turns=0, the key from a
file. Against the embedded engine with the tiny random model: junk ends as a recorded exit status.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import builtin_dataset_path, load_task
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.harnesses import agent_factory
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials
from tests.fakes.scripted_openai import Reply, ScriptedOpenAI, terminus_json

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("tmux") is None, reason="needs bubblewrap and tmux"
)


def _prompt(name: str) -> PromptRecord:
    t = load_task(builtin_dataset_path() / name)
    return PromptRecord(instance_id=name, task_path=str(t.path), instruction=t.instruction)


def _run(tmp_path: Path, url: str, tokenizer_path: str, *, model: str | None = "scripted", n: int = 1, **rollout):
    cfg = parse_run_config(
        {
            "rollout": {
                "harness": "terminus-2",
                "n_samples_per_prompt": n,
                "max_turns": 4,
                "retry_backoff_s": 0.0,
                "max_context_tokens": 8192,
                **rollout,
            }
        }
    )
    make_agent = agent_factory(cfg.rollout, cfg.engine, url, tokenizer_path, model=model)
    return asyncio.run(
        collect_step(
            "t",
            0,
            plan_group_trials([_prompt("hello-file")], 0, cfg.rollout.n_samples_per_prompt, 0),
            cfg.rollout,
            PolicyAccess(make_agent),
            sandbox_config(cfg.rollout),
            tmp_path / "trials",
            tmp_path / "details",
        )
    )


def _results(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "trials").glob("*/result.json"))]


def test_terminus_2_solves_the_task_through_tmux_and_reports_tool_time(tmp_path):
    replies = [
        terminus_json(["echo hello > /app/hello.txt"]),
        terminus_json([], done=True),
        terminus_json([], done=True),
    ]
    server = ScriptedOpenAI(lambda msgs, i: Reply(replies[min(i, 2)]))
    try:
        res = _run(tmp_path, server.url, "unused", temperature=0.3, top_k=5, max_new_tokens=77)
    finally:
        server.stop()
    [s] = res.samples
    assert (s.reward, s.exit_status, s.status) == (1.0, "Submitted", "COMPLETED")
    assert s.metrics["commands_run"] == 1 and s.metrics["policy_calls"] == len(server.requests) == 3
    assert s.metrics["tool_time_s"] > 0 and res.figures.seconds["tool_time_s"] == s.metrics["tool_time_s"]
    assert s.metrics["generation_time_s"] > 0
    body = server.requests[0]["body"]
    # The sampling params of the config reach every policy call; the trial's seed too.
    assert (body["temperature"], body["max_tokens"], body["top_k"], body["top_p"]) == (0.3, 77, 5, 1.0)
    [spec] = plan_group_trials([_prompt("hello-file")], 0, 1, 0)
    assert [r["body"]["seed"] for r in server.requests] == [spec.seed] * 3
    assert body["model"] == "scripted" and server.requests[0]["authorization"] == "Bearer grpoflow-local"
    # The command's output came back through the terminal (tmux lived across the sandbox's execs).
    assert "hello.txt" in json.dumps(server.requests[1]["body"]["messages"])


@pytest.mark.parametrize("parser", ["json", "xml"])
def test_a_truncated_turn_ends_the_episode_verified_and_runs_none_of_its_commands(tmp_path, parser):
    # The cut reply holds a complete command that would solve the task: XML's salvage would run it, and terminus-2
    # would otherwise re-send the cut reply with an error turn (refused by the server, like the session server).
    if parser == "json":
        cut = terminus_json(["echo hello > /app/hello.txt"]) + ' {"analysis": "more'
    else:
        cut = (
            '<response><analysis>a</analysis><plan>p</plan><commands><keystrokes duration="0.1">'
            "echo hello &gt; /app/hello.txt\n</keystrokes></commands></response>\n<response><analysis>more"
        )
    server = ScriptedOpenAI(lambda msgs, i: Reply(cut, finish="length"))
    try:
        res = _run(tmp_path, server.url, "unused", parser=parser, n=2)
    finally:
        server.stop()
    assert len(server.requests) == 2 and server.refused == 0  # one policy call per episode, none after the cut
    for s in res.samples:
        assert (s.status, s.exit_status, s.reward) == ("TRUNCATED", "SequenceLengthLimitExceeded", 0.0)
        assert s.metrics["commands_run"] == 0 and s.metrics["turns"] == 1
    for r in _results(tmp_path):
        assert r["exception_info"] is None and r["verifier_result"]["rewards"] == {"reward": 0.0}  # verified


def test_max_turns_zero_means_no_policy_call_not_unlimited(tmp_path):
    server = ScriptedOpenAI(lambda msgs, i: Reply(terminus_json(["true"])))
    try:
        res = _run(tmp_path, server.url, "unused", max_turns=0)
    finally:
        server.stop()
    [s] = res.samples
    assert server.requests == [] and s.metrics["policy_calls"] == 0
    assert (s.exit_status, s.status, s.reward, s.exit_reason) == ("Submitted", "COMPLETED", 0.0, "max_turns")


def test_the_policy_key_comes_from_a_file_and_is_written_nowhere(tmp_path, monkeypatch):
    from grpoflow.credentials import POLICY_KEY_VAR, export_policy_key

    key = "sk-policy-test-4242"
    key_file = tmp_path / "policy.key"
    key_file.write_text(key + "\n")
    monkeypatch.delenv(POLICY_KEY_VAR, raising=False)
    export_policy_key(str(key_file))  # what the rollout task does before the trials
    server = ScriptedOpenAI(lambda msgs, i: Reply(terminus_json([], done=True)))
    try:
        res = _run(tmp_path / "run", server.url, "unused", policy_api_key_file=str(key_file), max_turns=1)
    finally:
        server.stop()
    assert server.requests[0]["authorization"] == f"Bearer {key}"
    assert res.samples[0].exit_status == "Submitted"
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and key in p.read_text(errors="replace")]
    assert written == []


def test_junk_from_the_embedded_engine_ends_as_a_recorded_exit_status(tmp_path, tiny_model_dir):
    from grpoflow.engine.launch import start_embedded_engine

    with start_embedded_engine(str(tiny_model_dir), seed=0, threads=1, log_path=tmp_path / "engine.log") as engine:
        res = _run(tmp_path, engine.url, str(tiny_model_dir), model=None, max_new_tokens=24, max_turns=2)
    [s] = res.samples
    [r] = _results(tmp_path)
    # Verified (the verifier's reward, not an invented 0), with why the episode ended.
    assert r["verifier_result"]["rewards"] == {"reward": s.reward} and s.reward is not None
    assert s.exit_status in ("Submitted", "SequenceLengthLimitExceeded") and s.exit_reason
    assert r["agent_result"]["metadata"]["grpoflow"]["end_reason"] in ("truncated", "max_turns", "done")
    assert s.metrics["policy_calls"] >= 1

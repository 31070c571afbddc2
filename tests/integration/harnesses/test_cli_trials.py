"""The real claude-code and opencode CLIs (the pinned npm packages prepare installs) in real Harbor trials in the
local sandbox, through the session server and the sandbox's bridge, against a scripted policy (exact tokens, no
model): solving a task, the samples token-exact with tool output masked, and a cut-off turn ending TRUNCATED."""

from __future__ import annotations

import json
import shutil

import pytest

from grpoflow.prepare.clis import ensure_cli
from tests.fakes.rollout_step import scripted_task_step
from tests.fakes.scripted_engine import Reply

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("npm") is None, reason="needs bubblewrap and npm"
)
HARNESSES = ["claude-code", "opencode"]
# claude-code's shell tool is `Bash`, opencode's `bash` (which also asks for a description)
TOOL = {"claude-code": ("Bash", {}), "opencode": ("bash", {"description": "write the file"})}
COMMAND = "echo hello > /app/hello.txt && cat /app/hello.txt && echo tool-output-marker"


def _call(harness: str) -> str:
    name, extra = TOOL[harness]
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"command": COMMAND, **extra}}) + "\n</tool_call>"


def _run(tmp_path, tiny_model_dir, harness: str, script):
    ensure_cli(harness)
    # the CLIs' system prompts and tools run to thousands of tokens; the scripted engine takes any
    return scripted_task_step(tiny_model_dir, script, {"harness": harness, "max_context_tokens": 100_000}, tmp_path)


def _policy(harness: str, tok):
    """Solve the task: one tool call, then a final answer once the tool's output came back. opencode also asks
    the policy for a title (a request of its own)."""
    call = _call(harness)

    def script(ids: list[int], i: int) -> Reply:
        prompt = tok.decode(ids)
        if "title generator" in prompt:
            return Reply(text="Hello file")
        return Reply(text="Done." if "tool-output-marker" in prompt.split(call)[-1] else call)

    return script


@pytest.mark.parametrize("harness", HARNESSES)
def test_the_real_cli_solves_a_task_token_exact_with_tool_output_masked(tmp_path, tiny_model_dir, harness):
    from grpoflow.tokens import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    res, engine = _run(tmp_path, tiny_model_dir, harness, _policy(harness, tok))
    main = [s for s in res.samples if any("tool-output-marker" in (m.get("content") or "") for m in s.messages)]
    assert {(s.reward, s.status, s.exit_status) for s in res.samples} == {(1.0, "COMPLETED", "Submitted")}
    [sample] = main  # the segment that ran the tool and answered
    assert sample.metrics["retokenize_mismatches"] == 0 and sample.metrics["refused_requests"] == 0
    call_ids = engine.tokenizer.encode(_call(harness), add_special_tokens=False) + [engine.tokenizer.eos_token_id]
    done_ids = engine.tokenizer.encode("Done.", add_special_tokens=False) + [engine.tokenizer.eos_token_id]
    trained = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
    assert trained == call_ids + done_ids  # exactly the generated tokens: the tool's output never trains
    # ...and the tool's output is in the sample, as prompt tokens
    text = tok.decode([t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if not m])
    assert "hello\ntool-output-marker" in text
    # the trial's token reached the CLI, and Harbor wrote it into the trial's config redacted only
    [config] = (tmp_path / "trials").glob("*/config.json")
    key = json.loads(config.read_text())["agent"]["env"][
        "ANTHROPIC_API_KEY" if harness == "claude-code" else "OPENAI_API_KEY"
    ]
    assert "****" in key


@pytest.mark.parametrize("harness", HARNESSES)
def test_a_cut_off_turn_ends_the_episode_truncated_and_its_action_never_runs(tmp_path, tiny_model_dir, harness):
    from grpoflow.tokens import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    cut = _call(harness)[:-30]  # the call, cut before its end: it must not run

    def script(ids: list[int], i: int) -> Reply:
        if "title generator" in tok.decode(ids):
            return Reply(text="Hello file")
        return Reply(text=cut, finish="length")

    res, engine = _run(tmp_path, tiny_model_dir, harness, script)
    for s in res.samples:
        assert (s.status, s.exit_status, s.reward) == ("TRUNCATED", "SequenceLengthLimitExceeded", 0.0)
        assert s.metrics["refused_requests"] == 0  # the harness stopped by itself after the cut turn
    assert [s.metrics["truncated_turns"] for s in res.samples if s.messages and "Hello file" not in str(s.messages)]
    # verified (reward 0: the cut command never wrote the file), and one policy turn on the main path
    results = [json.loads(p.read_text()) for p in (tmp_path / "trials").glob("*/result.json")]
    assert [r["verifier_result"]["rewards"] for r in results] == [{"reward": 0.0}]
    assert sum("title generator" not in tok.decode(c.input_ids) for c in engine.calls) == 1

"""The harness table: what each binding builds for one trial, and how Harbor's endings map to exit statuses."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from harbor.agents.factory import AgentFactory

from grpoflow.config import parse_run_config
from grpoflow.credentials import (
    POLICY_KEY_VAR,
    CredentialError,
    export_policy_key,
)
from grpoflow.errors import ConfigError
from grpoflow.rollout.harnesses import (
    LOCAL_API_KEY,
    SESSION_TOKEN_VAR,
    agent_factory,
    claude_code_base_url,
    get_binding,
    model_alias,
    sampling_params,
)
from grpoflow.rollout.outcome import classify
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.trials import TrialOutcome, TrialSpec

SPEC = TrialSpec("hello-file", "/tasks/hello-file", "g", 3, "step0-hello-file-3", 1234)
SESSION = "http://10.0.0.5:8100/sessions/step0-hello-file-3/v1"


def _make(harness: str, sandbox: str | None = None, **rollout):
    if sandbox is None and harness in ("claude-code", "opencode"):  # a cloud sandbox reaching the server's URL
        sandbox, rollout = "e2b", {"session_server_url": "http://10.0.0.5:8100", **rollout}
    cfg = parse_run_config({"rollout": {"harness": harness, "sandbox": sandbox or "local", **rollout}})
    return agent_factory(
        cfg.rollout,
        cfg.engine,
        "http://127.0.0.1:30000",
        "/m/SmolLM2-135M-Instruct",
        api_base_for=lambda spec: f"http://10.0.0.5:8100/sessions/{spec.rollout_id}/v1",
    )


def test_terminus_2_kwargs_carry_the_session_url_key_parser_sampling_and_switches():
    ac = _make(
        "terminus-2", parser="xml", summarize=True, linear_history=False, temperature=0.9, top_k=20, max_new_tokens=300
    )(SPEC)
    k = ac.kwargs
    assert ac.model_name == "hosted_vllm/SmolLM2-135M-Instruct" and k["api_base"] == SESSION
    assert k["llm_kwargs"] == {"api_key": LOCAL_API_KEY} and ac.model_api_key_name is None
    assert k["parser_name"] == "xml" and k["enable_summarize"] is True
    assert k["trajectory_config"] == {"linear_history": False} and k["collect_rollout_details"] is True
    assert k["llm_call_kwargs"] == {
        "temperature": 0.9,
        "top_p": 1.0,
        "max_tokens": 300,
        "seed": 1234,
        "extra_body": {"top_k": 20},
    }


def test_terminus_2_max_turns_zero_is_passed_as_zero():
    ac = _make("terminus-2", max_turns=0)(SPEC)
    assert ac.kwargs["max_turns"] == 0
    agent = AgentFactory.create_agent_from_config(ac, logs_dir=Path("/tmp/grpoflow-binding-logs"))
    assert agent._max_episodes == 0  # not terminus-2's "no limit"


def test_a_key_file_is_handed_over_by_variable_name_only(tmp_path, monkeypatch):
    key = "sk-real-9876"
    (tmp_path / "k").write_text(key)
    monkeypatch.delenv(POLICY_KEY_VAR, raising=False)
    assert export_policy_key(str(tmp_path / "k")) == POLICY_KEY_VAR
    for harness in ("terminus-2", "claude-code", "opencode"):
        ac = _make(harness, policy_api_key_file=str(tmp_path / "k"))(SPEC)
        assert key not in ac.model_dump_json()  # Harbor writes this into the trial dir
        agent = AgentFactory.create_agent_from_config(ac, logs_dir=tmp_path / harness)
        if harness == "terminus-2":
            assert ac.model_api_key_name == POLICY_KEY_VAR and "api_key" not in ac.kwargs["llm_kwargs"]
            assert agent.model_connection.api_key == key
        else:
            assert key in agent.extra_env.values()  # resolved from the process env when the agent is built


def test_an_empty_policy_key_file_is_a_one_line_error(tmp_path):
    (tmp_path / "k").write_text("  \n")
    with pytest.raises(CredentialError, match=r"^rollout.harness.policy_api_key_file .*k is empty"):
        export_policy_key(str(tmp_path / "k"), environ={})


@pytest.mark.parametrize("api_base", [SESSION, SESSION + "/"])
def test_claude_code_gets_the_server_root_so_the_sdk_does_not_double_v1(api_base, tmp_path):
    assert claude_code_base_url(api_base) == "http://10.0.0.5:8100/sessions/step0-hello-file-3"
    cfg = parse_run_config(
        {
            "rollout": {
                "harness": {"name": "claude-code", "session_server_url": "http://10.0.0.5:8100"},
                "sandbox": {"backend": "e2b"},
            }
        }
    )
    ac = agent_factory(cfg.rollout, cfg.engine, "http://x", "m", api_base_for=lambda s: api_base)(SPEC)
    agent = AgentFactory.create_agent_from_config(ac, logs_dir=tmp_path)
    assert agent.model_connection.env["ANTHROPIC_BASE_URL"] == "http://10.0.0.5:8100/sessions/step0-hello-file-3"


def test_opencode_talks_chat_completions_to_our_url_under_its_own_provider_id(tmp_path):
    ac = _make("opencode")(SPEC)
    assert ac.model_name == "grpoflow/SmolLM2-135M-Instruct"
    agent = AgentFactory.create_agent_from_config(ac, logs_dir=tmp_path)
    command = agent._build_register_config_command()
    assert f'"baseURL": "{SESSION}"' in command and '"npm": "@ai-sdk/openai-compatible"' in command
    assert '"openai"' not in command  # not opencode's built-in provider (Responses API)


def test_unknown_harness_and_harnesses_the_sandbox_cannot_run_fail_before_any_trial():
    with pytest.raises(ConfigError, match=r"rollout.harness.name `aider`: unknown; known harnesses: shell, terminus-2"):
        get_binding("aider")
    with pytest.raises(
        ConfigError,
        match=r"field `rollout.harness.name`: one of shell, terminus-2, claude-code, opencode \(got \"aider\"\)",
    ):
        parse_run_config({"rollout": {"harness": {"name": "aider"}}})
    for url in ("10.0.0.5", "https://10.0.0.5:8300"):
        with pytest.raises(ConfigError, match=r"rollout.harness.session_server_url.*give http://<host>:<port>"):
            parse_run_config({"rollout": {"harness": {"name": "opencode", "session_server_url": url}}})
    cloud = parse_run_config({"rollout": {"harness": {"name": "claude-code"}, "sandbox": {"backend": "e2b"}}})
    with pytest.raises(
        ConfigError, match=r"on rollout.sandbox.backend=e2b calls the session server.*session_server_url"
    ):
        agent_factory(cloud.rollout, cloud.engine, "http://x", "m")


@pytest.mark.parametrize("harness", ["terminus-2", "claude-code", "opencode"])
def test_each_trial_sends_its_own_session_token_and_no_config_holds_it_whole(harness, tmp_path):
    cfg = parse_run_config({"rollout": {"harness": {"name": harness}}})
    make = agent_factory(
        cfg.rollout,
        cfg.engine,
        "http://x",
        "m",
        api_base_for=lambda s: SESSION,
        token_for=lambda s: f"tok-{s.seed}-secret",
    )
    ac = make(SPEC)
    assert "tok-1234-secret" not in ac.model_dump_json()  # what Harbor writes into the trial dir: redacted
    agent = AgentFactory.create_agent_from_config(ac, logs_dir=tmp_path)
    if harness == "terminus-2":
        assert agent._llm._llm_kwargs["api_key"] == "tok-1234-secret"
        assert SESSION_TOKEN_VAR not in agent.extra_env  # never exported into the sandbox's terminal
        assert "tok-1234-secret" not in repr(agent.options)  # terminus-2 writes its options into trajectory.json
    else:
        assert "tok-1234-secret" in agent.extra_env.values()


def test_the_local_sandbox_keeps_processes_for_the_trial_only_when_the_harness_needs_it():
    def kwargs(harness, sandbox="local", **extra):
        return sandbox_config(
            parse_run_config(
                {"rollout": {"harness": {"name": harness}, "sandbox": {"backend": sandbox, "kwargs": extra}}}
            ).rollout
        ).kwargs

    local = {"base_images": {}}  # `dataset.base_images`, which the local sandbox always takes
    assert kwargs("shell") == local
    assert kwargs("terminus-2") == {"process_scope": "trial"} | local
    assert (
        kwargs("terminus-2", memory_mb=512, process_scope="exec") == {"memory_mb": 512, "process_scope": "exec"} | local
    )
    assert kwargs("terminus-2", "e2b") == {}
    assert kwargs("opencode") == {"process_scope": "trial", "address_space_mb": 16384} | local


def test_a_cli_harness_sandbox_allows_the_session_server_host_and_no_other():
    def hosts(harness, sandbox="local", **rollout):
        cfg = parse_run_config({"rollout": {"harness": harness, "sandbox": sandbox, **rollout}})
        return sandbox_config(cfg.rollout).extra_allowed_hosts

    assert hosts("claude-code") == hosts("opencode") == ["127.0.0.1"]  # the bridge's loopback port
    assert hosts("opencode", "e2b", session_server_url="http://10.0.0.5:8300") == ["10.0.0.5"]
    assert hosts("shell") == hosts("terminus-2") == []  # nothing of theirs runs in the sandbox
    ac = _make("opencode")(SPEC)
    assert ac.extra_allowed_hosts == ["10.0.0.5"]  # the agent phase names the same host: Harbor needs them equal


def test_model_alias_fits_litellms_hosted_vllm_names():
    assert model_alias("/root/.cache/grpoflow/models/b179c9523d0e6a0f/") == "b179c9523d0e6a0f"
    assert model_alias("org/Some Model:v1") == "Some-Model-v1"
    assert sampling_params(parse_run_config({}).rollout, 5)["seed"] == 5


# ---- Harbor endings -> exit statuses ------------------------------------------------------------------------


def _outcome(exc: str | None, reward: float | None, meta: dict | None = None) -> TrialOutcome:
    result = SimpleNamespace(
        exception_info=SimpleNamespace(
            exception_type=exc, exception_message="boom", occurred_at=datetime.now(timezone.utc)
        )
        if exc
        else None,
        verifier_result=SimpleNamespace(rewards={"reward": reward}) if reward is not None else None,
        agent_result=SimpleNamespace(metadata={"grpoflow": meta or {}}),
    )
    return TrialOutcome(SPEC, result, [])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "reward", "meta", "expected"),
    [
        # The agent returned normally; a cut turn makes it TRUNCATED (shell agent, terminus-2).
        (None, 1.0, {"end_reason": "done"}, ("Submitted", "COMPLETED", 1.0)),
        (None, 0.0, {"end_reason": "truncated", "truncated": True}, ("SequenceLengthLimitExceeded", "TRUNCATED", 0.0)),
        (None, None, {}, ("VerifierError", "FAILED", None)),
        # Harbor verifies after these: the reward stands where the policy is to blame.
        ("AgentTimeoutError", 0.0, {}, ("TimeLimitExceeded", "TRUNCATED", 0.0)),
        ("OutputTokenExceededError", 0.0, {}, ("SequenceLengthLimitExceeded", "TRUNCATED", 0.0)),
        ("ContextWindowExceededError", 1.0, {}, ("SequenceLengthLimitExceeded", "TRUNCATED", 1.0)),
        # A harness that failed after a cut turn: still a truncation (the verifier ran).
        ("NonZeroAgentExitCodeError", 0.0, {"truncated": True}, ("SequenceLengthLimitExceeded", "TRUNCATED", 0.0)),
        ("NonZeroAgentExitCodeError", 1.0, {}, ("AgentError", "FAILED", None)),
        ("ApiRateLimitError", 0.0, {}, ("AgentError", "FAILED", None)),
        # No verifier ran.
        ("ContextLengthExceededError", None, {}, ("SequenceLengthLimitExceeded", "FAILED", None)),
        ("BadRequestError", None, {}, ("AgentError", "FAILED", None)),
        ("VerifierTimeoutError", None, {}, ("VerifierError", "FAILED", None)),
        ("EnvironmentStartTimeoutError", None, {}, ("TimeLimitExceeded", "FAILED", None)),
        ("SandboxDiedError", None, {}, ("SandboxError", "FAILED", None)),
    ],
)
def test_harbor_endings_map_to_the_exit_status_vocabulary(exc, reward, meta, expected):
    exit_status, status, got_reward, reason = classify(_outcome(exc, reward, meta))
    assert (exit_status, status, got_reward) == expected
    assert reason  # every ending says why

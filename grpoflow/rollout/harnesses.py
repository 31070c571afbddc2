"""Harness bindings: how each agent harness is configured for one trial (Harbor `AgentConfig` kwargs and env).

`HARNESSES` maps `rollout.harness.name` to a `HarnessBinding`; `agent_factory` turns a run's config into the
`TrialSpec -> AgentConfig` factory the rollout layer calls once per trial attempt. Every binding but `shell` talks
to an OpenAI-compatible policy endpoint given per trial (`api_base`, ending in `/v1`): the session server's
`<url>/sessions/<rollout_id>/v1` in a run (`api_base_for`), else the engine's own `<engine_url>/v1`.

    harness      Harbor agent      how it reaches the policy
    shell        (grpoflow's)      tokens in/out on the engine's /generate (not through api_base)
    terminus-2   terminus-2        LiteLLM `hosted_vllm/<model>` at api_base, from this process
    claude-code  claude-code       ANTHROPIC_BASE_URL = the server root (api_base without `/v1`: the SDK adds it),
                                   from inside the sandbox
    opencode     opencode          a custom provider `grpoflow` (npm @ai-sdk/openai-compatible, chat completions)
                                   at api_base, from inside the sandbox; opencode's built-in `openai` provider
                                   would use the Responses API

claude-code and opencode run in the sandbox: the local sandbox gets their pinned CLIs from prepare's cache and a
bridge to the session server (`SandboxNeeds`, which the rollout adds to the sandbox's kwargs); a cloud sandbox
installs them with Harbor's own install and reaches `rollout.harness.session_server_url`.

Keys: through the session server each trial sends its session's own token (`TrialEndpoint.token`), in a variable
whose name Harbor treats as a secret (it writes every trial's config to its trial dir, redacting those); terminus-2
takes it from `SESSION_TOKEN_VAR` in its agent env (`GrpoTerminus2`), so it never reaches the sandbox. Straight
to the engine, our servers take any key, so a fixed dummy is used; a real key (`rollout.harness.policy_api_key_file`) is
exported into this process's environment as `POLICY_KEY_VAR` (`grpoflow.credentials.export_policy_key`) and
the bindings only name that variable (`AgentConfig.model_api_key_name`, or a `${VAR}` template in
`AgentConfig.env` that Harbor resolves when it builds the agent), so a key value never goes into a config.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harbor.models.trial.config import AgentConfig

from grpoflow.config import ChatHarness, Engine, RolloutConfig, Terminus2Harness
from grpoflow.credentials import POLICY_KEY_VAR
from grpoflow.errors import ConfigError
from grpoflow.prepare.clis import CLI_PACKAGES
from grpoflow.rollout.environments import BRIDGE_HOST, SANDBOX_PYTHON
from grpoflow.rollout.trials import TrialSpec

SHELL_AGENT = "grpoflow.rollout.agents.shell:ShellAgent"
TERMINUS_AGENT = "grpoflow.rollout.agents.terminus:GrpoTerminus2"
CLAUDE_CODE_AGENT = "grpoflow.rollout.agents.clis:GrpoClaudeCode"
OPENCODE_AGENT = "grpoflow.rollout.agents.clis:GrpoOpenCode"
SESSION_TOKEN_VAR = "GRPOFLOW_SESSION_TOKEN"  # terminus-2's session token, in its agent env (see module doc)
LOCAL_API_KEY = "grpoflow-local"  # not a secret: our engine checks no key (the session server takes its own tokens)
OPENCODE_PROVIDER = "grpoflow"


@dataclass(frozen=True)
class TrialEndpoint:
    """Where one trial's harness finds the policy."""

    api_base: str  # OpenAI-compatible base URL ending in /v1
    model: str  # the served model name
    key_from_env: bool  # True: the key is in the process env as POLICY_KEY_VAR; False: LOCAL_API_KEY
    token: str | None = None  # the session's own token (through the session server), which wins


@dataclass(frozen=True)
class BindingInput:
    rollout: RolloutConfig
    engine: Engine
    spec: TrialSpec
    endpoint: TrialEndpoint
    engine_url: str
    tokenizer_path: str
    lora_path: str | None = None  # the adapter our shell agent's generations name (a LoRA run's)


@dataclass(frozen=True)
class HarnessBinding:
    harbor_agent: str  # Harbor's AgentName value of the agent (ours subclass it or are registered by import path)
    build: Callable[[BindingInput], AgentConfig]
    # Extra kwargs of the local sandbox this harness needs (terminus-2: a tmux server that lives across execs).
    local_sandbox_kwargs: Mapping[str, Any] = field(default_factory=dict)


def sampling_params(rollout: RolloutConfig, seed: int) -> dict[str, Any]:
    """OpenAI chat-completion sampling parameters of one trial (terminus-2's `llm_call_kwargs`)."""
    params: dict[str, Any] = {
        "temperature": rollout.sampling.temperature,
        "top_p": rollout.sampling.top_p,
        "max_tokens": rollout.sampling.max_new_tokens,
        "seed": seed,
    }
    if rollout.sampling.top_k != -1:
        params["extra_body"] = {
            "top_k": rollout.sampling.top_k
        }  # not an OpenAI parameter; SGLang and our engine read it
    return params


def _shell(b: BindingInput) -> AgentConfig:
    r = b.rollout
    return AgentConfig(
        import_path=SHELL_AGENT,
        kwargs={
            "engine": b.engine.model_dump(mode="json"),
            "engine_url": b.engine_url,
            "tokenizer_path": b.tokenizer_path,
            "sampling": r.sampling.model_dump(mode="json"),
            "episode": r.episode.model_dump(mode="json"),
            "seed": b.spec.seed,
            **({"lora_path": b.lora_path} if b.lora_path else {}),
        },
    )


def _terminus(b: BindingInput) -> AgentConfig:
    r, ep, harness = b.rollout, b.endpoint, b.rollout.harness
    assert isinstance(harness, Terminus2Harness)
    kwargs: dict[str, Any] = {
        "api_base": ep.api_base,
        "parser_name": harness.parser,
        "llm_call_kwargs": sampling_params(r, b.spec.seed),
        # Terminus-2 has no api_key parameter: LiteLLM takes it from llm_kwargs (or the key variable below).
        "llm_kwargs": {} if ep.key_from_env else {"api_key": LOCAL_API_KEY},
        # LiteLLM knows nothing of our model: tell terminus-2 its window (proactive summarisation reads it).
        "model_info": {
            "max_input_tokens": r.episode.max_context_tokens,
            "max_output_tokens": r.sampling.max_new_tokens,
            # all four costs, or LiteLLM warns per trial that the cache costs default to 0
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
            "cache_creation_input_token_cost": 0.0,
            "cache_read_input_token_cost": 0.0,
        },
        "enable_summarize": harness.summarize,
        "trajectory_config": {"linear_history": harness.linear_history},
        "collect_rollout_details": True,
        "max_turns": r.episode.max_turns,  # always set (0 means no turn), never left to terminus-2's 1e6
        "suppress_max_turns_warning": True,
        "record_terminal_session": False,  # asciinema is not in the sandbox and cannot be installed offline
        "early_truncation_exit": r.episode.early_truncation_exit,
        # terminus-2 has no web tools to turn off; saying so keeps Harbor from logging an ERROR per trial when
        # the sandbox has no network.
        "disable_web_search": False,
    }
    if ep.token is not None:
        kwargs["llm_kwargs"] = {}  # GrpoTerminus2 puts the session token there (not in the config Harbor writes)
    return AgentConfig(
        name=None,
        import_path=TERMINUS_AGENT,
        model_name=f"hosted_vllm/{ep.model}",
        # The key by name only; terminus-2's env (AgentConfig.env) is exported into the sandbox's terminal.
        model_api_key_name=POLICY_KEY_VAR if ep.key_from_env and ep.token is None else None,
        env={SESSION_TOKEN_VAR: ep.token} if ep.token is not None else {},
        kwargs=kwargs,
    )


def _key_env(ep: TrialEndpoint) -> str:
    if ep.token is not None:
        return ep.token
    return f"${{{POLICY_KEY_VAR}}}" if ep.key_from_env else LOCAL_API_KEY


# Telemetry, error reports and update checks off: the sandbox has no network, and a trial must not phone home.
CLAUDE_CODE_QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
}
OPENCODE_QUIET = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",  # models.dev: our provider is declared in the config
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",  # they are npm packages, installed at start
}


def claude_code_base_url(api_base: str) -> str:
    """The server root: Anthropic's SDK appends /v1/messages itself, so a base ending in /v1 would double it."""
    return api_base.rstrip("/").removesuffix("/v1")


def _claude_code(b: BindingInput) -> AgentConfig:
    ep = b.endpoint
    return AgentConfig(
        import_path=CLAUDE_CODE_AGENT,
        extra_allowed_hosts=_policy_hosts(ep),
        model_name=ep.model,
        skip_model_parsing=True,  # our served name is not an Anthropic model id
        base_url=claude_code_base_url(ep.api_base),
        env={"ANTHROPIC_API_KEY": _key_env(ep), **CLAUDE_CODE_QUIET},
        kwargs={"max_turns": b.rollout.episode.max_turns, "version": CLI_PACKAGES["claude-code"].version},
    )


def _policy_hosts(ep: TrialEndpoint) -> list[str]:
    """The one host a CLI in the sandbox needs: the session server's as the sandbox reaches it. Named to Harbor
    (it cannot tell opencode's custom provider's host, and says so every trial), the same as the sandbox's own
    allowlist (`sandbox_allowed_hosts`): a sandbox that cannot change its policy after start needs them equal."""
    return [urlsplit(ep.api_base).hostname or ""]


def sandbox_allowed_hosts(rollout: RolloutConfig) -> list[str]:
    """What the sandbox of a CLI harness must reach: the session server (loopback through the local sandbox's
    bridge, else `rollout.harness.session_server_url`'s host); nothing for the other harnesses."""
    harness = rollout.harness
    if not isinstance(harness, ChatHarness) or not harness.in_sandbox_cli:
        return []
    if rollout.sandbox.local or harness.session_server_url is None:
        return [BRIDGE_HOST]
    return [urlsplit(harness.session_server_url).hostname or ""]


def opencode_model(model: str) -> str:
    """opencode's `provider/model` selector with our provider id (see module doc)."""
    return f"{OPENCODE_PROVIDER}/{model}"


def _opencode(b: BindingInput) -> AgentConfig:
    ep = b.endpoint
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "grpoflow policy",
        # {env:...} is opencode's own substitution, done inside the sandbox where the variable is set.
        "options": {"baseURL": ep.api_base, "apiKey": "{env:OPENAI_API_KEY}"},
        "models": {ep.model: {"name": ep.model}},
    }
    return AgentConfig(
        import_path=OPENCODE_AGENT,
        model_name=opencode_model(ep.model),
        extra_allowed_hosts=_policy_hosts(ep),
        env={"OPENAI_API_KEY": _key_env(ep), **OPENCODE_QUIET},
        kwargs={
            "opencode_config": {"provider": {OPENCODE_PROVIDER: provider}},
            "version": CLI_PACKAGES["opencode"].version,
        },
    )


# The CLIs' bridge lives in the trial's namespaces; their JavaScript engines reserve far more address space than
# they use, so where no cgroup can be had (memory capped as address space) the cap is raised for them; a cgroup
# caps resident memory at the task's either way.
CLI_SANDBOX = {"process_scope": "trial", "address_space_mb": 16384}

HARNESSES: dict[str, HarnessBinding] = {
    "shell": HarnessBinding("grpoflow-shell", _shell),
    "terminus-2": HarnessBinding("terminus-2", _terminus, local_sandbox_kwargs={"process_scope": "trial"}),
    "claude-code": HarnessBinding("claude-code", _claude_code, local_sandbox_kwargs=CLI_SANDBOX),
    "opencode": HarnessBinding("opencode", _opencode, local_sandbox_kwargs=CLI_SANDBOX),
}


def get_binding(harness: str) -> HarnessBinding:
    try:
        return HARNESSES[harness]
    except KeyError:
        raise ConfigError(
            f"rollout.harness.name `{harness}`: unknown; known harnesses: {', '.join(HARNESSES)}"
        ) from None


def harness_problems(rollout: RolloutConfig) -> list[str]:
    """What stops `rollout.harness.name` from running on this machine (one line each; empty: fine)."""
    harness = rollout.harness
    if not rollout.sandbox.local:
        if isinstance(harness, ChatHarness) and harness.in_sandbox_cli and harness.session_server_url is None:
            # the CLI calls the policy from the cloud sandbox, which cannot reach this machine's loopback
            return [
                f"rollout.harness.name={rollout.harness.name} on rollout.sandbox.backend={rollout.sandbox.backend} calls the session server "
                "from the sandbox: set rollout.harness.session_server_url to an address the sandbox reaches"
            ]
        return []
    if isinstance(harness, Terminus2Harness) and shutil.which("tmux") is None:
        # The local sandbox shows the host's /usr, and terminus-2 drives a tmux in it (it cannot install one
        # offline).
        return [
            "rollout.harness.name=terminus-2 needs tmux on this machine for the local sandbox: apt-get install -y tmux"
        ]
    if harness.in_sandbox_cli and not Path(SANDBOX_PYTHON).is_file():
        # the bridge's forwarder inside the sandbox runs on the host's python3, which the sandbox sees in /usr
        return [
            f"rollout.harness.name={rollout.harness.name} needs {SANDBOX_PYTHON} on this machine for the local sandbox's "
            "bridge to the session server: apt-get install -y python3"
        ]
    return []


def agent_factory(
    rollout: RolloutConfig,
    engine: Engine,
    engine_url: str,
    tokenizer_path: str,
    *,
    model: str | None = None,
    api_base_for: Callable[[TrialSpec], str] | None = None,
    token_for: Callable[[TrialSpec], str] | None = None,
    lora_path: str | None = None,
) -> Callable[[TrialSpec], AgentConfig]:
    """The per-trial `AgentConfig` factory of `rollout.harness.name`. Raises `ConfigError` before any trial starts when
    the harness is unknown or cannot run in `rollout.sandbox.backend`.

    model: the served model name (default: `tokenizer_path`, which is what the embedded engine serves); see
        `model_alias`.
    api_base_for: the OpenAI base URL of one trial (default: the engine's, `<engine_url>/v1`); the session server
        gives each trial its own (`<url>/sessions/<rollout_id>/v1`).
    token_for: the API key of one trial (the session server's token of its session).
    """
    binding = get_binding(rollout.harness.name)
    problems = harness_problems(rollout)
    if problems:
        raise ConfigError(problems[0])
    base = engine_url.rstrip("/")
    url_of = api_base_for or (lambda spec: f"{base}/v1")
    served = model_alias(model or tokenizer_path)
    key_from_env = rollout.harness.policy_key_file() is not None

    def make(spec: TrialSpec) -> AgentConfig:
        token = token_for(spec) if token_for is not None else None
        endpoint = TrialEndpoint(api_base=url_of(spec), model=served, key_from_env=key_from_env, token=token)
        return binding.build(BindingInput(rollout, engine, spec, endpoint, engine_url, tokenizer_path, lora_path))

    return make


def model_alias(model: str) -> str:
    """The model name harnesses send: a model path's last component, in LiteLLM's `hosted_vllm/<name>` alphabet
    (letters, digits, `.-_`, under 64). Our engine and session server serve one model whatever a request names."""
    last = model.rstrip("/").rsplit("/", 1)[-1] or "policy"
    return re.sub(r"[^A-Za-z0-9._-]", "-", last)[:63]  # LiteLLM's hosted_vllm name rule

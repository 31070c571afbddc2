"""Agent trials: how the engine samples, an episode's limits, the harness, the sandbox."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args
from urllib.parse import urlsplit

from harbor.models.environment_type import EnvironmentType
from pydantic import ConfigDict, Field, field_validator, model_validator

from grpoflow.config.base import MOST_NEW_TOKENS, Section, any_of_schema, looks_like_credential, refuse_credentials
from grpoflow.credentials import sandbox_key_var
from grpoflow.sandbox_settings import sandbox_kwargs_problem

# Any environment type of the installed Harbor, read from its own enum so the two never disagree.
HarborEnvironment = Literal[tuple(t.value for t in EnvironmentType)]  # type: ignore[valid-type]
SandboxName = Literal[("local", *get_args(HarborEnvironment))]  # type: ignore[valid-type]
# Tool-call formats the session server parses: SGLang's `--tool-call-parser` names for the `<tool_call>` JSON format
# (`qwen25`, `qwen`), and vLLM's name for the same format (`hermes`).
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes")


class SamplingConfig(Section):
    """How the engine samples each turn."""

    max_new_tokens: int = Field(
        64,
        ge=1,
        le=MOST_NEW_TOKENS,
        description="Response length limit of one turn; a turn that hits it ends the episode.",
    )
    temperature: float = Field(
        0.5,
        ge=0.0,
        le=2.0,
        description="Sampling temperature (0 = greedy). The trainer scores tokens at the same temperature.",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling threshold. Engine and trainer score tokens under the unfiltered "
        "softmax(logits / temperature), so a train run refuses values below 1; an evaluate run may filter.",
    )
    top_k: int = Field(-1, ge=-1, description="Top-k sampling (-1 = off); refused by a train run, as `top_p` is.")


class EpisodeConfig(Section):
    """The limits of one episode (a trial's turns)."""

    max_turns: int = Field(4, ge=0, le=1000, description="Most policy turns in one episode (0: none).")
    max_context_tokens: int = Field(
        2048, ge=64, le=1_048_576, description="Token budget of a whole episode (prompt, turns, tool output)."
    )
    early_truncation_exit: bool = Field(
        True,
        description="End the episode as soon as a turn is cut off at `sampling.max_new_tokens` (the cut command "
        "is not run; "
        "the trial is still verified). Off only to measure what it saves.",
    )
    command_timeout_sec: float = Field(30.0, gt=0, le=86400, description="Time limit of one command in the sandbox.")
    output_cap_chars: int = Field(2000, ge=100, description="Command output fed back to the policy is cut to this.")


class Harness(Section):
    """What every harness takes; each harness is a type of its own below, with only the settings it uses. Our shell
    agent keeps a chat's exact tokens itself and talks to the engine directly; the chat harnesses re-send the
    conversation as text and reach the policy through the session server, which keeps the tokens."""

    # Runs its CLI inside the sandbox (claude-code, opencode): the local sandbox needs the CLI and a bridge to the
    # session server, and a cut-off turn must end the episode from the server's side (the CLI cannot be told).
    in_sandbox_cli: ClassVar[bool] = False

    name: str  # each harness's own Literal: what `rollout.harness.name` names, and first in a saved config

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        return refuse_credentials(
            "rollout.harness", cls, data, known=(f for h in HARNESS_TYPES.values() for f in h.model_fields)
        )

    def policy_key_file(self) -> str | None:
        """The file holding the policy endpoint's API key (`policy_api_key_file` of a chat harness)."""
        return None


class ShellHarness(Harness):
    model_config = ConfigDict(title="shell")

    name: Literal["shell"] = Field(
        "shell",
        description="The agent that runs each trial: `shell` (grpoflow's token-native bash agent), or a Harbor "
        "harness talking to the policy through the session server: `terminus-2` (tmux), `claude-code` (Anthropic "
        "Messages API) or `opencode` (OpenAI chat with tool calls). The local sandbox gets the pinned claude-code "
        "and opencode CLIs from prepare's npm install (npm needed once); cloud sandboxes install them themselves.",
    )


class ChatHarness(Harness):
    """A Harbor harness: it speaks a chat API to the policy, through the session server."""

    session_server_url: str | None = Field(
        None,
        description="The URL sandboxes reach the session server at, when they run elsewhere (cloud sandboxes, "
        "Ray nodes), e.g. `http://10.0.0.5:8300`: the server then listens on every interface at that port. "
        "Empty: it listens on loopback only, which the local sandbox reaches through its bridge.",
    )
    policy_api_key_file: str | None = Field(
        None,
        description="File holding the API key of the policy endpoint the harness talks to (only for endpoints "
        "that check one; grpoflow's engine and session server do not). Read when trials start, handed to the "
        "harness by variable name; never stored.",
    )

    @field_validator("session_server_url")
    @classmethod
    def _session_server_url(cls, value: str | None) -> str | None:
        if value is not None:
            url = urlsplit(value)
            if url.scheme != "http" or not url.hostname or url.port is None:
                raise ValueError(
                    f"`rollout.harness.session_server_url` {value!r}: give http://<host>:<port>, the "
                    "address sandboxes reach this machine at"
                )
        return value

    def policy_key_file(self) -> str | None:
        return self.policy_api_key_file


class Terminus2Harness(ChatHarness):
    model_config = ConfigDict(title="terminus-2")

    name: Literal["terminus-2"] = Field(
        "terminus-2", description="`terminus-2`: Harbor's tmux agent, driven from this process."
    )
    parser: Literal["json", "xml"] = Field(
        "json", description="The reply format the policy writes (terminus-2's `parser_name`)."
    )
    summarize: bool = Field(
        False,
        description="Summarise a long episode and continue in a fresh context (compaction; one trial then yields "
        "several linear segments).",
    )
    linear_history: bool = Field(
        True, description="Keep each context (before and after a summary) as its own linear trajectory."
    )


class ToolCallingHarness(ChatHarness):
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = Field(  # type: ignore[valid-type]
        "qwen25",
        description="How the policy writes a tool call, by SGLang's `--tool-call-parser` name: `qwen25` (or `qwen`; "
        'vLLM calls it `hermes`) reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.',
    )


class ClaudeCodeHarness(ToolCallingHarness):
    model_config = ConfigDict(title="claude-code")

    in_sandbox_cli = True

    name: Literal["claude-code"] = Field(
        "claude-code", description="`claude-code`: the Claude Code CLI in the sandbox, on the Anthropic Messages API."
    )


class OpenCodeHarness(ToolCallingHarness):
    model_config = ConfigDict(title="opencode")

    in_sandbox_cli = True

    name: Literal["opencode"] = Field(
        "opencode", description="`opencode`: the opencode CLI in the sandbox, on OpenAI chat with tool calls."
    )


# The harness section: one of the harnesses, told apart by `rollout.harness.name`.
HarnessConfig = Annotated[
    ShellHarness | Terminus2Harness | ClaudeCodeHarness | OpenCodeHarness, Field(discriminator="name")
]
# `rollout.harness.name` -> its type (the members of the union inside `HarnessConfig`)
HARNESS_TYPES: dict[str, type[Harness]] = {
    get_args(h.model_fields["name"].annotation)[0]: h for h in get_args(get_args(HarnessConfig)[0])
}


class BreakerConfig(Section):
    """When sandbox starts fail so often that the provider looks down, stop starting trials, wait, probe."""

    window: int = Field(10, ge=2, le=1000, description="How many of the latest sandbox starts the breaker weighs.")
    failure_rate: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="The breaker opens when more than this share of the latest `window` sandbox starts failed "
        "(1: never).",
    )
    wait_s: float = Field(5.0, gt=0.0, le=3600.0, description="Wait after the breaker opens before one probe start.")
    max_wait_s: float = Field(
        120.0, gt=0.0, le=3600.0, description="Longest wait between probes (each failed probe doubles the wait)."
    )
    give_up_s: float = Field(
        3600.0,
        gt=0.0,
        le=86400.0,
        description="The step fails (`SandboxOutageError`; resume later) once the breaker was open this long.",
    )


class Sandbox(Section):
    """Where trials run, and how a sandbox failure is retried; each kind of sandbox is a type of its own below."""

    local: ClassVar[bool] = False  # runs on this machine (grpoflow's bubblewrap sandbox), not in Harbor's

    backend: str  # each sandbox's own Literal: what `rollout.sandbox.backend` names, and first in a saved config
    kwargs: dict[str, Any]
    create_limit: str | None = Field(
        "sandbox-create",
        description="Name of a Prefect global concurrency limit held while a sandbox starts, bounding sandbox "
        "creation across all runs (`prefect gcl create sandbox-create --limit 8`). No such limit on the "
        "server, or trials on Ray rollout workers (`cluster.ray_address`): creation is bounded by "
        "`rollout.concurrency` "
        "alone. Empty: never ask.",
    )
    retries: int = Field(
        2, ge=0, le=20, description="Retries of a trial in a fresh sandbox after a sandbox/infrastructure failure."
    )
    retry_backoff_s: float = Field(
        0.5, ge=0.0, le=60.0, description="Base of the jittered exponential backoff between sandbox retries."
    )
    max_starts_per_s: float | None = Field(
        None,
        gt=0.0,
        le=10000.0,
        description="Most sandbox starts this run begins per second (a provider's rate limit); empty: unbounded.",
    )
    breaker: BreakerConfig = Field(
        default_factory=BreakerConfig,
        description="Holds back new trials while the sandbox provider is down; failed starts then cost no retry.",
    )
    on_retries_exhausted: Literal["drop_group", "keep_group"] = Field(
        "drop_group",
        description="What happens to a GRPO group when one of its trials still fails after all retries: "
        "`drop_group` leaves the whole group out of training; `keep_group` trains on its other trials.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        return refuse_credentials("rollout.sandbox", cls, data, known=HarborSandboxConfig.model_fields)

    @field_validator("kwargs")
    @classmethod
    def _no_credentials_in_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        secret = [k for k in kwargs if looks_like_credential(k)]
        if secret:
            raise ValueError(
                f"`rollout.sandbox.kwargs.{secret[0]}`: looks like a credential, and Harbor writes sandbox kwargs "
                "to every trial's config.json; put the key in the provider's environment variable or name a key "
                "file in rollout.sandbox.api_key_file"
            )
        return kwargs

    def key_file(self) -> str | None:
        """The file holding the provider's API key (`api_key_file` of a Harbor environment)."""
        return None


class LocalSandboxConfig(Sandbox):
    model_config = ConfigDict(title="local")

    local = True

    backend: Literal["local"] = Field(
        "local",
        description="Where trials run: `local`, bubblewrap on this machine, without network (the `harbor` variant "
        "names a Harbor environment type instead).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="The local sandbox's settings (`memory_mb`, `cpu_time_sec`, `storage_mb`, ...; keys and values "
        "are checked here), passed as Harbor's `EnvironmentConfig.kwargs`.",
    )

    @field_validator("kwargs")
    @classmethod
    def _local_settings(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if problem := sandbox_kwargs_problem(kwargs):
            raise ValueError(problem)
        return kwargs


class HarborSandboxConfig(Sandbox):
    model_config = ConfigDict(title="harbor")

    backend: HarborEnvironment = Field(  # type: ignore[valid-type]
        "docker",
        description="A Harbor environment type (`e2b`, `daytona`, `modal`, `docker`, ...), passed to Harbor as "
        "`EnvironmentConfig(type=...)`.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the sandbox environment (Harbor's `EnvironmentConfig.kwargs`), e.g. "
        "`sandbox_timeout_secs` for e2b. Harbor writes them to every trial's config.json: credentials never go here.",
    )
    api_key_file: str | None = Field(
        None,
        description="File holding the sandbox provider's API key (for e2b: the `E2B_API_KEY` value). Read when "
        "trials start and handed to the provider through the process environment; never stored. Empty: the key "
        "comes from the environment variable.",
    )

    @model_validator(mode="after")
    def _known_key_var(self) -> HarborSandboxConfig:
        if self.api_key_file is not None and sandbox_key_var(self.backend) is None:
            raise ValueError(
                f"`rollout.sandbox.api_key_file`: grpoflow does not know which variable sandbox `{self.backend}` "
                "reads its key from; give its credentials in the environment as Harbor documents"
            )
        return self

    def key_file(self) -> str | None:
        return self.api_key_file


# The sandbox section: the local one, or a Harbor environment, told apart by `rollout.sandbox.backend`.
SandboxConfig = Annotated[LocalSandboxConfig | HarborSandboxConfig, Field(discriminator="backend")]
SANDBOX_TYPES: dict[str, type[Sandbox]] = {
    name: s
    for s in (LocalSandboxConfig, HarborSandboxConfig)
    for name in get_args(s.model_fields["backend"].annotation)
}


class RolloutConfig(Section):
    prompts_per_step: int = Field(4, ge=1, le=4096, description="Prompts (GRPO groups) sampled per training step.")
    n_samples_per_prompt: int = Field(
        4, ge=1, le=256, description="Trials per prompt; together they form one GRPO group."
    )
    refill_rounds: int = Field(
        0,
        ge=0,
        le=64,
        description="Dynamic sampling (DAPO): at most this many extra rounds per training step, each running the "
        "groups of new prompts in place of the groups that carry no GRPO signal (equal rewards, or a failed trial "
        "under `rollout.sandbox.on_retries_exhausted` drop_group), until the step has `prompts_per_step` "
        "informative groups. 0: off.",
    )
    concurrency: int = Field(8, ge=1, le=4096, description="Trials running at once.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="How the engine samples each turn.")
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig, description="The limits of one episode.")
    harness: HarnessConfig = Field(
        default_factory=ShellHarness,
        description="The agent that runs each trial (`rollout.harness.name`), and how it reaches the policy.",
        json_schema_extra=any_of_schema,
    )
    sandbox: SandboxConfig = Field(
        default_factory=LocalSandboxConfig,
        description="Where trials run (`rollout.sandbox.backend`), and how a sandbox failure is retried.",
        json_schema_extra=any_of_schema,
    )

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        return refuse_credentials("rollout", cls, data)

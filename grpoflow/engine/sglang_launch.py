"""Start an SGLang server for a run from SGLang's own Python environment, wait until it serves, stop it after.

SGLang pins its own torch, transformers and CUDA kernels (and conflicts with Harbor's openai pin), so it runs from
a separate interpreter (`engine.sglang_python`) and grpoflow only talks to it over HTTP. The command is

    <sglang_python> -m sglang.launch_server --model-path M --host 127.0.0.1 --port P --tp-size N
        --mem-fraction-static F --random-seed S [--max-total-tokens T] [CPU flags] [engine.sglang_args]

with flag names from sgl-project/sglang `python/sglang/srt/server_args.py` (`ServerArgs.add_cli_args`).
`engine.device = "cpu"` runs it on the CPU (`launch_settings`): `SGLANG_USE_CPU_ENGINE=1`, `--device cpu`,
`--attention-backend torch_native` (SGLang's CPU attention kernels come from `sgl_kernel`'s CPU build, which the
torch-native backend does not need), `--sleep-on-idle` (else its idle scheduler polls on a full core) and a KV
cache of `engine.max_total_tokens` (else SGLang sizes it from the host's free memory).
SGLang has no "bind port 0 and report it" option, so a free port is picked here just before the start; if another
process takes it in between, SGLang dies at startup and the error below says so with its log.

The server runs in its own process group: SGLang's scheduler and detokenizer are child processes, and stopping
the group ends them all. The child's environment drops PYTHONPATH / PYTHONHOME / VIRTUAL_ENV so grpoflow's
packages cannot leak into SGLang's interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from grpoflow.config import EngineConfig
from grpoflow.engine.client import EngineClient
from grpoflow.engine.launch import EngineProcess, log_tail, stop_process_group
from grpoflow.errors import EngineError
from grpoflow.sockets import free_port

# SGLang's /health runs a one-token generation and polls for it once per second (http_server.py health_generate),
# so one probe may take over a second even on a healthy server.
_HEALTH_PROBE_TIMEOUT_S = 10.0
_POLL_S = 0.5
_ENV_DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
CPU_MAX_TOTAL_TOKENS = 16384  # the KV cache of a CPU launch unless engine.max_total_tokens says otherwise


def launch_settings(cfg: EngineConfig, seed: int, base_gpu_id: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The flags a launch from `cfg` passes after grpoflow's own (`sglang_command`), `cfg.sglang_args` last, and
    the environment variables it sets (see the module doc). `base_gpu_id`: the first of the GPUs the run's plan
    gives the engine (`grpoflow.placement`), so it does not start on the trainer's."""
    args, env = ["--random-seed", str(seed)], {}
    if base_gpu_id is not None and cfg.device == "cuda":
        args += ["--base-gpu-id", str(base_gpu_id)]
    total = cfg.max_total_tokens
    if cfg.device == "cpu":
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        total = total or CPU_MAX_TOTAL_TOKENS
    if total:
        args += ["--max-total-tokens", str(total)]
    if cfg.deterministic:
        args.append("--enable-deterministic-inference")
    return args + cfg.sglang_args, env


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
    env: dict[str, str] | None = None,
    log_path: str | Path | None = None,
    startup_timeout: float = 900.0,
    client_timeout: float = 300.0,
    client_retries: int = 3,
) -> EngineProcess:
    """Spawn SGLang on 127.0.0.1 (a free port) and return once `/health` answers 200.

    `env`: variables set for the server on top of ours (less the `_ENV_DROPPED`). Raises `EngineError` when the interpreter is missing, when the server exits during startup (with the exit
    code and the log's tail), or when it is not healthy within `startup_timeout` (it is stopped first).
    """
    exe = shutil.which(python)
    if exe is None:
        raise EngineError(
            f"engine.sglang_python {python}: no such executable (the SGLang environment's python, "
            "e.g. /opt/sglang-venv/bin/python)"
        )
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="grpoflow-sglang-")) / "engine.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = sglang_command(
        exe, model_path, port, tp_size=tp_size, mem_fraction_static=mem_fraction_static, extra_args=extra_args
    )
    child_env = {k: v for k, v in os.environ.items() if k not in _ENV_DROPPED} | (env or {})
    with open(log_path, "ab") as log_file:
        log_file.write(f"grpoflow: starting {' '.join(cmd)}\n".encode())
        log_file.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(proc, url, log_path, startup_timeout)
    except BaseException:
        stop_process_group(proc, timeout=10.0)
        raise
    client = EngineClient(url, timeout=client_timeout, retries=client_retries)
    # SGLang frees GPU memory on the way out: give it 30 s before SIGKILL
    return EngineProcess(proc, url, log_path, client, stop_timeout=30.0, command=cmd)


def _wait_until_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with EngineClient(url, timeout=_HEALTH_PROBE_TIMEOUT_S, retries=0) as probe:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EngineError(
                    f"SGLang server exited with code {proc.returncode} during startup; log {log_path}:\n"
                    + log_tail(log_path)
                )
            if probe.health(timeout=min(_HEALTH_PROBE_TIMEOUT_S, max(deadline - time.monotonic(), 0.1))):
                return
            time.sleep(_POLL_S)
    raise EngineError(
        f"SGLang server at {url} not healthy after {timeout:.0f}s; log {log_path}:\n" + log_tail(log_path)
    )

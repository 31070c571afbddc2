"""The live engine lanes: one real SGLang 0.5.23 server and one real vLLM 0.32 server on the CPU for the whole
session, each started from a run config (`engine.backend = "sglang-launch"` / `"vllm-launch"`, `engine.launch.device =
"cpu"`) over the tiny random model on first use, and stopped at the end.

SGLang's CPU kernels are not built here; its torch-native paths run (`install_sglang.sh` and `sgl_kernel_shim/`).
The environment is installed on first use (cached outside the repo); when that fails, every test of the lane fails
with the installer's reason: the lane is never skipped. `GRPOFLOW_SGLANG_URL=http://...` runs the lane against an
SGLang server already running instead (on a tiny model built by `tests.fakes.tiny_model`, seed 0), and
`GRPOFLOW_VLLM_URL` against a vLLM one (started as `grpoflow.engine.vllm_launch` starts it).

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
import torch

from grpoflow.engine.client import EngineClient, SglangClient
from grpoflow.engine.vllm_client import VllmClient

HERE = Path(__file__).parent
CONTEXT_LENGTH = 2048
# Trials a prompt in the lanes' train runs: see `train_config`.
TRIALS_PER_PROMPT = 12


@dataclass
class LiveEngine:
    url: str
    client: EngineClient
    model_dir: Path
    startup_s: float | None  # None: attached to a running server


def _installed(installer: str, name: str, *args: str) -> str:
    """The python an engine installer prints (installing now if missing or out of date); the lane fails without
    it, with the installer's reason."""
    proc = subprocess.run(
        ["bash", str(HERE / installer), *args], capture_output=True, text=True, timeout=1800, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"{name} for the live lane did not install:\n{proc.stderr[-3000:]}", pytrace=False)
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The SGLang environment's python."""
    return _installed("install_sglang.sh", "SGLang", sys.executable)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM environment's python (a Python 3.11 venv of its own)."""
    return _installed("install_vllm.sh", "vLLM")


@pytest.fixture(scope="session")
def sglang_model(tmp_path_factory) -> Path:
    """The lane's model: the tiny random Qwen2 (its own folder: a test must not see another's weights)."""
    from tests.fakes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("sglang-model") / "model", seed=0)


@pytest.fixture(scope="session")
def sglang(request, tmp_path_factory, sglang_model) -> Iterator[LiveEngine]:
    url = os.environ.get("GRPOFLOW_SGLANG_URL")
    if url:
        with SglangClient(url, timeout=300, retries=0) as client:
            # the model it was started on (/model_info's model_path is the last dir it loaded weights from)
            yield LiveEngine(url, client, Path(client.server_info()["model_path"]), None)
        return
    from grpoflow.config import SglangLaunch
    from grpoflow.engine.backends import open_engine

    cfg = SglangLaunch.model_validate(
        {
            "backend": "sglang-launch",
            "sglang": {
                "python": request.getfixturevalue("sglang_python"),
                "args": ["--context-length", str(CONTEXT_LENGTH)],
            },
            "launch": {"device": "cpu", "startup_timeout_s": 300},
            "retries": 0,
        }
    )
    log = tmp_path_factory.mktemp("sglang") / "engine.log"
    t0 = time.perf_counter()
    with open_engine(cfg, str(sglang_model), seed=0, log_path=log) as engine:
        yield LiveEngine(engine.url, engine.client, sglang_model, time.perf_counter() - t0)


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> Path:
    """The vLLM lane's model: the tiny random Qwen2, in a folder of its own."""
    from tests.fakes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "model", seed=0)


def vllm_engine_config(vllm_python: str, **fields):
    """The lane's `vllm-launch` engine config (the CPU, the lane's context length), with `fields` on top."""
    from grpoflow.config import VllmLaunch

    return VllmLaunch.model_validate(
        {
            "backend": "vllm-launch",
            "vllm": {"python": vllm_python, "args": ["--max-model-len", str(CONTEXT_LENGTH)]},
            "launch": {"device": "cpu", "startup_timeout_s": 600},
            **fields,
        }
    )


@pytest.fixture(scope="session")
def vllm(request, tmp_path_factory, vllm_model) -> Iterator[LiveEngine]:
    url = os.environ.get("GRPOFLOW_VLLM_URL")
    if url:
        with VllmClient(url, timeout=300, retries=0) as client:
            yield LiveEngine(url, client, Path(client.model_info().model_path), None)
        return
    from grpoflow.engine.backends import open_engine

    cfg = vllm_engine_config(request.getfixturevalue("vllm_python"), retries=0)
    log = tmp_path_factory.mktemp("vllm") / "engine.log"
    t0 = time.perf_counter()
    with open_engine(cfg, str(vllm_model), seed=0, log_path=log) as engine:
        yield LiveEngine(engine.url, engine.client, vllm_model, time.perf_counter() - t0)


@pytest.fixture
def restore_vllm_base(vllm) -> Iterator[None]:
    """The test may change the weights vLLM serves; the base model (version `base`) is served again after it."""
    yield
    vllm.client.update_weights_from_disk(str(vllm.model_dir), weight_version="base")


def move_weights(trainer, seed: int) -> None:
    """New weights the engine cannot have: every parameter moved (the probe tells them from the old ones)."""
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())) * 0.05)
    trainer.optimizer_steps += 1


# A weight sync's bucket in the lanes: a fraction of the tiny model (about 1 MiB in bfloat16), so that every
# `distributed` sync goes in several update requests, as a large model's would.
BUCKET_MB = 0.25


def sync_twice_and_probe(live: LiveEngine, cfg, tmp_path: Path) -> None:
    """Two syncs into `live` by `cfg`'s weight sync (the second reuses its group or buffer), as a run makes them,
    each of new weights: the version reads back (the push checks it, and so does every reply after it), and the
    served-weights probe finds the trainer's weights there."""
    from grpoflow.config import TrainConfig
    from grpoflow.train.probe import SyncProbe
    from grpoflow.train.sync import open_weight_sync
    from grpoflow.train.trainer import load_trainer

    trainer = load_trainer(live.model_dir, TrainConfig(), seed=0)
    probe = SyncProbe(limit=0.1)
    with open_weight_sync(cfg, live.url, trainer) as sync:
        probe.check(sync.client, trainer, "start")
        for version in ("1", "2"):
            move_weights(trainer, int(version))
            ckpt = None
            if sync.needs_dir:
                ckpt = tmp_path / f"step_{version}"
                trainer.model.save_pretrained(ckpt)
            moved = sync.push(trainer, version, ckpt)  # reads the served version back, or raises
            assert moved["bytes"] > 0 and live.client.model_info().weight_version == version
            if cfg.weight_sync_mode() == "distributed":  # several requests, each loaded before the next
                assert moved["buckets"] >= 3
            assert probe.check(sync.client, trainer, version)["probe_gap"] < 0.1
            assert live.client.generate([1, 2, 3]).meta_info.weight_version == version


def train_config(tmp_path: Path, policy: Path, run_id: str, engine: dict, steps: int = 2) -> dict:
    """A lane's train run of `steps` steps on `policy` (the fence policy: `tests.integration.faults.policy`, which
    earns rewards some of the time, so every step really moves the weights) against `engine`, as raw config.
    12 trials a prompt: where the engine ignores sampling seeds (SGLang on the CPU) the rewards are a draw, a trial
    solving with p ~ 1/8, and two steps without any reward, so without an update, are then rare (p ~ 0.002)."""
    from tests.integration.faults.policy import reward_tasks, run_config

    cfg = run_config(tmp_path / "runs", policy, reward_tasks(tmp_path / "tasks"), run_id, steps=steps)
    cfg["engine"] = engine
    cfg["rollout"]["n_samples_per_prompt"] = TRIALS_PER_PROMPT
    return cfg


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

"""Shared fixtures: one tiny model per session, one scheduler + HTTP server over it, reference logprobs."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.fakes.tiny_model import build_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def scheduler(tiny_model_dir: Path):
    """The shared engine. Tests must not change its weights (use `fresh_scheduler` for that)."""
    from grpoflow.embedded.engine.scheduler import Scheduler

    s = Scheduler(tiny_model_dir, seed=0, max_batch_size=8)
    yield s
    s.close()


@pytest.fixture
def fresh_scheduler(tiny_model_dir: Path):
    from grpoflow.embedded.engine.scheduler import Scheduler

    s = Scheduler(tiny_model_dir, seed=0, max_batch_size=8)
    yield s
    s.close()


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path):
    """A second copy of the tiny model, for plain full-sequence forwards outside the engine's thread."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def reference_logprobs(reference_model) -> Callable[[list[int], list[int]], list[float]]:
    """log_softmax(logits / T) of one full forward over prompt + output, read at each output token: what the
    trainer computes for a rollout sampled at temperature T (T = 0, greedy, is scored at T = 1)."""

    def compute(prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
        with torch.no_grad():
            logits = reference_model(torch.tensor([prompt + output])).logits[0].float()  # (T, V)
        lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return [lp[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(output)]

    return compute


@contextlib.contextmanager
def serve_app(app) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free 127.0.0.1 port in a thread; yield its base URL."""
    import uvicorn

    from grpoflow.sockets import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("test server did not start within 10 s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="session")
def engine_url(scheduler) -> Iterator[str]:
    from grpoflow.embedded.engine.server import create_app

    with serve_app(create_app(scheduler, served_model_name="tiny")) as url:
        yield url


@pytest.fixture
def serve() -> Callable:
    """`with serve(app) as url:` — an app served for the duration of the block."""
    return serve_app

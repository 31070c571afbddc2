"""The engine a run talks to, whichever backend: the embedded one started for the run, or an SGLang server
already running. Either way the rest of the pipeline sees one URL speaking SGLang's HTTP API."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from grpoflow.config import EngineConfig
from grpoflow.engine.client import EngineClient
from grpoflow.engine.launch import start_embedded_engine
from grpoflow.errors import EngineError


@dataclass(frozen=True)
class EngineHandle:
    url: str
    client: EngineClient


@contextmanager
def open_engine(cfg: EngineConfig, model_path: str, seed: int, log_path: Path) -> Iterator[EngineHandle]:
    if cfg.backend == "embedded":
        with start_embedded_engine(
            model_path, seed=seed, threads=cfg.threads, max_batch_size=cfg.max_batch_size, log_path=log_path,
            client_timeout=cfg.request_timeout_s,
        ) as engine:  # fmt: skip
            yield EngineHandle(engine.url, engine.client)
        return
    assert cfg.url, "validated by parse_run_config"
    client = EngineClient(cfg.url, timeout=cfg.request_timeout_s)
    if not client.health():
        raise EngineError(f"engine.url {cfg.url}: no healthy SGLang server answers there (GET /health)")
    try:
        yield EngineHandle(cfg.url, client)
    finally:
        client.close()

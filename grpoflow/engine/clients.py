"""The one place an engine API's name (`EngineConfig.api`; a harness's `engine_api`, which trials store) becomes
the client class that speaks it."""

from __future__ import annotations

from grpoflow.config import EngineApi
from grpoflow.engine.client import EngineClient, SglangClient
from grpoflow.engine.vllm_client import VllmClient

CLIENTS: dict[str, type[EngineClient]] = {"sglang": SglangClient, "vllm": VllmClient}


def engine_client(api: EngineApi, base_url: str, **settings) -> EngineClient:
    """A client of `api` for the server at `base_url`; `settings`: `EngineClient`'s (timeout, retries, ...)."""
    return CLIENTS[api](base_url, **settings)

"""The one place an engine API's name (`Engine.api`, a class variable of each backend's config type) becomes
the client class that speaks it."""

from __future__ import annotations

from grpoflow.config import Engine, EngineApi
from grpoflow.engine.client import EngineClient, SglangClient
from grpoflow.engine.vllm_client import VllmClient

CLIENTS: dict[str, type[EngineClient]] = {"sglang": SglangClient, "vllm": VllmClient}


def engine_client(api: EngineApi, base_url: str, **settings) -> EngineClient:
    """A client of `api` for the server at `base_url`; `settings`: `EngineClient`'s (timeout, retries, ...)."""
    return CLIENTS[api](base_url, **settings)


def client_of(
    engine: Engine, base_url: str, *, lora_path: str | None = None, waits_out_outages: bool = False
) -> EngineClient:
    """A client of `engine` (its API, request and generation timeouts, retries) for the server at `base_url`.
    `lora_path`: the adapter every generation names; `waits_out_outages`: a trial's client, which keeps retrying an
    engine that does not answer for `engine.outage_wait_s` (the run's own calls fail after their retries)."""
    return engine_client(
        engine.api,
        base_url,
        timeout=engine.request_timeout_s,
        min_decode_tok_s=engine.min_decode_tok_s,
        retries=engine.retries,
        lora_path=lora_path,
        outage_s=engine.outage_wait_s if waits_out_outages else 0.0,
    )

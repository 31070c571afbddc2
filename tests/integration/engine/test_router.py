"""The real sglang-router (the pinned PyPI wheel) in front of engines: what it forwards, and what it lists.

The router adds fields of its own to every `/generate` it forwards; the embedded engine takes exactly those
(`ROUTER_ADDED_*` in grpoflow.engine.protocol). A router upgrade that adds another shows up here first, by name.
"""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi import FastAPI, Request

from grpoflow.engine.client import _generate_body, replica_urls
from grpoflow.engine.launch import start_embedded_engine
from grpoflow.engine.protocol import ROUTER_ADDED_ANY_VALUE, ROUTER_ADDED_OFF, GenerateRequest, SamplingParams
from grpoflow.engine.router import healthy_workers, remove_worker, start_router
from tests.fakes.app_thread import AppThread


def _recording_worker(seen: list[dict]) -> FastAPI:
    """Answers what the router asks a worker at registration, and records each /generate body."""
    app = FastAPI()
    app.get("/health")(lambda: {})
    app.get("/get_server_info")(lambda: {"model_path": "m"})
    app.get("/get_model_info")(lambda: {"model_path": "m", "is_generation": True})

    @app.post("/generate")
    async def generate(req: Request) -> dict:
        seen.append(await req.json())
        return {"text": "", "output_ids": [], "meta_info": {"id": "x"}}

    return app


def test_the_router_adds_only_the_fields_the_engine_takes(tmp_path):
    seen: list[dict] = []
    worker = AppThread(_recording_worker(seen))
    router = start_router([worker.url], log_path=tmp_path / "router.log")
    try:
        body = _generate_body([1, 2, 3], SamplingParams(max_new_tokens=4, sampling_seed=7), True)
        assert httpx.post(router.url + "/generate", json=body, timeout=30).status_code == 200
        assert replica_urls(router.url) == [worker.url]
    finally:
        router.stop()
        worker.stop()
    [forwarded] = seen
    added = set(forwarded) - set(body)
    assert added == set(ROUTER_ADDED_ANY_VALUE) | set(ROUTER_ADDED_OFF)
    assert {k: forwarded[k] for k in body} == body  # what we sent arrives unchanged
    assert GenerateRequest.model_validate(forwarded).model_dump(exclude_defaults=True) == (
        GenerateRequest.model_validate(body).model_dump(exclude_defaults=True)
    )


def test_the_engine_refuses_a_router_field_that_asks_for_more():
    with pytest.raises(ValueError, match="return_hidden_states: not supported"):
        GenerateRequest.model_validate({"input_ids": [1], "return_hidden_states": True})


def test_two_engines_behind_the_router_answer_and_one_lost_leaves_it(tmp_path, tiny_model_dir):
    engines = [start_embedded_engine(tiny_model_dir, log_path=tmp_path / f"engine-{i}.log") for i in (0, 1)]
    router = start_router([e.url for e in engines], log_path=tmp_path / "router.log", client_retries=0)
    try:
        assert sorted(replica_urls(router.url)) == sorted(e.url for e in engines)
        out = router.client.generate([1, 2, 3], SamplingParams(max_new_tokens=4, sampling_seed=1))
        assert len(out.output_ids) == 4 and len(out.logprobs) == 4
        engines[1].stop()
        deadline = time.monotonic() + 30
        while len(healthy_workers(router.url)) != 1:
            assert time.monotonic() < deadline, "the router still routes to a stopped engine"
            time.sleep(0.2)
        assert healthy_workers(router.url) == [engines[0].url]
        again = router.client.generate([1, 2, 3], SamplingParams(max_new_tokens=4, sampling_seed=1))
        assert again.output_ids == out.output_ids  # the same seed on the same weights: the same tokens
    finally:
        router.stop()
        for e in engines:
            e.stop()


def test_a_worker_taken_out_of_the_router_leaves_its_rotation(tmp_path):
    workers = [AppThread(_recording_worker([])) for _ in range(2)]
    router = start_router([w.url for w in workers], log_path=tmp_path / "router.log")
    try:
        assert remove_worker(router.url, workers[1].url)
        deadline = time.monotonic() + 30
        while healthy_workers(router.url) != [workers[0].url]:
            assert time.monotonic() < deadline, "the router still lists the removed worker"
            time.sleep(0.2)
        assert not remove_worker(router.url, workers[1].url)  # no longer listed
    finally:
        router.stop()
        for w in workers:
            w.stop()

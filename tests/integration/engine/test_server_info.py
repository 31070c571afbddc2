"""GET /get_server_info: SGLang's shape, and counters a benchmark can turn into the engine's busy fraction."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI

from grpoflow.engine.client import EngineClient, SglangClient
from grpoflow.engine.protocol import SamplingParams
from grpoflow.errors import EngineError

REQUIRED = {
    "busy_time_s": float,
    "generated_tokens": int,
    "prefill_tokens": int,
    "decode_steps": int,
    "requests_finished": int,
}


def _settled_state(client: EngineClient) -> dict:
    """The scheduler's counters once it is idle (the last step's time is added just after its results)."""
    time.sleep(0.2)
    return client.server_info()["internal_states"][0]


def test_server_info_shape_and_counters(tiny_model_dir, serve):
    from grpoflow.embedded.engine.scheduler import Scheduler
    from grpoflow.embedded.engine.server import create_app

    prompt = [5, 6, 7, 8, 9]
    with (
        Scheduler(tiny_model_dir, seed=3, max_batch_size=4, weight_version="v7") as sched,
        serve(create_app(sched, served_model_name="tiny")) as url,
        SglangClient(url, retries=0) as client,
    ):
        info = client.server_info()
        assert info["model_path"] == str(tiny_model_dir) and info["weight_version"] == "v7"
        assert info["served_model_name"] == "tiny" and info["max_running_requests"] == 4
        assert info["random_seed"] == 3
        [state] = info["internal_states"]
        for key, kind in REQUIRED.items():
            assert isinstance(state[key], kind), key
        assert state["busy_time_s"] == 0.0 and state["requests_finished"] == 0

        client.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
        after = _settled_state(client)
        assert after["generated_tokens"] == 10 and after["decode_steps"] == 9  # the first token comes from prefill
        assert after["prefill_tokens"] == len(prompt) and after["requests_finished"] == 1
        assert after["busy_time_s"] > 0

        time.sleep(0.5)  # idle: the busy time stays put
        idle = client.server_info()["internal_states"][0]
        assert idle["busy_time_s"] == after["busy_time_s"]

        client.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        more = _settled_state(client)
        assert more["busy_time_s"] > after["busy_time_s"]
        assert more["generated_tokens"] == 40 and more["requests_finished"] == 2

        async def both() -> tuple[dict, dict]:
            info = await client.aserver_info()
            await client.aclose()
            return info, client.server_info()

        async_info, sync_info = asyncio.run(both())
        assert async_info["internal_states"][0]["generated_tokens"] == 40
        assert async_info.keys() == sync_info.keys()


def test_server_info_must_be_a_json_object(serve):
    app = FastAPI()

    @app.get("/get_server_info")
    async def not_an_object() -> list:
        return [1, 2]

    with serve(app) as url, SglangClient(url, retries=0) as client:
        with pytest.raises(EngineError, match="/get_server_info: malformed response: expected a JSON object"):
            client.server_info()

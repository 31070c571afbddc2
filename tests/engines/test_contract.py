"""What grpoflow's client relies on, asked of real SGLang and real vLLM on the CPU and of the embedded engine
alike.

Each case runs against all three (the same tiny model; vLLM through `VllmClient`, which answers as
SGLang does): where real SGLang behaves one way, the embedded engine and vLLM must too, so the fast suite (the
`embedded` cases) catches a regression that only a live engine would show. The few deliberate differences are
asserted per engine and say why (seeded sampling; the first weight version's name; what /model_info names).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from grpoflow.engine.client import EngineClient
from grpoflow.engine.launch import start_embedded_engine
from grpoflow.engine.protocol import (
    WEIGHT_SESSION_ALREADY_OPEN,
    WEIGHT_SESSION_NOT_OPEN,
    SamplingParams,
    outside_weight_session,
)
from grpoflow.errors import EngineError
from grpoflow.preflight import check_engine
from tests.engines.conftest import CONTEXT_LENGTH

PROMPT = [1, 5, 9, 14, 3, 7, 11, 4]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


@dataclass
class Engine:
    name: str
    url: str
    client: EngineClient
    model_dir: object


@pytest.fixture(scope="module")
def embedded(tiny_model_dir, tmp_path_factory) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("embedded") / "engine.log"
    with start_embedded_engine(tiny_model_dir, max_batch_size=4, log_path=log) as e:
        yield Engine("embedded", e.url, e.client, tiny_model_dir)


@pytest.fixture(
    params=["embedded", pytest.param("sglang", marks=pytest.mark.sglang), pytest.param("vllm", marks=pytest.mark.vllm)]
)
def engine(request) -> Engine:
    if request.param == "embedded":
        return request.getfixturevalue("embedded")
    live = request.getfixturevalue(request.param)
    return Engine(request.param, live.url, live.client, live.model_dir)


def test_generate_takes_token_ids_and_returns_ids_and_logprobs(engine):
    resp = engine.client.generate(PROMPT, GREEDY, return_logprob=True)
    meta = resp.meta_info
    assert len(resp.output_ids) == 8 and meta.completion_tokens == 8 and meta.prompt_tokens == len(PROMPT)
    assert meta.finish_reason.model_dump(exclude_none=True) == {"type": "length", "length": 8}
    assert [t for _, t, _ in meta.output_token_logprobs] == resp.output_ids  # (logprob, token id, text: null)
    assert all(lp <= 0 for lp in resp.logprobs) and {text for *_, text in meta.output_token_logprobs} == {None}
    assert meta.id and isinstance(resp.text, str)
    plain = engine.client.generate(PROMPT, GREEDY, return_logprob=False)
    assert plain.output_ids == resp.output_ids and plain.meta_info.output_token_logprobs is None


def test_greedy_repeats(engine):
    first = engine.client.generate(PROMPT, GREEDY)
    assert engine.client.generate(PROMPT, GREEDY).output_ids == first.output_ids


def test_a_stop_token_ends_the_reply_and_is_kept_unless_eos_is_ignored(engine):
    """SGLang's `ignore_eos` switches off every token-based stop, `stop_token_ids` too."""
    full = engine.client.generate(PROMPT, GREEDY).output_ids
    stop = full[2]
    cut = full.index(stop) + 1  # its first occurrence
    stopping = GREEDY.model_copy(update={"stop_token_ids": [stop], "ignore_eos": False})
    resp = engine.client.generate(PROMPT, stopping)
    assert resp.output_ids == full[:cut]
    assert resp.meta_info.finish_reason.model_dump(exclude_none=True) == {"type": "stop", "matched": stop}
    ignored = engine.client.generate(PROMPT, stopping.model_copy(update={"ignore_eos": True}))
    assert ignored.output_ids == full and ignored.meta_info.finish_reason.type == "length"


def test_a_stop_string_cuts_the_text_before_it(engine):
    full = engine.client.generate(PROMPT, GREEDY.model_copy(update={"max_new_tokens": 16}))
    stop = next(full.text[i : i + 2] for i in range(3, len(full.text) - 1) if full.text[i : i + 2].strip())
    resp = engine.client.generate(PROMPT, GREEDY.model_copy(update={"max_new_tokens": 16, "stop": [stop]}))
    assert resp.text == full.text[: full.text.index(stop)]
    assert resp.meta_info.finish_reason.model_dump(exclude_none=True) == {"type": "stop", "matched": stop}
    # the tokens up to the one that completed the match, that one included
    assert resp.output_ids == full.output_ids[: len(resp.output_ids)] and len(resp.output_ids) < 16


def test_a_sampling_seed_repeats_only_where_the_engine_honours_it(engine):
    """SGLang reads `sampling_seed` only under --enable-deterministic-inference (its SamplingBatchInfo leaves the
    seeds out otherwise, and the sampler draws from the process-wide torch generator), which refuses the CPU's
    torch_native attention: on SGLang-CPU the same seed twice gives different samples. The embedded engine seeds
    every request's own generator, and vLLM its `seed`."""
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, sampling_seed=1234)
    a, b = (engine.client.generate(PROMPT, seeded).output_ids for _ in range(2))
    if engine.name in ("embedded", "vllm"):
        assert a == b
    else:
        assert a != b
        assert engine.client.server_info()["enable_deterministic_inference"] is False


def test_in_memory_updates_are_refused_outside_a_weight_update_session(engine):
    """SGLang's rule and its answers, word for word: 400 and {"success": false, "message"}."""
    if engine.name == "vllm":
        pytest.skip("vLLM has no such routes: its in-memory syncs are refused at config validation")

    def post(path: str, body: dict) -> tuple[int, dict]:
        r = httpx.post(engine.url + path, json=body, timeout=60)
        return r.status_code, r.json()

    update = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "none"}
    for route, body in (
        ("update_weights_from_distributed", update),
        ("update_weights_from_tensor", {"serialized_named_tensors": ["AA=="]}),
    ):
        assert post(f"/{route}", body) == (400, {"success": False, "message": outside_weight_session(route)})
    assert post("/end_weight_update", {}) == (400, {"success": False, "message": WEIGHT_SESSION_NOT_OPEN})
    assert post("/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
    try:
        assert post("/begin_weight_update", {}) == (400, {"success": False, "message": WEIGHT_SESSION_ALREADY_OPEN})
    finally:
        assert post("/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
    with pytest.raises(EngineError, match="update_weights_from_distributed must run between begin_weight_update"):
        engine.client.update_weights_from_distributed(["x"], ["float32"], [[1]], "none")


def test_update_weights_from_disk_sets_the_version_every_reply_reports(engine):
    before = engine.client.generate(PROMPT, GREEDY)
    resp = engine.client.update_weights_from_disk(str(engine.model_dir), weight_version="disk-1")
    assert resp.success and engine.client.model_info().weight_version == "disk-1"
    after = engine.client.generate(PROMPT, GREEDY)
    assert after.meta_info.weight_version == "disk-1" and after.output_ids == before.output_ids  # the same weights
    with pytest.raises(EngineError, match="/update_weights_from_disk: failed: "):
        engine.client.update_weights_from_disk(str(engine.model_dir / "missing"), weight_version="disk-2")
    assert engine.client.model_info().weight_version == "disk-1"  # a failed load changes nothing


def test_model_info_names_the_last_weights_loaded_and_server_info_the_launch_model(engine, tmp_path):
    """SGLang's /model_info model_path follows /update_weights_from_disk (a run's checkpoint dir after a disk
    sync); /get_server_info keeps the --model-path it was started with, which preflight also accepts. vLLM has
    neither route: the client's model_info names the model it was started with, whatever it loaded since."""
    if engine.name == "vllm":
        copy = tmp_path / "copy"
        shutil.copytree(engine.model_dir, copy)
        try:
            engine.client.update_weights_from_disk(str(copy), weight_version="copy")
            assert engine.client.model_info().model_path == str(engine.model_dir)
            assert check_engine(engine.url, str(engine.model_dir), "model.source") == []
        finally:
            engine.client.update_weights_from_disk(str(engine.model_dir), weight_version="base")
        return
    started = engine.client.server_info()["model_path"]
    copy = tmp_path / "copy"
    shutil.copytree(engine.model_dir, copy)
    try:
        engine.client.update_weights_from_disk(str(copy), weight_version="copy")
        assert engine.client.model_info().model_path == str(copy)
        assert engine.client.server_info()["model_path"] == started
        assert check_engine(engine.url, started, "model.source") == []
    finally:
        engine.client.update_weights_from_disk(str(engine.model_dir), weight_version="base")
    assert engine.client.model_info().model_path == str(engine.model_dir)


def test_the_context_length_is_read_from_the_engine(engine):
    import asyncio

    assert asyncio.run(engine.client.acontext_length()) == CONTEXT_LENGTH


def test_the_engine_says_how_many_workers_join_a_weight_update_group(engine):
    """The weight sync sizes its group from the server, not from `engine.tp_size`: one worker each here (SGLang's
    `tp_size`, vLLM's workers answering a collective_rpc, the embedded engine's one process)."""
    assert engine.client.weight_update_ranks() == 1

"""Pin grpoflow's request/response models to SGLang's field names, so the client works against real SGLang.

The request field names are in tests/fakes/sglang_fields.py, copied from SGLang's source; response shapes are in
data/sglang_responses.json (its "_source" says where each came from). If SGLang renames a field, update it there;
the tests then show what breaks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpoflow.engine.client import _generate_body, _update_body
from grpoflow.engine.protocol import (
    GenerateRequest,
    GenerateResponse,
    ModelInfo,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
)
from tests.fakes.sglang_fields import (
    SGLANG_GENERATE_REQ_INPUT,
    SGLANG_SAMPLING_DEFAULTS,
    SGLANG_SAMPLING_PARAMS,
    SGLANG_UPDATE_WEIGHT_FROM_DISK_REQ_INPUT,
    SGLANG_UPDATE_WEIGHT_FROM_DISK_REQ_OUTPUT,
)

FIXTURES = json.loads((Path(__file__).parent / "data" / "sglang_responses.json").read_text())


def test_request_models_use_only_sglang_field_names():
    assert set(GenerateRequest.model_fields) <= SGLANG_GENERATE_REQ_INPUT
    assert set(SamplingParams.model_fields) <= SGLANG_SAMPLING_PARAMS
    assert set(UpdateWeightsFromDiskRequest.model_fields) <= SGLANG_UPDATE_WEIGHT_FROM_DISK_REQ_INPUT
    assert set(UpdateWeightsFromDiskResponse.model_fields) == SGLANG_UPDATE_WEIGHT_FROM_DISK_REQ_OUTPUT


def test_wire_bodies_use_only_sglang_field_names():
    full = SamplingParams(
        max_new_tokens=5,
        temperature=0.5,
        top_p=0.9,
        top_k=10,
        stop=["\n"],
        stop_token_ids=[2],
        ignore_eos=True,
        sampling_seed=3,
    )
    body = _generate_body([1, 2], full, return_logprob=True)
    assert set(body) <= SGLANG_GENERATE_REQ_INPUT
    assert set(body["sampling_params"]) <= SGLANG_SAMPLING_PARAMS
    assert set(body["sampling_params"]) == set(SamplingParams.model_fields)  # every param set reaches the wire
    assert set(_update_body("/w", "v1", True)) <= SGLANG_UPDATE_WEIGHT_FROM_DISK_REQ_INPUT


def test_sampling_defaults_match_sglang():
    defaults = SamplingParams()
    assert {k: getattr(defaults, k) for k in SGLANG_SAMPLING_DEFAULTS} == SGLANG_SAMPLING_DEFAULTS


@pytest.mark.parametrize("name", ["generate_length", "generate_stop", "generate_stop_str", "generate_abort"])
def test_sglang_generate_responses_parse(name):
    data = FIXTURES[name]
    resp = GenerateResponse.model_validate(data)
    assert resp.output_ids == data["output_ids"]
    assert resp.meta_info.finish_reason.type == data["meta_info"]["finish_reason"]["type"]
    assert resp.meta_info.weight_version == data["meta_info"]["weight_version"]


def test_sglang_logprob_triples_parse():
    resp = GenerateResponse.model_validate(FIXTURES["generate_length"])
    assert resp.logprobs == [-1.25, -0.02, -0.7]
    assert [t for _, t, _ in resp.meta_info.output_token_logprobs] == resp.output_ids
    assert resp.meta_info.finish_reason.length == 3


def test_sglang_update_and_model_info_parse():
    assert UpdateWeightsFromDiskResponse.model_validate(FIXTURES["update_weights_ok"]).success
    assert not UpdateWeightsFromDiskResponse.model_validate(FIXTURES["update_weights_failed"]).success
    info = ModelInfo.model_validate(FIXTURES["model_info"])
    assert info.is_generation and info.weight_version == "default"


def test_embedded_engine_answers_in_the_sglang_shape(engine_url):
    """Our server's answers carry no key that real SGLang does not send."""
    import httpx

    gen = httpx.post(
        engine_url + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True},
    ).json()
    sglang = FIXTURES["generate_length"]
    assert set(gen) == set(sglang)
    assert set(gen["meta_info"]) <= set(sglang["meta_info"])
    assert set(gen["meta_info"]["finish_reason"]) <= {"type", "matched", "length", "message"}
    info = httpx.get(engine_url + "/model_info").json()
    assert set(info) <= set(FIXTURES["model_info"])

"""The start-of-run probe: the embedded engine and the trainer score a sampled reply alike; a trainer that does
not match the engine fails the run with one line naming the likely causes."""

import pytest
import torch

from grpoflow.config import parse_run_config
from grpoflow.engine.client import SglangClient
from grpoflow.errors import EngineError
from grpoflow.train.probe import check_logprob_agreement, logprob_gap
from grpoflow.train.trainer import load_trainer


def test_engine_and_trainer_agree_on_the_probe(engine_url, tiny_model_dir):
    cfg = parse_run_config({"rollout": {"sampling": {"temperature": 0.7}}})
    state = load_trainer(tiny_model_dir, cfg.train, seed=0)
    with SglangClient(engine_url) as client:
        gap = check_logprob_agreement(client, state, cfg)
    assert gap["tokens"] > 0 and gap["mean"] < 1e-3  # the same fp32 model; batched and packed kernels round apart


def test_a_trainer_that_does_not_match_the_engine_fails_the_run(engine_url, tiny_model_dir):
    cfg = parse_run_config({})
    state = load_trainer(tiny_model_dir, cfg.train, seed=0)
    with torch.no_grad():  # other weights than the engine serves, as a wrong checkpoint or dtype would give
        state.model.get_output_embeddings().weight.mul_(1.5)
    with SglangClient(engine_url) as client:
        assert logprob_gap(client, state, cfg)["mean"] > 0.1
        with pytest.raises(EngineError, match=r"nats apart on average .* train.max_probe_logprob_gap=0.1\): check"):
            check_logprob_agreement(client, state, cfg)

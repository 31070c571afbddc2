"""The live vLLM lane: real vLLM 0.32 on the CPU (`tests/engines/install_vllm.sh`), started once for the session
through grpoflow's own `vllm-launch` code (`conftest.vllm`). The request/response contract is asked of it in
`test_contract.py` (beside SGLang and the embedded engine); here: the start-of-run logprob probe, the disk and the
in-memory weight syncs as a run makes them (the weight version read back, the served-weights probe after every
push), what vLLM refuses, and a two-step train flow that launches a vLLM of its own (`engine.backend =
"vllm-launch"`).
"""

from __future__ import annotations

import json
import shutil

import pytest

from grpoflow.config import TrainConfig, parse_run_config
from grpoflow.errors import ConfigError, EngineError
from grpoflow.run.metrics import read_metrics
from grpoflow.train.probe import check_logprob_agreement
from grpoflow.train.trainer import load_trainer
from tests.engines.conftest import BUCKET_MB, TRIALS_PER_PROMPT, sync_twice_and_probe, train_config, vllm_engine_config

pytestmark = pytest.mark.vllm


def _cfg(vllm, mode: str = "disk"):
    return parse_run_config(
        {"engine": {"backend": "vllm", "url": vllm.url, "weight_sync": {"mode": mode, "bucket_mb": BUCKET_MB}}}
    )


def test_the_server_serves_through_vllm_launch(vllm):
    if vllm.startup_s is not None:
        print(f"vLLM server start (vllm-launch, tiny model): {vllm.startup_s:.1f}s")
    assert vllm.client.health() and vllm.client.model_info().model_path == str(vllm.model_dir)


def test_engine_and_trainer_score_a_probe_reply_alike(vllm):
    """vLLM serves the float32 checkpoint in bfloat16 on the CPU: its logprobs stay within the run's bound."""
    trainer = load_trainer(vllm.model_dir, TrainConfig(), seed=0)
    gap = check_logprob_agreement(vllm.client, trainer, _cfg(vllm))
    assert gap["tokens"] > 0 and gap["mean"] < 0.1


@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_each_sync_serves_the_trainers_weights_and_reports_its_version(vllm, mode, tmp_path, restore_vllm_base):
    """`distributed`: over gloo into grpoflow's worker extension (`grpoflow.engine.vllm_worker`)."""
    sync_twice_and_probe(vllm, _cfg(vllm, mode), tmp_path)


def test_a_load_of_a_dir_without_weights_is_refused_and_vllm_serves_on(vllm, tmp_path):
    """vLLM's reload_weights of such a dir kills its engine core: the client refuses it before asking."""
    before = vllm.client.model_info().weight_version
    with pytest.raises(EngineError, match=r"/update_weights_from_disk: failed: no \*\.safetensors in "):
        vllm.client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="never")
    assert vllm.client.health() and vllm.client.model_info().weight_version == before


@pytest.mark.parametrize(
    "engine, field",
    [
        ({"weight_sync": {"mode": "tensor"}}, "engine.weight_sync.mode"),
        ({"deterministic": True}, "engine.deterministic"),
    ],
)
def test_what_vllm_does_not_take_is_refused_at_validation(engine, field):
    with pytest.raises(ConfigError, match=f"`{field}`: .*vLLM") as exc:
        parse_run_config({"engine": {"backend": "vllm", "url": "http://h:1", **engine}})
    assert "\n" not in str(exc.value)


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")
def test_two_steps_on_a_launched_vllm_sync_in_buckets_and_probe_the_served_weights(vllm_python, vllm_model, tmp_path):
    from flows.train import train_flow
    from tests.integration.faults.policy import fence_policy

    policy = fence_policy(vllm_model, tmp_path / "policy")
    sync = {"mode": "distributed", "bucket_mb": BUCKET_MB}  # into the worker extension, in several requests
    engine = vllm_engine_config(vllm_python, weight_sync=sync).model_dump(exclude_defaults=True)
    cfg = train_config(tmp_path, policy, "vllm-launch", engine)
    train_flow(parse_run_config(cfg))
    rows = read_metrics(tmp_path / "runs" / "vllm-launch" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and [r["weight_version"] for r in rows] == ["1", "2"]
    assert sum(r["train/optimizer_steps"] for r in rows) >= 1  # the weights moved: the probes had work to do
    for r in rows:  # every step's sync reached vLLM and the probe found the trainer's weights there
        assert r["sync/bytes"] > 0 and 0 <= r["sync/probe_gap"] < 0.1 and r["rollout/scored"] == 2 * TRIALS_PER_PROMPT
        assert r["sync/buckets"] >= 3
    details = tmp_path / "runs" / "vllm-launch" / "details" / "step_1" / "samples.jsonl"
    assert {json.loads(x)["weight_version"] for x in details.open()} == {"1"}  # generated after step 0's sync

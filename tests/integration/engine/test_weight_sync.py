"""In-memory weight sync against the embedded engine in its own process: `distributed` over gloo
(`/init_weights_update_group`, `/update_weights_from_distributed`) and `tensor` through shared memory
(`/update_weights_from_tensor`), the protocols SGLang speaks, with the request fields pinned to SGLang's and the
engine serving exactly the trainer's new weights afterwards."""

from __future__ import annotations

import time

import pytest
import torch

from grpoflow.config import TrainConfig, parse_run_config
from grpoflow.engine.client import EngineClient
from grpoflow.engine.launch import start_embedded_engine
from grpoflow.engine.protocol import (
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResponse,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsUpdateGroupResponse,
)
from grpoflow.errors import EngineError
from grpoflow.train.logprobs import token_logprobs
from grpoflow.train.lora import serving_tensors
from grpoflow.train.probe import SyncProbe
from grpoflow.train.sync import (
    SERVED_ADAPTER,
    AdapterSync,
    DiskSync,
    DistributedSync,
    TensorSync,
    open_weight_sync,
    update_session,
)
from grpoflow.train.trainer import load_trainer
from tests.fakes.sglang_fields import (
    SGLANG_GENERATE_REQ_INPUT,
    SGLANG_INIT_WEIGHTS_UPDATE_GROUP_REQ_INPUT,
    SGLANG_LOAD_LORA_ADAPTER_REQ_INPUT,
    SGLANG_LORA_UPDATE_OUTPUT,
    SGLANG_UNLOAD_LORA_ADAPTER_REQ_INPUT,
    SGLANG_UPDATE_WEIGHT_VERSION_REQ_INPUT,
    SGLANG_UPDATE_WEIGHTS_FROM_DISTRIBUTED_REQ_INPUT,
    SGLANG_UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT,
    SGLANG_WEIGHTS_UPDATE_GROUP_REQ_OUTPUT,
)
from tests.fakes.sglang_standin import StandinServer

PROMPT = [1, 5, 9, 14, 3, 7]


def test_the_requests_use_sglang_field_names():
    assert set(InitWeightsUpdateGroupRequest.model_fields) == SGLANG_INIT_WEIGHTS_UPDATE_GROUP_REQ_INPUT
    assert set(UpdateWeightsFromDistributedRequest.model_fields) <= SGLANG_UPDATE_WEIGHTS_FROM_DISTRIBUTED_REQ_INPUT
    assert set(WeightsUpdateGroupResponse.model_fields) == SGLANG_WEIGHTS_UPDATE_GROUP_REQ_OUTPUT
    assert set(UpdateWeightsFromTensorRequest.model_fields) <= SGLANG_UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    with start_embedded_engine(tiny_model_dir, log_path=tmp_path_factory.mktemp("engine") / "engine.log") as e:
        yield e


def _engine_logprobs(client: EngineClient) -> tuple[list[int], list[float]]:
    out = client.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0), return_logprob=True)
    return out.output_ids, out.logprobs


def _trainer_logprobs(trainer, ids: list[int]) -> list[float]:
    seq = torch.tensor([PROMPT + ids])
    mask = torch.zeros(1, seq.shape[1] - 1, dtype=torch.bool)
    mask[0, len(PROMPT) - 1 :] = True
    with torch.no_grad():
        lp, _ = token_logprobs(trainer.model, seq, mask, None, 1.0)
    return lp[0, len(PROMPT) - 1 :].tolist()


@pytest.mark.parametrize(
    "mode, kind, bucket_mb",
    [("distributed", DistributedSync, 512.0), ("distributed", DistributedSync, 0.2), ("tensor", TensorSync, 512.0)],
)
def test_the_engine_serves_the_trainers_weights_after_an_in_memory_sync(engine, tiny_model_dir, mode, kind, bucket_mb):
    """`bucket_mb` 0.2: the tiny model's weights go in several update requests, each loaded as it arrives."""
    trainer = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    with torch.no_grad():  # new weights the engine cannot have: every parameter moved
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    client = engine.client
    before = _engine_logprobs(client)
    cfg = parse_run_config({"engine": {"weight_sync": {"mode": mode, "bucket_mb": bucket_mb}}})
    n_bytes = sum(t.numel() * 4 for t in serving_tensors(trainer.model).values())
    with open_weight_sync(cfg, engine.url, trainer) as sync:
        sync = sync.syncs[0]  # the one engine's own sync
        assert isinstance(sync, kind) and not sync.needs_dir
        moved = sync.push(trainer, "7")
        ids, lps = _engine_logprobs(client)
        assert client.model_info().weight_version == "7"
        # fp32 both sides: the engine's logprobs of its own greedy reply are the trainer's, to rounding
        assert lps != before[1]
        assert max(abs(a - b) for a, b in zip(lps, _trainer_logprobs(trainer, ids), strict=True)) < 1e-4
        assert moved["bytes"] == n_bytes
        if mode == "distributed":  # the tiny model is over 3 x 0.2 MiB and under 512 MiB
            assert moved["buckets"] >= 3 if bucket_mb < 1 else moved["buckets"] == 1
        with torch.no_grad():  # a second sync over the same group
            for p in trainer.model.parameters():
                p.mul_(0.9)
        sync.push(trainer, "8")
        ids, lps = _engine_logprobs(client)
        assert max(abs(a - b) for a, b in zip(lps, _trainer_logprobs(trainer, ids), strict=True)) < 1e-4


def test_the_engine_refuses_tensor_updates_that_name_anything_but_tensors(engine, tmp_path):
    """The body is unpickled: one naming any other callable is refused before it runs, and the engine serves on."""
    import base64
    import os
    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    body = base64.b64encode(pickle.dumps([("w", Payload())])).decode()
    before = _engine_logprobs(engine.client)
    with update_session(engine.client):
        with pytest.raises(EngineError, match=r"\.system is not part of a tensor handle"):
            engine.client.update_weights_from_tensor([body], weight_version="x")
        assert not marker.exists()
        with pytest.raises(EngineError, match="one rank"):
            engine.client.update_weights_from_tensor([body, body])
    assert _engine_logprobs(engine.client) == before


def test_a_refused_update_fails_at_once_with_the_engines_reason(engine, tiny_model_dir, caplog):
    trainer = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    with open_weight_sync(
        parse_run_config({"engine": {"weight_sync": {"mode": "distributed"}}}), engine.url, trainer
    ) as sync:
        sync = sync.syncs[0]  # the one engine's own sync
        sync.group_name = "no-such-group"  # the engine refuses before any tensor is sent
        with pytest.raises(EngineError, match="no weight update group 'no-such-group'"):
            sync.push(trainer, "9")
    # The failed sync left the engine's weight-update session open (as it would leave SGLang's): the next run's
    # first sync closes it, says so, and goes through.
    with open_weight_sync(
        parse_run_config({"engine": {"weight_sync": {"mode": "distributed"}}}), engine.url, trainer
    ) as sync:
        sync = sync.syncs[0]  # the one engine's own sync
        sync.push(trainer, "9")
    assert "had a weight-update session open" in caplog.text
    assert engine.client.model_info().weight_version == "9"
    with pytest.raises(EngineError, match="only `gloo`"):
        engine.client.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", "nccl")


def test_disk_sync_loads_the_step_dir(engine, tiny_model_dir, tmp_path):
    trainer = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    trainer.model.save_pretrained(tmp_path / "step_0")
    with open_weight_sync(parse_run_config({"engine": {"weight_sync": {"mode": "disk"}}}), engine.url, trainer) as sync:
        sync = sync.syncs[0]  # the one engine's own sync
        assert isinstance(sync, DiskSync) and sync.needs_dir
        assert sync.push(trainer, "10", tmp_path / "step_0")["bytes"] > 0
    assert engine.client.model_info().weight_version == "10"


def test_a_sync_fails_when_the_engine_does_not_report_the_new_version(engine, tiny_model_dir, tmp_path):
    """The version is read back after every sync, one engine or many: an engine that loaded the weights but kept
    its old label would make every sample of the next step look stale (or fresh) by mistake."""
    trainer = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    trainer.model.save_pretrained(tmp_path / "step_0")
    with StandinServer(str(tiny_model_dir), upstream=engine.url) as front:
        front.faults.inject("ignore_version", path="/update_weights_from_disk")
        cfg = parse_run_config({"engine": {"weight_sync": {"mode": "disk"}}})
        with open_weight_sync(cfg, front.url, trainer) as sync:
            sync = sync.syncs[0]  # the one engine's own sync
            # (a label the engine's own numbering, which counts up from the last number, cannot hit by chance)
            with pytest.raises(EngineError, match=r"serves weight version \S+ after the sync to sync-a"):
                sync.push(trainer, "sync-a", tmp_path / "step_0")
            sync.push(trainer, "sync-b", tmp_path / "step_0")  # the fault is spent: the version is read back
    assert engine.client.model_info().weight_version == "sync-b"


def test_the_sync_probe_fails_when_the_engine_did_not_apply_a_sync(engine, tiny_model_dir):
    trainer = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    probe = SyncProbe(limit=0.1)
    with open_weight_sync(
        parse_run_config({"engine": {"weight_sync": {"mode": "distributed"}}}), engine.url, trainer
    ) as sync:
        sync = sync.syncs[0]  # the one engine's own sync
        sync.push(trainer, "20")
        assert probe.check(engine.client, trainer, "20")["probe_gap"] < 1e-4
        with torch.no_grad():  # an update the engine never receives, as if it acknowledged a sync and ignored it
            for p in trainer.model.parameters():
                p.mul_(1.02)
        trainer.optimizer_steps += 1
        with pytest.raises(EngineError, match="still serves the old weights after the sync to version 21"):
            probe.check(engine.client, trainer, "21")
        sync.push(trainer, "21")  # applied: the probe passes, and the next one compares with these weights
        assert probe.check(engine.client, trainer, "21")["probe_gap"] < 1e-4


def test_the_sync_probe_bounds_the_gap_to_the_trainer(engine, tiny_model_dir):
    trainer = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    with open_weight_sync(
        parse_run_config({"engine": {"weight_sync": {"mode": "distributed"}}}), engine.url, trainer
    ) as sync:
        sync = sync.syncs[0]  # the one engine's own sync
        sync.push(trainer, "30")
        with torch.no_grad():  # far from what the engine serves, at the first check (nothing to compare with)
            for p in trainer.model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.2)
        with pytest.raises(EngineError, match=r"nats from the trainer's on average .*does not serve"):
            SyncProbe(limit=0.1).check(engine.client, trainer, "31")


def test_the_lora_requests_use_sglang_field_names():
    assert set(LoadLoRAAdapterRequest.model_fields) <= SGLANG_LOAD_LORA_ADAPTER_REQ_INPUT
    assert set(UnloadLoRAAdapterRequest.model_fields) <= SGLANG_UNLOAD_LORA_ADAPTER_REQ_INPUT
    assert set(LoRAUpdateResponse.model_fields) <= SGLANG_LORA_UPDATE_OUTPUT
    assert set(UpdateWeightVersionRequest.model_fields) == SGLANG_UPDATE_WEIGHT_VERSION_REQ_INPUT
    assert "lora_path" in GenerateRequest.model_fields and "lora_path" in SGLANG_GENERATE_REQ_INPUT


def _lora_trainer(tiny_model_dir):
    cfg = TrainConfig(lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    trainer = load_trainer(tiny_model_dir, cfg, seed=0)
    with torch.no_grad():  # adapters that change the model (B starts at zero)
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return trainer


def test_an_adapter_sync_serves_base_plus_adapter_and_only_to_requests_that_name_it(engine, tiny_model_dir, tmp_path):
    base = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    with open_weight_sync(parse_run_config({"engine": {"weight_sync": {"mode": "disk"}}}), engine.url, base) as sync:
        sync = sync.syncs[0]  # the one engine's own sync
        base.model.save_pretrained(tmp_path / "base")
        sync.push(base, "40", tmp_path / "base")  # the engine serves the plain base model
    trainer = _lora_trainer(tiny_model_dir)
    cfg = parse_run_config({"engine": {"weight_sync": {"mode": "adapter"}}, "train": {"lora": {"rank": 4}}})
    assert cfg.weight_sync_mode() == "adapter"
    with open_weight_sync(cfg, engine.url, trainer, tmp_path / "sync") as sync:
        sync = sync.syncs[0]  # the one engine's own sync
        assert isinstance(sync, AdapterSync) and sync.client.lora_path == SERVED_ADAPTER
        moved = sync.push(trainer, "41")
        model_bytes = sum(t.numel() * 4 for t in serving_tensors(base.model).values())
        assert 0 < moved["bytes"] < model_bytes / 20  # the adapter alone
        assert [p.name for p in (tmp_path / "sync").iterdir()] == ["adapter-41"]  # the one before is spent
        ids, lps = _engine_logprobs(sync.client)
        assert sync.client.model_info().weight_version == "41"
        assert max(abs(a - b) for a, b in zip(lps, _trainer_logprobs(trainer, ids), strict=True)) < 1e-4
        probe = SyncProbe(limit=0.1)
        assert probe.check(sync.client, trainer, "41")["probe_gap"] < 1e-4
        # a request for the base model (or another adapter) is refused while the adapter is merged in
        with pytest.raises(EngineError, match="lora_path None: this engine serves adapter 'grpoflow-policy'"):
            _engine_logprobs(engine.client)
        with pytest.raises(EngineError, match="unload it before new base weights"):
            engine.client.update_weights_from_disk(str(tmp_path / "base"))
        with pytest.raises(EngineError, match="'grpoflow-policy' is loaded: unload it first"):
            engine.client.load_lora_adapter("other", str(tmp_path / "sync" / "adapter-41"))
    engine.client.unload_lora_adapter(SERVED_ADAPTER)  # the base model again
    ids, lps = _engine_logprobs(engine.client)
    assert max(abs(a - b) for a, b in zip(lps, _trainer_logprobs(base, ids), strict=True)) < 1e-4
    with pytest.raises(EngineError, match="no adapter_config.json"):
        engine.client.load_lora_adapter("other", str(tmp_path / "base"))


def test_a_failure_on_the_trainers_side_raises_at_once(tiny_model_dir, tmp_path, monkeypatch):
    """Our side of the broadcast fails (here: at once): the push raises that error instead of waiting for the
    engine's answer, which never comes (its receive waits for tensors until the group's timeout)."""
    import grpoflow.train.sync as sync_module

    def broken(group, tensors):
        raise RuntimeError("out of memory casting the weights")

    trainer = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    with start_embedded_engine(tiny_model_dir, log_path=tmp_path / "engine.log") as own_engine:
        with open_weight_sync(
            parse_run_config({"engine": {"weight_sync": {"mode": "distributed"}}}), own_engine.url, trainer
        ) as syncs:
            s = syncs.syncs[0]  # the one engine's own sync
            monkeypatch.setattr(sync_module, "broadcast_tensors", broken)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match="out of memory casting"):
                s.push(trainer, "50")
            assert time.monotonic() - t0 < 30 and s.broken
            with pytest.raises(EngineError, match="unusable after an earlier failed update"):
                s.push(trainer, "51")


def test_the_group_is_sized_by_the_server_not_by_the_config(engine, tiny_model_dir, monkeypatch):
    """An attached server whose layout differs from `engine.tp_size` (here: the config says 2, the server runs
    1): sized from the config, the group would wait for a rank that never comes (here for the shortened timeout
    of the group's rendezvous, instead of half an hour)."""
    import grpoflow.train.sync as sync_module

    monkeypatch.setattr(sync_module, "UPDATE_GROUP_TIMEOUT_S", 20.0)
    trainer = load_trainer(tiny_model_dir, TrainConfig(), seed=0)
    cfg = parse_run_config(
        {"engine": {"backend": "sglang", "url": engine.url, "tp_size": 2, "weight_sync": {"mode": "distributed"}}}
    )
    with open_weight_sync(cfg, engine.url, trainer) as syncs:
        moved = syncs.push(trainer, "60")
    assert moved["bytes"] > 0 and engine.client.model_info().weight_version == "60"

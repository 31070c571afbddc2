"""A LoRA run end to end (train.lora): the adapters train; the engine serves base + adapter, synced as the adapter
alone (`/load_lora_adapter`) or as the merged weights in memory (the default), every sync verified by the probe;
full checkpoints hold the adapter and its optimizer state, and the last one the merged model as a plain HF dir."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.run.metrics import read_metrics
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


@pytest.mark.parametrize("sync", ["adapter", "auto"])  # auto: the merged weights in memory
def test_a_lora_run_trains_adapters_and_exports_the_merged_model(tmp_path, tiny_model_dir, sync):
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    runs = tmp_path / "runs"
    cfg = run_config(runs, model, reward_tasks(tmp_path / "tasks"), "lora", steps=3)
    cfg["engine"]["weight_sync"] = {"mode": sync}
    cfg["train"]["optimizer"]["learning_rate"] = 3e-2
    cfg["train"]["lora"] = {"rank": 4, "alpha": 8}
    train_flow(parse_run_config(cfg))
    rows = read_metrics(runs / "lora" / "metrics.jsonl")
    assert sum(r["train/optimizer_steps"] for r in rows) >= 1
    assert all(r["sync/probe_gap"] < 1e-4 for r in rows)  # the engine served the new weights after each sync
    model_bytes = (model / "model.safetensors").stat().st_size
    if sync == "adapter":  # the adapter alone: a few per cent of the model, and the last one left in sync/
        assert all(r["sync/bytes"] < model_bytes / 20 for r in rows)
        assert [p.name for p in (runs / "lora" / "sync").iterdir()] == ["adapter-3"]
    ckpts = runs / "lora" / "checkpoints"
    mid, last = ckpts / "step_1", ckpts / "step_2"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2"]
    assert not list(mid.glob("*.safetensors")) and (mid / "adapter" / "adapter_model.safetensors").is_file()
    assert (mid / "optimizer.pt").stat().st_size < model_bytes / 10
    merged = AutoModelForCausalLM.from_pretrained(last)  # a plain HF dir: no PEFT needed to use it
    base = AutoModelForCausalLM.from_pretrained(model)
    moved = [k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert moved and all(any(m in k for m in ("_proj",)) for k in moved)  # only adapted linears changed

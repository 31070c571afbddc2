"""Rerun: the same config under a new run_id reproduces metrics.jsonl and the final weights bit for bit on the
embedded CPU path (deterministic engine), and says so; a difference is reported with its step and key."""

import json
import shutil

import pytest

from flows.cli import main
from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.run.metrics import read_metrics
from tests.integration.faults.events import run_events
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


def test_rerun_reproduces_metrics_and_weights_bit_exact(tmp_path, tiny_model_dir, capfd):
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    data = reward_tasks(tmp_path / "tasks")
    runs = tmp_path / "runs"
    train_flow(parse_run_config(run_config(runs, model, data, "orig", steps=2, evals=2)))
    *records, final_eval = read_metrics(runs / "orig" / "metrics.jsonl")
    assert final_eval["step"] == 2 and "eval/trained/pass_at_1_change" in final_eval  # reproduced with the rest
    # the run really trained: rewards spread within groups and the optimizer stepped, so the weights moved
    assert sum(r["train/optimizer_steps"] for r in records) >= 1

    assert main(["rerun", "orig", "--output-dir", str(runs), "--run-id", "orig-again"]) == 0
    assert "grpoflow: rerun orig-again of orig: reproduced bit-exact" in capfd.readouterr().out
    report = json.loads((runs / "orig-again" / "rerun.json").read_text())
    new = runs / "orig-again"
    assert (new / "metrics.jsonl").read_bytes() == (runs / "orig" / "metrics.jsonl").read_bytes()
    assert report["metrics_identical"] and report["weights_identical"]
    fc = report["final_checkpoint"]
    assert fc["original"] == fc["rerun"] and fc["rerun"]["step"] == 1
    assert json.loads((new / "run.json").read_text())["rerun_of"] == "orig"
    # timings are apart from metrics and differ run to run; they are not compared
    assert (new / "timings.jsonl").exists()
    # the train subflow and the rerun flow each announced their end, with the run's summary
    events = run_events("orig-again", expect=2)
    assert [(e.event, e.payload["flow"]) for e in events] == [
        ("grpoflow.run.completed", "train"),
        ("grpoflow.run.completed", "rerun"),
    ]
    train_ev, rerun_ev = events
    assert train_ev.payload["steps"] == 2 and train_ev.payload["final_metrics"]["step"] == 1
    assert train_ev.payload["final_metrics"]["train/loss"] == records[-1]["train/loss"]
    assert train_ev.payload["final_evaluation"]["eval/trained/pass_at_1"] == final_eval["eval/trained/pass_at_1"]
    assert rerun_ev.payload["reproduced"] is True and rerun_ev.payload["rerun_of"] == "orig"


def test_rerun_reports_the_first_difference(tmp_path, tiny_model_dir):
    """A changed record is found: its step and key are named (the original's metrics are edited here)."""
    from grpoflow.run.rerun import first_metrics_difference

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"step": 0, "x": 1.0}\n{"step": 1, "x": 2.0, "y": 3}\n')
    b.write_text('{"step": 0, "x": 1.0}\n{"step": 1, "x": 2.0000000000000004, "y": 3}\n')
    assert first_metrics_difference(a, a) is None
    assert first_metrics_difference(a, b) == "step 1: `x` 2.0 -> 2.0000000000000004"
    b.write_text('{"step": 0, "x": 1.0}\n')
    assert first_metrics_difference(a, b) == "the original has 2 steps, the rerun 1"


def test_rerun_names_the_first_tensor_whose_bits_differ(tmp_path):
    """Weights that differ are traced to a tensor: the first in name order, with how many values and by how much
    (one ulp here); -0.0 against 0.0 counts, and so does a tensor that one side lacks."""
    import torch
    from safetensors.torch import save_file

    from grpoflow.run.rerun import first_tensor_difference

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    w = {"model.a.weight": torch.ones(3, 2), "model.b.weight": torch.zeros(4)}
    save_file(w, a / "model.safetensors")
    save_file({k: v.clone() for k, v in w.items()}, b / "model.safetensors")
    assert first_tensor_difference(a, b) is None
    w2 = {k: v.clone() for k, v in w.items()}
    w2["model.b.weight"][1] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))
    save_file(w2, b / "model.safetensors")
    assert first_tensor_difference(a, b) == "`model.b.weight`: 1 of 4 values differ, by up to 1.4e-45"
    w2["model.b.weight"] = -torch.zeros(4)
    save_file(w2, b / "model.safetensors")
    assert first_tensor_difference(a, b).startswith("`model.b.weight`: 4 of 4 values differ")
    save_file({"model.a.weight": w["model.a.weight"]}, b / "model.safetensors")
    assert first_tensor_difference(a, b) == "`model.b.weight` only in the original"


def test_an_in_memory_weight_sync_trains_exactly_like_a_disk_sync(tmp_path, tiny_model_dir):
    """engine.weight_sync.mode=distributed (gloo on the CPU) gives the same run as the disk path, metric for metric,
    and writes only the full checkpoints; every sync is verified by the probe."""
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    data = reward_tasks(tmp_path / "tasks")
    runs = tmp_path / "runs"
    rows = {}
    for sync in ("disk", "distributed"):
        cfg = run_config(runs, model, data, sync, steps=3)
        cfg["engine"]["weight_sync"] = {"mode": sync}
        train_flow(parse_run_config(cfg))
        rows[sync] = read_metrics(runs / sync / "metrics.jsonl")
    assert sum(r["train/optimizer_steps"] for r in rows["disk"]) >= 1  # the weights moved, so syncs mattered
    for disk, memory in zip(rows["disk"], rows["distributed"], strict=True):
        how = ("sync/bytes", "sync/buckets")  # what each sync moved, and in how many requests
        assert {k: v for k, v in disk.items() if k not in how} == {k: v for k, v in memory.items() if k not in how}
        assert memory["sync/bytes"] > 0 and memory["sync/buckets"] >= 1 and memory["sync/probe_gap"] < 1e-4
    assert sorted(p.name for p in (runs / "distributed" / "checkpoints").iterdir()) == ["step_1", "step_2"]

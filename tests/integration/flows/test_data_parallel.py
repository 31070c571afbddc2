"""The train flow with two data-parallel trainer ranks (`cluster.train_ranks=2`, gloo on this machine): it
completes, and its first update equals the single-process run's; a resume restarts both ranks from the
checkpoint."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from flows.cli import main
from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.run.metrics import read_metrics
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


def _run(tmp_path, tiny_model_dir, run_id, ranks, steps):
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    data = reward_tasks(tmp_path / "tasks")
    cfg = run_config(tmp_path / "runs", model, data, run_id, steps=steps)
    cfg["train"]["checkpoint"] = {"interval": 1}
    cfg["cluster"] = {"train_ranks": ranks}
    train_flow(parse_run_config(cfg))
    return tmp_path / "runs" / run_id


def test_two_trainer_ranks_train_like_one(tmp_path, tiny_model_dir, capfd):
    one = _run(tmp_path, tiny_model_dir, "one-rank", 1, steps=1)
    two = _run(tmp_path, tiny_model_dir, "two-ranks", 2, steps=2)
    [a], (b, b_next) = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert a["train/optimizer_steps"] >= 1  # the step really updated the weights
    for key in ("rollout/reward_mean", "train/n_samples", "train/n_tokens", "train/optimizer_steps"):
        assert b[key] == a[key], key
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
    wa = load_file(one / "checkpoints" / "step_0" / "model.safetensors")
    wb = load_file(two / "checkpoints" / "step_0" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=1e-6)
    # a resume of the two-rank run from step 0's checkpoint starts both ranks from it and finishes step 1 alike
    shutil.rmtree(two / "checkpoints" / "step_1")
    lines = (two / "metrics.jsonl").read_text().splitlines(keepends=True)
    (two / "metrics.jsonl").write_text("".join(lines[:1]))
    assert main(["resume", "two-ranks", "--output-dir", str(tmp_path / "runs")]) == 0
    [_, resumed] = read_metrics(two / "metrics.jsonl")
    assert resumed["train/loss"] == pytest.approx(b_next["train/loss"], rel=1e-5, abs=1e-7)
    assert resumed["train/optimizer_steps"] == b_next["train/optimizer_steps"]

"""Lineage: an evaluation of a train run's final checkpoint (`from_run`) records that run as its parent, and
evaluates the weights the train run ended with."""

import shutil
from pathlib import Path

import pytest

from flows.evaluate import evaluate_flow
from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.errors import RunDirError
from grpoflow.paths import RunPaths
from grpoflow.placement import machine_gpus, plan_gpus
from grpoflow.run.info import read_run_info
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


def test_an_evaluation_of_a_train_run_records_it_as_parent(tmp_path, tiny_model_dir):
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    data = reward_tasks(tmp_path / "tasks")
    runs = tmp_path / "runs"
    train_flow(parse_run_config(run_config(runs, model, data, "night-1", steps=2)))
    first = read_run_info(RunPaths(runs / "night-1"))
    assert first.parent is None  # it started from a plain model dir
    assert first.gpus == plan_gpus(parse_run_config(run_config(runs, model, data, "x")), machine_gpus()).to_json()
    evaluation = run_config(runs, model, data, "night-1-eval", steps=0)
    evaluate_flow(parse_run_config(evaluation), split="all", from_run="night-1")
    info = read_run_info(RunPaths(runs / "night-1-eval"))
    assert info.flow == "evaluate" and info.parent is not None
    assert info.parent.run_id == "night-1" and info.parent.checkpoint.endswith("night-1/checkpoints/step_1")
    # the weights evaluated are the train run's last ones, not the model the config named
    trained = read_run_info(RunPaths(runs / "night-1"))
    assert info.model.weights_sha256 != trained.model.weights_sha256
    assert Path(info.model.path).resolve() == Path(info.parent.checkpoint).resolve()  # that checkpoint's weights
    with pytest.raises(RunDirError, match="no-such-run: no such run"):
        evaluate_flow(parse_run_config({**evaluation, "run_id": "orphan"}), from_run="no-such-run")

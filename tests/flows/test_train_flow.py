"""The train and evaluate flows end to end on the tiny random model: embedded engine, local sandbox, Harbor."""

import json
import shutil

import pytest
from prefect.client.orchestration import get_client

from flows.evaluate import evaluate_flow
from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.reporting import read_metrics, read_step_records

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


def _cfg(tmp_path, model, run_id, **over):
    return parse_run_config({
        "run_id": run_id, "output_dir": str(tmp_path), "model": {"source": str(model)},
        "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 2, "max_new_tokens": 16, "max_turns": 2,
                    "temperature": 1.0},
        "train": {"steps": 3, "learning_rate": 1e-3, "save_interval": 2}, **over,
    })  # fmt: skip


def _artifact_keys(prefix):
    with get_client(sync_client=True) as client:
        return {a.key for a in client.read_latest_artifacts() if a.key and a.key.startswith(prefix)}


def test_train_flow_records_every_step(tmp_path, tiny_model_dir):
    last = train_flow(_cfg(tmp_path, tiny_model_dir, "train-1"))
    root = tmp_path / "train-1"
    assert {"config.json", "run.json", "prompts.jsonl", "trials", "details", "metrics.jsonl", "checkpoints", "tb",
            "summary.png"} <= {p.name for p in root.iterdir()}  # fmt: skip
    records = read_step_records(root / "metrics.jsonl")  # metrics.jsonl with timings.jsonl merged in
    assert [r["step"] for r in records] == [0, 1, 2] and records[-1] == {"step": 2, **last}
    # wall-clock figures live in timings.jsonl only, so metrics.jsonl is reproducible byte for byte
    assert not [k for r in read_metrics(root / "metrics.jsonl") for k in r if k.endswith("_s")]
    assert {"time/step_s", "train/tokens_per_s", "rollout/wall_time_s"} <= set(records[-1])
    assert records[0]["rollout/trials"] == 4 and records[0]["rollout/tokens_after_truncation"] == 0
    # every save_interval-th checkpoint and the latest are kept
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step_0", "step_2"]
    assert list((root / "tb").iterdir())
    step1 = [json.loads(line) for line in (root / "details" / "step_1" / "samples.jsonl").read_text().splitlines()]
    assert len(step1) == 4 and {s["weight_version"] for s in step1} == {"1"}  # trained after step 0's update
    assert len(list((root / "trials" / "step_0").iterdir())) == 4
    assert {"train-1-steps", "train-1-summary", "train-1-run-dir", "train-1-step-0-trials"} <= _artifact_keys("train-1")


def test_evaluate_flow_scores_the_eval_split_without_training(tmp_path, tiny_model_dir):
    m = evaluate_flow(_cfg(tmp_path, tiny_model_dir, "eval-1"), split="eval")
    root = tmp_path / "eval-1"
    n_eval = sum(json.loads(line)["split"] == "eval" for line in (root / "prompts.jsonl").read_text().splitlines())
    assert m["trials"] == n_eval * 2 and not (root / "checkpoints").exists()
    assert read_metrics(root / "metrics.jsonl")[0]["trials"] == m["trials"]
    assert "eval-1-evaluation" in _artifact_keys("eval-1")

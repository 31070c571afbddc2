"""The train and evaluate flows end to end on the tiny random model: embedded engine, local sandbox, Harbor."""

import json
import shutil

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

from flows.evaluate import evaluate_flow
from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.run.metrics import read_metrics, read_step_records

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


def _cfg(tmp_path, model, run_id, evals=0, **over):
    return parse_run_config(
        {
            "run_id": run_id,
            "output_dir": str(tmp_path),
            "model": {"source": str(model)},
            "dataset": {"path": "builtin-fixed"},
            "prompts": {"difficulties": ["easy"]},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 2,
                "sampling": {"max_new_tokens": 16, "temperature": 1.0},
                "episode": {"max_turns": 2},
            },
            "train": {
                "steps": 3,
                "optimizer": {"learning_rate": 1e-3},
                "checkpoint": {"interval": 2},
                "eval": {"samples_per_prompt": evals},
            },
            **over,
        }
    )


def _artifact_keys(prefix):
    """The keys of the artifacts named `<prefix>...` (filtered by the server: the folder's runs make many)."""
    flt = ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(like_=prefix))
    with get_client(sync_client=True) as client:
        return {a.key for a in client.read_latest_artifacts(artifact_filter=flt) if a.key and a.key.startswith(prefix)}


def test_train_flow_records_every_step(tmp_path, tiny_model_dir, caplog):
    last = train_flow(_cfg(tmp_path, tiny_model_dir, "train-1", evals=2))
    root = tmp_path / "train-1"
    assert {
        "config.json",
        "run.json",
        "prompts.jsonl",
        "trials",
        "details",
        "metrics.jsonl",
        "checkpoints",
        "tb",
        "summary.png",
    } <= {p.name for p in root.iterdir()}
    records = read_step_records(root / "metrics.jsonl")  # metrics.jsonl with timings.jsonl merged in
    # one row per step, then the final evaluation's
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[2] == {"step": 2, **last}
    # wall-clock figures live in timings.jsonl only, so metrics.jsonl is reproducible byte for byte
    assert not [k for r in read_metrics(root / "metrics.jsonl") for k in r if k.endswith("_s")]
    assert {"time/step_s", "time/commit_s", "time/sync_s", "train/tokens_per_s", "rollout/wall_time_s"} <= set(last)
    assert records[0]["rollout/trials"] == 4 and records[0]["rollout/tokens_after_truncation"] == 0
    # the base policy's evaluation on step 0's row, the trained policy's on its own row; none between
    prompts = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    n = {split: 2 * sum(p["split"] == split for p in prompts) for split in ("train", "eval")}
    for r in (records[0], records[3]):
        assert r["eval/trained/trials"] == n["train"] and r["eval/heldout/trials"] == n["eval"]
        assert 0.0 <= r["eval/trained/pass_at_1_ci95_low"] <= r["eval/trained/pass_at_1"]
        assert {f"eval/trained/task/{p['instance_id']}" for p in prompts if p["split"] == "train"} <= set(r)
    assert "eval/trained/pass_at_1_change" in records[3] and "eval/trained/pass_at_1_change" not in records[0]
    assert not any(k.startswith("eval/") for r in records[1:3] for k in r)
    assert records[3]["weight_version"] == "3" and "rollout/reward_gain" in records[1]
    step0 = {json.loads(x)["instance_id"] for x in (root / "details" / "step_0" / "samples.jsonl").open()}
    assert {k.removeprefix("rollout/task/") for k in records[0] if k.startswith("rollout/task/")} == step0
    # both evaluations ran the same trials (same seeds), on the weights before and after training
    evals = [
        [json.loads(x) for x in (root / "details" / f"eval_{v}" / "samples.jsonl").read_text().splitlines()]
        for v in (0, 3)
    ]
    assert [s["sample_index"] for s in evals[0]] == [s["sample_index"] for s in evals[1]]
    assert [s["tokens"][: s["prompt_len"]] for s in evals[0]] == [s["tokens"][: s["prompt_len"]] for s in evals[1]]
    assert {s["weight_version"] for s in evals[0]} == {"0"} and {s["weight_version"] for s in evals[1]} == {"3"}
    assert "before -> after training" in caplog.text  # printed by the flow, through Prefect's log handler
    # full checkpoints (every save_interval steps, and the last) are kept; the latest of the others too
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert all((root / "checkpoints" / d / "optimizer.pt").is_file() for d in ("step_1", "step_2"))
    assert list((root / "tb").iterdir())
    step1 = [json.loads(line) for line in (root / "details" / "step_1" / "samples.jsonl").read_text().splitlines()]
    assert len(step1) == 4 and {s["weight_version"] for s in step1} == {"1"}  # trained after step 0's update
    assert len(list((root / "trials" / "step_0").iterdir())) == 4
    assert {"train-1-steps", "train-1-summary", "train-1-run-dir", "train-1-step-0-trials"} <= _artifact_keys("train-1")


def test_evaluate_flow_scores_the_eval_split_without_training(tmp_path, tiny_model_dir):
    m = evaluate_flow(_cfg(tmp_path, tiny_model_dir, "eval-1", prompts={}), split="eval")
    root = tmp_path / "eval-1"
    n_eval = sum(json.loads(line)["split"] == "eval" for line in (root / "prompts.jsonl").read_text().splitlines())
    n = parse_run_config(json.loads((root / "config.json").read_text())).train.eval.samples_per_prompt
    assert m["eval/heldout/trials"] == n_eval * n and not (root / "checkpoints").exists()
    assert "eval/trained/trials" not in m  # the eval split only
    assert read_metrics(root / "metrics.jsonl")[0]["eval/heldout/trials"] == m["eval/heldout/trials"]
    assert "eval-1-evaluation" in _artifact_keys("eval-1")

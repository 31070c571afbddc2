"""One train step of SmolLM2 (the built-in model, the embedded engine) with the real claude-code and opencode CLIs in
the local sandbox: whatever reward it earns, the path is what is tested. Turns are cut at a few tokens, so the
episodes end on a truncated turn, which must end TRUNCATED (verified, trained), not FAILED."""

from __future__ import annotations

import json
import shutil

import pytest

from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import builtin_dataset_path
from grpoflow.run.metrics import read_metrics

pytestmark = [
    pytest.mark.flow,
    pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("npm") is None, reason="needs bwrap and npm"),
]


@pytest.mark.parametrize("harness", ["claude-code", "opencode"])
def test_smollm2_trains_a_step_through_the_real_cli(tmp_path, harness):
    tasks = tmp_path / "tasks"
    shutil.copytree(builtin_dataset_path() / "hello-file", tasks / "hello-file")
    cfg = parse_run_config(
        {
            "run_id": f"cli-{harness}",
            "output_dir": str(tmp_path / "runs"),
            "dataset": {"path": str(tasks)},
            "prompts": {"eval_fraction": 0.0},
            "rollout": {
                "prompts_per_step": 1,
                "n_samples_per_prompt": 2,
                "harness": {"name": harness},
                "episode": {"max_turns": 2, "max_context_tokens": 8192},
                "sampling": {"max_new_tokens": 8},
            },
            # equal rewards carry no GRPO signal: keep the group anyway, so the update gets the CLIs' samples
            "train": {"steps": 1, "eval": {"samples_per_prompt": 0}, "loss": {"filter_zero_std": False}},
        }
    )
    last = train_flow(cfg)

    root = tmp_path / "runs" / cfg.run_id
    samples = [json.loads(line) for line in (root / "details" / "step_0" / "samples.jsonl").read_text().splitlines()]
    assert {s["status"] for s in samples} <= {"COMPLETED", "TRUNCATED"}, [s["exit_reason"] for s in samples]
    assert all(s["metrics"]["requests"] >= 1 and s["metrics"]["refused_requests"] == 0 for s in samples)
    truncated = [s for s in samples if s["metrics"]["truncated_turns"]]
    assert truncated and all(
        (s["status"], s["exit_status"]) == ("TRUNCATED", "SequenceLengthLimitExceeded") for s in truncated
    )
    assert all(sum(s["loss_mask"]) > 0 for s in samples)  # the policy's tokens are there to train
    [m] = read_metrics(root / "metrics.jsonl")
    assert m["rollout/session/requests"] >= 2 and m["train/n_groups"] == 1
    # the update got every generated token of the step; it learns from them only when the rewards differ
    trained = sum(sum(s["loss_mask"]) for s in samples)
    if len({s["reward"] for s in samples}) > 1:
        assert last["train/n_samples"] == len(samples) and last["train/optimizer_steps"] >= 1
    else:
        assert m["ledger/discarded/zero_advantage"] == trained and last["train/skipped_zero_advantage"] == 1
    # the trials ran the pinned CLI from prepare's cache, through the sandbox's bridge
    [trial_config, *_] = (root / "trials").glob("step_0/*/config.json")
    kwargs = json.loads(trial_config.read_text())["environment"]["kwargs"]
    assert "clis" in kwargs["cli_dir"] and kwargs["session_bridge"].startswith("127.0.0.1:")

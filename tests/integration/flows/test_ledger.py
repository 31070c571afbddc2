"""The rollout ledger through the train flow: on every step, every generated token is trained or discarded for
one reason, with failed trials (flaky sandbox starts, no retries), cut-off turns masked out and flat groups."""

import shutil

import pytest

from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.ledger import REASONS, ledger_table, run_ledger, unaccounted
from grpoflow.run.metrics import read_step_records
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


def test_every_generated_token_is_trained_or_discarded_for_a_reason(tmp_path, tiny_model_dir, faulty_sandbox):
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    cfg = run_config(tmp_path / "runs", model, reward_tasks(tmp_path / "tasks", n=4), "ledger", steps=3)
    cfg["rollout"]["prompts_per_step"] = 4
    cfg["rollout"]["sandbox"] |= {"kwargs": {"fail_start_probability": 0.1, "fail_start_seed": 2}, "retries": 0}
    cfg["rollout"]["sampling"]["max_new_tokens"] = 10  # some of the fence policy's replies run past 10: cut-off turns
    cfg["train"]["loss"] = {"truncated": "mask"}
    cfg["report"] = {"cost_per_gpu_hour": 2.0, "cost_per_sandbox_hour": 0.1}
    train_flow(parse_run_config(cfg))
    root = tmp_path / "runs" / "ledger"
    rows = read_step_records(root / "metrics.jsonl")  # metrics and timings merged
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["ledger/generated"] == r["rollout/tokens_generated"] > 0
        assert unaccounted(r) == 0, r
        assert not any(k.startswith("train/discarded/") or k == "train/tokens_trained" for k in r)
        assert r["ledger/trainer_s"] > 0 and r["ledger/sandbox_s"] > 0 and "ledger/engine_s" in r
    total = run_ledger(rows, 2.0, 0.1)
    reasons = {reason: total[f"ledger/discarded/{reason}"] for reason in REASONS}
    # what this run was built to show: tokens of failed trials' groups, of cut-off turns, trained ones
    assert reasons["dropped_group"] > 0 and reasons["masked_overlong"] > 0 and total["ledger/trained"] > 0
    assert total["ledger/generated"] == total["ledger/trained"] + sum(reasons.values())
    assert total["ledger/cost"] > 0 and total["ledger/cost_per_million_trained_tokens"] > 0
    table = {row["item"]: row for row in ledger_table(total)}
    assert table["trained tokens"]["share"] == pytest.approx(total["ledger/trained"] / total["ledger/generated"])
    fates = [row["share"] for item, row in table.items() if item == "trained tokens" or item.startswith("discarded")]
    assert sum(fates) == pytest.approx(1.0)
    assert table["cost per million trained tokens"]["value"] == total["ledger/cost_per_million_trained_tokens"]

"""Faults through the real train flow (Prefect test server, embedded engine on the tiny model, local sandbox):
sandbox creation failing at a rate, and the disk filling up while a step's artifacts are written."""

import errno
import json
import os
import shutil

import pytest

from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.run.metrics import read_metrics, read_step_records

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


def _cfg(tmp_path, model, run_id, rollout=None, train=None, **over):
    return parse_run_config(
        {
            "run_id": run_id,
            "output_dir": str(tmp_path),
            "model": {"source": str(model)},
            "dataset": {"path": "builtin-fixed"},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 2,
                "max_new_tokens": 8,
                "max_turns": 1,
                "temperature": 1.0,
                **(rollout or {}),
            },
            "train": {
                "steps": 2,
                "learning_rate": 1e-3,
                "save_interval": 1,
                "eval_samples_per_prompt": 0,
                **(train or {}),
            },
            **over,
        }
    )


def _samples(root, step):
    return [json.loads(x) for x in (root / "details" / f"step_{step}" / "samples.jsonl").read_text().splitlines()]


def test_flaky_sandbox_creation_through_the_train_flow(tmp_path, tiny_model_dir, faulty_sandbox):
    cfg = _cfg(
        tmp_path,
        tiny_model_dir,
        "flaky",
        rollout={
            "sandbox_kwargs": {"fail_start_probability": 0.3, "fail_start_seed": 1},
            "sandbox_retries": 8,
            "retry_backoff_s": 0.01,
        },
    )
    assert cfg.rollout.sandbox.kwargs == {"fail_start_probability": 0.3, "fail_start_seed": 1}
    train_flow(cfg)
    root = tmp_path / "flaky"
    records = read_metrics(root / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    total_retries = 0
    for r in records:
        step = r["step"]
        samples = _samples(root, step)
        assert len(samples) == 4 == r["rollout/trials"]
        # every trial ended with the verifier's reward: the failed starts were all retried in fresh sandboxes
        assert all(s["reward"] is not None and s["exit_status"] != "SandboxError" for s in samples)
        assert r["rollout/scored"] == 4 and r["rollout/dropped_groups"] == 0
        retries = int(r["rollout/retries"])
        assert sum(int(s["metrics"]["retries"]) for s in samples) == retries
        assert len(list((root / "trials" / f"step_{step}").iterdir())) == 4 + retries  # one dir per attempt
        total_retries += retries
    assert total_retries > 0  # 30 % of starts fail at seed 1: some trials needed retries
    # every failed start left a SandboxStartError in its attempt's result.json
    failed = [json.loads(p.read_text()) for p in (root / "trials").glob("step_*/*/result.json")]
    n_failed = sum((d.get("exception_info") or {}).get("exception_type") == "SandboxStartError" for d in failed)
    assert n_failed == total_retries


def _fail_fsync_under(monkeypatch, marker: str):
    """os.fsync raises ENOSPC for files whose path contains `marker` (the disk is full from there on)."""
    real = os.fsync
    hits = []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if marker in path:
            hits.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return hits


def _run_until_disk_full(tmp_path, tiny_model_dir, monkeypatch, run_id):
    hits = _fail_fsync_under(monkeypatch, f"{run_id}/details/step_1/")
    with pytest.raises(OSError) as info:
        train_flow(_cfg(tmp_path, tiny_model_dir, run_id))
    monkeypatch.undo()
    return info.value, hits


def test_disk_full_while_writing_step_artifacts_keeps_what_was_written(tmp_path, tiny_model_dir, monkeypatch):
    err, hits = _run_until_disk_full(tmp_path, tiny_model_dir, monkeypatch, "diskfull")
    root = tmp_path / "diskfull"
    assert err.errno == errno.ENOSPC and hits  # the error propagated out of the flow, not swallowed
    # Everything before the failing write is intact and parseable.
    assert json.loads((root / "config.json").read_text())["run_id"] == "diskfull"
    json.loads((root / "run.json").read_text())
    prompts = [json.loads(x) for x in (root / "prompts.jsonl").read_text().splitlines()]
    assert prompts and all("instance_id" in p for p in prompts)
    assert [r["step"] for r in read_metrics(root / "metrics.jsonl")] == [0]  # step 0 recorded, step 1 never
    assert len(_samples(root, 0)) == 4
    assert (root / "checkpoints" / "step_0").is_dir()
    # The target of the failed write is absent (never torn), and no temp file is left behind.
    step1 = root / "details" / "step_1"
    assert not (step1 / "samples.jsonl").exists()
    # The first write there is the resume journal's append (the one that hit the full disk): at most it holds
    # whole sample lines, which resume reuses; no temp file is left behind.
    assert {p.name for p in step1.iterdir()} <= {"journal.jsonl"} if step1.exists() else True


def test_engine_down_for_generation_the_steps_and_run_go_on(tmp_path, tiny_model_dir):
    """An attached SGLang whose /generate answers 503 to every call: every sample FAILED EngineError (no reward,
    never a silent 0) after its retries in a fresh sandbox, every group dropped, the GRPO step skipped, weights
    still synced, and the run completes."""
    from tests.integration.faults.helpers import load_standin

    with load_standin()(str(tiny_model_dir)) as front:
        front.faults.inject("5xx", times=None, status=503)
        cfg = _cfg(
            tmp_path,
            tiny_model_dir,
            "engine-down",
            rollout={"sandbox_retries": 1, "retry_backoff_s": 0.0},
            engine={"backend": "sglang", "url": front.url, "retries": 1, "request_timeout_s": 5, "outage_wait_s": 0},
            # the probe would stop this run before its first step (the engine is down from the start); the trials'
            # failure records are what is tested here
            train={"max_probe_logprob_gap": None},
        )
        last = train_flow(cfg)
        n_generate = front.count("/generate")
    root = tmp_path / "engine-down"
    records = read_metrics(root / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    merged = read_step_records(root / "metrics.jsonl")[-1]  # with timings.jsonl
    assert json.dumps(merged, sort_keys=True) == json.dumps({"step": 1, **last}, sort_keys=True)  # NaN != NaN
    for r in records:
        assert r["rollout/trials"] == 4 and r["rollout/scored"] == 0 and r["rollout/exit/EngineError"] == 4
        assert r["rollout/reward_mean"] != r["rollout/reward_mean"]  # NaN: no reward, not 0
        assert r["rollout/dropped_groups"] == 2 and r["train/n_samples"] == 0
        for s in _samples(root, r["step"]):
            assert (s["status"], s["exit_status"], s["reward"]) == ("FAILED", "EngineError", None)
            assert "HTTP 503" in s["exit_reason"] or "503" in s["exit_reason"], s["exit_reason"]
    assert n_generate == 2 * 4 * 2 * 2  # 2 steps x 4 trials x 2 sandboxes each x (1 try + 1 engine.retries)


def test_an_attached_engine_serving_an_earlier_run_s_weights_gets_this_run_s_first(tmp_path, tiny_model_dir):
    """An attached SGLang still serving another run's weights (version `earlier-run`): before its first step the
    run loads its own model into it as version "0", so step 0's trials are generated by this run's weights and are
    fresh, not of an unknown version (which would be past any staleness bound, and dropped)."""
    from tests.integration.faults.helpers import load_standin

    with load_standin()(str(tiny_model_dir)) as front:
        front.model.weight_version = "earlier-run"
        cfg = _cfg(
            tmp_path,
            tiny_model_dir,
            "attached",
            train={"steps": 1, "max_probe_logprob_gap": None},
            engine={"backend": "sglang", "url": front.url},
        )
        train_flow(cfg)
        requests = list(front.requests)
    assert requests.index("/update_weights_from_disk") < requests.index("/generate")
    samples = _samples(tmp_path / "attached", 0)
    assert samples and {s["weight_version"] for s in samples} == {"0"}
    assert read_metrics(tmp_path / "attached" / "metrics.jsonl")[0].get("rollout/stale_dropped", 0.0) == 0.0

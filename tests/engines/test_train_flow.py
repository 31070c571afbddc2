"""The train flow against real SGLang on the CPU (`engine.backend = "sglang"`): two short steps with each weight
sync a real run uses there, the start-of-run probe, the served-weights probe after every sync (`sync/probe_gap`)
and the weight version read back (the run fails otherwise); then sglang-router in front of two SGLang servers,
one killed mid-run.

The policy is the test-only fence policy (`tests.integration.faults.policy`), which earns rewards half the time,
so every step really moves the weights and the probes tell the new ones from the old. The lane's server loads it
with `/update_weights_from_disk` first (and the base model again after: `restore_base`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest

from flows.train import train_flow
from grpoflow.config import SglangLaunch, parse_run_config
from grpoflow.engine.protocol import SamplingParams
from grpoflow.engine.router import start_router
from grpoflow.engine.sglang_launch import launch_settings, start_sglang_server
from grpoflow.run.metrics import read_metrics
from tests.engines.conftest import BUCKET_MB, CONTEXT_LENGTH, TRIALS_PER_PROMPT, train_config
from tests.integration.faults.policy import fence_policy

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.flow,
    pytest.mark.usefixtures("prefect_server"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed"),
]


def _run(tmp_path, sglang, run_id: str, url: str, mode: str, steps: int = 2) -> list[dict]:
    policy = fence_policy(sglang.model_dir, tmp_path / "policy")
    sglang.client.update_weights_from_disk(str(policy), weight_version="policy")
    cfg = train_config(
        tmp_path,
        policy,
        run_id,
        {"backend": "sglang", "url": url, "weight_sync": {"mode": mode, "bucket_mb": BUCKET_MB}},
        steps,
    )
    train_flow(parse_run_config(cfg))
    return read_metrics(tmp_path / "runs" / run_id / "metrics.jsonl")


@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_two_steps_sync_and_probe_the_served_weights(sglang, mode, tmp_path, restore_base):
    rows = _run(tmp_path, sglang, f"sglang-{mode}", sglang.url, mode)
    assert [r["step"] for r in rows] == [0, 1] and [r["weight_version"] for r in rows] == ["1", "2"]
    assert sum(r["train/optimizer_steps"] for r in rows) >= 1  # the weights moved: the probes had work to do
    for r in rows:  # every step's sync reached SGLang and the probe found the trainer's weights there
        assert r["sync/bytes"] > 0 and 0 <= r["sync/probe_gap"] < 0.1 and r["rollout/scored"] == 2 * TRIALS_PER_PROMPT
        assert r.get("sync/buckets", 3) >= 3  # `distributed`: in several requests (disk: none)
    assert sglang.client.model_info().weight_version == "2"
    details = tmp_path / "runs" / f"sglang-{mode}" / "details" / "step_1" / "samples.jsonl"
    assert {json.loads(x)["weight_version"] for x in details.open()} == {"1"}  # generated after step 0's sync


def test_a_server_killed_behind_the_router_is_left_out_and_the_run_goes_on(
    sglang, sglang_python, tmp_path, restore_base
):
    """sglang-router in front of the lane's server and a second one; the second is killed once step 0 is
    recorded: its requests go to the other, the next sync leaves it out (and takes it out of the router)."""
    cfg = SglangLaunch.model_validate(
        {
            "backend": "sglang-launch",
            "sglang": {"python": sglang_python, "args": ["--context-length", str(CONTEXT_LENGTH)]},
            "launch": {"device": "cpu"},
        }
    )
    args, env = launch_settings(cfg, 1)
    policy = fence_policy(sglang.model_dir, tmp_path / "policy")
    metrics = tmp_path / "runs" / "routed" / "metrics.jsonl"
    killed: list[int] = []
    with (
        start_sglang_server(
            sglang_python, policy, extra_args=args, env=env, log_path=tmp_path / "second.log"
        ) as second,
        start_router([sglang.url, second.url], policy="round_robin", log_path=tmp_path / "router.log") as router,
    ):

        def kill_second_after_step_0() -> None:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
                time.sleep(0.1)
            killed.append(second.pid)
            os.killpg(second.pid, signal.SIGKILL)  # the server and its scheduler and detokenizer

        killer = threading.Thread(target=kill_second_after_step_0, daemon=True)
        killer.start()
        rows = _run(tmp_path, sglang, "routed", router.url, "disk")
        killer.join(5)
    assert killed
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["rollout/scored"] == 2 * TRIALS_PER_PROMPT for r in rows)  # no trial failed for the lost server
    assert rows[0]["sync/replicas"] == 2
    assert rows[-1]["sync/replicas"] == 1 and rows[-1]["sync/replicas_lost"] == 1


def test_generations_longer_than_the_request_timeout_are_answered_and_reach_the_step(sglang, tmp_path, restore_base):
    """The base (random) model's turns run up to `max_new_tokens` (a length-truncated one ends its trial), which
    takes SGLang on the CPU longer than `request_timeout_s`: each generation gets time for its tokens
    (`engine.min_decode_tok_s`), so every trial is scored and goes to the train step (where its group's reward
    spread decides its weight); none is cut off, re-sent, or failed as infrastructure. The timeout is half of what
    one such generation takes on this machine (within 0.5-2 s), so the generation's length, not the CPU's speed,
    exceeds it."""
    long = 1024
    sglang.client.update_weights_from_disk(str(sglang.model_dir), weight_version="base")
    start = time.monotonic()
    full = SamplingParams(max_new_tokens=long, temperature=1.0, ignore_eos=True)
    assert len(sglang.client.generate([1, 2, 3], full, return_logprob=False).output_ids) == long
    timeout_s = max(0.5, min(2.0, (time.monotonic() - start) / 2))  # the other requests get it too
    engine = {"backend": "sglang", "url": sglang.url, "request_timeout_s": timeout_s, "min_decode_tok_s": 8.0}
    cfg = train_config(tmp_path, sglang.model_dir, "long-turns", engine, steps=1)
    cfg["rollout"] |= {"n_samples_per_prompt": 2, "concurrency": 4, "episode": {"max_turns": 1}}
    cfg["rollout"]["sampling"]["max_new_tokens"] = long
    cfg["train"]["max_probe_logprob_gap"] = None  # the base model's probe is not what this tests
    train_flow(parse_run_config(cfg))
    [row] = read_metrics(tmp_path / "runs" / "long-turns" / "metrics.jsonl")
    assert row["rollout/scored"] == row["rollout/trials"] == 4 and row["rollout/dropped_groups"] == 0
    assert row["train/n_groups"] == 2 and row["train/n_samples"] + row["train/filtered_samples"] == 4
    details = tmp_path / "runs" / "long-turns" / "details" / "step_0" / "samples.jsonl"
    samples = [json.loads(x) for x in details.open()]
    for s in samples:
        assert s["status"] != "FAILED" and s["metrics"]["retries"] == 0, (s["status"], s["exit_reason"])
    longest = max(samples, key=lambda s: s["metrics"]["generation_time_s"])
    assert longest["metrics"]["generation_time_s"] > timeout_s  # one request, longer than the request timeout
    assert sum(longest["loss_mask"]) > 0 and longest["metrics"]["policy_calls"] == 1

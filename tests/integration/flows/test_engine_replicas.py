"""Two embedded engines behind the real sglang-router (`engine.embedded.replicas=2`): the train flow runs its trials
through the router, every weight sync reaches both replicas (each reports the new weight version), and a
replica killed mid-run is left out while the run goes on."""

import os
import shutil
import signal
import threading
import time

import pytest

from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.paths import RunPaths
from grpoflow.run.info import read_run_info
from grpoflow.run.metrics import read_metrics
from tests.fakes.proc import descendants_running
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [
    pytest.mark.flow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed"),
]
STEPS = 3


def _config(tmp_path, tiny_model_dir, run_id):
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    data = reward_tasks(tmp_path / "tasks")
    cfg = run_config(tmp_path / "runs", model, data, run_id, steps=STEPS)
    cfg["engine"] |= {"embedded": {"replicas": 2}, "weight_sync": {"mode": "distributed"}}
    return cfg


def test_two_replicas_behind_the_router_serve_every_sync(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, "replicas")
    train_flow(parse_run_config(cfg))
    root = tmp_path / "runs" / "replicas"
    rows = read_metrics(root / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert sum(r["train/optimizer_steps"] for r in rows) >= 1
    synced = [r for r in rows if "sync/bytes" in r]
    assert synced and all(r["sync/replicas"] == 2 for r in synced)
    # each replica loaded every version the run synced (ReplicaSyncs also read each one's weight_version back)
    logs = [(root / f"engine-{i}.log").read_text() for i in (0, 1)]
    for version in [r["weight_version"] for r in synced]:
        assert all(f"weight_version={version}\n" in log for log in logs), version
    assert (root / "router.log").is_file()
    assert all(r["rollout/trials"] == 8 and r["rollout/scored"] == 8 for r in rows)


@pytest.mark.parametrize("max_restarts", [0, 3])
def test_a_replica_killed_mid_run_is_restarted_or_left_out_and_the_run_goes_on(tmp_path, tiny_model_dir, max_restarts):
    """Restarts allowed (the default), the killed replica comes back on its port with the run's weights and every
    later sync reaches both; with none, it is left out of the syncs and the router."""
    cfg = _config(tmp_path, tiny_model_dir, "lose-one")
    cfg["engine"]["max_restarts"] = max_restarts
    metrics = tmp_path / "runs" / "lose-one" / "metrics.jsonl"
    killed: list[int] = []

    def kill_one_after_step_0():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            time.sleep(0.05)
        victim = max(descendants_running("grpoflow.embedded.engine.server"))
        killed.append(victim)
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_one_after_step_0, daemon=True)
    killer.start()
    train_flow(parse_run_config(cfg))
    killer.join(5)
    assert killed
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["rollout/scored"] == 8 for r in rows)  # no trial failed for the lost replica
    restarts = read_run_info(RunPaths(tmp_path / "runs" / "lose-one")).engine_restarts
    assert [(r.exit, r.error is None) for r in restarts] == [("code 137 (SIGKILL)", max_restarts > 0)]
    if max_restarts:  # back, on the weights of the step that had just synced
        assert restarts[0].weight_version == "1"
        assert rows[-1]["sync/replicas"] == 2 and rows[-1]["sync/replicas_lost"] == 0
    else:  # the last sync reached the one left
        assert rows[-1]["sync/replicas"] == 1 and rows[-1]["sync/replicas_lost"] == 1

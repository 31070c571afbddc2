"""Rollout on a Ray cluster (`cluster.ray_address`): a 2-node cluster on loopback (ray.cluster_utils), two
rollout workers, one per node; the train flow runs its trials there and journals them here. A worker killed
mid-step loses no finished trial: its unfinished ones run again on the other worker."""

import json
import os
import shutil
import signal
import threading
import time

import pytest

from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.run.metrics import read_metrics
from tests.fakes.proc import descendants_running
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster.address
    cluster.shutdown()


def _config(tmp_path, tiny_model_dir, run_id, address, steps):
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    data = reward_tasks(tmp_path / "tasks")
    cfg = run_config(tmp_path / "runs", model, data, run_id, steps=steps)
    cfg["cluster"] = {"ray_address": address}
    return cfg


def _workers() -> list[int]:
    """The rollout workers' processes of this test's cluster (Ray names an actor's process after its class)."""
    return descendants_running("ray::_Worker")


def _journal(root, step) -> list[dict]:
    path = root / "details" / f"step_{step}" / "journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_trials_run_on_ray_workers_on_both_nodes(tmp_path, tiny_model_dir, ray_cluster, caplog):
    cfg = _config(tmp_path, tiny_model_dir, "on-ray", ray_cluster, steps=2)
    local = _config(tmp_path, tiny_model_dir, "in-process", "", steps=2)
    train_flow(parse_run_config(cfg))
    assert "trials run on 2 rollout workers on 2 Ray nodes" in caplog.text  # the flow's own line (log_prints)
    # a cluster address (not `local`): the engine listens where other nodes reach it, this node's address
    from ray.util import get_node_ip_address

    engine_log = (tmp_path / "runs" / "on-ray" / "engine.log").read_text()
    assert f"grpoflow-engine listening on http://{get_node_ip_address()}:" in engine_log
    train_flow(parse_run_config(local))
    ray_rows = read_metrics(tmp_path / "runs" / "on-ray" / "metrics.jsonl")
    local_rows = read_metrics(tmp_path / "runs" / "in-process" / "metrics.jsonl")
    assert [r["step"] for r in ray_rows] == [0, 1]
    # the same trials, the same seeds, the same deterministic engine: the same rewards and updates as in-process
    for key in ("rollout/trials", "rollout/scored", "rollout/reward_mean", "train/n_tokens", "train/loss"):
        assert [r[key] for r in ray_rows] == [r[key] for r in local_rows], key
    assert all(r["rollout/retries"] == 0 for r in ray_rows)
    deadline = time.monotonic() + 30
    while _workers() and time.monotonic() < deadline:  # Ray tears actors down in the background
        time.sleep(0.2)
    assert not _workers()  # the run's workers are gone with it


def test_a_rollout_worker_killed_mid_step_loses_no_finished_trial(tmp_path, tiny_model_dir, ray_cluster):
    cfg = _config(tmp_path, tiny_model_dir, "lose-worker", ray_cluster, steps=1)
    cfg["train"]["eval"]["samples_per_prompt"] = 0
    root = tmp_path / "runs" / "lose-worker"
    seen: dict = {}

    def kill_a_worker_after_the_first_trial():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not _journal(root, 0):
            time.sleep(0.02)
        seen["finished_before"] = {line["rollout_id"] for line in _journal(root, 0)}
        victim = _workers()[0]
        seen["pid"] = victim
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_a_worker_after_the_first_trial, daemon=True)
    killer.start()
    train_flow(parse_run_config(cfg))
    killer.join(5)
    assert seen.get("pid"), "no worker was killed"
    [row] = read_metrics(root / "metrics.jsonl")
    assert row["rollout/trials"] == 8 and row["rollout/scored"] == 8  # every trial ended with a verdict
    journal = _journal(root, 0)
    ids = [line["rollout_id"] for line in journal]
    assert len(ids) == len(set(ids)) == 8  # each trial journaled once
    # the trials that had finished before the kill were not run again: one trial dir each
    trials = root / "trials" / "step_0"
    for rid in seen["finished_before"]:
        instance, k = rid.rsplit("-", 1)[0].removeprefix("step0-"), rid.rsplit("-", 1)[1]
        assert len(list(trials.glob(f"{instance}__{k}__a*"))) == 1, rid
    assert row["rollout/retries"] >= 1  # the killed worker's trials ran again elsewhere


def test_the_train_flow_on_two_nodes_two_engines_and_two_trainer_ranks(tmp_path, tiny_model_dir, ray_cluster, caplog):
    cfg = _config(tmp_path, tiny_model_dir, "scaled-out", ray_cluster, steps=2)
    cfg["cluster"] |= {"train_ranks": 2}
    cfg["engine"]["embedded"] = {"replicas": 2}
    cfg["train"]["checkpoint"] = {"interval": 1}
    train_flow(parse_run_config(cfg))
    out = caplog.text  # the flow's own lines (log_prints)
    assert "2 trainer ranks over gloo: rank 0 here, the other 1 as Ray actors" in out
    assert "trials run on 2 rollout workers on 2 Ray nodes" in out
    root = tmp_path / "runs" / "scaled-out"
    rows = read_metrics(root / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["rollout/scored"] == 8 for r in rows) and sum(r["train/optimizer_steps"] for r in rows) >= 1
    assert all(r["sync/replicas"] == 2 for r in rows if "sync/bytes" in r)
    assert (root / "checkpoints" / "step_1" / "model.safetensors").is_file()


def test_workers_that_cannot_reach_the_engine_stop_the_run_before_its_first_trial(ray_cluster):
    from grpoflow.cluster import ray_session
    from grpoflow.config import ClusterConfig
    from grpoflow.errors import EngineError
    from grpoflow.rollout.workers import rollout_workers
    from grpoflow.sockets import free_port

    cluster = ClusterConfig(ray_address=ray_cluster)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with ray_session(cluster), rollout_workers(cluster, 2) as workers:
        assert workers.unreachable([dead])[0].startswith("rollout-worker-0 (node ")
    with ray_session(cluster), pytest.raises(EngineError) as err:
        with rollout_workers(cluster, 2, (dead,)):
            pytest.fail("no block may run: its trials could not reach the engine")
    assert str(err.value).startswith("rollout workers cannot reach the engine: rollout-worker-0 (node ")
    assert "(2 of 2 checks failed)" in str(err.value) and "\n" not in str(err.value)
    assert not _workers() or _wait_gone()


def test_a_ray_session_leaves_the_commands_sigterm_handler_in_place(ray_cluster):
    """ray.init sets a SIGTERM handler of its own that exits at once: the command's (which stops the run's
    sandboxes and engines and says how to resume) is the one in force while the run holds the cluster."""
    from grpoflow.cluster import ray_session
    from grpoflow.config import ClusterConfig

    def commands(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    before = signal.signal(signal.SIGTERM, commands)
    try:
        with ray_session(ClusterConfig(ray_address=ray_cluster)) as connected:
            assert connected and signal.getsignal(signal.SIGTERM) is commands
    finally:
        signal.signal(signal.SIGTERM, before)


def _wait_gone() -> bool:
    deadline = time.monotonic() + 30
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _workers()

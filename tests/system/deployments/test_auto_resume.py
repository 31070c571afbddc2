"""A crashed run resumed with no person acting: the resume deployment's trigger, as `prefect deploy --all` creates
it, on a real server with the worker running the flows. A manual-train run is stopped by SIGTERM under the worker
(a preempted node, a stopped container: Prefect marks it Crashed), another loses its node (its process killed with
SIGKILL, the worker frozen: its heartbeats stop and deployments/automations.yaml marks it Crashed); the server starts `resume` for each, which finishes it. A run
that fails for a reason of its own is not resumed."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from grpoflow.paths import RunPaths
from grpoflow.run.info import read_run_info
from tests.system.deployments.conftest import Stack, tiny_config

pytestmark = pytest.mark.slow
STEPS = 4


def _flow_run_process(flow_run_id: str) -> int:
    """The pid of the process the worker started for the flow run (its environment names the run)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ.read_bytes().split(b"\0"):
                return int(environ.parent.name)
        except OSError:  # gone meanwhile, or a kernel thread
            continue
    raise AssertionError(f"no process runs flow run {flow_run_id}")


def _resumes_of(stack: Stack, run_id: str) -> list[dict]:
    return [fr for fr in stack.flow_runs("resume") if fr["parameters"].get("run_id") == run_id]


def _start(stack: Stack, cfg: dict) -> str:
    r = stack.post(
        f"/deployments/{stack.deployments['manual-train']['id']}/create_flow_run", {"parameters": {"config": cfg}}
    )
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _config(run_id: str, runs: Path, model_dir: Path) -> dict:
    cfg = tiny_config(run_id, runs, model_dir)
    cfg["train"] = {"steps": STEPS, "eval": {"samples_per_prompt": 0}}
    return cfg


def _wait_for_step_0(stack: Stack, run_dir: Path) -> None:
    """Until step 0 is recorded: step 1 is under way."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, (stack.tmp / "worker.log").read_text(errors="replace")[-4000:]
        time.sleep(0.2)


def _assert_resumed_to_the_end(stack: Stack, runs: Path, run_id: str, after: str) -> None:
    """The server started one resume of the run, which finished it; run.json says `after` what."""
    deadline = time.monotonic() + 120
    while not (resumes := _resumes_of(stack, run_id)):
        assert time.monotonic() < deadline, (
            "the server started no resume of the crashed run; what its automations did: "
            + stack.post("/events/filter", {"filter": {"event": {"prefix": ["prefect.automation"]}}}).text[:4000]
        )
        time.sleep(1)
    (resume,) = resumes
    assert resume["parameters"] == {"run_id": run_id, "output_dir": str(runs), "max_resumes": 3}
    done = stack.wait_final(resume["id"])
    assert done["state_type"] == "COMPLETED", (stack.tmp / "worker.log").read_text(errors="replace")[-5000:]
    rows = (runs / run_id / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == list(range(STEPS))
    info = read_run_info(RunPaths(runs / run_id))
    (resumed,) = info.resumes
    assert resumed.flow_run_id == resume["id"] and resumed.after.startswith("Crashed") and after in resumed.after
    assert info.ended is not None and info.survived.resumes == 1


def test_a_run_stopped_under_the_worker_is_resumed_by_the_server(prefect_stack, tiny_model_dir):
    stack = prefect_stack
    runs = stack.tmp / "crashes"
    train_id = _start(stack, _config("crash-1", runs, tiny_model_dir))
    _wait_for_step_0(stack, runs / "crash-1")
    os.kill(_flow_run_process(train_id), signal.SIGTERM)
    crashed = stack.wait_final(train_id)
    assert crashed["state_type"] == "CRASHED", crashed["state"]
    _assert_resumed_to_the_end(stack, runs, "crash-1", "termination signal")


def test_a_run_whose_node_is_lost_is_marked_crashed_by_its_heartbeats_and_resumed(prefect_stack, tiny_model_dir):
    """The node is lost: the flow's process killed with SIGKILL and its worker frozen (SIGSTOP), so no one reports
    an end. Its heartbeats stop, deployments/automations.yaml marks it Crashed, the resume trigger starts `resume`,
    and the worker, back (SIGCONT), runs it to the end. (With the worker alive, it reports the SIGKILL itself.)"""
    stack = prefect_stack
    runs = stack.tmp / "crashes"
    train_id = _start(stack, _config("lost-1", runs, tiny_model_dir))
    _wait_for_step_0(stack, runs / "lost-1")
    flow_pid = _flow_run_process(train_id)
    worker = int(Path(f"/proc/{flow_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
    os.kill(worker, signal.SIGSTOP)
    try:
        os.kill(flow_pid, signal.SIGKILL)
        crashed = stack.wait_final(train_id, timeout=240)  # 90 s after its last heartbeat
    finally:
        os.kill(worker, signal.SIGCONT)
    assert crashed["state_type"] == "CRASHED" and "no heartbeat" in crashed["state"]["message"], crashed["state"]
    _assert_resumed_to_the_end(stack, runs, "lost-1", "no heartbeat")


def test_a_run_that_fails_for_its_own_reason_is_not_resumed(prefect_stack, tiny_model_dir, tmp_path):
    stack = prefect_stack
    cfg = tiny_config("bad-dataset", stack.tmp / "crashes", tiny_model_dir)
    cfg["dataset"] = {"path": str(tmp_path / "no-such-dataset")}
    failed = stack.wait_final(_start(stack, cfg))
    assert failed["state_type"] == "FAILED", failed["state"]
    time.sleep(10)  # the server's triggers act within seconds of the event
    assert _resumes_of(stack, "bad-dataset") == []

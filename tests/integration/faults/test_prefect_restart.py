"""The Prefect server restarting mid-run: a train flow (in its own process) against `prefect server start` on
loopback; the server is killed as soon as step 0 is recorded (as step 1's rollout starts) and started again on
the same port and database.

Two server starts and a flow take ~50-75 s on 2 cores (marked slow).

The server stays down DOWNTIME_S (10 s: a restart of a real server takes about that long) before it is started
again, so the outcome does not depend on how fast the machine restarts it."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from grpoflow.run.metrics import read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.flow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed"),
]
DOWNTIME_S = 10.0

ROOT = Path(__file__).resolve().parents[3]
PREFECT = Path(sys.executable).with_name("prefect")

FLOW = """
import json, sys
from flows.train import train_flow
from grpoflow.config import parse_run_config
cfg = parse_run_config(json.loads(sys.argv[1]))
print("RESULT", json.dumps(train_flow(cfg)))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(env, port, log, ui=False):
    cmd = [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port), *([] if ui else ["--no-ui"])]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "prefect server exited at start"
        time.sleep(0.3)
    raise AssertionError("prefect server did not answer /api/health in 120 s")


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # a crash, not a graceful stop
        proc.wait(30)


def test_prefect_server_restart_during_rollout(tmp_path, tiny_model_dir):
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_UI_ENABLED": "false",
        "PYTHONPATH": str(ROOT),
    }
    cfg = {
        "run_id": "restart",
        "output_dir": str(tmp_path / "runs"),
        "model": {"source": str(tiny_model_dir)},
        "dataset": {"path": "builtin-fixed"},
        "rollout": {
            "prompts_per_step": 2,
            "n_samples_per_prompt": 2,
            "sampling": {"max_new_tokens": 8},
            "episode": {"max_turns": 1},
        },
        "train": {
            "steps": 4,
            "optimizer": {"learning_rate": 1e-3},
            "checkpoint": {"interval": 1},
            "eval": {"samples_per_prompt": 0},
        },
    }
    metrics = tmp_path / "runs" / "restart" / "metrics.jsonl"
    server_log = open(tmp_path / "server.log", "ab")
    server = _start_server(env, port, server_log)
    flow = subprocess.Popen(
        [sys.executable, "-c", FLOW, json.dumps(cfg)],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # step 0 recorded
            assert flow.poll() is None, flow.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "step 0 never finished"
            time.sleep(0.1)
        _stop(server)
        down_at = time.monotonic()
        time.sleep(DOWNTIME_S)
        server = _start_server(env, port, server_log)
        downtime = time.monotonic() - down_at
        out, _ = flow.communicate(timeout=240)
    finally:
        if flow.poll() is None:
            flow.kill()
        _stop(server)
        server_log.close()
    (tmp_path / "flow.log").write_text(out)
    steps = [r["step"] for r in read_metrics(metrics)]
    print(f"server down {downtime:.1f}s; flow rc {flow.returncode}; steps recorded {steps}")
    assert steps[:1] == [0]  # nothing written before the restart is lost
    assert len((tmp_path / "runs" / "restart" / "details" / "step_0" / "samples.jsonl").read_text().splitlines()) == 4
    # completes, or fails with a clear error
    assert flow.returncode == 0, f"flow failed across a {downtime:.0f}s server restart:\n{out[-4000:]}"
    assert steps == [0, 1, 2, 3] and "RESULT" in out

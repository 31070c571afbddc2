"""One real Prefect stack for the deployment tests: `prefect server start` (with its UI) on a free loopback port
with its own PREFECT_HOME, the project's process work pool, `prefect deploy --all` with deployments/prefect.yaml,
and a worker; plus one finished manual-train run on the tiny model that the API and browser tests both look at.

The server's scheduler service is off, so the nightly cron schedules are recorded but never fire during a test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from flows import OFFLINE_ENV
from flows.serve import DEPLOYMENTS_FILE, read_specs
from tests.fakes.proc import descendants
from tests.integration.faults.test_prefect_restart import _free_port, _start_server, _stop

ROOT = Path(__file__).resolve().parents[3]
PREFECT = Path(sys.executable).with_name("prefect")
POOL = "grpoflow-local"
AUTOMATIONS_FILE = ROOT / "deployments" / "automations.yaml"
OUTPUT = ROOT / "test-output" / "deployments"  # screenshots a person looks at (git-ignored)


@dataclass
class Stack:
    api: str  # http://127.0.0.1:<port>/api
    ui: str  # http://127.0.0.1:<port>
    env: dict[str, str]
    tmp: Path
    deployments: dict[str, dict]  # name -> the server's deployment, read right after `prefect deploy`
    not_deployed: list[str] = field(default_factory=list)  # declared, but the entrypoint file is not there yet
    deploy_output: str = ""

    def request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        return api_request(self.api, method, path, body)

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        return self.request("POST", path, body or {})

    def get(self, path: str) -> httpx.Response:
        return self.request("GET", path)

    def delete(self, path: str) -> httpx.Response:
        return self.request("DELETE", path)

    def flow_runs(self, deployment_name: str) -> list[dict]:
        dep_id = self.deployments[deployment_name]["id"]
        r = self.post("/flow_runs/filter", {"deployments": {"id": {"any_": [dep_id]}}})
        r.raise_for_status()
        return r.json()

    def wait_final(self, flow_run_id: str, timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fr = self.get(f"/flow_runs/{flow_run_id}").json()
            if fr["state_type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
                return fr
            time.sleep(1.0)
        raise AssertionError(f"flow run {flow_run_id} not finished after {timeout:.0f}s: {fr['state_type']}")


def api_request(api: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    # 503 is the server's "database busy" (SQLite locked while a run writes): retried, as Prefect's client does.
    for attempt in range(8):
        r = httpx.request(method, f"{api}{path}", json=body, timeout=30)
        if r.status_code != 503:
            break
        time.sleep(0.25 * 2**attempt)
    return r


def stop_tree(proc: subprocess.Popen, first: int = signal.SIGINT, grace: float = 20.0) -> None:
    """Stop a worker or `serve` and every flow run it started. A flow-run process lives in its own session, and
    a run left over from a failed test would otherwise go on (the real default job runs for hours)."""
    below = descendants(proc.pid)
    for pid in [proc.pid, *below]:
        try:
            os.kill(pid, first if pid == proc.pid else signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in below):
        time.sleep(0.2)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _prefect(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = 180) -> str:
    res = subprocess.run([str(PREFECT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, (
        f"prefect {' '.join(args)} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    )
    return res.stdout


def tiny_config(run_id: str, output_dir: Path, model_dir: Path) -> dict:
    """A run config the tiny random model finishes in seconds: one step, 2 prompts x 2 trials, one short turn, one
    trial per task regraded at the end."""
    return {
        "run_id": run_id,
        "output_dir": str(output_dir),
        "model": {"source": str(model_dir)},
        "rollout": {
            "prompts_per_step": 2,
            "n_samples_per_prompt": 2,
            "sampling": {"max_new_tokens": 8},
            "episode": {"max_turns": 1},
        },
        "train": {"steps": 1, "eval": {"samples_per_prompt": 0}},
        "report": {"regrade_per_task": 1},  # as the nightly recipe: the morning's task health regrades trials
    }


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefect-stack")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    # Nothing of the caller's Prefect profile leaks in (a session-wide test harness may be active in-process).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        {
            "PREFECT_HOME": str(tmp / "prefect-home"),
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_CLI_PROMPT": "false",
            **OFFLINE_ENV,
        }
    )
    t0 = time.monotonic()
    server_log = open(tmp / "server.log", "ab")
    server = _start_server(env, port, server_log, ui=True)
    worker = None
    try:
        t_server = time.monotonic() - t0
        _prefect(["work-pool", "create", POOL, "--type", "process"], env)
        # `--all` as a user runs it; while another change still lacks an entrypoint file, deploy what exists.
        specs = read_specs()
        missing = [s.name for s in specs if not s.entrypoint_file.is_file()]
        names = ["--all"] if not missing else [a for s in specs if s.name not in missing for a in ("-n", s.name)]
        t1 = time.monotonic()
        out = _prefect(
            ["--no-prompt", "deploy", *names, "--prefect-file", str(DEPLOYMENTS_FILE.relative_to(ROOT))], env
        )
        t_deploy = time.monotonic() - t1
        _prefect(["automation", "create", "--from-file", str(AUTOMATIONS_FILE)], env)  # as the yaml's header says
        r = api_request(api, "POST", "/deployments/filter", {})
        r.raise_for_status()
        deployments = {d["name"]: d for d in r.json()}
        # The worker starts outside the repository: the deployments' pull step must take the run there.
        worker_dir = tmp / "worker-cwd"
        worker_dir.mkdir()
        worker_log = open(tmp / "worker.log", "ab")
        worker = subprocess.Popen(
            [str(PREFECT), "worker", "start", "--pool", POOL],
            cwd=worker_dir,
            env=env,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        print(
            f"prefect stack at {api}: server up in {t_server:.1f}s, deploy in {t_deploy:.1f}s"
            f"{'; not deployed yet: ' + ', '.join(missing) if missing else ''}"
        )
        yield Stack(
            api=api,
            ui=f"http://127.0.0.1:{port}",
            env=env,
            tmp=tmp,
            deployments=deployments,
            not_deployed=missing,
            deploy_output=out,
        )
    finally:
        if worker is not None:
            stop_tree(worker)
        _stop(server)
        server_log.close()


@pytest.fixture(scope="session")
def finished_run(prefect_stack, tiny_model_dir):
    """The manual-train deployment triggered through the API with a tiny config, run by the worker to the end."""
    stack = prefect_stack
    cfg = tiny_config("deployed-tiny", stack.tmp / "runs", tiny_model_dir)
    dep_id = stack.deployments["manual-train"]["id"]
    t0 = time.monotonic()
    r = stack.post(f"/deployments/{dep_id}/create_flow_run", {"parameters": {"config": cfg}})
    assert r.status_code == 201, r.text
    fr = stack.wait_final(r.json()["id"])
    took = time.monotonic() - t0
    log = (stack.tmp / "worker.log").read_text(errors="replace")
    assert fr["state_type"] == "COMPLETED", f"{fr['state_type']}: {fr['state']['message']}\n{log[-5000:]}"
    print(f"manual-train run {fr['name']} completed {took:.1f}s after it was triggered")
    return {"flow_run": fr, "config": cfg, "run_dir": Path(cfg["output_dir"]) / cfg["run_id"], "seconds": took}


def artifacts_of(stack: Stack, flow_run_id: str) -> dict[str, dict]:
    r = stack.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    r.raise_for_status()
    return {a["key"]: a for a in r.json()}


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)[:3000]

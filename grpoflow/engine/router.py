"""Several engines behind one URL: the real `sglang-router` (PyPI `sglang-router`, Rust) in front of replicas.

The router takes SGLang's HTTP API at its own URL and forwards each `/generate` (and `/v1/...`) to one replica,
by its policy (`cache_aware`: where the longest prefix of the request is cached, so an episode's turns meet
their KV cache). It health-checks the replicas and stops sending to one that fails. Everything that is not a
generation — weight syncs, the probes, `/model_info` — goes to each replica itself: `SglangClient.replicas` reads them
from the router's `GET /workers`, for the replicas started here and for an SGLang fleet a user runs behind their
own router alike. A replica the run finds dead is taken out of the router (`remove_worker`), so the router cannot
take it back into rotation should it answer again on old weights; one the run restarted is put back (`add_worker`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from grpoflow.engine.client import SglangClient
from grpoflow.engine.launch import EngineProcess, log_tail, start_group, stop_process_group
from grpoflow.errors import EngineError
from grpoflow.sockets import free_port

ROUTER_STOP_S = 10.0  # how long a stopped router has before SIGKILL

# How often the router probes each replica's /health, and after how many failures in a row it stops routing
# there: a dead replica leaves within a few seconds.
HEALTH_INTERVAL_S = 2
HEALTH_FAILURES = 2


def start_router(
    worker_urls: list[str],
    *,
    policy: str = "cache_aware",
    log_path: Path,
    startup_timeout: float = 60.0,
    client_timeout: float = 600.0,
    client_retries: int = 3,
    host: str = "127.0.0.1",
    request_timeout: float | None = None,
) -> EngineProcess:
    """`python -m sglang_router.launch_router` on a free port of `host` in front of `worker_urls`; returns once
    it answers /health and lists every worker as healthy. `request_timeout`: how long the router lets a request
    run (default `client_timeout`); a run's is its longest generation's, so that the client, which knows each
    generation's length, is the one that times it out."""
    port = free_port(host)
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--host",
        host,
        "--port",
        str(port),
        "--health-check-interval-secs",
        str(HEALTH_INTERVAL_S),
        "--health-failure-threshold",
        str(HEALTH_FAILURES),
        "--request-timeout-secs",
        str(int(request_timeout or client_timeout)),
        "--log-level",
        "warn",
        # its metrics exporter takes a fixed port by default: two routers on one machine (two runs) would collide
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = start_group(cmd, log, grace_s=ROUTER_STOP_S)
    url = f"http://{host}:{port}"
    try:
        _wait_for_workers(proc, url, len(worker_urls), log_path, startup_timeout)
    except BaseException:
        stop_process_group(proc, timeout=ROUTER_STOP_S)
        raise
    client = SglangClient(url, timeout=client_timeout, retries=client_retries)
    return EngineProcess(proc, url, log_path, client, stop_timeout=ROUTER_STOP_S)


def remove_worker(router_url: str, worker_url: str, timeout: float = 10.0) -> bool:
    """Take `worker_url` out of the router's rotation (`DELETE /workers/<id>`); False when the router does not
    list it."""
    base = router_url.rstrip("/")
    workers = httpx.get(base + "/workers", timeout=timeout).json().get("workers") or []
    ids = [w["id"] for w in workers if w.get("url") == worker_url and "id" in w]
    for worker_id in ids:
        httpx.delete(f"{base}/workers/{worker_id}", timeout=timeout).raise_for_status()
    return bool(ids)


def add_worker(router_url: str, worker_url: str, timeout: float = 10.0) -> None:
    """Put `worker_url` back into the router's rotation (`POST /workers`): the router takes it up in the background,
    once it has asked the worker for its model."""
    httpx.post(router_url.rstrip("/") + "/workers", json={"url": worker_url}, timeout=timeout).raise_for_status()


def healthy_workers(url: str, timeout: float = 5.0) -> list[str]:
    """The router's workers it currently routes to (`is_healthy`)."""
    workers = httpx.get(url.rstrip("/") + "/workers", timeout=timeout).json().get("workers") or []
    return [w["url"] for w in workers if w.get("is_healthy")]


def _wait_for_workers(proc: subprocess.Popen, url: str, n: int, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineError(
                f"sglang-router exited with code {proc.returncode} during startup; log {log_path}:\n"
                + log_tail(log_path)
            )
        try:
            if len(healthy_workers(url, timeout=2.0)) == n:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise EngineError(
        f"sglang-router at {url} did not list {n} healthy engines after {timeout:.0f}s; log {log_path}:\n"
        + log_tail(log_path)
    )

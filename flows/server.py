"""The temporary Prefect server of one command, started by grpoflow instead of by Prefect.

With no Prefect server configured, Prefect starts a temporary one (uvicorn in a subprocess) the first time it needs
an API and stops it at interpreter exit. A SIGKILLed run never reaches that exit: its server stayed up,
reparented to init, listening on its port. And its stop came after the command's last line, so the last line a
user saw was Prefect's "Stopping temporary server", not the error.

`command_server()` starts that same server first, as Prefect's own `SubprocessASGIServer` registered where Prefect
looks for it (as `prefect.testing.utilities.prefect_test_harness` does), so every part of Prefect that wants the
temporary server gets this one. Its command is Prefect's own behind `grpoflow.lifeline`: it dies with this
process. It is stopped when the block ends, after Prefect's queued logs and events are sent, so the command's
last line comes after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import prefect
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings

from grpoflow.lifeline import Lifeline


class LifelineServer(SubprocessASGIServer):
    """Prefect's temporary server, stopped when this process dies (SIGKILL included)."""

    def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
        # Prefect 3's SubprocessASGIServer._run_uvicorn_command, behind the lifeline (a test compares the two).
        server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        argv = [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(prefect.__module_path__.parent),
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ]
        env = {**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)}
        return Lifeline(argv, env=env)  # Prefect's stop() signals the group


@contextmanager
def command_server() -> Iterator[None]:
    """Prefect's temporary server for the block, when Prefect would start one (no API URL set, temporary servers
    allowed): started here, and stopped when the block ends. With a server configured, or one already started in
    this process, nothing is done."""
    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        yield
        return
    server = LifelineServer()  # registered as Prefect's default (port None) unless this process has one already
    if type(server) is not LifelineServer or server.running:
        yield
        return
    server.start(timeout=settings.server.ephemeral.startup_timeout_seconds)
    try:
        yield
    finally:
        # What the flow logged and emitted reaches the server before it stops (else it is lost, with a warning
        # printed at exit after the command's last line).
        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)
        server.stop()

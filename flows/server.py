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
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import prefect
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings

from grpoflow.errors import GrpoflowError, one_line
from grpoflow.lifeline import Lifeline


class PrefectUnavailableError(GrpoflowError):
    """The Prefect API a command needs cannot be had: a configured server that does not answer, or a temporary
    server whose database cannot be written."""


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
    if settings.api.url:
        check_api(settings.api.url)
        yield
        return
    if not settings.server.ephemeral.enabled:
        yield
        return
    check_database_dir(settings)
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


def check_api(url: str) -> None:
    """Raise `PrefectUnavailableError` when the configured Prefect API does not answer its health check (said at
    once, in one line, instead of a flow that fails on its first call)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        failure = client.api_healthcheck()
    if failure is not None:
        raise PrefectUnavailableError(
            f"PREFECT_API_URL {url}: the Prefect API does not answer ({one_line(failure, 160)}); start that server "
            "(`prefect server start`), or unset PREFECT_API_URL to let grpoflow start a temporary one"
        )


def check_database_dir(settings) -> None:
    """Raise `PrefectUnavailableError` when the temporary server's SQLite database cannot be made where Prefect
    puts it (PREFECT_HOME under a HOME that does not exist, a read-only dir): Prefect itself waits out its startup
    timeout and ends in a traceback per try."""
    url = settings.server.database.connection_url
    url = url.get_secret_value() if url is not None else ""
    _, sep, path = url.partition(":///")
    if not (url.startswith("sqlite") and sep) or path in ("", ":memory:"):
        return  # another database (PostgreSQL): its own server answers for it
    where = Path(path).parent
    try:
        where.mkdir(mode=0o700, exist_ok=True)  # as Prefect makes its home: not its parents
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        name = "PREFECT_HOME" if where == Path(settings.home) else "PREFECT_SERVER_DATABASE_CONNECTION_URL"
        raise PrefectUnavailableError(
            f"{name}: Prefect's database dir {where} cannot be written ({exc.strerror}); set PREFECT_HOME to a "
            "writable directory"
        ) from None

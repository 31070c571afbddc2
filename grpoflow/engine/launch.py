"""Start the embedded engine as a subprocess and wait until it serves; and the same for an engine server from its
own Python environment (`start_server`: SGLang's, vLLM's).

The server runs in its own process group behind `grpoflow.lifeline` (so `stop()` also ends anything it spawned,
and a flow killed with SIGKILL does not leave it holding its GPUs) with stdout/stderr in a log file; if it dies
during startup the raised `EngineError` carries the log's tail. It reports its port through
a file in a private temporary folder, removed once startup is over (the log's folder is often a user's run dir).

`EngineProcess.restart` starts a server that exited again, with the same command on the same port (so every
client's URL still holds), and with generation held until `release`: the caller gives it its weights first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpoflow.engine.client import EngineClient, SglangClient
from grpoflow.errors import EngineError
from grpoflow.lifeline import Lifeline

_LOG_TAIL_LINES = 30
EMBEDDED_STOP_S = 10.0  # how long a stopped server has before SIGKILL: the embedded engine's, and
LAUNCHED_STOP_S = 30.0  # SGLang's and vLLM's, which free GPU memory on the way out
_POLL_S = 0.5
# Dropped from a launched server's environment, so grpoflow's packages cannot leak into its interpreter.
_ENV_DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


class EngineProcess:
    """A served engine in its own process group (the embedded server, or a launched SGLang or vLLM): `.url`,
    `.client`, `.log_path`, `.stop()`, `.restart()`; a context manager.

    `command` (and `env`) start it again on the same port; `starts_held`: that command starts it with generation
    paused (the embedded engine's `--paused`), else `restart` pauses it as soon as it answers."""

    def __init__(
        self,
        process: subprocess.Popen,
        url: str,
        log_path: Path,
        client: EngineClient,
        *,
        stop_timeout: float = 10.0,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        starts_held: bool = False,
    ):
        self.process = process
        self.url = url
        self.log_path = log_path
        self.client = client
        self.stop_timeout = stop_timeout
        self.command = command
        self.env = env
        self.starts_held = starts_held

    def restart(self, startup_timeout: float) -> None:
        """Start the server again after its process exited (what it spawned is stopped first), on the same port,
        and return once it answers /health with generation held; EngineError (the log's tail) if it does not."""
        if self.command is None:
            raise EngineError(f"engine {self.url} cannot be restarted: its command is not known")
        stop_process_group(self.process, self.stop_timeout)
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"grpoflow: restarting {' '.join(self.command)}\n".encode())
            log_file.flush()
            self.process = start_group(self.command, log_file, env=self.env, grace_s=self.stop_timeout)
        try:
            _wait_until_healthy(type(self.client), self.process, self.url, self.log_path, startup_timeout, 10.0)
            if not self.starts_held:
                self.client.hold_generation()
        except BaseException:
            stop_process_group(self.process, self.stop_timeout)
            raise

    def release(self) -> None:
        """Let generation go on (after `restart`, once the server has its weights)."""
        self.client.release_generation()

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the process group, wait up to `timeout` (default `stop_timeout`), then SIGKILL it. Idempotent."""
        self.client.close()
        stop_process_group(self.process, self.stop_timeout if timeout is None else timeout)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_embedded_engine(
    model_path: str | Path,
    *,
    seed: int = 0,
    threads: int | None = None,
    max_batch_size: int = 16,
    log_path: str | Path | None = None,
    startup_timeout: float = 120.0,
    client_timeout: float = 600.0,
    client_retries: int = 3,
    served_model_name: str | None = None,
    prefix_cache_tokens: int | None = None,
    host: str = "127.0.0.1",
) -> EngineProcess:
    """Spawn `python -m grpoflow.embedded.engine.server` on `host` (a free port) and return once /health answers.

    `threads=None` leaves the torch thread count to the server's default (1)."""
    model_path = Path(model_path)
    if not (model_path / "config.json").is_file():
        raise EngineError(f"cannot start the embedded engine: model path {model_path} has no config.json")
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="grpoflow-engine-")) / "engine.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port_dir = Path(tempfile.mkdtemp(prefix="grpoflow-engine-port-"))  # mode 0700: only we read the port
    port_file = port_dir / "port"

    server = [
        sys.executable,
        "-m",
        "grpoflow.embedded.engine.server",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--seed",
        str(seed),
        "--max-batch-size",
        str(max_batch_size),
    ]
    if threads:
        server += ["--threads", str(threads)]
    if served_model_name:
        server += ["--served-model-name", served_model_name]
    if prefix_cache_tokens is not None:
        server += ["--prefix-cache-tokens", str(prefix_cache_tokens)]
    cmd = [*server, "--port", "0", "--port-file", str(port_file)]
    try:
        with open(log_path, "ab") as log_file:
            proc = start_group(cmd, log_file, grace_s=EMBEDDED_STOP_S)
        try:
            url = _wait_until_serving(proc, port_file, log_path, startup_timeout, host)
        except BaseException:
            stop_process_group(proc, timeout=EMBEDDED_STOP_S)
            raise
    finally:
        shutil.rmtree(port_dir, ignore_errors=True)
    client = SglangClient(url, timeout=client_timeout, retries=client_retries)
    again = [*server, "--port", url.rsplit(":", 1)[1], "--paused"]  # held until it has the run's weights
    return EngineProcess(
        proc, url, log_path, client, stop_timeout=EMBEDDED_STOP_S, command=again, env=None, starts_held=True
    )


def _wait_until_serving(proc: subprocess.Popen, port_file: Path, log_path: Path, timeout: float, host: str) -> str:
    deadline = time.monotonic() + timeout
    url: str | None = None
    probe: EngineClient | None = None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EngineError(
                    f"embedded engine exited with code {proc.returncode} during startup; log {log_path}:\n"
                    + log_tail(log_path)
                )
            if url is None and port_file.is_file():
                port = port_file.read_text().strip()
                if port:
                    url = f"http://{host}:{port}"
                    probe = SglangClient(url, timeout=2.0, retries=0)
            if probe is not None and probe.health(timeout=2.0):
                return url
            time.sleep(0.1)
    finally:
        if probe is not None:
            probe.close()
    raise EngineError(
        f"embedded engine not healthy after {timeout:.0f}s (url={url or 'no port yet'}); log {log_path}:\n"
        + log_tail(log_path)
    )


def server_python(python: str, field: str, name: str, example: str) -> str:
    """The launched server's interpreter `python` as an executable path, or EngineError naming `field`."""
    exe = shutil.which(python)
    if exe is None:
        raise EngineError(f"{field} {python}: no such executable (the {name} environment's python, e.g. {example})")
    return exe


def server_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A launched server's environment: ours less what would put grpoflow's packages into its interpreter, plus
    `env`."""
    return {k: v for k, v in os.environ.items() if k not in _ENV_DROPPED} | (env or {})


def start_server(
    client_class: type[EngineClient],
    cmd: list[str],
    port: int,
    *,
    env: dict[str, str] | None = None,
    log_path: str | Path | None = None,
    startup_timeout: float = 900.0,
    client_timeout: float = 300.0,
    client_retries: int = 3,
    health_timeout: float = 10.0,
    host: str = "127.0.0.1",
) -> EngineProcess:
    """Run `cmd` (an engine server listening on `host`:`port`, spoken to with `client_class`) in its own process
    group, with its output in `log_path`, and return once `/health` answers 200.

    `env`: variables set for the server on top of ours (less the `_ENV_DROPPED`). Raises `EngineError` when the
    server exits during startup (with the exit code and the log's tail), or when it is not healthy within
    `startup_timeout` (it is stopped first)."""
    name = client_class.name
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix=f"grpoflow-{name.lower()}-")) / "engine.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    child_env = server_env(env)
    with open(log_path, "ab") as log_file:
        log_file.write(f"grpoflow: starting {' '.join(cmd)}\n".encode())
        log_file.flush()
        proc = start_group(cmd, log_file, env=child_env, grace_s=LAUNCHED_STOP_S)
    url = f"http://{host}:{port}"
    try:
        _wait_until_healthy(client_class, proc, url, log_path, startup_timeout, health_timeout)
    except BaseException:
        stop_process_group(proc, timeout=LAUNCHED_STOP_S)
        raise
    client = client_class(url, timeout=client_timeout, retries=client_retries)
    return EngineProcess(proc, url, log_path, client, stop_timeout=LAUNCHED_STOP_S, command=cmd, env=child_env)


def _wait_until_healthy(
    client_class: type[EngineClient],
    proc: subprocess.Popen,
    url: str,
    log_path: Path,
    timeout: float,
    probe_timeout: float,
) -> None:
    name = client_class.name
    deadline = time.monotonic() + timeout
    with client_class(url, timeout=probe_timeout, retries=0) as probe:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EngineError(
                    f"{name} server exited with code {proc.returncode} during startup; log {log_path}:\n"
                    + log_tail(log_path)
                )
            if probe.health(timeout=min(probe_timeout, max(deadline - time.monotonic(), 0.1))):
                return
            time.sleep(_POLL_S)
    raise EngineError(
        f"{name} server at {url} not healthy after {timeout:.0f}s; log {log_path}:\n" + log_tail(log_path)
    )


def start_group(cmd: list[str], log_file, *, grace_s: float, env: dict[str, str] | None = None) -> Lifeline:
    """`cmd` in a process group of its own behind the lifeline (stopped when this process dies, after `grace_s`
    seconds of SIGTERM), its output appended to `log_file`."""
    return Lifeline(cmd, grace_s=grace_s, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def stop_process_group(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait(5.0)


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<log unreadable: {e}>"

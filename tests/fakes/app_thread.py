"""Serve an ASGI app (a fake server at a boundary we cannot run here) on a free loopback port, in a thread."""

from __future__ import annotations

import threading
import time

import uvicorn

from grpoflow.sockets import bind_socket


class AppThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread: `.url`, `.stop()`."""

    def __init__(self, app, timeout_s: float = 30.0):
        sock = bind_socket("127.0.0.1", 0)  # bound before uvicorn starts: no race for the port
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"test server at {self.url} did not start in {timeout_s:.0f} s")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)

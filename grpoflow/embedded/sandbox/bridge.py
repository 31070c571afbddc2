"""The host side of a local sandbox's bridge to one address: a unix socket in the trial's dir, shown to the sandbox,
whose every connection is piped to `host:port` (the session server). Inside, `forward.py` listens on the sandbox's
loopback and pipes to the socket, so a harness in the sandbox reaches the session server at
`http://127.0.0.1:<port>` while the sandbox still has no network.

One daemon thread with its own event loop serves every bridge of the process: a sandbox may be started and
stopped from different event loops, and the pipes must not depend on either.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from pathlib import Path

FORWARDER = Path(__file__).with_name("forward.py")

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _bridge_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="sandbox-bridges", daemon=True).start()
            _loop = loop
        return _loop


def _run(coro) -> object:
    fut: Future = asyncio.run_coroutine_threadsafe(coro, _bridge_loop())
    return fut.result(timeout=30)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError, RuntimeError):
        pass


class Bridge:
    """A unix socket at `path` whose connections go to `host:port`. `close()` stops it and removes the socket."""

    def __init__(self, path: Path, host: str, port: int):
        self.path, self.host, self.port = Path(path), host, port
        self._server = _run(asyncio.start_unix_server(self._handle, path=str(self.path)))
        # The sandbox's uid (not ours, when we run as root) connects: a socket needs write permission to connect.
        os.chmod(self.path, 0o666)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:

            async def stop() -> None:
                server.close()

            _run(stop())
        self.path.unlink(missing_ok=True)

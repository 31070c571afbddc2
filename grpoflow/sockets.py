"""Listening sockets for the HTTP servers grpoflow runs (the embedded engine, the session server)."""

from __future__ import annotations

import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = a free one chosen by the OS)."""
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are TCP, and
    # with Nagle on every small answer waits for the client's delayed ACK (~40 ms a request).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # accept (queue) connections before uvicorn's loop starts
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a server in another process that takes its port on the command line (it
    may be taken before that process binds it: the server then fails to start, and says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

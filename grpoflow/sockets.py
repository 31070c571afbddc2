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

"""Runs inside a local sandbox (with the host's /usr/bin/python3, standard library only): listens on
127.0.0.1:<port> in the sandbox's own network namespace and forwards each connection to a unix socket that the
host bridged in (`grpoflow.embedded.sandbox.bridge`). The sandbox keeps no network: this one port reaches the one
address on the host side of the socket, and nothing else.

    python3 forward.py <port> <socket path>

Returns once it listens (the forwarder goes on in the background), so the caller knows the port is ready.
"""

import os
import socket
import sys
import threading


def pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def relay(client, path):
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def main():
    port, path = int(sys.argv[1]), sys.argv[2]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    if os.fork():  # the parent returns: the port is listening
        os._exit(0)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    while True:
        client, _ = listener.accept()
        try:
            threading.Thread(target=relay, args=(client, path), daemon=True).start()
        except RuntimeError:  # no thread to be had (the sandbox's process limit): this connection only fails
            client.close()


if __name__ == "__main__":
    main()

"""The session bridge of a local sandbox: the sandbox reaches one host address (at its own loopback port of the
same number) and nothing else on the host; and, through the session server's tokens, only its own session."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest

from grpoflow.embedded.sandbox.local import LocalSandbox
from tests.fakes.scripted_engine import Reply, ScriptedEngine


def _get(url: str, token: str | None = None) -> str:
    """A python3 one-liner for the sandbox: GET url (with a bearer token) and print the status."""
    headers = f"{{'Authorization': 'Bearer {token}'}}" if token else "{}"
    return (
        '/usr/bin/python3 -c "import urllib.request as u, urllib.error as e, sys\n'
        f"try: print(u.urlopen(u.Request('{url}', headers={headers}), timeout=5).status)\n"
        "except e.HTTPError as x: print(x.code)\n"
        "except OSError as x: print('unreachable', x)\""
    )


def test_the_sandbox_reaches_its_own_session_and_nothing_else(
    make_sandbox: Callable[..., LocalSandbox], tiny_model_dir
):
    from grpoflow.rollout.sessions.server import SessionServer
    from tests.fakes.session_settings import session_settings

    engine = ScriptedEngine(str(tiny_model_dir), lambda ids, i: Reply(text="ok"))
    server = SessionServer(
        session_settings(engine.url, str(tiny_model_dir), episode={"max_context_tokens": 512})
    ).start()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.socket() as other:  # another service on the host's loopback
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        other_port = other.getsockname()[1]
        own, theirs = server.session_url("trial-a"), server.session_url("trial-b")
        try:

            async def main() -> dict[str, str]:
                env = make_sandbox(process_scope="trial", session_bridge=f"127.0.0.1:{port}")
                await env.start(force_build=False)
                runs = {
                    "own": _get(f"{own}/models", server.session_token("trial-a")),
                    "no token": _get(f"{own}/models"),
                    "other session": _get(f"{theirs}/models", server.session_token("trial-a")),
                    "engine": _get(f"{engine.url}/health"),
                    "other port": f"echo x > /dev/tcp/127.0.0.1/{other_port} && echo reached || echo unreachable",
                }
                out = {k: (await env.exec(cmd, timeout_sec=20)).stdout.strip() for k, cmd in runs.items()}
                # the forwarder is the sandbox's only way out, and it is the sandbox's own process
                out["ifaces"] = (await env.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")).stdout
                await env.stop(delete=True)
                return out

            out = asyncio.run(main())
        finally:
            server.stop()
            engine.stop()
    assert out["own"] == "200"
    assert out["no token"] == "401" and out["other session"] == "401"
    assert out["engine"].startswith("unreachable")
    assert out["other port"] == "unreachable"
    assert out["ifaces"].split() == ["lo"]


def test_a_bridge_needs_trial_scope_and_a_host_port(make_sandbox: Callable[..., LocalSandbox]):
    with pytest.raises(ValueError, match="process_scope='trial'"):
        make_sandbox(session_bridge="127.0.0.1:8000")
    with pytest.raises(ValueError, match="host:port"):
        make_sandbox(process_scope="trial", session_bridge="localhost")
    with pytest.raises(ValueError, match="node_modules/.bin"):
        make_sandbox(cli_dir="/nonexistent")

"""Prefect's temporary server as grpoflow starts it runs Prefect's own command, only behind the lifeline: held
against the installed Prefect, so an upgrade that changes the command fails here, not in a user's run."""

from __future__ import annotations

import subprocess

from prefect.server.api.server import SubprocessASGIServer

import flows.server
from flows.server import LifelineServer


class _Recorded:
    calls: list[tuple[list[str], dict]] = []

    def __init__(self, args, **kwargs):
        self.calls.append((list(args), kwargs))


def test_the_command_is_prefect_s_own_behind_the_lifeline(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", _Recorded)  # Prefect's
    monkeypatch.setattr(flows.server, "Lifeline", _Recorded)  # ours: the command behind the lifeline
    server = object.__new__(LifelineServer)  # not through __new__: that registers it as Prefect's default server
    server.port = 8765
    SubprocessASGIServer._run_uvicorn_command(server)
    LifelineServer._run_uvicorn_command(server)
    (prefect_args, prefect_kwargs), (our_args, our_kwargs) = _Recorded.calls[-2:]
    assert "8765" in prefect_args and "prefect.server.api.server:create_app" in prefect_args
    assert our_args == prefect_args  # wrapped by `Lifeline` itself (tests/unit/test_lifeline.py)
    assert our_kwargs == prefect_kwargs  # the same environment, nothing else

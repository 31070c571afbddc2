"""The launcher: a real server subprocess, and clear errors when it cannot start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from grpoflow.engine.launch import start_embedded_engine
from grpoflow.engine.protocol import SamplingParams
from grpoflow.errors import EngineError
from tests.fakes.proc import group_members


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(EngineError, match=f"model path {tmp_path / 'nope'} has no config.json"):
        start_embedded_engine(tmp_path / "nope")


def test_server_dying_at_startup_reports_its_log_tail(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(EngineError, match=r"(?s)exited with code 1 during startup.*no-such-architecture"):
        start_embedded_engine(broken, log_path=tmp_path / "engine.log", startup_timeout=60)


def test_start_generate_stop(tiny_model_dir, tmp_path, monkeypatch):
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs) -> str:
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    log_path = tmp_path / "logs" / "engine.log"
    with start_embedded_engine(tiny_model_dir, seed=1, max_batch_size=4, log_path=log_path) as engine:
        assert engine.url.startswith("http://127.0.0.1:")
        resp = engine.client.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0))
        assert len(resp.output_ids) == 4
        assert engine.client.model_info().model_path == str(tiny_model_dir)
        assert os.getpgid(engine.pid) == engine.pid  # its own process group
        assert engine.client.server_info()["internal_states"][0]["torch_threads"] == 1  # the server's default
        # The port went through a private temp folder, gone once the server answered; the log folder holds the log.
        assert made and not any(os.path.exists(d) for d in made)
        assert sorted(p.name for p in log_path.parent.iterdir()) == ["engine.log"]
    assert engine.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(engine.pid, 0)  # signal 0: does the group still exist?
    assert f"grpoflow-engine listening on {engine.url}" in log_path.read_text()


# A server as SGLang's is launched: an HTTP server answering /health, with a child process of its own (its
# scheduler), in its own interpreter (`start_server` drops PYTHONPATH from a launched server's environment).
SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen(["sleep", "600"])
print("scheduler pid:", child.pid, flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
RUNS = {
    "embedded": "from grpoflow.engine.launch import start_embedded_engine\n"
    "e = start_embedded_engine({model!r}, seed=0, log_path={log!r})\n",
    "launched": "from grpoflow.engine.client import SglangClient\n"
    "from grpoflow.engine.launch import start_server\n"
    "from grpoflow.sockets import free_port\n"
    "port = free_port()\n"
    "e = start_server(SglangClient, [sys.executable, '-c', {server!r}, str(port)], port, log_path={log!r})\n",
}


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_an_engine_and_its_children_exit_when_the_run_that_started_it_is_killed(kind, tiny_model_dir, tmp_path):
    """A run killed with SIGKILL cannot stop its engine: the lifeline it runs behind stops the engine's whole
    process group (the server, and what it started) once the run is gone."""
    log = tmp_path / "engine.log"
    script = (
        "import sys, time\n"
        + RUNS[kind].format(model=str(tiny_model_dir), log=str(log), server=SERVER)
        + "print(e.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(run.stdout.readline())
        members = group_members(engine_pid)
        assert engine_pid in members and len(members) >= 2  # the lifeline, the server (and what it started)
        if kind == "launched":
            assert int(log.read_text().rsplit("scheduler pid: ")[1].split()[0]) in members
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        deadline = time.monotonic() + 30
        while group_members(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = group_members(engine_pid)
        if left:
            os.killpg(engine_pid, signal.SIGKILL)
        assert not left, f"{left} of the engine's group outlived the run that started it"
    finally:
        run.kill()
    assert "is gone: stopping it" in log.read_text()

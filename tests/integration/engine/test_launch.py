"""The launcher: a real server subprocess, and clear errors when it cannot start."""

from __future__ import annotations

import os
import tempfile

import pytest

from grpoflow.engine.launch import start_embedded_engine
from grpoflow.engine.protocol import SamplingParams
from grpoflow.errors import EngineError


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


def test_engine_exits_when_the_run_that_started_it_is_killed(tiny_model_dir, tmp_path):
    """A run killed with SIGKILL cannot stop its engine; the engine notices its parent is gone and exits."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\n"
        "from grpoflow.engine.launch import start_embedded_engine\n"
        f"e = start_embedded_engine({str(tiny_model_dir)!r}, seed=0, log_path={str(tmp_path / 'engine.log')!r})\n"
        "print(e.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(run.stdout.readline())
        os.kill(engine_pid, 0)  # serving
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.killpg(engine_pid, signal.SIGKILL)
            pytest.fail("the engine outlived the run that started it")
    finally:
        run.kill()
    assert "is gone: shutting down" in (tmp_path / "engine.log").read_text()

"""A full disk under grpoflow.fileio: the failed write leaves the target old or absent (never torn), no temp file,
and every earlier line of an append-only log stays readable."""

import errno
import json
import os

import pytest

from grpoflow import fileio
from grpoflow.fileio import append_jsonl, write_bytes_atomic, write_json_atomic
from grpoflow.run.metrics import read_metrics


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _HalfWrite:
    """A file whose write() gets half the data onto disk, then fails with ENOSPC (the disk filled up mid-write)."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        _enospc()

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_atomic_write_on_full_disk_keeps_the_old_file(tmp_path, monkeypatch, where):
    target = tmp_path / "config.json"
    write_json_atomic(target, {"v": 1})
    if where == "fsync":
        monkeypatch.setattr(os, "fsync", _enospc)
    else:  # the data itself does not fit: the temp file is cut short
        real_fdopen = os.fdopen

        monkeypatch.setattr(os, "fdopen", lambda *a, **k: _HalfWrite(real_fdopen(*a, **k)))
    with pytest.raises(OSError) as info:
        write_json_atomic(target, {"v": 2, "pad": "x" * 10000})
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert json.loads(target.read_text()) == {"v": 1}  # old content, whole
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # the temp file was removed


def test_atomic_write_on_full_disk_leaves_a_new_target_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(OSError):
        write_bytes_atomic(tmp_path / "d" / "samples.jsonl", b'{"a": 1}\n' * 100)
    monkeypatch.undo()
    assert list((tmp_path / "d").iterdir()) == []


def test_append_on_full_disk_keeps_earlier_lines(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    for step in range(3):
        append_jsonl(path, {"step": step, "x": 1.0})
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(OSError):
        append_jsonl(path, {"step": 3})
    monkeypatch.undo()
    assert [r["step"] for r in read_metrics(path)][:3] == [0, 1, 2]


def _torn_append(monkeypatch, path, record):
    """append_jsonl whose write stops halfway with ENOSPC (the file gets a partial line)."""
    real_open = open
    monkeypatch.setattr(fileio, "open", lambda *a, **k: _HalfWrite(real_open(*a, **k)), raising=False)
    with pytest.raises(OSError):
        append_jsonl(path, record)
    monkeypatch.undo()


def test_torn_append_on_full_disk_keeps_earlier_lines_readable(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    for step in range(3):
        append_jsonl(path, {"step": step})
    _torn_append(monkeypatch, path, {"step": 3, "pad": "y" * 200})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]  # the torn last line is skipped


def test_append_after_a_torn_append_keeps_the_log_readable(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    for step in range(3):
        append_jsonl(path, {"step": step})
    _torn_append(monkeypatch, path, {"step": 3, "pad": "y" * 200})
    append_jsonl(path, {"step": 3})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    append_jsonl(path, {"step": 4})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]


def test_disk_full_error_names_the_file(tmp_path, monkeypatch):
    from grpoflow.fileio import write_jsonl_atomic

    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(OSError) as info:
        write_jsonl_atomic(tmp_path / "details" / "step_1" / "samples.jsonl", [{"a": 1}])
    monkeypatch.undo()
    assert "samples.jsonl" in str(info.value)

import os

import pytest

from grpoflow import fileio


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    p = tmp_path / "a" / "x.json"
    fileio.write_json_atomic(p, {"a": 1})
    fileio.write_json_atomic(p, {"b": 2})
    assert p.read_text() == '{\n  "b": 2\n}\n'
    assert [q.name for q in p.parent.iterdir()] == ["x.json"]


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "x.txt"
    fileio.write_text_atomic(p, "old")

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="No space"):
        fileio.write_text_atomic(p, "new")
    assert p.read_text() == "old"
    assert [q.name for q in tmp_path.iterdir()] == ["x.txt"]


def test_tree_hash_sees_content_names_and_exec_bit(tmp_path):
    (tmp_path / "d").mkdir()
    f = tmp_path / "d" / "f.sh"
    f.write_text("echo hi\n")
    h0 = fileio.sha256_tree(tmp_path)
    f.write_text("echo ho\n")
    h1 = fileio.sha256_tree(tmp_path)
    f.chmod(0o755)
    h2 = fileio.sha256_tree(tmp_path)
    f.rename(tmp_path / "d" / "g.sh")
    h3 = fileio.sha256_tree(tmp_path)
    assert len({h0, h1, h2, h3}) == 4

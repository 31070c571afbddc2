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


def test_read_tail_reads_only_the_end_of_a_huge_file_and_never_a_link_or_fifo(tmp_path):
    huge = tmp_path / "test-stdout.txt"
    with open(huge, "wb") as f:  # 1 GiB, sparse: what a verifier printing a gigabyte leaves
        f.truncate(2**30)
        f.seek(2**30)
        f.write(b"\nlast line\n")
    tail = fileio.read_tail(huge, 4096)
    assert len(tail) == 4096 and tail.endswith("\nlast line\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert fileio.read_tail(fifo, 4096) == ""  # no writer: a plain read would block forever
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    (tmp_path / "link").symlink_to(secret)
    with pytest.raises(OSError):
        fileio.read_tail(tmp_path / "link", 4096)

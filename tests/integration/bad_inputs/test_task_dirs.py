"""Malformed Harbor task dirs and datasets, through the whole prepare stage: one line naming the task dir (and the
file at fault), raised before the run dir exists."""

from __future__ import annotations

import shutil

import pytest

from grpoflow.errors import DatasetError
from grpoflow.prepare.dataset import MAX_INSTRUCTION_BYTES, load_dataset

from .conftest import assert_nothing_written, assert_one_line, copy_task


def _write(task, rel, data):
    (task / rel).write_bytes(data if isinstance(data, bytes) else data.encode())


def _rm(task, rel):
    p = task / rel
    shutil.rmtree(p) if p.is_dir() else p.unlink()


CASES = [
    # id, how the task is broken, words the one-line error must contain (besides the task dir)
    (
        "toml-syntax",
        lambda t: _write(t, "task.toml", 'schema_version = "1.4"\n[agent\ntimeout_sec = 1\n'),
        ["task.toml", "not valid TOML"],
    ),
    (
        "toml-wrong-type",
        lambda t: _write(t, "task.toml", '[verifier]\ntimeout_sec = "soon"\n'),
        ["task.toml", "verifier.timeout_sec"],
    ),
    (
        "toml-metadata-wrong-type",
        lambda t: _write(t, "task.toml", "[metadata]\ncategory = [1, 2]\n"),
        ["task.toml", "[metadata].category"],
    ),
    ("instruction-missing", lambda t: _rm(t, "instruction.md"), ["instruction.md"]),
    ("instruction-empty", lambda t: _write(t, "instruction.md", ""), ["instruction.md is empty"]),
    (
        "instruction-not-utf8",
        lambda t: _write(t, "instruction.md", b"\xff\xfe w\x00r\x00i\x00t\x00e\n"),
        ["instruction.md is not UTF-8"],
    ),
    (
        "instruction-huge",
        lambda t: _write(t, "instruction.md", "write hello\n" * (MAX_INSTRUCTION_BYTES // 12 + 10)),
        ["instruction.md", "65536-byte limit"],
    ),
    ("tests-test-sh-missing", lambda t: _rm(t, "tests/test.sh"), ["tests/test.sh"]),
    ("solution-missing", lambda t: _rm(t, "solution"), ["solution/solve.sh"]),
    ("environment-missing", lambda t: _rm(t, "environment"), ["environment/"]),
]


@pytest.mark.parametrize(("breaker", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_broken_task_fails_prepare_with_one_line_and_no_run_dir(dataset, prepare, breaker, words):
    call, runs = prepare
    task = dataset / "make-dir"
    breaker(task)
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)})
    assert_one_line(info.value, task.resolve(), *words)
    assert_nothing_written(runs)


def test_unknown_toml_section_is_accepted_like_harbor_does(dataset):
    # Harbor's TaskConfig allows extra tables (forward compatibility), so grpoflow does too: no error, and the
    # task's known fields are still read.
    with (dataset / "make-dir" / "task.toml").open("a") as f:
        f.write("\n[future_section]\nsomething = 1\n")
    ds = load_dataset(dataset)
    assert ds.by_name("make-dir").verifier_timeout_sec > 0


def test_empty_dataset_dir_fails_prepare(tmp_path, prepare):
    call, runs = prepare
    empty = tmp_path / "empty"
    (empty / ".hidden-task").mkdir(parents=True)  # hidden dirs are not tasks
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(empty)})
    assert_one_line(info.value, empty.resolve(), "no task directories")
    assert_nothing_written(runs)


def test_duplicate_task_names_fail_prepare(dataset, prepare):
    call, runs = prepare
    copy_task(dataset, "hello-file", as_name="HELLO-FILE")  # collides case-folded with hello-file
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)})
    assert_one_line(info.value, "duplicate task name", "hello-file")
    assert_nothing_written(runs)


def test_dataset_path_that_is_a_file_fails_prepare(tmp_path, prepare):
    call, runs = prepare
    f = tmp_path / "tasks.txt"
    f.write_text("not a dir\n")
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(f)})
    assert_one_line(info.value, f.resolve(), "not a directory")
    assert_nothing_written(runs)

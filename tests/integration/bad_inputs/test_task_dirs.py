"""Malformed Harbor task dirs and datasets, through the whole prepare stage: one line naming the task dir (and the
file at fault), raised before the run dir exists."""

from __future__ import annotations

import json
import os
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


SECRET = "grpoflow-test-secret-5f3a"  # the content of a host file outside the task dir


def _link_out(rel, *, as_dir=False):
    """Replace `rel` in the task by a symlink to a host file (or dir) outside it, as a hostile dataset would."""

    def breaker(task):
        outside = task.parents[1] / "host" / rel.replace("/", "_")
        outside.parent.mkdir(exist_ok=True)
        if as_dir:
            shutil.copytree(task / rel, outside)
            (outside / "stolen.txt").write_text(SECRET + "\n")
        else:
            outside.write_text(SECRET + "\n")
        _rm(task, rel)
        (task / rel).symlink_to(outside)

    return breaker


def _set_toml(section, key, value):
    def breaker(task):
        out, current = [], None
        for line in (task / "task.toml").read_text().splitlines():
            if line.startswith("["):
                current = line.strip("[] ")
            if not (current == section and line.startswith(f"{key} =")):  # the task's own value goes
                out.append(line)
            if line == f"[{section}]":
                out.append(f"{key} = {value}")
        assert f"{key} = {value}" in out, section
        _write(task, "task.toml", "\n".join(out) + "\n")

    return breaker


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
    ("environment-missing", lambda t: _rm(t, "environment"), ["environment/"]),
    # a dataset is third-party input: nothing in a task dir may make grpoflow read a host file outside it
    ("instruction-symlink-out", _link_out("instruction.md"), ["instruction.md is a symlink", "outside the task"]),
    ("task-toml-symlink-out", _link_out("task.toml"), ["task.toml is a symlink", "outside the task"]),
    ("test-sh-symlink-out", _link_out("tests/test.sh"), ["tests/test.sh is a symlink", "outside the task"]),
    ("solution-dir-symlink-out", _link_out("solution", as_dir=True), ["solution is a symlink", "outside the task"]),
    ("environment-file-symlink-out", _link_out("environment/Dockerfile"), ["environment/Dockerfile is a symlink"]),
    ("fifo-in-tests", lambda t: os.mkfifo(t / "tests" / "data"), ["tests/data is a FIFO"]),
    # a task may not choose to run without a time limit (or with none worth the name)
    ("agent-timeout-inf", _set_toml("agent", "timeout_sec", "inf"), ["`agent.timeout_sec` = inf"]),
    ("agent-timeout-1e300", _set_toml("agent", "timeout_sec", "1e300"), ["`agent.timeout_sec` = 1e+300"]),
    ("verifier-timeout-inf", _set_toml("verifier", "timeout_sec", "inf"), ["`verifier.timeout_sec` = inf"]),
    ("verifier-timeout-nan", _set_toml("verifier", "timeout_sec", "nan"), ["`verifier.timeout_sec` = nan"]),
    ("agent-timeout-zero", _set_toml("agent", "timeout_sec", "0"), ["`agent.timeout_sec` = 0"]),
    ("build-timeout-negative", _set_toml("environment", "build_timeout_sec", "-5.0"), ["build_timeout_sec` = -5"]),
]


@pytest.mark.parametrize(("breaker", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_broken_task_fails_prepare_with_one_line_and_no_run_dir(dataset, prepare, breaker, words):
    # The broken task alone: beside a good one it would only be left out (next test).
    call, runs = prepare
    _rm(dataset, "hello-file")
    task = dataset / "make-dir"
    breaker(task)
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)})
    assert_one_line(info.value, task.resolve(), *words)
    assert_nothing_written(runs)


def test_a_broken_task_beside_a_good_one_is_left_out_with_its_reason(dataset, prepare):
    call, runs = prepare
    _rm(dataset / "make-dir", "tests/test.sh")
    run = call(dataset={"path": str(dataset), "validate": False})  # not gated: no trial, the refusal alone
    gate = json.loads(run.paths.gate.read_text())
    [out] = [t for t in gate["tasks"] if not t["admitted"]]
    assert (out["name"], out["verdict"]) == ("make-dir", "refused")
    assert_one_line(out["reason"], (dataset / "make-dir").resolve(), "tests/test.sh")
    assert [json.loads(line)["instance_id"] for line in run.paths.prompts.read_text().splitlines()] == ["hello-file"]


def test_a_task_without_a_solution_is_kept(dataset, prepare):
    call, runs = prepare
    _rm(dataset / "make-dir", "solution")
    run = call(dataset={"path": str(dataset), "validate": False})
    verdicts = {t["name"]: t["verdict"] for t in json.loads(run.paths.gate.read_text())["tasks"]}
    assert verdicts == {"hello-file": "ungated", "make-dir": "unverified"}  # gate off: nothing ran


def test_nothing_outside_a_task_dir_reaches_an_error_or_an_artifact(tmp_path, dataset, prepare):
    call, runs = prepare
    _rm(dataset, "hello-file")
    _link_out("instruction.md")(dataset / "make-dir")
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)})
    assert SECRET not in str(info.value)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and "host" not in p.parts]
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]


def test_symlinks_inside_the_task_dir_are_followed(dataset):
    task = dataset / "make-dir"
    (task / "docs").mkdir()
    (task / "instruction.md").rename(task / "docs" / "instruction.md")
    (task / "instruction.md").symlink_to("docs/instruction.md")
    assert "/app/out" in load_dataset(dataset).by_name("make-dir").instruction


def test_a_task_dir_linked_from_outside_the_dataset_is_refused(tmp_path, dataset, prepare):
    call, runs = prepare
    elsewhere = copy_task(tmp_path / "elsewhere", "hello-file", as_name="outside-task")
    (dataset / "linked").symlink_to(elsewhere)
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)})
    assert_one_line(info.value, dataset / "linked", "outside the dataset directory")
    assert_nothing_written(runs)


def test_timeouts_within_a_day_are_accepted(dataset):
    _set_toml("agent", "timeout_sec", "86400")(dataset / "make-dir")
    assert load_dataset(dataset).by_name("make-dir").agent_timeout_sec == 86400


def test_a_bad_dataset_is_said_before_the_model_is_touched(tmp_path, dataset, prepare):
    call, runs = prepare
    _rm(dataset, "hello-file")
    _rm(dataset / "make-dir", "instruction.md")
    corrupt = tmp_path / "policy.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 8)  # converting it would fail (and cost)
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)}, model={"source": str(corrupt)})
    assert_one_line(info.value, "make-dir", "instruction.md")
    assert not (tmp_path / "cache").exists()  # the model was never looked at: no GGUF read, no conversion dir
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

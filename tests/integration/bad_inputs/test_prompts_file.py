"""A bad prompts jsonl (`prompts.path`), through the whole prepare stage: one line naming `file:line` (or the
file, or the task dir at fault), raised before the run dir exists."""

from __future__ import annotations

import json

import pytest

from grpoflow.errors import DatasetError

from .conftest import assert_nothing_written, assert_one_line


def _rec(dataset, iid="a", task="hello-file", **extra):
    return json.dumps({"instance_id": iid, "task_path": str(dataset / task), **extra})


CASES = [
    # id, lines of the jsonl (a function of the dataset dir), what the error must name
    ("bad-json-line", lambda d: [_rec(d), '{"instance_id": "b", "task_path": '], [":2", "not valid JSON"]),
    ("non-object-line", lambda d: [_rec(d), '"just a string"'], [":2", "must be a JSON object"]),
    ("array-line", lambda d: ["[" + _rec(d) + "]"], [":1", "must be a JSON object"]),
    (
        "duplicate-ids",
        lambda d: [_rec(d, "x"), _rec(d, "y", "make-dir"), _rec(d, "x", "make-dir")],
        [":3", "duplicate instance_id `x`", "line 1"],
    ),
    ("missing-task-path", lambda d: [json.dumps({"instance_id": "a", "instruction": "do it"})], [":1", "`task_path`"]),
    ("task-path-not-a-string", lambda d: [json.dumps({"instance_id": "a", "task_path": 7})], [":1", "`task_path`"]),
    ("unknown-field", lambda d: [_rec(d, colour="red")], [":1", "`colour`"]),
    ("wrong-type-field", lambda d: [_rec(d, metadata=[1, 2])], [":1", "`metadata`"]),
    ("bad-split", lambda d: [_rec(d, split="test")], [":1", "`split`"]),
    ("only-blank-lines", lambda d: ["", "   "], ["no prompt records"]),
]


@pytest.mark.parametrize(("lines", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_prompts_file_fails_prepare_naming_file_and_line(tmp_path, dataset, prepare, lines, words):
    call, runs = prepare
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(line + "\n" for line in lines(dataset)))
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)}, prompts={"path": str(f)})
    assert_one_line(info.value, f, *words)
    assert_nothing_written(runs)


def test_empty_prompts_file(tmp_path, dataset, prepare):
    call, runs = prepare
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(b"")
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)}, prompts={"path": str(f)})
    assert_one_line(info.value, f, "no prompt records")
    assert_nothing_written(runs)


def test_non_utf8_prompts_file(tmp_path, dataset, prepare):
    call, runs = prepare
    f = tmp_path / "prompts.jsonl"
    f.write_bytes((_rec(dataset) + "\n").encode() + b'{"instance_id": "caf\xe9"}\n')
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)}, prompts={"path": str(f)})
    assert_one_line(info.value, f, "not UTF-8")
    assert_nothing_written(runs)


def test_missing_prompts_file(tmp_path, dataset, prepare):
    call, runs = prepare
    f = tmp_path / "nowhere.jsonl"
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)}, prompts={"path": str(f)})
    assert_one_line(info.value, f, "not found")
    assert_nothing_written(runs)


def test_task_path_to_a_non_task_names_the_dir(tmp_path, dataset, prepare):
    call, runs = prepare
    not_a_task = tmp_path / "notes"
    not_a_task.mkdir()
    (not_a_task / "README.md").write_text("just notes\n")
    f = tmp_path / "prompts.jsonl"
    f.write_text(_rec(dataset) + "\n" + json.dumps({"instance_id": "n", "task_path": "notes"}) + "\n")
    with pytest.raises(DatasetError) as info:
        call(dataset={"path": str(dataset)}, prompts={"path": str(f)})
    # Relative task_path resolves against the jsonl's dir; the error names that dir and what it lacks.
    assert_one_line(info.value, not_a_task.resolve(), "task.toml")
    assert_nothing_written(runs)

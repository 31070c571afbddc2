import json
import shutil

import pytest

from grpoflow.errors import DatasetError
from grpoflow.prepare.dataset import builtin_dataset_path, load_dataset, load_task
from grpoflow.prepare.prompts import build_prompts, load_prompts, write_prompts


@pytest.fixture(scope="module")
def builtin():
    return load_dataset("builtin-fixed")


def test_one_record_per_task_with_instruction_and_metadata(builtin):
    recs = build_prompts(builtin, seed=0, eval_fraction=0.25)
    assert sorted(r.instance_id for r in recs) == sorted(t.name for t in builtin.tasks)
    for r in recs:
        task = builtin.by_name(r.instance_id)
        assert r.instruction == task.instruction and r.task_path == str(task.path)
        assert r.metadata["difficulty"] == task.difficulty


def test_order_and_split_are_a_function_of_the_seed(builtin):
    a = build_prompts(builtin, seed=1, eval_fraction=0.25)
    b = build_prompts(builtin, seed=1, eval_fraction=0.25)
    c = build_prompts(builtin, seed=2, eval_fraction=0.25)
    key = lambda rs: [(r.instance_id, r.split) for r in rs]  # noqa: E731
    assert key(a) == key(b)
    assert key(a) != key(c)


def test_eval_split_spans_every_difficulty(builtin):
    recs = build_prompts(builtin, seed=0, eval_fraction=0.25)
    grades = {t.difficulty for t in builtin.tasks}
    eval_grades = {r.metadata["difficulty"] for r in recs if r.split == "eval"}
    assert eval_grades == grades
    assert 0 < sum(r.split == "eval" for r in recs) < len(recs)


def test_no_eval_and_max_prompts(builtin):
    recs = build_prompts(builtin, seed=0, eval_fraction=0.0, max_prompts=5)
    assert len(recs) == 5 and all(r.split == "train" for r in recs)


def test_written_prompts_load_back_identically(builtin, tmp_path):
    recs = build_prompts(builtin, seed=3, eval_fraction=0.25)
    f = tmp_path / "prompts.jsonl"
    write_prompts(f, recs)
    assert load_prompts(f) == recs


def test_external_list_with_relative_paths_and_no_instruction(tmp_path):
    shutil.copytree(builtin_dataset_path() / "hello-file", tmp_path / "tb2" / "hello-file")
    f = tmp_path / "train.jsonl"
    f.write_text(
        json.dumps({"instance_id": "hello-1", "task_path": "tb2/hello-file", "metadata": {"src": "tb2"}}) + "\n\n"
    )
    [rec] = load_prompts(f)
    assert rec.task_path == str((tmp_path / "tb2" / "hello-file").resolve())
    assert rec.instruction == load_task(tmp_path / "tb2" / "hello-file").instruction != ""
    assert rec.metadata == {"src": "tb2"} and rec.split == "train"


def _write(tmp_path, lines):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(line + "\n" for line in lines))
    return f


HELLO = str(builtin_dataset_path() / "hello-file")


@pytest.mark.parametrize(
    "lines, where, expect",
    [
        (["{oops"], ":1", "not valid JSON"),
        (["[1, 2]"], ":1", "must be a JSON object"),
        ([json.dumps({"instance_id": "a"})], ":1", "`task_path` is required"),
        ([json.dumps({"instance_id": "a", "task_path": "/no/such/task"})], "/no/such/task", ""),
        ([json.dumps({"instance_id": "a", "task_path": HELLO})] * 2, ":2", "duplicate instance_id `a`"),
        ([json.dumps({"instance_id": "a", "task_path": HELLO, "split": "dev"})], ":1", "`split`"),
        ([json.dumps({"instance_id": "", "task_path": HELLO})], ":1", "`instance_id`"),
        ([json.dumps({"instance_id": "a", "task_path": HELLO, "extra": 1})], ":1", "`extra`"),
        ([], "p.jsonl", "no prompt records"),
    ],
)
def test_bad_prompt_lines_name_file_and_line(tmp_path, lines, where, expect):
    f = _write(tmp_path, lines)
    with pytest.raises(DatasetError) as exc:
        load_prompts(f)
    msg = str(exc.value)
    assert where in msg and expect in msg and "\n" not in msg


def test_non_utf8_prompts_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"instance_id": "\xff"}\n')
    with pytest.raises(DatasetError, match="not UTF-8"):
        load_prompts(f)

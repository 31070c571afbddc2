"""Loading and validating task datasets, and the built-in task set's shape."""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from harbor.lint.models import LintRule
from harbor.lint.task import lint_task

from grpoflow.errors import DatasetError
from grpoflow.prepare.dataset import (
    CATEGORIES,
    DIFFICULTIES,
    MAX_INSTRUCTION_BYTES,
    Dataset,
    builtin_dataset_path,
    load_dataset,
)

BUILTIN = load_dataset("builtin-fixed")


def _write_task(task_dir: Path, toml: str | None = None) -> Path:
    """A minimal valid task dir."""
    (task_dir / "tests").mkdir(parents=True)
    (task_dir / "solution").mkdir()
    (task_dir / "environment").mkdir()
    (task_dir / "task.toml").write_text(
        toml
        if toml is not None
        else '[metadata]\ndifficulty = "easy"\ncategory = "file"\n\n[agent]\ntimeout_sec = 30.0\n'
    )
    (task_dir / "instruction.md").write_text("Create the file /app/x.\n")
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (task_dir / "solution" / "solve.sh").write_text("#!/bin/bash\ntouch /app/x\n")
    (task_dir / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    return task_dir


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    root = tmp_path / "tasks"
    _write_task(root / "alpha")
    _write_task(root / "beta")
    return root


# ---------------------------------------------------------------- the built-in set


def test_builtin_set_loads_with_every_difficulty() -> None:
    assert len(BUILTIN.tasks) >= 18
    per_difficulty = Counter(t.difficulty for t in BUILTIN.tasks)
    assert set(per_difficulty) == set(DIFFICULTIES)
    assert min(per_difficulty.values()) >= 5, per_difficulty
    assert {t.category for t in BUILTIN.tasks} == set(CATEGORIES)
    assert [t.name for t in BUILTIN.tasks] == sorted(t.name for t in BUILTIN.tasks)
    assert BUILTIN.root == builtin_dataset_path()
    for task in BUILTIN.tasks:
        assert task.path.is_absolute() and task.path.parent == BUILTIN.root
        assert "/app" in task.instruction
        assert task.agent_timeout_sec is not None and task.agent_timeout_sec > 0
        assert task.metadata["difficulty"] == task.difficulty


def test_builtin_by_name_and_path_agree() -> None:
    by_path = load_dataset(builtin_dataset_path())
    assert by_path == BUILTIN
    assert BUILTIN.by_name("hello-file").difficulty == "easy"
    with pytest.raises(KeyError):
        BUILTIN.by_name("no-such-task")


@pytest.mark.parametrize("task", BUILTIN.tasks, ids=lambda t: t.name)
def test_builtin_task_files_follow_conventions(task) -> None:
    for script in (task.path / "tests" / "test.sh", task.path / "solution" / "solve.sh"):
        # Harbor runs both scripts by path, so the shebang and exec bit are load-bearing.
        assert os.access(script, os.X_OK), script
        assert script.read_text().startswith("#!/bin/bash\n"), script
    test_sh = (task.path / "tests" / "test.sh").read_text()
    # `set -u` without `set -e`: a failing check must fall through to a reward, not abort the script.
    assert re.search(r"^set -u$", test_sh, re.M) and not re.search(r"^\s*set -\w*e", test_sh, re.M)
    # The default reward is written before any check can exit.
    assert test_sh.index("echo 0 > /logs/verifier/reward.txt") < test_sh.index("finish 1")

    dockerfile = (task.path / "environment" / "Dockerfile").read_text().splitlines()
    assert dockerfile[:2] == ["FROM debian:bookworm-slim", "WORKDIR /app"]
    has_inputs = (task.path / "environment" / "app").is_dir()
    # Docker users get the same /app as the sandbox, which copies environment/app/ in.
    assert ("COPY app/ /app/" in dockerfile) == has_inputs
    if has_inputs:
        assert "environment/app/" in (task.path / "README.md").read_text()


@pytest.mark.parametrize("task", BUILTIN.tasks, ids=lambda t: t.name)
def test_builtin_task_passes_harbor_lint(task) -> None:
    # Catches what Harbor's model silently ignores, e.g. a misspelt `timeout_secs`. The rules left out are
    # about docker deployments (root user, shared verifier, pinned images), not about the task's files.
    rules = {LintRule.INVALID_TASK_CONFIG, LintRule.UNKNOWN_CONFIG_FIELD, LintRule.INVALID_TASK_FILES}
    assert lint_task(task.path, selected_rules=rules) == []


# ---------------------------------------------------------------- the dataset hash


def test_hash_is_stable_and_independent_of_location(tmp_path: Path) -> None:
    assert load_dataset("builtin-fixed").sha256 == BUILTIN.sha256
    copy = tmp_path / "copy"
    shutil.copytree(builtin_dataset_path(), copy)
    assert load_dataset(copy).sha256 == BUILTIN.sha256


def _append(rel: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        with open(root / rel, "a") as f:
            f.write("# changed\n")

    return change


def _add_input_file(root: Path) -> None:
    (root / "alpha" / "environment" / "app").mkdir()
    (root / "alpha" / "environment" / "app" / "in.txt").write_text("")


@pytest.mark.parametrize(
    "change",
    [
        _append("alpha/tests/test.sh"),
        _append("alpha/instruction.md"),
        _append("beta/solution/solve.sh"),
        _append("beta/environment/Dockerfile"),
        _append("beta/task.toml"),
        lambda root: (root / "alpha" / "tests" / "expected.txt").write_text("x\n"),
        _add_input_file,
        lambda root: os.chmod(root / "alpha" / "tests" / "test.sh", 0o755),
        lambda root: (root / "beta").rename(root / "gamma"),
    ],
    ids=["test", "instruction", "solution", "dockerfile", "toml", "new-test-file", "new-input", "chmod", "rename"],
)
def test_hash_changes_with_any_task_file(dataset_dir: Path, change: Callable[[Path], None]) -> None:
    before = load_dataset(dataset_dir).sha256
    change(dataset_dir)
    assert load_dataset(dataset_dir).sha256 != before


def test_hash_ignores_files_beside_the_tasks(dataset_dir: Path) -> None:
    before = load_dataset(dataset_dir).sha256
    (dataset_dir / "README.md").write_text("about this dataset\n")
    (dataset_dir / ".cache").mkdir()
    assert load_dataset(dataset_dir).sha256 == before


# ---------------------------------------------------------------- task fields


def test_task_fields_come_from_task_toml(dataset_dir: Path) -> None:
    (dataset_dir / "alpha" / "task.toml").write_text(
        '[metadata]\ndifficulty = "hard"\ncategory = "text"\nowner = "me"\n\n'
        "[verifier]\ntimeout_sec = 12.5\n\n[agent]\ntimeout_sec = 99.0\n"
    )
    (dataset_dir / "beta" / "task.toml").write_text("")  # every field defaults
    (dataset_dir / "alpha" / "instruction.md").write_text("<!-- canary GUID 1234 -->\n\nDo the thing.\n")
    ds = load_dataset(dataset_dir)
    alpha, beta = ds.tasks
    assert (alpha.name, alpha.difficulty, alpha.category) == ("alpha", "hard", "text")
    assert (alpha.agent_timeout_sec, alpha.verifier_timeout_sec) == (99.0, 12.5)
    assert alpha.metadata == {"difficulty": "hard", "category": "text", "owner": "me"}
    assert alpha.instruction == "Do the thing.\n"  # Harbor strips canary lines before the agent sees them
    assert alpha.path == (dataset_dir / "alpha").resolve()
    assert (beta.difficulty, beta.category, beta.agent_timeout_sec, beta.verifier_timeout_sec) == (
        "unknown",
        "unknown",
        None,
        600.0,
    )
    assert isinstance(ds, Dataset) and ds.root == dataset_dir.resolve()


def test_solution_is_optional(dataset_dir: Path) -> None:
    # Harbor does not require one, and public datasets often ship none: the task loads, marked as such.
    (dataset_dir / "alpha" / "solution" / "solve.sh").unlink()
    ds = load_dataset(dataset_dir)
    assert [(t.name, t.has_solution) for t in ds.tasks] == [("alpha", False), ("beta", True)]
    assert ds.left_out == ()


def test_hidden_dirs_are_not_tasks(dataset_dir: Path) -> None:
    (dataset_dir / ".git").mkdir()
    (dataset_dir / "__pycache__").mkdir()
    assert [t.name for t in load_dataset(dataset_dir).tasks] == ["alpha", "beta"]


# ---------------------------------------------------------------- bad tasks


def _rm(rel: str) -> Callable[[Path], None]:
    def change(task: Path) -> None:
        target = task / rel
        shutil.rmtree(target) if target.is_dir() else target.unlink()

    return change


def _write(rel: str, data: str | bytes) -> Callable[[Path], None]:
    def change(task: Path) -> None:
        (task / rel).write_bytes(data if isinstance(data, bytes) else data.encode())

    return change


def _multi_line_toml_error(task: Path) -> None:
    (task / "task.toml").write_text('[agent]\ntimeout_sec = "soon"\n\n[verifier]\ntimeout_sec = "later"\n')


def _escaping_symlink(task: Path) -> None:
    (task / "tests" / "data").symlink_to("/etc")


BAD_TASKS = [
    ("missing-toml", _rm("task.toml"), "missing task.toml"),
    ("toml-syntax", _write("task.toml", "[agent\ntimeout_sec = 1\n"), "task.toml is not valid TOML"),
    ("toml-schema", _multi_line_toml_error, "agent.timeout_sec"),
    ("toml-not-utf8", _write("task.toml", b'[metadata]\nx = "\xff"\n'), "task.toml is not UTF-8"),
    ("multi-step", _write("task.toml", '[[steps]]\nname = "one"\n'), "multi-step"),
    ("bad-difficulty", _write("task.toml", "[metadata]\ndifficulty = 3\n"), "[metadata].difficulty"),
    ("missing-instruction", _rm("instruction.md"), "missing instruction.md"),
    ("empty-instruction", _write("instruction.md", " \n\n\t\n"), "instruction.md is empty"),
    ("canary-only-instruction", _write("instruction.md", "# canary GUID 1234\n\n"), "instruction.md is empty"),
    ("instruction-not-utf8", _write("instruction.md", b"caf\xe9 au lait\n"), "instruction.md is not UTF-8"),
    ("instruction-too-long", _write("instruction.md", "a" * (MAX_INSTRUCTION_BYTES + 1)), "over the 65536-byte"),
    ("missing-test", _rm("tests/test.sh"), "missing tests/test.sh"),
    ("missing-tests-dir", _rm("tests"), "missing tests/test.sh"),
    ("missing-environment", _rm("environment"), "missing environment/"),
    ("input-escapes-task", _escaping_symlink, "tests/data is a symlink to /etc, outside the task directory"),
]


@pytest.mark.parametrize(("break_task", "expected"), [c[1:] for c in BAD_TASKS], ids=[c[0] for c in BAD_TASKS])
def test_bad_task_is_left_out_with_one_line_naming_the_task(
    dataset_dir: Path, break_task: Callable[[Path], None], expected: str
) -> None:
    task = dataset_dir / "beta"
    break_task(task)
    ds = load_dataset(dataset_dir)  # one bad task does not stop the dataset
    assert [t.name for t in ds.tasks] == ["alpha"]
    [out] = ds.left_out
    assert (out.name, out.path) == ("beta", task.resolve())
    assert str(task.resolve()) in out.reason and expected in out.reason and "\n" not in out.reason
    # with nothing else left, the same line is the dataset's error
    shutil.rmtree(dataset_dir / "alpha")
    with pytest.raises(DatasetError) as info:
        load_dataset(dataset_dir)
    assert str(info.value) == out.reason


def test_a_dataset_with_every_task_left_out_fails_in_one_line(dataset_dir: Path) -> None:
    for name in ("alpha", "beta"):
        (dataset_dir / name / "instruction.md").unlink()
    with pytest.raises(DatasetError) as info:
        load_dataset(dataset_dir)
    message = str(info.value)
    assert "\n" not in message and "all 2 task dirs left out" in message and "missing instruction.md" in message
    assert str(dataset_dir.resolve()) in message


def test_a_left_out_task_changes_the_hash_by_its_reason(dataset_dir: Path) -> None:
    before = load_dataset(dataset_dir).sha256
    (dataset_dir / "beta" / "instruction.md").unlink()
    assert load_dataset(dataset_dir).sha256 != before


def test_instruction_at_the_size_limit_is_accepted(dataset_dir: Path) -> None:
    (dataset_dir / "beta" / "instruction.md").write_text("a" * MAX_INSTRUCTION_BYTES)
    assert len(load_dataset(dataset_dir).by_name("beta").instruction) == MAX_INSTRUCTION_BYTES


def test_schema_errors_are_all_quoted(dataset_dir: Path) -> None:
    _multi_line_toml_error(dataset_dir / "alpha")
    [out] = load_dataset(dataset_dir).left_out
    problems = out.reason.split("Harbor's task config: ", 1)[1].split("; ")
    assert sorted(p.split(":")[0] for p in problems) == ["agent.timeout_sec", "verifier.timeout_sec"]


def test_duplicate_names_are_rejected(dataset_dir: Path) -> None:
    # Distinct dirs on a case-sensitive filesystem, one name for trials, artifacts and metrics.
    _write_task(dataset_dir / "Alpha")
    with pytest.raises(DatasetError) as info:
        load_dataset(dataset_dir)
    message = str(info.value)
    assert "duplicate task name" in message and str(dataset_dir / "alpha") in message
    assert "\n" not in message


def test_empty_dataset_dir_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("no tasks here\n")
    with pytest.raises(DatasetError, match="holds no task directories") as info:
        load_dataset(tmp_path)
    assert str(tmp_path.resolve()) in str(info.value)


def test_missing_dataset_dir_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(tmp_path / "nowhere")


# ---------------------------------------------------------------- what the local sandbox reproduces

LOCAL_OK = [
    "FROM debian:bookworm-slim\nWORKDIR /app\n",
    "# syntax=docker/dockerfile:1\nFROM ubuntu:24.04 AS base\n\n# inputs\nWORKDIR /app/\nCOPY app/ /app/\n",
    "FROM debian\nWORKDIR /app\nCOPY ./app .\n",
    "FROM debian\n",
]
LOCAL_REFUSED = [
    # Dockerfile, line, words of the one-line reason
    ("FROM ubuntu:24.04\nWORKDIR /app\nRUN apt-get update && \\\n    apt-get install -y curl\n", 3, "RUN apt-get"),
    ("FROM ubuntu\nENV PIP_CERT=/x\n", 2, "`ENV PIP_CERT=/x`"),
    ("FROM ubuntu\nWORKDIR /workspace\n", 2, "working directory is /app"),
    ("FROM ubuntu\nWORKDIR /app\nCOPY data.csv /app/\n", 3, "copies only environment/app/"),
    ("FROM ubuntu\nWORKDIR /app\nCOPY app/ /workspace/\n", 3, "copies only environment/app/"),
    ("FROM ubuntu\nCOPY app/ .\n", 2, "copies only environment/app/"),  # `.` is / without a WORKDIR
    ("FROM ubuntu\nWORKDIR /app\nCOPY --chown=1000 app/ /app/\n", 3, "COPY --chown"),
    ("FROM ubuntu AS build\nFROM debian\n", 2, "a second build stage"),
    ("FROM ubuntu\nADD app.tar /app/\n", 2, "builds no image"),
    ("ARG BASE=ubuntu\nFROM $BASE\n", 1, "`ARG BASE=ubuntu`"),
]


@pytest.mark.parametrize("dockerfile", LOCAL_OK)
def test_a_dockerfile_the_local_sandbox_reproduces_is_accepted(dataset_dir: Path, dockerfile: str) -> None:
    (dataset_dir / "beta" / "environment" / "Dockerfile").write_text(dockerfile)
    assert [t.name for t in load_dataset(dataset_dir, local_sandbox=True).tasks] == ["alpha", "beta"]


@pytest.mark.usefixtures("no_docker_engine")
@pytest.mark.parametrize(("dockerfile", "line", "words"), LOCAL_REFUSED)
def test_a_dockerfile_beyond_the_local_sandbox_is_refused_naming_file_and_line(
    dataset_dir: Path, dockerfile: str, line: int, words: str
) -> None:
    (dataset_dir / "beta" / "environment" / "Dockerfile").write_text(dockerfile)
    ds = load_dataset(dataset_dir, local_sandbox=True)  # the default builds when an engine answers; none does
    [out] = ds.left_out
    assert [t.name for t in ds.tasks] == ["alpha"] and out.name == "beta"
    assert f"environment/Dockerfile:{line}: " in out.reason and words in out.reason and "\n" not in out.reason
    assert str((dataset_dir / "beta").resolve()) in out.reason
    assert "no Docker engine answers" in out.reason
    assert load_dataset(dataset_dir, local_sandbox=True, build_images=True).left_out == ds.left_out
    # told not to, a dataset's Dockerfile is not built at all, engine or not
    [unasked] = load_dataset(dataset_dir, local_sandbox=True, build_images=False).left_out
    assert unasked.reason.endswith("dataset.build_images=true builds it with Docker")
    # other sandboxes build the image themselves: nothing to refuse there
    assert len(load_dataset(dataset_dir).tasks) == 2


def test_a_workdir_other_than_the_local_sandboxes_is_refused(dataset_dir: Path) -> None:
    with (dataset_dir / "beta" / "task.toml").open("a") as f:
        f.write('\n[environment]\nworkdir = "/workspace"\n')
    [out] = load_dataset(dataset_dir, local_sandbox=True).left_out
    assert "[environment].workdir = '/workspace'" in out.reason


def test_the_builtin_tasks_pass_the_local_sandbox_check() -> None:
    assert load_dataset("builtin-fixed", local_sandbox=True) == BUILTIN


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            lambda d: (d / "environment" / "docker-compose.yaml").write_text("services: {db: {image: pg}}\n"),
            "environment/docker-compose.yaml: the local sandbox runs no extra services",
        ),
        (
            lambda d: (d / "task.toml").open("a").write("\n[environment]\ngpus = 1\n"),
            "[environment] gpus = 1: the local sandbox has no GPU",
        ),
        (
            lambda d: (
                (d / "task.toml")
                .open("a")
                .write('\n[verifier]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org", "*.pythonhosted.org"]\n')
            ),
            "[verifier] allowed_hosts '*.pythonhosted.org': a wildcard-hostname entry; the local sandbox enforces",
        ),
        (
            lambda d: (
                (d / "task.toml")
                .open("a")
                .write('\n[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["192.168.1.0/24"]\n')
            ),
            "[environment] allowed_hosts '192.168.1.0/24': a private, link-local or reserved range",
        ),
    ],
)
def test_a_task_needing_more_than_one_sandbox_is_refused_for_the_local_one(
    dataset_dir: Path, change: Callable[[Path], object], words: str
) -> None:
    change(dataset_dir / "beta")
    [out] = load_dataset(dataset_dir, local_sandbox=True).left_out
    assert out.name == "beta" and words in out.reason and "\n" not in out.reason
    assert len(load_dataset(dataset_dir).tasks) == 2  # Harbor's docker environment or a cloud one may run it

"""Helpers for the bad-input cases: a one-task dataset copied from a built-in task, and the prepare stage run on it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import builtin_dataset_path
from grpoflow.run.start import prepare_run


def assert_one_line(err: BaseException, *names: object) -> str:
    """The error is one line and names every given file/field."""
    msg = str(err)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    for name in names:
        assert str(name) in msg, f"{name!r} not named in {msg!r}"
    return msg


def copy_task(dest_root: Path, name: str = "hello-file", as_name: str | None = None) -> Path:
    dest = dest_root / (as_name or name)
    shutil.copytree(builtin_dataset_path() / name, dest)
    return dest


@pytest.fixture
def dataset(tmp_path) -> Path:
    """A dataset dir holding two valid tasks (hello-file, make-dir); tests break one of them."""
    root = tmp_path / "tasks"
    copy_task(root, "hello-file")
    copy_task(root, "make-dir")
    return root


@pytest.fixture
def prepare(tmp_path, tiny_model_dir):
    """Run the whole prepare stage (model, dataset, prompts, run dir) with config overrides.

    Returns (call, runs_dir); `call(**sections)` raises whatever prepare raises.
    """
    runs = tmp_path / "runs"

    def call(run_id: str = "bad-1", **sections):
        data = {"run_id": run_id, "output_dir": str(runs), "model": {"source": str(tiny_model_dir)}, **sections}
        return prepare_run(parse_run_config(data), cache_dir=tmp_path / "cache")

    return call, runs


def assert_nothing_written(runs: Path, run_id: str = "bad-1") -> None:
    assert not (runs / run_id).exists(), f"prepare wrote {runs / run_id} despite bad input"

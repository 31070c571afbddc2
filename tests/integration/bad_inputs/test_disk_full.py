"""A disk that fills up while a checkpoint is written: one `CheckpointError` line naming the checkpoint, and no
temp dir or temp file left beside it (the step's published dir, if any, stays as it was). The real thing on a
small tmpfs where this machine lets us mount one, and a failing write anywhere."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from grpoflow.config import TrainConfig
from grpoflow.errors import CheckpointError
from grpoflow.figures import Figures
from grpoflow.paths import RunPaths
from grpoflow.run.commit import StepCommits, save_step
from grpoflow.run.metrics import MetricsLog
from grpoflow.run.record import StepRecord
from grpoflow.train.checkpoint import save_checkpoint
from grpoflow.train.step import train_step
from grpoflow.train.trainer import load_trainer
from tests.fakes.samples import agentic_samples

from .conftest import assert_one_line


@pytest.fixture
def small_disk(tmp_path):
    """`mount(size)`: a tmpfs of that size under tmp_path (the tiny model's weights take 2.2 MB)."""
    mounted = []

    def mount(size: str):
        where = tmp_path / f"disk-{size}"
        where.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        # lazy: a failed torch.save's file may stay open until the exception pytest keeps is collected
        subprocess.run(["umount", "--lazy", str(where)], check=True)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    state = load_trainer(tiny_model_dir, TrainConfig(optimizer={"learning_rate": 1e-2}), seed=0)
    train_step(
        state, agentic_samples(state.model), TrainConfig(optimizer={"learning_rate": 1e-2}), seed=0
    )  # AdamW moments exist
    return state


def _left(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_weights_that_do_not_fit(small_disk, trainer):
    disk = small_disk("1m")
    out = disk / "checkpoints" / "step_0"
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(trainer.model, trainer.tokenizer, out)
    assert_one_line(info.value, out, "No space left on device")
    assert _left(disk) == ["checkpoints"]  # no .step_0.tmp-<pid>/, no step_0/


def test_optimizer_state_that_does_not_fit(small_disk, trainer):
    # torch.save's own error on a full disk says nothing of the disk: the free space does.
    disk = small_disk("4m")
    out = disk / "checkpoints" / "step_0"
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(trainer.model, trainer.tokenizer, out, optimizer=trainer.optimizer, counters={"step": 0})
    assert_one_line(info.value, out, "KiB free on its filesystem")
    assert _left(disk) == ["checkpoints"]


def test_a_full_checkpoint_completed_in_the_background(tmp_path, small_disk, trainer):
    # The step's dir fits; the AdamW state that would make it a resume point does not. The dir stays the step dir
    # save_step published, with no temp file in it, and the run's thread gets the one line.
    disk = small_disk("4m")
    paths = RunPaths(disk / "run")
    paths.root.mkdir()
    log = MetricsLog(paths.metrics, tmp_path / "tb")  # TensorBoard's files elsewhere: not under test
    commits = StepCommits(paths, log)
    record = StepRecord(0, train=Figures({"train/loss": 1.0}))
    ckpt = save_step(trainer, paths, 0, record)
    published = _left(ckpt)
    commits.finish(trainer, ckpt, 0, record, full=True)
    with pytest.raises(CheckpointError) as info:
        commits.flush()
    log.close()
    assert_one_line(info.value, ckpt)
    assert not [n for n in _left(ckpt) if n.startswith(".")], _left(ckpt)
    assert "optimizer.pt" not in _left(ckpt) and set(published) <= set(_left(ckpt))
    assert not paths.metrics.exists() or paths.metrics.read_text() == ""  # no row for a step that is no resume point


def test_a_failing_write_anywhere(tmp_path, trainer, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(type(trainer.tokenizer), "save_pretrained", full)  # after the weights were written
    out = tmp_path / "checkpoints" / "step_3"
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(trainer.model, trainer.tokenizer, out)
    assert_one_line(info.value, out, "No space left on device")
    assert _left(tmp_path / "checkpoints") == []


def test_a_bug_is_not_dressed_as_a_disk_error(tmp_path, trainer, monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("not a disk problem")

    monkeypatch.setattr(type(trainer.tokenizer), "save_pretrained", bug)
    with pytest.raises(KeyError):
        save_checkpoint(trainer.model, trainer.tokenizer, tmp_path / "checkpoints" / "step_3")
    assert _left(tmp_path / "checkpoints") == []  # cleaned up all the same

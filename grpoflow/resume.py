"""A step's commit point, and picking a killed run up from its last complete step. No Prefect in here.

A training step is complete once `checkpoints/step_<N>/` exists with its `step.json`: weights, AdamW state,
trainer counters and the step's record are published by one atomic rename (`grpoflow.train.save_checkpoint`).
Only then are the step's rows appended to metrics.jsonl / timings.jsonl, and only after that are older
checkpoints pruned, so the last complete step's checkpoint always exists whatever moment a crash hits.

Resuming therefore means: find the newest checkpoint with a step.json, make the logs agree with it (append its
rows if the crash came between the rename and the append, drop rows and torn lines of later steps), remove temp
dirs of interrupted writes, restore the trainer, and go on at the next step. Trials of that next step that had
finished are in its journal (`grpoflow.collect`) and are not run again.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpoflow.config import RunConfig, parse_run_config, read_config_file
from grpoflow.errors import RunDirError
from grpoflow.fileio import append_jsonl, write_text_atomic
from grpoflow.reporting import MetricsLog, split_record, timings_path
from grpoflow.rundir import RunPaths
from grpoflow.train import STEP_FILE, TrainerState, prune_checkpoints, save_checkpoint


def commit_step(
    trainer: TrainerState, paths: RunPaths, step: int, record: dict[str, Any], log: MetricsLog, keep_interval: int
) -> Path:
    """Checkpoint (atomic, with optimizer, counters and step.json) -> metrics/timings rows -> prune older ones."""
    metrics, timings = split_record(record)
    ckpt = save_checkpoint(
        trainer.model, trainer.tokenizer, paths.checkpoint(step), optimizer=trainer.optimizer,
        counters={"step": step, "optimizer_steps": trainer.optimizer_steps},
        step_record={"step": step, "metrics": metrics, "timings": timings},
    )  # fmt: skip
    log.log(step, record)
    prune_checkpoints(ckpt.parent, keep_interval, latest=step)
    return ckpt


LOCK_FILE = "run.lock"


@contextmanager
def run_lock(root: Path) -> Iterator[None]:
    """Hold the run dir for one process while it trains: a resume started while the run is still alive would
    repair files under its feet. The kernel drops the lock when the holder dies, however it dies."""
    path = Path(root) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(f"{path}: another process is running this run; resume it after that process "
                              "has ended") from None  # fmt: skip
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # for a person wondering who holds it
        yield
    finally:
        os.close(fd)


def load_saved_config(root: Path) -> RunConfig:
    """The run's own config.json, validated; one line naming the file when it is missing or bad."""
    path = Path(root) / "config.json"
    if not Path(root).is_dir():
        raise RunDirError(f"run dir {root} does not exist")
    return parse_run_config(read_config_file(path), source=str(path))


def complete_steps(paths: RunPaths) -> list[int]:
    """Steps whose checkpoint dir holds a step.json (a published commit point), ascending."""
    root = paths.root / "checkpoints"
    steps = []
    for p in root.iterdir() if root.is_dir() else []:
        if p.name.startswith("step_") and p.name[5:].isdigit() and (p / STEP_FILE).is_file():
            steps.append(int(p.name[5:]))
    return sorted(steps)


@dataclass
class ResumePoint:
    last_step: int | None  # last complete step; None: no step completed
    checkpoint: Path | None  # its checkpoint dir
    record: dict[str, Any] | None  # its step.json: {"step", "metrics", "timings"}
    repairs: list[str] = field(default_factory=list)  # what was fixed on disk, one line each

    @property
    def next_step(self) -> int:
        return 0 if self.last_step is None else self.last_step + 1


def find_resume_point(paths: RunPaths) -> ResumePoint:
    """The last complete step of a run dir (nothing is changed on disk)."""
    for name in ("config.json", "run.json", "prompts.jsonl"):
        if not (paths.root / name).is_file():
            raise RunDirError(f"{paths.root / name} is missing: the run never finished preparing; start a new run")
    flow = json.loads(paths.run_info.read_text(encoding="utf-8")).get("flow", "train")
    if flow != "train":
        raise RunDirError(
            f"{paths.run_info}: run {paths.root.name} was made by the `{flow}` flow; only train runs resume"
        )
    steps = complete_steps(paths)
    if not steps:
        return ResumePoint(None, None, None)
    ckpt = paths.checkpoint(steps[-1])
    try:
        record = json.loads((ckpt / STEP_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:  # cannot happen short of disk corruption: it was renamed whole
        raise RunDirError(f"{ckpt / STEP_FILE}: unreadable ({err})") from None
    return ResumePoint(steps[-1], ckpt, record)


def repair_run_dir(paths: RunPaths, point: ResumePoint) -> list[str]:
    """Make the run dir agree with `point`: logs end at its step, no temp dirs of interrupted writes remain.
    Returns what was done, one line each (also kept in `point.repairs`)."""
    notes: list[str] = []
    last = -1 if point.last_step is None else point.last_step
    metrics, timings = split_record(point.record["metrics"] | point.record["timings"]) if point.record else ({}, {})
    for path, row in ((paths.metrics, metrics), (timings_path(paths.metrics), timings)):
        notes += _repair_log(path, last, row if point.record else None)
    ckpts = paths.root / "checkpoints"
    for p in sorted(ckpts.iterdir()) if ckpts.is_dir() else []:
        step = int(p.name[5:]) if p.name.startswith("step_") and p.name[5:].isdigit() else None
        if p.name.startswith(".step_") and (".tmp-" in p.name or ".old-" in p.name):
            shutil.rmtree(p)
            notes.append(f"removed {p.name}, left by an interrupted checkpoint write")
        elif step is not None and step > last:  # not a commit point (no step.json): never part of the run
            shutil.rmtree(p)
            notes.append(f"removed checkpoints/{p.name}: step {step} never completed")
    for tmp in [*paths.root.glob(".*.tmp"), *paths.root.glob("details/*/.*.tmp")]:
        tmp.unlink()
        notes.append(f"removed {tmp.relative_to(paths.root)}, left by an interrupted write")
    for d in sorted((paths.root / "details").glob("step_*")):
        # The resumed step's journal is kept (its finished trials are reused); samples.jsonl of steps that
        # never completed is rewritten when the step completes.
        n = d.name[5:]
        if n.isdigit() and int(n) > last and (d / "samples.jsonl").exists():
            (d / "samples.jsonl").unlink()
            notes.append(f"removed details/{d.name}/samples.jsonl: step {n} never completed")
    point.repairs += notes
    return notes


def _repair_log(path: Path, last: int, last_row: dict[str, Any] | None) -> list[str]:
    """Keep the lines of steps <= last (bytes untouched), drop later and torn ones, append the last step's row if
    it is missing."""
    if not path.exists() and last_row is None:
        return []
    data = path.read_bytes() if path.exists() else b""
    kept: list[bytes] = []
    notes: list[str] = []
    steps: list[int] = []
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:  # a torn last line (no newline after it): a crash mid-append
                notes.append(f"{path.name}: dropped a torn last line")
                continue
            raise RunDirError(f"{path}:{i + 1}: not a valid record") from None
        if step > last:
            notes.append(f"{path.name}: dropped the row of step {step} (that step never completed)")
            continue
        kept.append(line + b"\n")
        steps.append(step)
    if notes:
        write_text_atomic(path, b"".join(kept).decode("utf-8"))
    if last_row is not None and last not in steps:
        append_jsonl(path, {"step": last, **last_row})
        notes.append(f"{path.name}: appended the row of step {last} from its checkpoint's step.json")
    return notes

"""A step's commit, and picking a killed run up from its last full checkpoint. No Prefect in here.

Every step writes `checkpoints/step_<N>/` (the weights the engine loads next, and `step.json`, the step's record)
by one atomic rename; the engine syncs from it. After every `train.save_interval` steps and after the last, the
dir is made a *full* checkpoint in a background thread (`StepCommits`): the AdamW state and the trainer counters
join it and everything is fsynced. Other steps skip both (the optimizer state is twice the size of the weights),
so most steps' commit costs one unsynced write of the weights. A step's metrics.jsonl / timings.jsonl rows follow
its dir (a full one's once it is complete), then older checkpoints that are not full are pruned.

A full checkpoint is a resume point. Resuming means: find the newest full checkpoint, make the logs agree with it
(append its rows if the crash came before they were appended, drop rows and torn lines of later steps), remove
temp dirs and later checkpoints, restore the trainer, and go on at the next step. The steps after it are done
again, but their trials are not: every finished trial is in its step's journal (`grpoflow.collect`), so a redone
step only trains again (bit-exact on CPU); what a crash costs is the training of at most `save_interval - 1`
steps, plus the trials of the interrupted step that had not finished.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpoflow.config import RunConfig, parse_run_config, read_config_file
from grpoflow.errors import RunDirError
from grpoflow.fileio import append_jsonl, write_text_atomic
from grpoflow.reporting import MetricsLog, split_record, timings_path
from grpoflow.rundir import RunPaths
from grpoflow.train import (
    OPTIMIZER_FILE,
    STEP_FILE,
    TRAINER_FILE,
    TrainerState,
    fsync_files,
    fsync_path,
    prune_checkpoints,
    save_checkpoint,
    step_of,
)


def is_full_checkpoint(step: int, steps: int, save_interval: int) -> bool:
    """Whether step `step` (from 0) of a `steps`-step run writes a full checkpoint (a resume point): after every
    `save_interval` steps, and after the last."""
    return (step + 1) % save_interval == 0 or step == steps - 1


def save_step(trainer: TrainerState, paths: RunPaths, step: int, record: dict[str, Any]) -> Path:
    """`checkpoints/step_<step>/`, atomically: the weights the engine loads next and step.json (not fsynced:
    nothing resumes from it unless `StepCommits` makes it a full checkpoint)."""
    metrics, timings = split_record(record)
    record = {"step": step, "metrics": metrics, "timings": timings}
    return save_checkpoint(trainer.model, trainer.tokenizer, paths.checkpoint(step), step_record=record, durable=False)


class StepCommits:
    """The end of each step's commit, after `save_step` and the engine's weight sync.

    A step that writes no full checkpoint logs its metrics/timings rows at once (`log_step`). A full one is
    completed in a background thread while the run goes on: a snapshot of the AdamW state and the counters are
    written into its dir, every file is fsynced, and the optimizer file's rename makes the dir a resume point
    (`complete_steps`). Its rows are logged only then, by `flush`, which every later save and the end of the run
    call: rows never run ahead of what a resume would keep. `flush` raises what the thread raised."""

    def __init__(self, paths: RunPaths, log: MetricsLog) -> None:
        self.paths, self.log = paths, log
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: tuple[int, dict[str, Any]] | None = None

    def finish(self, trainer: TrainerState, ckpt: Path, step: int, record: dict[str, Any], full: bool) -> None:
        self.flush()
        if not full:
            log_step(self.paths, step, record, self.log)
            return
        t0 = time.perf_counter()
        state = _cpu_copy(trainer.optimizer.state_dict())  # the next step updates the live tensors in place
        counters = {"step": step, "optimizer_steps": trainer.optimizer_steps}
        record["time/commit_s"] = record.get("time/commit_s", 0.0) + time.perf_counter() - t0  # the caller's too
        self._pending = (step, record)
        self._thread = threading.Thread(target=self._complete, args=(Path(ckpt), state, counters),
                                        name=f"full-checkpoint-{step}", daemon=True)  # fmt: skip
        self._thread.start()

    def _complete(self, ckpt: Path, state: dict[str, Any], counters: dict[str, Any]) -> None:
        try:
            tmp = ckpt / f".{OPTIMIZER_FILE}.tmp"
            torch.save(state, tmp)
            (ckpt / TRAINER_FILE).write_text(json.dumps(counters, indent=2) + "\n", encoding="utf-8")
            fsync_files(ckpt)  # the publishing rename is only as durable as the bytes it points at
            tmp.rename(ckpt / OPTIMIZER_FILE)
            fsync_path(ckpt)
            fsync_path(ckpt.parent)  # the step dir's own entry (its rename into checkpoints/ was not synced)
        except BaseException as err:  # raised again in the run's thread by flush()
            self._error = err

    def flush(self) -> None:
        """Wait for a full checkpoint being completed, then log its step's rows."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        pending, self._pending = self._pending, None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if pending is not None:
            log_step(self.paths, *pending, self.log)


def _cpu_copy(state: Any) -> Any:
    """A copy of an optimizer state dict with every tensor in CPU memory (no second copy on the GPU)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _cpu_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cpu_copy(v) for v in state)
    return copy.deepcopy(state)


def log_step(paths: RunPaths, step: int, record: dict[str, Any], log: MetricsLog) -> None:
    """The step's metrics/timings rows, then pruning of older checkpoints that are not full."""
    log.log(step, record)
    prune_checkpoints(paths.checkpoint(step).parent, latest=step)


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
    """The run's own config.json, validated; one line naming the file when it is missing or bad.

    config.json holds every field the run had. One without `train.eval_samples_per_prompt` was made before runs
    evaluated themselves: it keeps running without evaluations, so a resume or rerun does what the run did."""
    path = Path(root) / "config.json"
    if not Path(root).is_dir():
        raise RunDirError(f"run dir {root} does not exist")
    data = read_config_file(path)
    train = data.get("train")
    if isinstance(train, dict) and "eval_samples_per_prompt" not in train:
        data = {**data, "train": {**train, "eval_samples_per_prompt": 0}}
    return parse_run_config(data, source=str(path))


def complete_steps(paths: RunPaths) -> list[int]:
    """Steps with a full checkpoint (step.json and the optimizer state: a resume point), ascending."""
    root = paths.root / "checkpoints"
    steps = []
    for p in root.iterdir() if root.is_dir() else []:
        n = step_of(p)
        if n is not None and (p / STEP_FILE).is_file() and (p / OPTIMIZER_FILE).is_file():
            steps.append(n)
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


def repair_run_dir(paths: RunPaths, point: ResumePoint, steps: int | None = None) -> list[str]:
    """Make the run dir agree with `point`: logs end at its step, no temp dirs of interrupted writes remain.
    When `point` is the last of the run's `steps` steps, the row after it (the final evaluation) is kept.
    Returns what was done, one line each (also kept in `point.repairs`)."""
    notes: list[str] = []
    last = -1 if point.last_step is None else point.last_step
    keep = last + 1 if steps is not None and last == steps - 1 else last
    metrics, timings = split_record(point.record["metrics"] | point.record["timings"]) if point.record else ({}, {})
    for path, row in ((paths.metrics, metrics), (timings_path(paths.metrics), timings)):
        notes += _repair_log(path, last, row if point.record else None, keep)
    ckpts = paths.root / "checkpoints"
    for p in sorted(ckpts.iterdir()) if ckpts.is_dir() else []:
        step = step_of(p)
        if p.name.startswith(".step_") and (".tmp-" in p.name or ".old-" in p.name):
            shutil.rmtree(p)
            notes.append(f"removed {p.name}, left by an interrupted checkpoint write")
        elif step is not None and step > last:  # after the resume point: the step is done again
            shutil.rmtree(p)
            notes.append(f"removed checkpoints/{p.name}: step {step} is done again from {_point_name(point)}")
    for tmp in [*paths.root.glob(".*.tmp"), *paths.root.glob("details/*/.*.tmp")]:
        tmp.unlink()
        notes.append(f"removed {tmp.relative_to(paths.root)}, left by an interrupted write")
    for d in sorted((paths.root / "details").glob("step_*")):
        # Journals are kept (their finished trials are reused, evaluations' too); samples.jsonl of a step done
        # again is rewritten when the step completes.
        n = step_of(d)
        if n is not None and n > last and (d / "samples.jsonl").exists():
            (d / "samples.jsonl").unlink()
            notes.append(f"removed details/{d.name}/samples.jsonl: step {n} is done again from {_point_name(point)}")
    point.repairs += notes
    return notes


def _point_name(point: ResumePoint) -> str:
    return f"the full checkpoint of step {point.last_step}" if point.checkpoint else "the start"


def _repair_log(path: Path, last: int, last_row: dict[str, Any] | None, keep: int) -> list[str]:
    """Keep the lines of steps <= keep (bytes untouched), drop later and torn ones, append the row of step `last`
    if it is missing."""
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
        if step > keep:
            notes.append(f"{path.name}: dropped the row of step {step} (that step is done again)")
            continue
        kept.append(line + b"\n")
        steps.append(step)
    if notes:
        write_text_atomic(path, b"".join(kept).decode("utf-8"))
    if last_row is not None and last not in steps:
        append_jsonl(path, {"step": last, **last_row})
        notes.append(f"{path.name}: appended the row of step {last} from its checkpoint's step.json")
    return notes

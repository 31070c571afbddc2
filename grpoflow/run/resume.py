"""Picking a killed run up from its last full checkpoint (`grpoflow.run.commit` makes them).

A full checkpoint is a resume point. Resuming means: find the newest full checkpoint, make the logs agree with it
(append its rows if the crash came before they were appended, drop rows and torn lines of later steps), remove
temp dirs and later checkpoints, restore the trainer, and go on at the next step. The steps after it are done
again, but their trials are not: every finished trial is in its step's journal (`grpoflow.rollout.step`), so a redone
step only trains again (bit-exact on CPU); what a crash costs is the training of at most `train.checkpoint.interval - 1`
steps, plus the trials of the interrupted step that had not finished.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

from grpoflow.config import RunConfig, parse_run_config, read_config_file
from grpoflow.errors import GrpoflowError, RunDirError
from grpoflow.fileio import append_jsonl, is_temp_sibling, write_text_atomic
from grpoflow.paths import RunPaths, step_of
from grpoflow.rollout.journal import read_journal
from grpoflow.run.info import Resume, RunInfo, read_run_info, update_run_info
from grpoflow.run.loop import evaluation_versions
from grpoflow.run.metrics import has_row, timings_path
from grpoflow.train.checkpoint import STEP_FILE, holds_optimizer, restore_training_state
from grpoflow.train.trainer import TrainerState, load_trainer


@contextmanager
def run_lock(root: Path) -> Iterator[None]:
    """Hold the run dir for one process while it trains: a resume started while the run is still alive would
    repair files under its feet. The kernel drops the lock when the holder dies, however it dies."""
    path = RunPaths(Path(root)).lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(
                f"{path}: another process is running this run; resume it after that process has ended"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # for a person wondering who holds it
        yield
    finally:
        os.close(fd)


def load_saved_config(root: Path) -> RunConfig:
    """The run's own config.json, validated, saying what the run did whichever version wrote it (`upgrade`); one
    line naming the file when it is missing or bad."""
    path = RunPaths(Path(root)).config
    if not Path(root).is_dir():
        raise RunDirError(f"run dir {root} does not exist")
    return parse_run_config(read_config_file(path, saved=True), source=str(path))


def complete_steps(paths: RunPaths) -> list[int]:
    """Steps with a full checkpoint (step.json and the optimizer state: a resume point), ascending."""
    root = paths.checkpoints
    steps = []
    for p in root.iterdir() if root.is_dir() else []:
        n = step_of(p)
        if n is not None and (p / STEP_FILE).is_file() and holds_optimizer(p):
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
    for path in (paths.config, paths.run_info, paths.prompts):
        if not path.is_file():
            raise RunDirError(f"{path} is missing: the run never finished preparing; start a new run")
    info = read_run_info(paths)
    if not info.trains:
        raise RunDirError(
            f"{paths.run_info}: run {paths.root.name} was made by the `{info.flow}` flow; only train runs resume"
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
    metrics, timings = (point.record["metrics"], point.record["timings"]) if point.record else ({}, {})
    for path, row in ((paths.metrics, metrics), (timings_path(paths.metrics), timings)):
        notes += _repair_log(path, last, row if point.record else None, keep)
    ckpts = paths.checkpoints
    for p in sorted(ckpts.iterdir()) if ckpts.is_dir() else []:
        step = step_of(p)
        if is_temp_sibling(p):
            shutil.rmtree(p)
            notes.append(f"removed {p.name}, left by an interrupted checkpoint write")
        elif step is not None and step > last:  # after the resume point: the step is done again
            shutil.rmtree(p)
            notes.append(f"removed checkpoints/{p.name}: step {step} is done again from {_point_name(point)}")
    for tmp in [*paths.root.glob(".*.tmp"), *paths.all_details.glob("*/.*.tmp")]:
        tmp.unlink()
        notes.append(f"removed {tmp.relative_to(paths.root)}, left by an interrupted write")
    for d in sorted(paths.all_details.glob("step_*")):
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


@dataclass(frozen=True)
class ResumePlan:
    """What resuming a run does, decided from its run dir once the dir agrees with its resume point."""

    # `complete`: every step and the report are done; `report`: every step is recorded but the run never ended
    # (killed in its report): only the report is written; `continue`: training goes on at `point.next_step`.
    action: Literal["complete", "report", "continue"]
    point: ResumePoint
    steps: int  # the run's `train.steps`
    info: RunInfo

    @property
    def done(self) -> dict[str, Any]:
        """The last complete step's metrics and timings (empty when none completed)."""
        record = self.point.record
        return {**record["metrics"], **record["timings"]} if record else {}

    def describe(self, paths: RunPaths) -> str:
        """One line saying what resuming does."""
        run_id, point, final = paths.root.name, self.point, self.steps
        if self.action == "complete":
            return f"run {run_id} is already complete ({final} of {final} steps): nothing to resume"
        if self.action == "report":
            return f"run {run_id} has all {final} steps but never ended: writing its report"
        reused = len(read_journal(paths.details(point.next_step)))
        at = f"step {point.next_step + 1}/{final}" if point.next_step < final else "its final evaluation"
        return (
            f"resuming run {run_id} at {at} ("
            + (f"checkpoint {point.checkpoint.name}" if point.checkpoint else "no step had completed")
            + (f"; {reused} finished trials of that step are kept" if reused else "")
            + ")"
        )


def plan_resume(cfg: RunConfig, paths: RunPaths, point: ResumePoint) -> ResumePlan:
    """What resuming the run at `point` does: the final step's evaluation (when it has one) is part of the steps."""
    final = cfg.train.steps
    steps_done = point.next_step >= final and (
        final not in evaluation_versions(cfg.train) or has_row(paths.metrics, final)
    )
    info = read_run_info(paths)
    action = ("complete" if info.ended is not None else "report") if steps_done else "continue"
    return ResumePlan(action, point, final, info)


def record_resume(
    paths: RunPaths, plan: ResumePlan, flow_run_id: str | None, *, after: str | None = None, stopped_at: float
) -> None:
    """Add this resume to run.json's `resumes`: when, from which step, `after` what (how the attempt before it
    ended), and how long the run stood still since `stopped_at` (`last_write` before the resume touched it)."""
    now = datetime.now(timezone.utc)
    resume = Resume(
        at=now.isoformat(timespec="seconds"),
        from_step=plan.point.next_step,
        flow_run_id=flow_run_id,
        after=after,
        idle_s=round(max(now.timestamp() - stopped_at, 0.0), 1),
    )
    update_run_info(paths, resumes=[*plan.info.resumes, resume])


RESUME_WINDOW = timedelta(hours=24)  # how far back `max_resumes` counts: one night and the day after


def check_resume_budget(info: RunInfo, max_resumes: int, now: datetime) -> None:
    """Refuse a resume that would be the run's `max_resumes`+1-th within `RESUME_WINDOW` of `now`: a run that
    crashes at every start is left for a person instead of restarted all night."""
    recent = [r for r in info.resumes if now - datetime.fromisoformat(r.at) < RESUME_WINDOW]
    if len(recent) >= max_resumes:
        raise GrpoflowError(
            f"run {info.run_id} was resumed {len(recent)} times in the last 24 h (max_resumes {max_resumes}), the "
            f"last after {recent[-1].after or 'an unknown end'}: not again; resume it by hand once its cause is fixed"
        )


def last_write(root: Path) -> float:
    """When anything under the run dir was last written (epoch seconds): where an interrupted run stopped. A file
    gone between listing and stat (a run still alive, refused by `run_lock` later) is passed over."""
    latest = root.lstat().st_mtime
    for path in root.rglob("*"):
        try:
            latest = max(latest, path.lstat().st_mtime)
        except FileNotFoundError:
            continue
    return latest


def reopen_trainer(cfg: RunConfig, model_path: Path | str, point: ResumePoint) -> TrainerState:
    """The trainer of the run, restored to its resume point's checkpoint (fresh when no step completed)."""
    trainer = load_trainer(model_path, cfg.train, seed=cfg.seed, sharded=cfg.sharding_mode() == "fsdp")
    if point.checkpoint is not None:
        restore_training_state(trainer, point.checkpoint)
    return trainer

"""The `runs/<run_id>/` layout: every path of a run dir, and its creation (never over an existing run)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from grpoflow.errors import RunDirError


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:  # the resolved RunConfig, reloadable by parse_run_config
        return self.root / "config.json"

    @property
    def run_info(self) -> Path:  # provenance: model, dataset, code commit, package versions
        return self.root / "run.json"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def timings(self) -> Path:  # wall-clock figures per step (keys ending in `_s`), apart from metrics.jsonl
        return self.root / "timings.jsonl"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    def trials(self, step: int) -> Path:
        return self.root / "trials" / f"step_{step}"

    def details(self, step: int) -> Path:
        return self.root / "details" / f"step_{step}"

    def eval_trials(self, version: int) -> Path:  # the evaluation of the weights after `version` updates
        return self.root / "trials" / f"eval_{version}"

    def eval_details(self, version: int) -> Path:
        return self.root / "details" / f"eval_{version}"

    def checkpoint(self, step: int) -> Path:
        return self.root / "checkpoints" / f"step_{step}"


def temp_sibling(path: Path, kind: str) -> Path:
    """`.<name>.<kind>-<pid>` beside `path`: where a dir is written (`tmp`) or set aside (`old`) around the rename
    that publishes it."""
    return path.parent / f".{path.name}.{kind}-{os.getpid()}"


def is_temp_sibling(path: Path) -> bool:
    """A `temp_sibling` left by an interrupted write."""
    return re.fullmatch(r"\..+\.(tmp|old)-\d+", path.name) is not None


def step_of(path: Path) -> int | None:
    """N of a `step_<N>` dir (checkpoint, trials or details), else None."""
    name = path.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def run_dir_problems(output_dir: str | Path, run_id: str) -> list[str]:
    """Why `output_dir/run_id` cannot be created, one line each (empty: it can), without creating anything."""
    root = Path(output_dir) / run_id
    if root.exists() or root.is_symlink():
        return [f"run dir {root} already exists: choose another run_id (runs are never overwritten)"]
    problem = output_dir_problem(output_dir)
    return [problem] if problem else []


def output_dir_problem(output_dir: str | Path) -> str | None:
    """Whether run dirs can be made in `output_dir`: its nearest existing ancestor (itself, once it exists) must be
    a writable dir."""
    out = Path(output_dir)
    here = out.absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        return f"output dir {out}: {here} is a file, not a directory"
    if not os.access(here, os.W_OK | os.X_OK):  # also false for root on a read-only filesystem
        return f"output dir {out}: {here} is not writable"
    return None


def create_run_dir(output_dir: str | Path, run_id: str) -> RunPaths:
    """Create `output_dir/run_id`; refuse (one line) if it already exists, so no run is ever overwritten."""
    root = Path(output_dir) / run_id
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(
            output_dir_problem(output_dir) or f"cannot create output dir {root.parent}: {err.strerror}"
        ) from None
    try:
        root.mkdir()
    except FileExistsError:
        raise RunDirError(
            f"run dir {root} already exists: choose another run_id (runs are never overwritten)"
        ) from None
    except OSError as err:
        raise RunDirError(f"cannot create run dir {root}: {err.strerror}") from None
    return RunPaths(root)

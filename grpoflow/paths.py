"""The `runs/<run_id>/` layout: every path of a run dir, and its creation (never over an existing run)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from grpoflow.errors import RunDirError

RUN_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"


def new_run_id(now: datetime | None = None) -> str:
    """A readable, sortable id: UTC timestamp plus 6 hex chars, e.g. `20261129-093012-a1b2c3`.

    Lowercase letters, digits and dashes only, so it is also a legal Prefect artifact key.
    """
    now = now or datetime.now(timezone.utc)
    salt = hashlib.sha256(f"{now.isoformat()}-{os.getpid()}-{os.urandom(8).hex()}".encode()).hexdigest()[:6]
    return f"{now:%Y%m%d-%H%M%S}-{salt}"


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
    def engine_log(self) -> Path:  # the engine the run started (`engine-<i>.log` per replica)
        return self.root / "engine.log"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    @property
    def lock(self) -> Path:  # held by the process running the run (`grpoflow.run.resume.run_lock`)
        return self.root / "run.lock"

    @property
    def sync(self) -> Path:  # what an adapter weight sync writes for the engine to load
        return self.root / "sync"

    @property
    def tasks(self) -> Path:  # the run's own counts per task (`grpoflow.run.health`)
        return self.root / "tasks.json"

    @property
    def gate(self) -> Path:  # the dataset gate's verdict per task dir (`grpoflow.scoring.gate`)
        return self.root / "gate.json"

    @property
    def regrades(self) -> Path:  # one line per regraded trial (`grpoflow.run.regrade`)
        return self.root / "regrades.jsonl"

    @property
    def rerun(self) -> Path:  # a rerun's comparison with the run it reran
        return self.root / "rerun.json"

    @property
    def viewer(self) -> Path:  # best and worst trial of every group, offline
        return self.root / "viewer.html"

    @property
    def summary_plot(self) -> Path:
        return self.root / "summary.png"

    @property
    def all_trials(self) -> Path:  # Harbor's trial dirs, one dir per step and per evaluation
        return self.root / "trials"

    @property
    def all_details(self) -> Path:  # our samples and journals, one dir per step and per evaluation
        return self.root / "details"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def trials(self, step: int) -> Path:
        return self.all_trials / f"step_{step}"

    def details(self, step: int) -> Path:
        return self.all_details / f"step_{step}"

    def eval_trials(self, version: int) -> Path:  # the evaluation of the weights after `version` updates
        return self.all_trials / f"eval_{version}"

    def eval_details(self, version: int) -> Path:
        return self.all_details / f"eval_{version}"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"


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


def default_cache_dir() -> Path:
    """Where prepared models, gate verdicts, CLIs and task images are cached: $GRPOFLOW_CACHE or ~/.cache/grpoflow."""
    return Path(os.environ.get("GRPOFLOW_CACHE", Path.home() / ".cache" / "grpoflow"))

"""The `runs/<run_id>/` layout, its creation (never over an existing run), and the run's provenance record."""

from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from grpoflow.errors import RunDirError

_TRACKED_PACKAGES = ("grpoflow", "torch", "transformers", "tokenizers", "safetensors", "harbor", "prefect", "gguf")


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


def step_of(path: Path) -> int | None:
    """N of a `step_<N>` dir (checkpoint, trials or details), else None."""
    name = path.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def create_run_dir(output_dir: str | Path, run_id: str) -> RunPaths:
    """Create `output_dir/run_id`; refuse (one line) if it already exists, so no run is ever overwritten."""
    root = Path(output_dir) / run_id
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir()
    except FileExistsError:
        raise RunDirError(f"run dir {root} already exists: choose another run_id (runs are never overwritten)") from None
    except OSError as err:
        raise RunDirError(f"cannot create run dir {root}: {err.strerror}") from None
    return RunPaths(root)


def code_commit() -> str | None:
    """The git commit of the grpoflow checkout (with `-dirty` when it has local changes), if it is one."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment_info() -> dict:
    versions = {}
    for name in _TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "code_commit": code_commit(),
        "packages": versions,
    }

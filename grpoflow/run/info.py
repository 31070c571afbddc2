"""run.json: what a run was made from (code, packages, model, tasks) and what happened to it since (the flow that
made it, resumes, the run it reruns).

Read back as a typed `RunInfo`: a misspelt field fails where it is written, and a damaged file fails with one line
naming it, instead of turning into a default where it is read.
"""

from __future__ import annotations

import platform
import subprocess
import threading
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpoflow.engine.restart import Restart
from grpoflow.errors import RunDirError
from grpoflow.fileio import write_json_atomic
from grpoflow.numerics import cpu_arithmetic
from grpoflow.paths import RunPaths
from grpoflow.prepare.dataset import Dataset
from grpoflow.prepare.model import PreparedModel
from grpoflow.prepare.prompts import PromptRecord, family_of, side_of, split_kind
from grpoflow.prepare.split import SIDES

_TRACKED_PACKAGES = ("grpoflow", "torch", "transformers", "tokenizers", "safetensors", "harbor", "prefect", "gguf")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetInfo(_Record):
    path: str
    sha256: str  # over every file of the task dirs
    tasks: list[str]
    # FROM reference -> "image id" its Dockerfile-built tasks started from (`dataset.base_images` applied)
    base_images: dict[str, str] = Field(default_factory=dict)


class Provenance(_Record):
    """The world a run was made in; a rerun compares it with the world now (`differences`)."""

    created_at: str
    python: str
    platform: str
    # The CPU and MKL mode the run's updates ran on (`numerics.cpu_arithmetic`); None in runs made before it was
    # recorded.
    cpu: str | None = None
    code_commit: str | None  # `-dirty` when the checkout had local changes
    packages: dict[str, str | None]
    model: PreparedModel
    dataset: DatasetInfo

    @classmethod
    def now(cls, model: PreparedModel, dataset: Dataset) -> Provenance:
        return cls(
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            python=platform.python_version(),
            platform=platform.platform(),
            cpu=cpu_arithmetic(),
            code_commit=code_commit(),
            packages={name: _version(name) for name in _TRACKED_PACKAGES},
            model=model,
            dataset=DatasetInfo(
                path=str(dataset.root),
                sha256=dataset.sha256,
                tasks=[t.name for t in dataset.tasks],
                base_images=dataset.base_images(),
            ),
        )

    def differences(self, now: Provenance) -> list[str]:
        """One line per difference: code commit, Python, CPU arithmetic, package versions, dataset and model weights
        sha256."""
        pairs = [
            ("code commit", self.code_commit, now.code_commit),
            ("python", self.python, now.python),
        ]
        if self.cpu is not None:  # older run.json files have none
            pairs.append(("cpu arithmetic", self.cpu, now.cpu))
        for name in sorted(set(self.packages) | set(now.packages)):
            pairs.append((f"package {name}", self.packages.get(name), now.packages.get(name)))
        pairs.append(("dataset sha256", self.dataset.sha256, now.dataset.sha256))
        for ref in sorted(set(self.dataset.base_images) | set(now.dataset.base_images)):
            pairs.append((f"base image {ref}", self.dataset.base_images.get(ref), now.dataset.base_images.get(ref)))
        pairs.append(("model weights sha256", self.model.weights_sha256, now.model.weights_sha256))
        return [f"{label}: {a} -> {b}" for label, a, b in pairs if a != b]


class SplitInfo(_Record):
    """The run's train/eval split, as prompts.jsonl holds it: by `task`, `family` or `category`, each side's tasks
    (`trained`, `heldout`, and with a split by family `unseen`), and each family's side (`trained`: some of its
    instances train, `unseen`: none does). Made from the prompts, so a prompts file's split is recorded too."""

    by: Literal["task", "family", "category"]
    tasks: dict[str, list[str]]
    families: dict[str, Literal["trained", "unseen"]] = {}

    @classmethod
    def of_prompts(cls, prompts: list[PromptRecord]) -> SplitInfo:
        tasks: dict[str, list[str]] = {}
        families: dict[str, Literal["trained", "unseen"]] = {}
        for p in prompts:
            side = side_of(p)
            tasks.setdefault(side, []).append(p.instance_id)
            if (family := family_of(p)) is not None:
                # `trained` wins: a family is unseen only when none of its instances trains.
                if families.get(family) != "trained":
                    families[family] = "unseen" if side == "unseen" else "trained"
        tasks = {side: tasks[side] for side in SIDES if side in tasks}  # in that order, whichever prompt came first
        return cls(by=split_kind(prompts), tasks=tasks, families=dict(sorted(families.items())))


class Resume(_Record):
    at: str
    from_step: int
    flow_run_id: str | None = None
    # How the attempt before it ended, as Prefect last recorded its flow run ("Crashed: ..."; a flow killed with
    # SIGKILL stays "Running"); None when no Prefect server knows that flow run.
    after: str | None = None
    idle_s: float | None = None  # seconds from the run's last write to this resume: what the stop cost in time


class Survived(_Record):
    """What a finished run came through (`grpoflow.run.survived`): written with its report."""

    resumes: int = 0
    idle_s: float = 0.0  # over all resumes
    breaker_openings: int = 0  # times the sandbox breaker held the starts of trials back
    breaker_open_s: float = 0.0
    sandbox_retries: int = 0  # trials run again after their sandbox failed
    engine_restarts: int = 0  # engines that exited and were brought back in place
    engine_restart_s: float = 0.0  # from each exit to the engine generating again


class Parent(_Record):
    """The run a run started from: its policy is a checkpoint of that run."""

    run_id: str
    checkpoint: str  # the checkpoint dir, as the model source named it


class DeploymentRef(_Record):
    """The Prefect deployment a run was started from (nightly-train, manual-train, ...)."""

    id: str
    name: str


class RunInfo(Provenance):
    run_id: str
    flow_run_id: str | None = None
    # A resumed run announces its end as from this deployment too, so what follows a nightly run (its evaluation,
    # a trigger on the deployment) follows a crashed one that `resume` finished.
    deployment: DeploymentRef | None = None
    # When the train run (or the resume that finished it) ended, its report written: a resume that finds every
    # step done and no end finishes the report and announces the end.
    ended: str | None = None
    flow: Literal["train", "evaluate"] | None = None  # None: prepared only
    resumes: list[Resume] = []
    engine_restarts: list[Restart] = []  # exits of the engines the run started, and what became of them
    survived: Survived | None = None  # None until the run's report is written
    rerun_of: str | None = None
    parent: Parent | None = None  # lineage: the run whose checkpoint this run's model is
    split: SplitInfo | None = None  # None in runs made before the split was recorded
    # Which GPUs the trainer ranks and a launched engine used (`placement.GpuPlan.to_json`); None before serving
    gpus: dict[str, Any] | None = None

    @property
    def last_flow_run_id(self) -> str | None:
        """The flow run of the run's latest attempt: its last resume's, else the one that started it."""
        return self.resumes[-1].flow_run_id if self.resumes else self.flow_run_id

    @property
    def trains(self) -> bool:
        """Made by the train flow (or by a prepare that a train run would have followed): resume and rerun take
        these only."""
        return self.flow in (None, "train")


def read_run_info(paths: RunPaths) -> RunInfo:
    """run.json; one line naming the file (and the field) when it is missing, not JSON or not a run record."""
    try:
        return RunInfo.model_validate_json(paths.run_info.read_bytes())
    except FileNotFoundError:
        raise RunDirError(f"{paths.run_info}: not found (the run never finished preparing)") from None
    except OSError as err:
        raise RunDirError(f"{paths.run_info}: unreadable: {err}") from None
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "top level"
        raise RunDirError(f"{paths.run_info}: `{where}`: {first['msg']}") from None


def parent_of(model_source: str) -> Parent | None:
    """The run whose checkpoint `model_source` is (`<run dir>/checkpoints/step_<N>`, the run dir holding a
    run.json), else None."""
    path = Path(model_source)
    run_dir = path.parent.parent
    if path.parent.name != RunPaths(run_dir).checkpoints.name or not RunPaths(run_dir).run_info.is_file():
        return None
    return Parent(run_id=run_dir.name, checkpoint=str(path))


def final_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a finished train run ends with: its last step's (`train.steps` - 1), complete (`step.json`)
    with weights (a LoRA run's merged model). One line naming the run dir when it is no run, or not finished."""
    from grpoflow.config import read_config_file

    run_dir, paths = Path(run_dir), RunPaths(Path(run_dir))
    if not paths.config.is_file():
        raise RunDirError(f"{run_dir}: no such run (no config.json)")
    try:
        steps = int(read_config_file(paths.config)["train"]["steps"])
    except (KeyError, TypeError, ValueError) as err:
        raise RunDirError(f"{paths.config}: no train.steps ({err})") from None
    last = paths.checkpoint(steps - 1)
    if steps < 1 or not (last / "step.json").is_file() or not any(last.glob("*.safetensors")):
        raise RunDirError(f"{run_dir}: not a finished train run (no complete checkpoint of its last step, {last.name})")
    return last


def write_run_info(paths: RunPaths, info: RunInfo) -> None:
    write_json_atomic(paths.run_info, info.model_dump(mode="json"))


_UPDATES = threading.Lock()  # the loop and the engine keeper's thread both update run.json


def update_run_info(paths: RunPaths, **fields: Any) -> RunInfo:
    """Add or replace fields of run.json (validated, atomically); returns the new record."""
    with _UPDATES:
        info = RunInfo.model_validate({**read_run_info(paths).model_dump(), **fields})
        write_run_info(paths, info)
    return info


def add_engine_restart(paths: RunPaths, restart: Restart) -> None:
    """`restart` appended to run.json's `engine_restarts`."""
    with _UPDATES:
        info = read_run_info(paths)
        write_run_info(paths, info.model_copy(update={"engine_restarts": [*info.engine_restarts, restart]}))


def code_commit() -> str | None:
    """The git commit of the grpoflow checkout (with `-dirty` when it has local changes), if it is one."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

"""A dataset: a directory of Harbor task directories, validated up front.

Each task dir holds `task.toml`, `instruction.md`, `tests/test.sh`, `environment/` and, optionally,
`solution/solve.sh` (Harbor 0.25's layout; Harbor does not require a solution, and many public datasets ship
none). `task.toml` is parsed with Harbor's own `TaskConfig`, and Harbor's `Task` must accept the dir too, so a
task we load is a task Harbor will run. Problems surface here, before any rollout, as a one-line message naming
the task dir: `load_task` raises it as a `DatasetError`; `load_dataset` leaves such a task out with its reason
(`Dataset.left_out`), so one malformed task among thousands does not stop a run, and fails only when no task is
left. For the local sandbox a task whose Dockerfile asks for more than that sandbox reproduces is left out the
same way (`grpoflow.dockerfile`): it would run in the wrong environment.

The built-in dataset (`load_dataset("builtin", seed=...)`) is task families generated from the run's seed into a
cache dir (`grpoflow.prepare.families`): several instances per family, so one memorised command solves no family.
The hand-written tasks it grew from, one fixed instance each, ship in `grpoflow/data/tasks`
(`load_dataset("builtin-fixed")`); the test suite uses them as its fixture tasks. Tasks that need input files keep
them in `environment/app/`; the sandbox copies that folder into `/app` before the agent starts.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from harbor.models.task.config import TaskConfig
from harbor.models.task.task import Task, strip_canary
from pydantic import ValidationError

from grpoflow.dockerfile import BaseImage, local_sandbox_problem, workdir_problem
from grpoflow.errors import DatasetError, one_line
from grpoflow.fileio import sha256_tree
from grpoflow.paths import default_cache_dir
from grpoflow.prepare.families import generate
from grpoflow.prepare.task_files import check_task_times, check_task_tree
from grpoflow.sandbox_settings import allowlist_problem

BUILTIN = "builtin"  # the generated task families
BUILTIN_FIXED = "builtin-fixed"  # the hand-written tasks of grpoflow/data/tasks
MAX_INSTRUCTION_BYTES = 64 * 1024
# Values the built-in tasks use; other datasets may use their own (Harbor does not constrain metadata).
DIFFICULTIES = ("easy", "medium", "hard")
CATEGORIES = ("file", "shell", "text")
UNKNOWN = "unknown"


@dataclass(frozen=True)
class TaskSpec:
    """One validated task directory."""

    name: str  # the task dir's name, unique within its dataset
    path: Path  # absolute path of the task dir
    instruction: str  # instruction.md as Harbor shows it to the agent (canary lines stripped)
    difficulty: str  # [metadata].difficulty, or "unknown"
    category: str  # [metadata].category, or "unknown"
    agent_timeout_sec: float | None  # [agent].timeout_sec; None means Harbor applies no limit
    verifier_timeout_sec: float  # [verifier].timeout_sec (Harbor's default 600 s when unset)
    metadata: dict[str, Any] = field(default_factory=dict)  # the whole [metadata] table
    has_solution: bool = True  # solution/solve.sh exists: the oracle can prove the task solvable
    bases: tuple[BaseImage, ...] = ()  # the FROM images its Dockerfile-built image starts from (local sandbox)


@dataclass(frozen=True)
class LeftOut:
    """A task dir of the dataset that does not train or evaluate, and why (one line naming the dir)."""

    name: str
    path: Path
    reason: str


@dataclass(frozen=True)
class Dataset:
    """Validated tasks of one dataset directory, sorted by name, a hash of all its task dirs' files, and the task
    dirs left out (malformed, or refused for the sandbox) with their reasons."""

    root: Path
    tasks: tuple[TaskSpec, ...]
    sha256: str
    left_out: tuple[LeftOut, ...] = ()

    def __len__(self) -> int:
        return len(self.tasks)

    def by_name(self, name: str) -> TaskSpec:
        for task in self.tasks:
            if task.name == name:
                return task
        raise KeyError(name)

    def base_images(self) -> dict[str, str]:
        """FROM reference -> "image id" that its Dockerfile-built tasks start from (`dataset.base_images` applied)."""
        return {b.reference: f"{b.image} {b.id}" for t in self.tasks for b in t.bases}


def builtin_dataset_path() -> Path:
    """The packaged hand-written task directories (`grpoflow/data/tasks`, the dataset `builtin-fixed`)."""
    return Path(__file__).resolve().parents[1] / "data" / "tasks"


def is_builtin(path: str | Path) -> bool:
    """`path` names a task set of grpoflow's own (`builtin`, `builtin-fixed` or the latter's directory), whose
    tasks the test suite proves."""
    if isinstance(path, str) and path in (BUILTIN, BUILTIN_FIXED):
        return True
    return Path(path).expanduser().resolve() == builtin_dataset_path()


def dataset_root(path: str | Path, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """The directory a dataset name stands for: `builtin` is `seed`'s generated families (written into
    `cache_dir`, by default grpoflow's cache, on first use), `builtin-fixed` the packaged tasks, else `path`."""
    if isinstance(path, str) and path == BUILTIN:
        return generate(seed, Path(cache_dir or default_cache_dir()))
    if isinstance(path, str) and path == BUILTIN_FIXED:
        return builtin_dataset_path()
    return Path(path)


def load_dataset(
    path: str | Path,
    *,
    local_sandbox: bool = False,
    seed: int = 0,
    cache_dir: Path | None = None,
    build_images: bool | None = None,
    base_images: dict[str, str] | None = None,
) -> Dataset:
    """Load and validate every task dir under `path` (or under `dataset_root`'s dir for `builtin`, generated from
    `seed`, and `builtin-fixed`).

    Every non-hidden subdirectory of `path` is a task dir. One that is malformed (or, with `local_sandbox`, whose
    environment the local sandbox does not reproduce, on the host's rootfs or, unless `build_images` is False, in
    the image built from its Dockerfile, its `FROM` images mapped by `base_images`) is left out with its reason (`Dataset.left_out`); when none
    is left, `DatasetError` says why in one line. A dataset-wide problem (no such dir, a task dir linked from
    outside it, two tasks of one name) raises at once.
    """
    root = dataset_root(path, seed, cache_dir).expanduser().resolve()
    if not root.is_dir():
        raise DatasetError(f"{root}: dataset directory does not exist or is not a directory")
    task_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not _is_hidden(p))
    for p in task_dirs:
        real = p.resolve()
        if not real.is_relative_to(root):
            raise DatasetError(f"{p}: a symlink to {real}, outside the dataset directory (not read)")
    if not task_dirs:
        raise DatasetError(f"{root}: dataset directory holds no task directories")
    tasks: list[TaskSpec] = []
    left_out: list[LeftOut] = []
    for d in task_dirs:
        try:
            tasks.append(load_task(d, local_sandbox=local_sandbox, build_images=build_images, base_images=base_images))
        except DatasetError as err:
            left_out.append(LeftOut(d.name, d.resolve(), str(err)))
    _check_unique_names(tasks)
    if not tasks:
        if len(left_out) == 1:  # the task's own line names the dir and the problem
            raise DatasetError(left_out[0].reason)
        raise DatasetError(
            one_line(
                f"{root}: no usable task: all {len(left_out)} task dirs left out, first {left_out[0].reason}", None
            )
        )
    return Dataset(root=root, tasks=tuple(tasks), sha256=_dataset_sha256(tasks, left_out), left_out=tuple(left_out))


def load_task(
    task_dir: Path,
    *,
    local_sandbox: bool = False,
    build_images: bool | None = None,
    base_images: dict[str, str] | None = None,
) -> TaskSpec:
    """Validate one task dir and describe it; raises `DatasetError` naming the dir and the problem. With
    `local_sandbox`, a task whose Dockerfile or workdir the local sandbox does not reproduce is refused too."""
    task_dir = Path(task_dir).resolve()
    if task_dir.is_dir() and (problem := check_task_tree(task_dir)):  # before any of its files is read
        _fail(task_dir, problem)
    config = task_config(task_dir)
    if problem := check_task_times(config.model_dump(mode="python")):
        _fail(task_dir, problem)
    if config.steps:
        _fail(task_dir, "multi-step tasks ([[steps]] in task.toml) are not supported")
    instruction = _load_instruction(task_dir)
    if not (task_dir / "tests" / "test.sh").is_file():
        _fail(task_dir, "missing tests/test.sh (the verifier)")
    if not (task_dir / "environment").is_dir():
        _fail(task_dir, "missing environment/ directory")
    bases: tuple[BaseImage, ...] = ()
    if local_sandbox:
        fit = workdir_problem(config.environment.workdir) or local_sandbox_problem(task_dir, build_images, base_images)
        if isinstance(fit, str):
            _fail(task_dir, fit)
        bases = tuple(fit or ())
    if local_sandbox and (problem := beyond_one_container(task_dir, config)):
        _fail(task_dir, problem)
    try:
        # Harbor's own checks on top of ours (e.g. inputs that symlink out of the task dir), so a task we
        # accept is one that Trial will accept.
        Task(task_dir)
    except (OSError, ValueError, RuntimeError) as e:
        _fail(task_dir, f"Harbor rejects the task: {one_line(str(e))}")
    metadata = dict(config.metadata)
    return TaskSpec(
        name=task_dir.name,
        path=task_dir,
        instruction=instruction,
        difficulty=_metadata_str(task_dir, metadata, "difficulty"),
        category=_metadata_str(task_dir, metadata, "category"),
        agent_timeout_sec=config.agent.timeout_sec,
        verifier_timeout_sec=config.verifier.timeout_sec,
        metadata=metadata,
        has_solution=(task_dir / "solution" / "solve.sh").is_file(),
        bases=bases,
    )


def beyond_one_container(task_dir: Path, config: TaskConfig) -> str | None:
    """What the task's environment asks beyond one sandbox that the local sandbox does not give: extra services
    (a compose file), GPUs, MCP servers, an allowlist entry it does not enforce. Run anyway, its trials would fail
    or score 0 for want of them."""
    for name in ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml"):
        if (task_dir / "environment" / name).is_file():
            return (
                f"environment/{name}: the local sandbox runs no extra services (rollout.sandbox.backend=docker runs them "
                "with docker compose v2)"
            )
    if problem := allowlist_problem(config):
        return problem
    env = config.environment
    if env.gpus:
        return f"task.toml [environment] gpus = {env.gpus}: the local sandbox has no GPU"
    if env.mcp_servers:
        return f"task.toml [environment] mcp_servers: the local sandbox starts no MCP server ({len(env.mcp_servers)} asked)"
    return None


def task_config(task_dir: Path) -> TaskConfig:
    """The task's task.toml as Harbor reads it; a `DatasetError` naming the dir when it is missing or bad."""
    config_path = task_dir / "task.toml"
    if not config_path.is_file():
        _fail(task_dir, "missing task.toml")
    try:
        text = config_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        _fail(task_dir, f"task.toml is not UTF-8: {one_line(str(e))}")
    try:
        return TaskConfig.model_validate_toml(text)
    except tomllib.TOMLDecodeError as e:
        _fail(task_dir, f"task.toml is not valid TOML: {one_line(str(e))}")
    except ValidationError as e:
        errors = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'task'}: {err['msg']}"
            for err in e.errors(include_url=False, include_input=False)
        )
        _fail(task_dir, f"task.toml does not match Harbor's task config: {one_line(errors)}")


def _load_instruction(task_dir: Path) -> str:
    path = task_dir / "instruction.md"
    if not path.is_file():
        _fail(task_dir, "missing instruction.md")
    data = path.read_bytes()
    if len(data) > MAX_INSTRUCTION_BYTES:
        _fail(task_dir, f"instruction.md is {len(data)} bytes, over the {MAX_INSTRUCTION_BYTES}-byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        _fail(task_dir, f"instruction.md is not UTF-8: {one_line(str(e))}")
    instruction = strip_canary(text)
    if not instruction.strip():
        _fail(task_dir, "instruction.md is empty")
    return instruction


def _metadata_str(task_dir: Path, metadata: dict[str, Any], key: str) -> str:
    value = metadata.get(key, UNKNOWN)
    if not isinstance(value, str) or not value:
        _fail(task_dir, f"task.toml [metadata].{key} must be a non-empty string, got {value!r}")
    return value


def _check_unique_names(tasks: tuple[TaskSpec, ...]) -> None:
    # Names come from directory names, which a case-insensitive filesystem or a later merge of datasets can
    # make collide; trials, artifacts and metrics are keyed by name, so compare them case-folded.
    seen: dict[str, TaskSpec] = {}
    for task in tasks:
        key = task.name.casefold()
        if key in seen:
            raise DatasetError(f"{task.path}: duplicate task name {task.name!r} (also {seen[key].path})")
        seen[key] = task


def _dataset_sha256(tasks: list[TaskSpec], left_out: list[LeftOut]) -> str:
    # Per task: its name and the hash of every file in it (paths, exec bits, bytes). Per left-out task dir its
    # name and reason, not its files: they may lead outside the dir, and are never read (fixing the task changes
    # its reason, or admits it). Files beside the task dirs (a README at the root, hidden dirs) are not part of
    # the dataset and do not change the hash.
    lines = [f"{t.name}\0{sha256_tree(t.path)}\n" for t in tasks] + [f"{x.name}\0!{x.reason}\n" for x in left_out]
    h = hashlib.sha256()
    for line in sorted(lines) if left_out else lines:  # as before when nothing is left out
        h.update(line.encode())
    return h.hexdigest()


def _is_hidden(path: Path) -> bool:
    return path.name.startswith(".") or path.name == "__pycache__"


def _fail(task_dir: Path, problem: str) -> NoReturn:
    raise DatasetError(one_line(f"{task_dir}: {problem}", None))

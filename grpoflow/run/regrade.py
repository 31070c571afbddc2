"""Regrading a run's stored trials with Harbor: does a task's verifier give the same verdict twice?

Harbor's regrade (`TrialConfig.source_trial`, action `regrade`) runs a task's verifier again, in a fresh sandbox,
on what a recorded trial left behind (its artifacts), never on a live agent. So that every trial can be regraded,
a run with `report.regrade_per_task` > 0 has each trial record its task's workdir as an artifact (Harbor copies it
out after the agent and before the verifier; `recorded_artifacts`). When the run ends, up to that many graded
trials of each task are regraded (passes and failures alike, `pick_trials`), and a reward that differs from the
recorded one flags the task's verifier in task health: it is flaky, or it reads state the trial did not record;
either way its rewards cannot be trusted for training.

Harbor regrades only with a separate-mode verifier (the trial's own sandbox is gone). A task written for shared
mode, as the built-in ones are, is regraded through a copy of it under `<run>/regrade/tasks/` whose task.toml says
`environment_mode = "separate"`; Harbor re-materializes the recorded workdir at its own path in the verifier's
sandbox, so the task's verifier reads exactly what the agent left there. The regrade trials' dirs go to
`<run>/regrade/trials/`, their verdicts to `<run>/regrades.jsonl`, which `grpoflow.run.health` reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path

from harbor.models.task.config import TaskConfig as TaskFile
from harbor.models.task.config import VerifierEnvironmentMode
from harbor.models.task.verifier_mode import resolve_task_verifier_mode
from harbor.models.trial.config import EnvironmentConfig, SourceTrialConfig, TaskConfig, TrialConfig
from harbor.models.trial.result import TrialResult
from harbor.trial.trial import Trial

from grpoflow.config import RolloutConfig
from grpoflow.fileio import write_text_atomic
from grpoflow.rollout.step import sandbox_config
from grpoflow.rollout.trials import recorded_artifacts
from grpoflow.scoring import PASS, verifier_reward

log = logging.getLogger(__name__)

REGRADE_DIR = "regrade"  # under the run dir: the separate-mode copies of tasks and the regrade trials' dirs
REGRADES_FILE = "regrades.jsonl"  # one line per regraded trial: task, trial, recorded and regraded reward


@dataclass
class Regrade:
    """One stored trial, graded again."""

    task: str  # the instance id
    trial: str  # the source trial's dir, relative to the run dir
    recorded: float  # the reward the run trained or evaluated with
    regraded: float | None  # the reward of the regrade; None when it gave none (see `error`)
    error: str | None = None  # why the regrade gave no reward (not regradable, sandbox or verifier failure)

    @property
    def differs(self) -> bool:
        return self.regraded is not None and abs(self.regraded - self.recorded) > 1e-9


@dataclass(frozen=True)
class StoredTrial:
    task: str
    task_path: Path
    trial_dir: Path
    reward: float


def pick_trials(run_root: Path, per_task: int) -> list[StoredTrial]:
    """Up to `per_task` graded trials of each task that recorded their workdir, in the order the run ran them
    (training steps, then evaluations), passes and failures taken in turn: a verifier that flips only one way
    is still caught when the run has both verdicts."""
    ids = _instance_ids(run_root)
    by_task: dict[str, list[StoredTrial]] = {}
    for trial_dir in _trial_dirs(run_root):
        stored = _stored(trial_dir, ids)
        if stored is not None:
            by_task.setdefault(stored.task, []).append(stored)
    picked = []
    for task in sorted(by_task):
        passes = [t for t in by_task[task] if t.reward >= PASS]
        fails = [t for t in by_task[task] if t.reward < PASS]
        alternating = [t for pair in zip_longest(passes, fails) for t in pair if t is not None]
        picked += alternating[:per_task]
    return picked


async def regrade_trials(
    run_root: Path, trials: Sequence[StoredTrial], environment: EnvironmentConfig, concurrency: int
) -> list[Regrade]:
    """Regrade `trials` with Harbor in `environment`'s sandboxes, at most `concurrency` at once; writes
    `regrades.jsonl`. The regrade dir is remade on every call (a resumed run that ends again regrades again)."""
    out = run_root / REGRADE_DIR
    if out.exists():
        shutil.rmtree(out)
    gate = asyncio.Semaphore(concurrency)

    async def one(stored: StoredTrial) -> Regrade:
        relative = str(stored.trial_dir.relative_to(run_root))
        async with gate:
            try:
                result = await _regrade(stored, environment, out)
            except Exception as err:  # not regradable, or Harbor failed: recorded with why, never a verdict
                return Regrade(stored.task, relative, stored.reward, None, _one_line(err))
        exc = result.exception_info
        regraded, why = verifier_reward(result.verifier_result.rewards if result.verifier_result else None)
        if regraded is None:
            why = f"{exc.exception_type}: {_one_line(exc.exception_message)}" if exc else why
        return Regrade(stored.task, relative, stored.reward, regraded, why if regraded is None else None)

    regrades = list(await asyncio.gather(*(one(t) for t in trials)))
    write_text_atomic(run_root / REGRADES_FILE, "".join(json.dumps(asdict(r)) + "\n" for r in regrades))
    for r in regrades:
        if r.differs:
            log.warning(
                "regrade of %s gave %s, the run recorded %s: %s's verifier", r.trial, r.regraded, r.recorded, r.task
            )
    return regrades


def regrade_run(run_root: Path, rollout: RolloutConfig, per_task: int) -> list[Regrade]:
    """`pick_trials` of the run, regraded in the sandboxes `rollout` names (empty: nothing the run recorded)."""
    stored = pick_trials(run_root, per_task)
    if not stored:
        return []
    return asyncio.run(regrade_trials(run_root, stored, sandbox_config(rollout), rollout.concurrency))


def regrade_summary(regrades: Sequence[Regrade]) -> str:
    differ = sorted({r.task for r in regrades if r.differs})
    return (
        f"regraded {len(regrades)} trials of {len({r.task for r in regrades})} tasks: "
        f"{sum(r.differs for r in regrades)} gave another reward than the run recorded ({', '.join(differ) or 'no task'}), "
        f"{sum(r.regraded is None for r in regrades)} gave none"
    )


def read_regrades(run_root: Path) -> list[Regrade]:
    """The run's `regrades.jsonl`; empty when it has none."""
    path = run_root / REGRADES_FILE
    if not path.is_file():
        return []
    return [Regrade(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


async def _regrade(stored: StoredTrial, environment: EnvironmentConfig, out: Path) -> TrialResult:
    source = TrialResult.model_validate_json((stored.trial_dir / "result.json").read_text(encoding="utf-8"))
    cfg = TrialConfig(
        task=TaskConfig(path=separate_mode_task(stored.task_path, out / "tasks")),
        trial_name=stored.trial_dir.name,
        trials_dir=out / "trials" / stored.trial_dir.parent.name,
        agent=source.config.agent,  # as Harbor's own regrade does: the agent is never run
        environment=environment,
        artifacts=list(recorded_artifacts(str(stored.task_path))),
        source_trial=SourceTrialConfig(action="regrade", type="local", path=stored.trial_dir),
    )
    trial = await Trial.create(cfg)
    return await trial.run()


def separate_mode_task(task_path: Path, into: Path) -> Path:
    """The task as Harbor's regrade needs it: itself when its verifier already runs in a separate environment,
    else a copy under `into` (same dir name, so the same task name) with `environment_mode = "separate"`."""
    task = _task_file(task_path)
    if task.steps:
        raise ValueError(f"{task_path}: a multi-step task is not regraded")
    if resolve_task_verifier_mode(task) == VerifierEnvironmentMode.SEPARATE:
        return task_path
    dest = into / hashlib.sha256(str(task_path.resolve()).encode()).hexdigest()[:12] / task_path.name
    if not dest.exists():
        shutil.copytree(task_path, dest)
        task = task.model_copy(deep=True)
        task.verifier.environment_mode = VerifierEnvironmentMode.SEPARATE
        (dest / "task.toml").write_text(task.model_dump_toml(), encoding="utf-8")
    return dest


def _task_file(task_path: Path) -> TaskFile:
    return TaskFile.model_validate_toml((task_path / "task.toml").read_text(encoding="utf-8"))


def _trial_dirs(run_root: Path) -> list[Path]:
    """The run's trial dirs: training steps in order, then evaluations in order."""

    def key(group: Path) -> tuple[int, int]:
        kind, _, n = group.name.partition("_")
        return (kind != "step", int(n) if n.isdigit() else -1)

    root = run_root / "trials"
    groups = sorted((g for g in root.iterdir() if g.is_dir()), key=key) if root.is_dir() else []
    return [d for g in groups for d in sorted(g.iterdir()) if d.is_dir()]


def _instance_ids(run_root: Path) -> dict[str, str]:
    """task_path -> instance id, from the run's prompts.jsonl."""
    path = run_root / "prompts.jsonl"
    ids = {}
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        if line.strip():
            record = json.loads(line)
            ids[record["task_path"]] = record["instance_id"]
    return ids


def _stored(trial_dir: Path, ids: dict[str, str]) -> StoredTrial | None:
    """The trial, when it has a verdict and recorded what a regrade replays; else None."""
    if not (trial_dir / "result.json").is_file():
        return None
    result = TrialResult.model_validate_json((trial_dir / "result.json").read_text(encoding="utf-8"))
    reward, _ = verifier_reward(result.verifier_result.rewards if result.verifier_result else None)
    task_path = result.config.task.path
    if reward is None or task_path is None:
        return None
    wanted = set(recorded_artifacts(str(task_path)))
    if not wanted or not wanted <= _manifest_sources(trial_dir):
        return None  # a trial of a run without `report.regrade_per_task`, or one that could not collect them
    return StoredTrial(ids.get(str(task_path), result.task_name), Path(task_path), trial_dir, reward)


def _manifest_sources(trial_dir: Path) -> set[str]:
    """The paths the trial's artifacts manifest (Harbor's) lists as collected."""
    path = trial_dir / "artifacts" / "manifest.json"
    if not path.is_file():
        return set()
    entries = json.loads(path.read_text(encoding="utf-8"))
    return {e["source"].rstrip("/") or "/" for e in entries if e.get("status") in ("ok", "empty")}


def _one_line(err: BaseException | str | None) -> str:
    text = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else (err or "")
    return " ".join(text.split())[:300]

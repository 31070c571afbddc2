"""Regrading a run's stored trials with Harbor: does a task's verifier give the same verdict twice?

Harbor's regrade (`TrialConfig.source_trial`, action `regrade`) runs a task's verifier again, in a fresh sandbox,
on what a recorded trial left behind (its artifacts), never on a live agent. So that every trial can be regraded,
a run with `report.regrade_per_task` > 0 has each trial record its task's workdir as an artifact (Harbor copies it
out after the agent and before the verifier; `recorded_artifacts`). When the run ends, every graded trial of its
first and last evaluations (the two the verdict compares) is regraded, and up to that many of each task's other
graded trials (passes and failures alike, `pick_trials`). A reward that differs from the recorded one flags the
task's verifier in task health: it is flaky, or it reads state the trial did not record; either way its rewards
cannot be trusted for training. Over the verdict's evaluations, the share of regrades that disagreed is each row's
grader noise (`grader_noise`), which the verdict weighs a change against
(`grpoflow.scoring.evaluation.judge_change`). A regrade that gives no reward (the trial's record is
unreadable, the task changed since the trial, the sandbox or the verifier failed) is recorded with why and counts
neither way.

What a regrade replays is Harbor's copy of the workdir: links out of it and setuid bits do not survive the copy,
so a verifier that judges those may differ on regrade without being flaky. Regrades run in the flow's process at
`rollout.concurrency` sandboxes at once, after the run's trials (not through Ray workers or the global limit on
sandbox starts), and a failed sandbox start is not retried.

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
import re
import shutil
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path

from harbor.models.task.config import VerifierEnvironmentMode
from harbor.models.task.verifier_mode import resolve_task_verifier_mode
from harbor.models.trial.config import EnvironmentConfig, SourceTrialConfig, TaskConfig, TrialConfig
from harbor.models.trial.result import TrialResult
from harbor.publisher.packager import Packager

from grpoflow.config import RewardRule, RunConfig
from grpoflow.errors import DatasetError, one_line
from grpoflow.fileio import publish_dir, write_text_atomic
from grpoflow.paths import RunPaths, default_cache_dir
from grpoflow.prepare.dataset import task_config
from grpoflow.prepare.prompts import PromptRecord, load_prompts, side_of
from grpoflow.rollout.outcome import verifier_reward
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.trials import run_here
from grpoflow.samples import PASS
from grpoflow.scoring.evaluation import GraderNoise
from grpoflow.scoring.gate import GateSettings, record_flaky

REGRADE_DIR = "regrade"  # under the run dir: the separate-mode copies of tasks and the regrade trials' dirs


@dataclass
class Regrade:
    """One stored trial, graded again."""

    task: str  # the instance id
    trial: str  # the source trial's dir, relative to the run dir
    recorded: float | None  # the verifier's reward in the trial's result.json; None when that was unreadable
    regraded: float | None  # the reward of the regrade; None when it gave none (see `error`)
    error: str | None = None  # why the regrade gave no reward

    @property
    def differs(self) -> bool:
        return self.regraded is not None and self.recorded is not None and abs(self.regraded - self.recorded) > 1e-9


@dataclass(frozen=True)
class StoredTrial:
    task: str
    task_path: Path
    trial_dir: Path
    reward: float


def pick_trials(
    run_root: Path, per_task: int, reward: RewardRule | None = None
) -> tuple[list[StoredTrial], list[Regrade]]:
    """(every graded trial that recorded its workdir in the run's verdict evaluations (`verdict_evaluations`),
    then up to `per_task` of each task's other such trials, in the order the run ran them, passes and failures
    taken in turn, so that a verifier that flips only one way is still caught when the run has both verdicts; a
    row with why for each trial dir whose record could not be read)."""
    ids = _instance_ids(run_root)
    verdict = verdict_evaluations(run_root)
    whole: list[StoredTrial] = []
    by_task: dict[str, list[StoredTrial]] = {}
    unreadable = []
    for trial_dir in _trial_dirs(run_root):
        try:
            stored = _stored(trial_dir, ids, reward)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # truncated, foreign, moved
            unreadable.append(Regrade(_task_of(trial_dir), _relative(trial_dir, run_root), None, None, one_line(err)))
            continue
        if stored is None:
            continue
        if trial_dir.parent.name in verdict:
            whole.append(stored)
        else:
            by_task.setdefault(stored.task, []).append(stored)
    return [*whole, *(t for task in sorted(by_task) for t in alternate(by_task[task], per_task))], unreadable


def verdict_evaluations(run_root: Path) -> set[str]:
    """The trial-group names (`eval_<version>`) of the run's first and last evaluations: the two its verdict
    compares (one when the run evaluated once; none when it never did)."""
    root = RunPaths(run_root).all_trials
    versions = [int(g.name[5:]) for g in root.glob("eval_*") if g.is_dir() and g.name[5:].isdigit()]
    return {f"eval_{v}" for v in (min(versions), max(versions))} if versions else set()


def grader_noise(
    regrades: Sequence[Regrade], prompts: Sequence[PromptRecord], evaluations: Collection[str]
) -> dict[str, GraderNoise]:
    """Side of the split (`trained`, `heldout`, `unseen`) -> how many regrades of its trials in `evaluations`
    (trial-group names: `verdict_evaluations`) disagreed with the recorded reward, of how many gave one. A side
    none of whose trials was regraded is left out (its noise was not measured)."""
    sides = {p.instance_id: side_of(p) for p in prompts}
    counts: dict[str, list[int]] = {}
    for r in regrades:
        if r.regraded is None or r.recorded is None or Path(r.trial).parent.name not in evaluations:
            continue
        if r.task not in sides:  # a trial of a task the run's prompts no longer list
            continue
        c = counts.setdefault(sides[r.task], [0, 0])
        c[0] += r.differs
        c[1] += 1
    return {side: GraderNoise(d, n) for side, (d, n) in counts.items()}


def run_grader_noise(run_root: Path, regrades: Sequence[Regrade]) -> dict[str, GraderNoise] | None:
    """`grader_noise` of a run's verdict evaluations, its sides from its prompts.jsonl; None when it regraded
    nothing (the verdict then says nothing of noise)."""
    if not regrades:
        return None
    path = RunPaths(run_root).prompts
    prompts = load_prompts(path) if path.is_file() else []
    return grader_noise(regrades, prompts, verdict_evaluations(run_root))


def alternate(trials: Sequence[StoredTrial], k: int) -> list[StoredTrial]:
    """The first `k` of `trials` taking a pass and a failure in turn (while both last), each in its own order."""
    passes = [t for t in trials if t.reward >= PASS]
    fails = [t for t in trials if t.reward < PASS]
    return [t for pair in zip_longest(passes, fails) for t in pair if t is not None][:k]


async def regrade_trials(
    run_root: Path,
    trials: Sequence[StoredTrial],
    environment: EnvironmentConfig,
    concurrency: int,
    unreadable: Sequence[Regrade] = (),
    reward: RewardRule | None = None,
) -> list[Regrade]:
    """Regrade `trials` with Harbor in `environment`'s sandboxes, at most `concurrency` at once; writes their rows,
    after the `unreadable` ones, to `regrades.jsonl`. The regrade dir is remade on every call (a resumed run that
    ends again regrades again)."""
    out = run_root / REGRADE_DIR
    if out.exists():
        shutil.rmtree(out)
    gate = asyncio.Semaphore(concurrency)

    async def one(stored: StoredTrial) -> Regrade:
        relative = _relative(stored.trial_dir, run_root)
        async with gate:
            try:
                result = await _regrade(stored, environment, out)
            except Exception as err:  # not regradable, or Harbor failed: recorded with why, never a verdict
                return Regrade(stored.task, relative, stored.reward, None, one_line(err))
        exc = result.exception_info
        regraded, why = verifier_reward(result.verifier_result.rewards if result.verifier_result else None, reward)
        if regraded is None:
            why = f"{exc.exception_type}: {one_line(exc.exception_message)}" if exc else why
        return Regrade(stored.task, relative, stored.reward, regraded, why if regraded is None else None)

    regrades = [*unreadable, *await asyncio.gather(*(one(t) for t in trials))]
    write_text_atomic(RunPaths(run_root).regrades, "".join(json.dumps(asdict(r)) + "\n" for r in regrades))
    return regrades


def regrade_run(run_root: Path, cfg: RunConfig, per_task: int, cache_dir: Path | None = None) -> list[Regrade]:
    """`pick_trials` of the run, regraded in the sandboxes `cfg.rollout` names and scored as the run scored them
    (`dataset.reward`); `regrades.jsonl` says what came of it (empty: the run recorded nothing to regrade). A task
    whose regrade differs is recorded `flaky` in the dataset gate's cache under `cache_dir`, so the next prepare
    that gates it leaves it out."""
    rule, rollout = cfg.dataset.reward_rule(), cfg.rollout
    stored, unreadable = pick_trials(run_root, per_task, rule)
    environment = sandbox_config(rollout, cfg.dataset.base_images)
    regrades = asyncio.run(regrade_trials(run_root, stored, environment, rollout.concurrency, unreadable, rule))
    paths = {t.task: t.task_path for t in stored}
    for row in {r.task: r for r in reversed(regrades) if r.differs}.values():
        reason = (
            f"a regrade of {row.trial} scored {row.regraded} where the run recorded {row.recorded}: its verifier "
            "is flaky or reads state the trial did not record"
        )
        try:
            record_flaky(
                paths[row.task], rollout, cache_dir or default_cache_dir(), reason, GateSettings.of(cfg.dataset), rule
            )
        except DatasetError:  # the task no longer loads: the gate refuses it anyway
            continue
    return regrades


def regrade_summary(regrades: Sequence[Regrade]) -> list[str]:
    """What a person reads of the regrades: a count line, then a line per regrade that differed or gave none."""
    differ = sorted({r.task for r in regrades if r.differs})
    lines = [
        f"regraded {len(regrades)} trials of {len({r.task for r in regrades})} tasks: "
        f"{sum(r.differs for r in regrades)} gave another reward than the run recorded "
        f"({', '.join(differ) or 'no task'}), {sum(r.regraded is None for r in regrades)} gave none"
    ]
    for r in regrades:
        if r.differs:
            lines.append(
                f"{r.trial}: recorded {r.recorded}, regraded {r.regraded}: {r.task}'s verifier is flaky or reads unrecorded state"
            )
        elif r.regraded is None:
            lines.append(f"{r.trial}: no reward on regrade: {r.error}")
    return lines


def read_regrades(run_root: Path) -> list[Regrade]:
    """The run's `regrades.jsonl`; empty when it has none. A damaged line is a ValueError naming file and line."""
    path = RunPaths(run_root).regrades
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(Regrade(**json.loads(line)))
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}:{n}: not a regrade row: {one_line(err)}") from None
    return rows


class TaskChangedError(Exception):
    """The task's files are not those the trial ran with: a regrade would judge another task."""


async def _regrade(stored: StoredTrial, environment: EnvironmentConfig, out: Path) -> TrialResult:
    source = TrialResult.model_validate_json((stored.trial_dir / "result.json").read_text(encoding="utf-8"))
    if not (stored.task_path / "task.toml").is_file():
        raise FileNotFoundError(f"{stored.task_path}: the task is not there any more (moved or deleted)")
    lock = json.loads((stored.trial_dir / "lock.json").read_text(encoding="utf-8"))
    now = "sha256:" + Packager.compute_content_hash(stored.task_path)[0]
    if lock["task"]["digest"] != now:
        raise TaskChangedError(f"{stored.task_path} changed since the trial ran (digest {lock['task']['digest']})")
    cfg = TrialConfig(
        task=TaskConfig(path=separate_mode_task(stored.task_path, out / "tasks")),
        trial_name=stored.trial_dir.name,
        trials_dir=out / "trials" / stored.trial_dir.parent.name,
        agent=source.config.agent,  # as Harbor's own regrade does: the agent is never run
        environment=environment,
        artifacts=source.config.artifacts,  # what the trial recorded, the regrade replays
        source_trial=SourceTrialConfig(action="regrade", type="local", path=stored.trial_dir),
    )
    return await run_here(cfg)


def separate_mode_task(task_path: Path, into: Path) -> Path:
    """The task as Harbor's regrade needs it: itself when its verifier already runs in a separate environment,
    else a copy under `into` (same dir name, so the same task name) with `environment_mode = "separate"`."""
    task = task_config(task_path)
    if task.steps:
        raise ValueError(f"{task_path}: a multi-step task is not regraded")
    if resolve_task_verifier_mode(task) == VerifierEnvironmentMode.SEPARATE:
        return task_path
    dest = into / hashlib.sha256(str(task_path.resolve()).encode()).hexdigest()[:12] / task_path.name
    if not dest.exists():
        # Published whole: a copy that failed halfway is never taken for a whole one.
        with publish_dir(dest) as tmp:
            shutil.copytree(task_path, tmp, dirs_exist_ok=True)
            task = task.model_copy(deep=True)
            task.verifier.environment_mode = VerifierEnvironmentMode.SEPARATE
            (tmp / "task.toml").write_text(task.model_dump_toml(), encoding="utf-8")
    return dest


def _trial_dirs(run_root: Path) -> list[Path]:
    """The run's trial dirs: training steps in order, then evaluations in order; within one, by task, sample and
    attempt (numbers compared as numbers)."""

    def natural(name: str) -> list[tuple[int, int | str]]:
        return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)]

    def group_key(group: Path) -> tuple[bool, list]:
        return (not group.name.startswith("step_"), natural(group.name))

    root = RunPaths(run_root).all_trials
    groups = sorted((g for g in root.iterdir() if g.is_dir()), key=group_key) if root.is_dir() else []
    return [d for g in groups for d in sorted((d for d in g.iterdir() if d.is_dir()), key=lambda d: natural(d.name))]


def _instance_ids(run_root: Path) -> dict[str, str]:
    """task_path (as written, and resolved) -> instance id, from the run's prompts.jsonl."""
    path = RunPaths(run_root).prompts
    ids = {}
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        if line.strip():
            record = json.loads(line)
            ids[record["task_path"]] = ids[str(Path(record["task_path"]).resolve())] = record["instance_id"]
    return ids


def _stored(trial_dir: Path, ids: dict[str, str], reward: RewardRule | None = None) -> StoredTrial | None:
    """The trial, when it has a verdict and recorded what a regrade replays; None when it is not a candidate (no
    verdict, or a run that recorded no workdir). Raises when its record cannot be read."""
    manifest = trial_dir / "artifacts" / "manifest.json"
    if not manifest.is_file():
        return None  # a trial of a run without `report.regrade_per_task`, or one killed before collection
    result = TrialResult.model_validate_json((trial_dir / "result.json").read_text(encoding="utf-8"))
    recorded, _ = verifier_reward(result.verifier_result.rewards if result.verifier_result else None, reward)
    task_path = result.config.task.path
    if recorded is None or task_path is None:
        return None
    wanted = {(a if isinstance(a, str) else a.source).rstrip("/") for a in result.config.artifacts}
    if not wanted or not wanted <= _manifest_sources(manifest):
        return None  # the trial was asked to keep nothing (its task names no workdir), or could not collect it
    task = ids.get(str(task_path)) or ids.get(str(Path(task_path).resolve())) or _task_of(trial_dir)
    return StoredTrial(task, Path(task_path), trial_dir, recorded)


def _manifest_sources(manifest: Path) -> set[str]:
    """The paths Harbor's artifacts manifest lists as collected."""
    entries = json.loads(manifest.read_text(encoding="utf-8"))
    return {e["source"].rstrip("/") or "/" for e in entries if e.get("status") in ("ok", "empty")}


def _task_of(trial_dir: Path) -> str:
    """The instance id a trial dir's name starts with (`trial_name`: `<instance id>__<sample>__a<attempt>`)."""
    return trial_dir.name.rsplit("__", 2)[0]


def _relative(trial_dir: Path, run_root: Path) -> str:
    return str(trial_dir.relative_to(run_root))

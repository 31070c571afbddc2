"""The dataset gate: before a run trains on a dataset, prove each task can be solved and cannot be passed by
doing nothing, in the sandbox the run will use.

Each task runs Harbor's oracle agent once (its `solution/solve.sh`, when it has one) and Harbor's no-op agent
once, through the same trial machinery as a training step (`collect_step`: Harbor `Trial`s, sandbox retries,
scoring by `to_sample`). A task whose oracle does not reach the full reward (`PASS`), or whose no-op already
does, would train the policy on rewards that say nothing about its work (all zeros, or all ones): it is left out
of training and evaluation with its reason, the verifier's last lines included. A task without a solution is
kept and marked `unverified` (its no-op still runs). A trial that ends in a sandbox or infrastructure failure
(after its retries) says nothing about the task: the task is kept, marked `unchecked`, and not cached. With the
gate off (`dataset.validate`; the built-in set by default) nothing runs: tasks are `ungated` (or `unverified`).

Verdicts are cached under `<cache>/gate/` by the task's content digest (every file of the task dir) and the
sandbox kind, so a second prepare of the same tasks runs no trial, and a nightly run pays only for changed tasks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from harbor.models.agent.name import AgentName
from harbor.models.trial.config import AgentConfig

from grpoflow.config import RewardRule, RolloutConfig
from grpoflow.credentials import export_sandbox_key
from grpoflow.errors import DatasetError, one_line
from grpoflow.fileio import read_tail, sha256_tree, write_json_atomic
from grpoflow.prepare.dataset import Dataset, LeftOut, TaskSpec
from grpoflow.rollout.environments import ImageBuildError, is_infrastructure_failure
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.record import TrialRecord
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import TrialOutcome, TrialSpec
from grpoflow.samples import PASS, Sample

# Bumped when what a verdict means changes: older cache entries are then not read.
GATE_VERSION = 1
TAIL_LINES = 5  # of the verifier's output, kept with a verdict
TAIL_BYTES = 64 * 1024  # read from the end of the verifier's output for those lines
ORACLE, NOP = AgentName.ORACLE.value, AgentName.NOP.value

Verdict = Literal[
    "verified", "unverified", "unchecked", "ungated", "oracle-fails", "nop-passes", "environment-fails", "refused"
]
ADMITTED: frozenset[str] = frozenset({"verified", "unverified", "unchecked", "ungated"})
LEFT_OUT: tuple[str, ...] = ("oracle-fails", "nop-passes", "environment-fails", "refused")
CACHED: frozenset[str] = frozenset({"verified", "unverified", "oracle-fails", "nop-passes"})


@dataclass(frozen=True)
class TaskGate:
    """The gate's verdict on one task dir."""

    name: str
    path: str
    verdict: Verdict
    reason: str | None = None  # one line; None for an admitted task with nothing to say
    oracle_reward: float | None = None
    nop_reward: float | None = None
    verifier_tail: list[str] = field(default_factory=list)  # the last lines of the deciding trial's verifier
    digest: str | None = None  # sha256 of the task dir's files (the cache key, with the sandbox kind)
    cached: bool = False  # the verdict came from the cache: no trial ran for it

    @property
    def admitted(self) -> bool:
        return self.verdict in ADMITTED


@dataclass(frozen=True)
class GateReport:
    """Every task dir of a dataset with its verdict, and what the gate cost."""

    dataset: str
    sandbox: str
    gated: bool  # False: the gate was off (`dataset.validate`); only refused task dirs have a verdict
    tasks: list[TaskGate]
    trials_run: int = 0
    seconds: float = 0.0

    @property
    def left_out(self) -> list[TaskGate]:
        return [t for t in self.tasks if not t.admitted]

    def to_json(self) -> dict:
        return {
            "dataset": self.dataset,
            "sandbox": self.sandbox,
            "gated": self.gated,
            "admitted": sum(t.admitted for t in self.tasks),
            "left_out": len(self.left_out),
            "trials_run": self.trials_run,
            "seconds": round(self.seconds, 3),
            "tasks": [asdict(t) | {"admitted": t.admitted} for t in self.tasks],
        }

    def lines(self) -> list[str]:
        """What the CLI shows: a head line, then one line per task left out or not checked."""
        head = (
            f"dataset gate: {sum(t.admitted for t in self.tasks)} of {len(self.tasks)} tasks admitted, "
            f"{len(self.left_out)} left out"
        )
        if self.gated:
            unverified = sum(t.verdict == "unverified" for t in self.tasks)
            cached = sum(t.cached for t in self.tasks)
            head += (
                f" ({unverified} unverified: no solution/solve.sh; {self.trials_run} trials in {self.seconds:.1f} s, "
                f"{cached} verdicts from the cache; sandbox {self.sandbox})"
            )
        else:
            head += " (gate off: tasks not run)"
        rows = [
            f"  {t.verdict}: {t.name}: {t.reason}" for t in self.tasks if t.verdict not in ("verified", "unverified")
        ]
        return [head, *rows]


def refused(left_out: tuple[LeftOut, ...]) -> list[TaskGate]:
    """Task dirs the dataset loader left out (malformed, or an environment the sandbox does not reproduce)."""
    return [TaskGate(x.name, str(x.path), "refused", x.reason) for x in left_out]


def ungated_report(dataset: Dataset, sandbox: str) -> GateReport:
    # Not run: a task is `unverified` for want of a solution, else `ungated`, taken as it is (the built-in set is
    # proven by the test suite instead).
    tasks = [TaskGate(t.name, str(t.path), "ungated" if t.has_solution else "unverified") for t in dataset.tasks]
    return GateReport(str(dataset.root), sandbox, False, sorted([*tasks, *refused(dataset.left_out)], key=_by_name))


def gate_cache_path(cache_dir: Path, sandbox: str, digest: str) -> Path:
    return Path(cache_dir) / "gate" / f"v{GATE_VERSION}" / sandbox / f"{digest}.json"


def run_gate(dataset: Dataset, rollout: RolloutConfig, cache_dir: Path, reward: RewardRule | None = None) -> GateReport:
    """The gate over every task of `dataset`, in `rollout`'s sandbox (`rollout.concurrency` trials at once, with
    its sandbox retries), scored by `reward` (`dataset.reward`); cached verdicts are reused, new definite ones
    cached (keyed by the reward rule too: it decides what the oracle scores)."""
    scored_by = "" if reward is None else "-" + hashlib.sha256(repr(reward).encode()).hexdigest()[:12]
    t0 = time.perf_counter()
    verdicts: dict[str, TaskGate] = {}
    pending: list[tuple[TaskSpec, str]] = []
    for task in dataset.tasks:
        digest = sha256_tree(task.path)
        hit = _read_cache(gate_cache_path(cache_dir, rollout.sandbox.backend, digest + scored_by))
        if hit is not None:
            verdicts[task.name] = replace(hit, name=task.name, path=str(task.path), digest=digest, cached=True)
        else:
            pending.append((task, digest))
    specs = [spec for task, _ in pending for spec in _specs(task)]
    if specs:
        outcomes = _run(specs, rollout, reward)
        for task, digest in pending:
            verdict = _verdict(task, digest, outcomes)
            verdicts[task.name] = verdict
            if verdict.verdict in CACHED:
                write_json_atomic(
                    gate_cache_path(cache_dir, rollout.sandbox.backend, digest + scored_by), _cache_record(verdict)
                )
    tasks = sorted([*verdicts.values(), *refused(dataset.left_out)], key=_by_name)
    return GateReport(str(dataset.root), rollout.sandbox.backend, True, tasks, len(specs), time.perf_counter() - t0)


def admitted_dataset(dataset: Dataset, report: GateReport) -> Dataset:
    """`dataset` less the tasks the gate left out (they join `left_out`); `DatasetError` in one line when none
    is left."""
    out = {t.name: t for t in report.left_out}
    keep = tuple(t for t in dataset.tasks if t.name not in out)
    if not keep:
        counts: dict[str, int] = {}
        for t in report.left_out:
            counts[t.verdict] = counts.get(t.verdict, 0) + 1
        why = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
        first = report.left_out[0]
        raise DatasetError(
            one_line(
                f"dataset {dataset.root}: every task was left out ({why}); first, {first.name}: {first.reason}", 600
            )
        )
    extra = tuple(
        LeftOut(t.name, Path(t.path), t.reason or t.verdict) for t in report.left_out if t.verdict != "refused"
    )
    return replace(dataset, tasks=keep, left_out=(*dataset.left_out, *extra))


# ---- the trials -------------------------------------------------------------------------------------------------


def _specs(task: TaskSpec) -> list[TrialSpec]:
    agents = [ORACLE, NOP] if task.has_solution else [NOP]
    return [
        TrialSpec(task.name, str(task.path), f"gate-{task.name}", k, f"gate-{task.name}-{agent}", 0)
        for k, agent in enumerate(agents)
    ]


@dataclass(frozen=True)
class _Done:
    sample: Sample
    outcome: TrialOutcome
    tail: list[str]  # the verifier's last lines (read before the trial dirs go)


def _run(specs: list[TrialSpec], rollout: RolloutConfig, reward: RewardRule | None) -> dict[str, _Done]:
    """Run the gate's trials through `collect_step`, keyed by rollout id."""
    agent_of = {s.rollout_id: s.rollout_id.rsplit("-", 1)[1] for s in specs}
    # Neither agent has web tools to turn off; saying so keeps Harbor from logging an ERROR per trial when the
    # sandbox has no network.
    policy = PolicyAccess(
        lambda spec: AgentConfig(name=agent_of[spec.rollout_id], kwargs={"disable_web_search": False})
    )
    # The oracle and the no-op reach no host: a CLI harness's session-server allowance has nothing to serve here,
    # and the local sandbox refuses a host it cannot reach.
    environment = sandbox_config(rollout).model_copy(update={"extra_allowed_hosts": []})
    export_sandbox_key(rollout.sandbox.backend, rollout.sandbox.key_file())
    outcomes: dict[str, TrialOutcome] = {}
    with tempfile.TemporaryDirectory(prefix="grpoflow-gate-") as tmp:
        result = asyncio.run(
            collect_step(
                "gate",
                0,
                specs,
                rollout,
                policy,
                environment,
                Path(tmp) / "trials",
                Path(tmp) / "details",
                on_done=lambda o: outcomes.__setitem__(o.spec.rollout_id, o),
                reward=reward,
            )
        )
        # The verifier's output is read before the trial dirs go.
        tails = {rid: _verifier_tail(o) for rid, o in outcomes.items()}
    return {s.rollout_id: _Done(s, outcomes[s.rollout_id], tails[s.rollout_id]) for s in result.samples}


def _verifier_tail(outcome: TrialOutcome) -> list[str]:
    path = Path(outcome.attempts[-1].trial_dir) / "verifier" / "test-stdout.txt"
    try:
        text = read_tail(path, TAIL_BYTES)
    except FileNotFoundError:  # the verifier never ran (the trial failed before it)
        return []
    except OSError as exc:  # ELOOP: the sandbox left a link there
        return [f"(test-stdout.txt not read: {exc.strerror})"]
    lines = [one_line(line, 200) for line in text.splitlines() if line.strip()]
    return lines[-TAIL_LINES:]


def _infrastructure(outcome: TrialOutcome) -> bool:
    exc = outcome.result.exception_info
    if exc is None:
        return False
    # bubblewrap missing is no verdict on the task either (the sandbox cannot run at all)
    return exc.exception_type == "SandboxUnavailableError" or is_infrastructure_failure(
        exc.exception_type, TrialRecord.of(outcome.result).end_reason
    )


def _verdict(task: TaskSpec, digest: str, done: dict[str, _Done]) -> TaskGate:
    base = TaskGate(task.name, str(task.path), "verified", digest=digest)
    oracle = done.get(f"gate-{task.name}-{ORACLE}")
    nop = done[f"gate-{task.name}-{NOP}"]
    base = replace(base, nop_reward=nop.sample.reward, oracle_reward=oracle.sample.reward if oracle else None)
    for agent, d in ((ORACLE, oracle), (NOP, nop)):
        exc = d.outcome.result.exception_info if d is not None else None
        if d is not None and exc is not None and exc.exception_type == ImageBuildError.__name__:
            # The task's own environment (its image's build, or its tree) gives no sandbox: every trial of it would
            # fail the same way. Left out, and not cached: a build that failed on a registry's hiccup is tried again.
            return replace(
                base,
                verdict="environment-fails",
                reason=f"the {agent} trial could not get the task's environment ({d.sample.exit_reason})",
            )
        if d is not None and _infrastructure(d.outcome):
            return replace(
                base,
                verdict="unchecked",
                reason=f"the {agent} trial hit an infrastructure failure ({d.sample.exit_reason}): not a verdict "
                "on the task, which is kept unchecked",
            )
    if oracle is not None and (oracle.sample.reward is None or oracle.sample.reward < PASS):
        tail = oracle.tail
        return replace(
            base,
            verdict="oracle-fails",
            reason=f"its oracle (solution/solve.sh) scored {_score(oracle.sample)}, not {PASS}"
            + (f"; verifier: {' | '.join(tail[-3:])}" if tail else ""),
            verifier_tail=tail,
        )
    if nop.sample.reward is not None and nop.sample.reward >= PASS:
        tail = nop.tail
        return replace(
            base,
            verdict="nop-passes",
            reason=f"an agent that does nothing already scores {nop.sample.reward}: the verifier does not check "
            "the task's work" + (f"; verifier: {' | '.join(tail[-3:])}" if tail else ""),
            verifier_tail=tail,
        )
    if oracle is None:
        return replace(base, verdict="unverified", reason="no solution/solve.sh: solvability not proven")
    return base


def _score(sample: Sample) -> str:
    if sample.reward is not None:
        return f"{sample.reward}" + (f" ({sample.exit_status}: {sample.exit_reason})" if sample.exit_reason else "")
    return f"no reward ({sample.exit_status}: {sample.exit_reason})"


# ---- the cache --------------------------------------------------------------------------------------------------


def _cache_record(verdict: TaskGate) -> dict:
    record = asdict(verdict)
    for key in ("name", "path", "digest", "cached"):  # the task's place and name are not part of its content
        record.pop(key)
    return record


def _read_cache(path: Path) -> TaskGate | None:
    """A cached verdict, or None when there is none or it cannot be read (then the trials run again)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return TaskGate(name="", path="", **record)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):  # a torn or foreign file: the trials decide again
        return None


def _by_name(t: TaskGate) -> str:
    return t.name

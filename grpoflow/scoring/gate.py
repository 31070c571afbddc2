"""The dataset gate: before a run trains on a dataset, prove each task can be solved and cannot be passed by
doing nothing, in the sandbox the run will use.

Each task runs Harbor's oracle agent `dataset.gate_oracle_runs` times (its `solution/solve.sh`, when it has one) and
Harbor's no-op agent once, through the same trial machinery as a training step (`collect_step`: Harbor `Trial`s,
sandbox retries, scoring by `to_sample`). A task whose oracle does not reach the full reward (`PASS`), or whose
no-op already does, would train the policy on rewards that say nothing about its work (all zeros, or all ones): it
is left out of training and evaluation with its reason, the verifier's last lines included. Oracle runs that
disagree make the task `flaky` (its verifier's rewards cannot be trusted); an oracle whose verifier failed to
resolve a host name under a `no-network` or allowlist policy is `needs-network` (the task wants a network its own
task.toml does not give it), not `oracle-fails`. A
task without a solution is kept and marked `unverified` (its no-op still runs). A trial that ends in a sandbox or
infrastructure failure (after its retries) says nothing about the task: the task is kept, marked `unchecked`, and
not cached. With the gate off (`dataset.validate`; the built-in set by default) nothing runs: tasks are `ungated`
(or `unverified`).

Verdicts are cached under `<cache>/gate/` keyed by everything that decides them: the task's content digest (every
file of the task dir), the image IDs its Dockerfile builds from, the reward rule, the oracle runs, the sandbox's
settings and Harbor's version. So a second prepare of the same tasks runs no trial, and a nightly run pays only
for changed tasks. A verdict that leaves a task out is never right for good: it is reused only while grpoflow's
own code is the same and for `dataset.gate_ttl` days (`fresh` runs every task again); a regrade that finds a task's
verifier flaky records `flaky` here too (`record_flaky`), so the next prepare leaves it out.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from importlib.metadata import version
from pathlib import Path
from typing import Literal

from harbor.models.agent.name import AgentName
from harbor.models.task.config import NetworkMode
from harbor.models.trial.config import AgentConfig

from grpoflow.config import DatasetConfig, RewardRule, RolloutConfig
from grpoflow.credentials import export_sandbox_key
from grpoflow.errors import DatasetError, one_line
from grpoflow.fileio import read_tail, sha256_tree, write_json_atomic
from grpoflow.prepare.dataset import Dataset, LeftOut, TaskSpec, load_task, task_config
from grpoflow.rollout.environments import ImageBuildError, is_infrastructure_failure
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.record import TrialRecord
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import TrialOutcome, TrialSpec
from grpoflow.samples import PASS, Sample

# Bumped when what a verdict means changes: older cache entries are then not read.
GATE_VERSION = 4
TAIL_LINES = 5  # of the verifier's output, kept with a verdict
TAIL_BYTES = 64 * 1024  # read from the end of the verifier's output for those lines
ORACLE, NOP = AgentName.ORACLE.value, AgentName.NOP.value
PROGRESS_EVERY_S = 10.0  # the gate is never silent for longer

Verdict = Literal[
    "verified",
    "unverified",
    "unchecked",
    "ungated",
    "oracle-fails",
    "nop-passes",
    "flaky",
    "needs-network",
    "environment-fails",
    "refused",
]
ADMITTED: frozenset[str] = frozenset({"verified", "unverified", "unchecked", "ungated"})
LEFT_OUT: tuple[str, ...] = ("oracle-fails", "nop-passes", "flaky", "needs-network", "environment-fails", "refused")
NEGATIVE: frozenset[str] = frozenset({"oracle-fails", "nop-passes", "flaky", "needs-network"})  # cached, expiring
CACHED: frozenset[str] = frozenset({"verified", "unverified", *NEGATIVE})
# What a verifier prints when it reached for the network and found none (curl, pip, apt, Python's socket, git).
NO_NETWORK_SIGNS = (
    "could not resolve host",
    "temporary failure in name resolution",
    "name or service not known",
    "failed to establish a new connection",
    "network is unreachable",
    "could not resolve hostname",
    "getaddrinfo failed",
)


@dataclass(frozen=True)
class GateSettings:
    """How the gate runs (`dataset.*` settings of the run, and the CLI's `--fresh`)."""

    # the config's defaults (one home for each)
    oracle_runs: int = DatasetConfig.model_fields["gate_oracle_runs"].default
    ttl_days: float = DatasetConfig.model_fields["gate_ttl"].default  # how long a verdict leaving a task out holds
    base_images: dict[str, str] = field(default_factory=dict)  # `dataset.base_images`, for the sandbox's builds
    fresh: bool = False  # read no cached verdict (write the new ones)

    @classmethod
    def of(cls, dataset: DatasetConfig, fresh: bool = False) -> GateSettings:
        return cls(dataset.gate_oracle_runs, dataset.gate_ttl, dict(dataset.base_images), fresh)


@dataclass(frozen=True)
class TaskGate:
    """The gate's verdict on one task dir."""

    name: str
    path: str
    verdict: Verdict
    reason: str | None = None  # one line; None for an admitted task with nothing to say
    oracle_reward: float | None = None  # the deciding oracle run's (a failing one, when any failed)
    nop_reward: float | None = None
    verifier_tail: list[str] = field(default_factory=list)  # the last lines of the deciding trial's verifier
    digest: str | None = None  # sha256 of the task dir's files (in the cache key)
    oracle_rewards: list[float | None] = field(default_factory=list)  # every oracle run's, in order
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
    base_images: dict[str, str] = field(default_factory=dict)  # FROM reference -> "image id" the builds start from

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
            "base_images": self.base_images,
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
        bases = [f"  base image: FROM {ref} -> {used}" for ref, used in sorted(self.base_images.items())]
        rows = [
            f"  {t.verdict}: {t.name}: {t.reason}" for t in self.tasks if t.verdict not in ("verified", "unverified")
        ]
        return [head, *bases, *rows]


def refused(left_out: tuple[LeftOut, ...]) -> list[TaskGate]:
    """Task dirs the dataset loader left out (malformed, or an environment the sandbox does not reproduce)."""
    return [TaskGate(x.name, str(x.path), "refused", x.reason) for x in left_out]


def ungated_report(dataset: Dataset, sandbox: str) -> GateReport:
    # Not run: a task is `unverified` for want of a solution, else `ungated`, taken as it is (the built-in set is
    # proven by the test suite instead).
    tasks = [TaskGate(t.name, str(t.path), "ungated" if t.has_solution else "unverified") for t in dataset.tasks]
    return GateReport(str(dataset.root), sandbox, False, sorted([*tasks, *refused(dataset.left_out)], key=_by_name))


def gate_cache_path(cache_dir: Path, sandbox: str, key: str) -> Path:
    return Path(cache_dir) / "gate" / f"v{GATE_VERSION}" / sandbox / f"{key}.json"


def verdict_key(
    task: TaskSpec, digest: str, rollout: RolloutConfig, reward: RewardRule | None, oracle_runs: int
) -> str:
    """What decides a task's verdict, hashed: the task's files, the images its own builds from, the reward rule,
    the oracle runs, the sandbox's settings (its retries and start limits aside: they change no outcome) and
    Harbor's version."""
    sandbox = rollout.sandbox.model_dump(
        mode="json",
        exclude={
            "retries",
            "retry_backoff_s",
            "on_retries_exhausted",
            "create_limit",
            "max_starts_per_s",
            "breaker",
            "api_key_file",
        },
    )
    parts = {
        "task": digest,
        "bases": [b.id for b in task.bases],
        "reward": repr(reward),
        "oracle_runs": oracle_runs,
        "sandbox": sandbox,
        "harbor": _harbor_version(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _verdict_path(
    cache_dir: Path,
    task: TaskSpec,
    digest: str,
    rollout: RolloutConfig,
    reward: RewardRule | None,
    settings: GateSettings,
) -> Path:
    """Where the gate reads and writes the task's verdict (`record_flaky` writes there too)."""
    key = verdict_key(task, digest, rollout, reward, settings.oracle_runs)
    return gate_cache_path(cache_dir, rollout.sandbox.backend, key)


@cache
def _harbor_version() -> str:
    # read once: a dataset of thousands of tasks would otherwise scan the installed packages' metadata per task
    return version("harbor")


@cache
def code_digest() -> str:
    """sha256 of grpoflow's own modules: a verdict that leaves a task out is not reused across a code change."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def run_gate(
    dataset: Dataset,
    rollout: RolloutConfig,
    cache_dir: Path,
    reward: RewardRule | None = None,
    settings: GateSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> GateReport:
    """The gate over every task of `dataset`, in `rollout`'s sandbox (`rollout.concurrency` trials at once, with
    its sandbox retries), scored by `reward` (`dataset.reward`); cached verdicts are reused (`verdict_key`; one
    that leaves a task out only while fresh), new definite ones cached. `progress` hears a line at the start and
    at least every `PROGRESS_EVERY_S` while trials run."""
    settings = settings or GateSettings()
    t0 = time.perf_counter()
    verdicts: dict[str, TaskGate] = {}
    pending: list[tuple[TaskSpec, str, Path]] = []
    for task in dataset.tasks:
        digest = sha256_tree(task.path)
        path = _verdict_path(cache_dir, task, digest, rollout, reward, settings)
        hit = None if settings.fresh else _read_cache(path, settings.ttl_days)
        if hit is not None:
            verdicts[task.name] = replace(hit, name=task.name, path=str(task.path), digest=digest, cached=True)
        else:
            pending.append((task, digest, path))
    specs = [spec for task, _, _ in pending for spec in _specs(task, settings.oracle_runs)]
    if specs:
        if progress is not None:
            progress(
                f"dataset gate: {len(specs)} trials of {len(pending)} tasks to run "
                f"({len(verdicts)} verdicts from the cache; {rollout.concurrency} at once)"
            )
        outcomes = _run(specs, rollout, reward, settings.base_images, progress)
        for task, digest, path in pending:
            verdict = _verdict(task, digest, outcomes, settings.oracle_runs)
            verdicts[task.name] = verdict
            if verdict.verdict in CACHED:
                write_json_atomic(path, _cache_record(verdict))
    tasks = sorted([*verdicts.values(), *refused(dataset.left_out)], key=_by_name)
    seconds = time.perf_counter() - t0
    return GateReport(
        str(dataset.root), rollout.sandbox.backend, True, tasks, len(specs), seconds, dataset.base_images()
    )


def record_flaky(
    task_path: Path,
    rollout: RolloutConfig,
    cache_dir: Path,
    reason: str,
    settings: GateSettings | None = None,
    reward: RewardRule | None = None,
) -> Path:
    """Cache a `flaky` verdict for the task at `task_path` (a regrade found its verifier's reward differing), under
    the key the gate reads: the next prepare leaves the task out, for `dataset.gate_ttl` days."""
    settings = settings or GateSettings()
    task = load_task(task_path, local_sandbox=rollout.sandbox.local, base_images=settings.base_images)
    digest = sha256_tree(task.path)
    verdict = TaskGate(task.name, str(task.path), "flaky", reason, digest=digest)
    path = _verdict_path(cache_dir, task, digest, rollout, reward, settings)
    write_json_atomic(path, _cache_record(verdict))
    return path


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


def _oracle_id(task: TaskSpec, run: int) -> str:
    return f"gate-{task.name}-{ORACLE}-{run}"


def _nop_id(task: TaskSpec) -> str:
    return f"gate-{task.name}-{NOP}"


def _specs(task: TaskSpec, oracle_runs: int) -> list[TrialSpec]:
    ids = [_oracle_id(task, k) for k in range(oracle_runs)] if task.has_solution else []
    return [
        TrialSpec(task.name, str(task.path), f"gate-{task.name}", k, rollout_id, 0)
        for k, rollout_id in enumerate([*ids, _nop_id(task)])
    ]


@dataclass(frozen=True)
class _Done:
    sample: Sample
    outcome: TrialOutcome
    tail: list[str]  # the verifier's last lines (read before the trial dirs go)


def _run(
    specs: list[TrialSpec],
    rollout: RolloutConfig,
    reward: RewardRule | None,
    base_images: dict[str, str],
    progress: Callable[[str], None] | None,
) -> dict[str, _Done]:
    """Run the gate's trials through `collect_step`, keyed by rollout id."""
    agent_of = {s.rollout_id: NOP if s.rollout_id.endswith(f"-{NOP}") else ORACLE for s in specs}
    # Neither agent has web tools to turn off; saying so keeps Harbor from logging an ERROR per trial when the
    # sandbox has no network.
    policy = PolicyAccess(
        lambda spec: AgentConfig(name=agent_of[spec.rollout_id], kwargs={"disable_web_search": False})
    )
    # The oracle and the no-op reach no host: a CLI harness's session-server allowance has nothing to serve here,
    # and the local sandbox refuses a host it cannot reach.
    environment = sandbox_config(rollout, base_images).model_copy(update={"extra_allowed_hosts": []})
    # No breaker: the gate's trials are there to find tasks whose sandbox does not start, and a dataset with many
    # would look like a provider outage. A start failure is the task's "unchecked" (not cached), as ever.
    never = rollout.sandbox.breaker.model_copy(update={"failure_rate": 1.0})
    rollout = rollout.model_copy(update={"sandbox": rollout.sandbox.model_copy(update={"breaker": never})})
    export_sandbox_key(rollout.sandbox.backend, rollout.sandbox.key_file())
    outcomes: dict[str, TrialOutcome] = {}
    with tempfile.TemporaryDirectory(prefix="grpoflow-gate-") as tmp, _Ticker(len(specs), outcomes, progress):
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


class _Ticker:
    """A line to `progress` every `PROGRESS_EVERY_S` while the gate's trials run: done/total, elapsed, ETA (image
    builds happen inside the first trials of a task, so a long build shows as time without trials done)."""

    def __init__(self, total: int, done: dict, progress: Callable[[str], None] | None):
        self.total, self.done, self.progress = total, done, progress
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="gate-progress", daemon=True)

    def __enter__(self) -> _Ticker:
        self.t0 = time.monotonic()
        if self.progress is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _tick(self) -> None:
        assert self.progress is not None
        while not self.stop.wait(PROGRESS_EVERY_S):
            done, elapsed = len(self.done), time.monotonic() - self.t0
            eta = f"ETA {elapsed / done * (self.total - done):.0f} s" if done else "ETA after the first trial"
            self.progress(f"dataset gate: {done}/{self.total} trials done in {elapsed:.0f} s, {eta}")


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


def verifier_network_mode(task_dir: Path) -> NetworkMode:
    """The network policy a task's verifier runs under, as Harbor resolves it: its own, else the environment's."""
    config = task_config(task_dir)
    return (config.verifier.explicit_phase_policy() or config.environment.resolve_baseline()).network_mode


def _infrastructure(outcome: TrialOutcome) -> bool:
    exc = outcome.result.exception_info
    if exc is None:
        return False
    # bubblewrap missing is no verdict on the task either (the sandbox cannot run at all)
    return exc.exception_type == "SandboxUnavailableError" or is_infrastructure_failure(
        exc.exception_type, TrialRecord.of(outcome.result).end_reason
    )


def _verdict(task: TaskSpec, digest: str, done: dict[str, _Done], oracle_runs: int) -> TaskGate:
    oracles = [done[_oracle_id(task, k)] for k in range(oracle_runs)] if task.has_solution else []
    nop = done[_nop_id(task)]
    passed = [o for o in oracles if o.sample.reward is not None and o.sample.reward >= PASS]
    failed = [o for o in oracles if o not in passed]
    decider = failed[0] if failed else (passed[0] if passed else None)
    base = TaskGate(
        task.name,
        str(task.path),
        "verified",
        digest=digest,
        nop_reward=nop.sample.reward,
        oracle_reward=decider.sample.reward if decider else None,
        oracle_rewards=[o.sample.reward for o in oracles],
    )
    for agent, d in [*((ORACLE, o) for o in oracles), (NOP, nop)]:
        exc = d.outcome.result.exception_info
        if exc is not None and exc.exception_type == ImageBuildError.__name__:
            # The task's own environment (its image's build, or its tree) gives no sandbox: every trial of it would
            # fail the same way. Left out, and not cached: a build that failed on a registry's hiccup is tried again.
            return replace(
                base,
                verdict="environment-fails",
                reason=f"the {agent} trial could not get the task's environment ({d.sample.exit_reason})",
            )
        if _infrastructure(d.outcome):
            return replace(
                base,
                verdict="unchecked",
                reason=f"the {agent} trial hit an infrastructure failure ({d.sample.exit_reason}): not a verdict "
                "on the task, which is kept unchecked",
            )
    if failed and passed:
        bad, good = failed[0], passed[0]
        return replace(
            base,
            verdict="flaky",
            reason=f"its oracle passed {len(passed)} of {len(oracles)} runs (scored {_score(bad.sample)} once): the "
            f"verifier's verdict varies; failing run's verifier: {' | '.join(bad.tail[-2:]) or '(no output)'}; "
            f"passing run's: {' | '.join(good.tail[-2:]) or '(no output)'}",
            verifier_tail=bad.tail,
        )
    if failed:
        tail = failed[0].tail
        lowered = " ".join(tail).lower()
        mode = verifier_network_mode(task.path)
        if mode != NetworkMode.PUBLIC and any(sign in lowered for sign in NO_NETWORK_SIGNS):
            return replace(
                base,
                verdict="needs-network",
                reason=f"its verifier reached for the network and found none (task.toml gives the verifier "
                f"network_mode {mode.value}); verifier: {' | '.join(tail[-3:])}",
                verifier_tail=tail,
            )
        return replace(
            base,
            verdict="oracle-fails",
            reason=f"its oracle (solution/solve.sh) scored {_score(failed[0].sample)}, not {PASS}"
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
    if not oracles:
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
    # when and by which code: a verdict that leaves a task out is reused only while both hold (`_read_cache`)
    return record | {"at": time.time(), "code": code_digest()}


def _read_cache(path: Path, ttl_days: float) -> TaskGate | None:
    """A cached verdict, or None when there is none, it cannot be read, or it leaves the task out and is older
    than `ttl_days` or was reached by other code (then the trials run again)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        at, code = record.pop("at"), record.pop("code")
        verdict = TaskGate(name="", path="", **record)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError):  # a torn or foreign file: the trials decide again
        return None
    if verdict.verdict in NEGATIVE and (code != code_digest() or time.time() - float(at) > ttl_days * 86400):
        return None
    return verdict


def _by_name(t: TaskGate) -> str:
    return t.name

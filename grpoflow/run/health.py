"""Task health across the runs under one output dir: what `grpoflow tasks` prints and every train run attaches.

For each task (a task instance of the dataset): its pass rate in each run that ran it, oldest run first (training
trials and evaluation trials together: every trial a verifier graded), flagged
- `always 0` / `always 1` when every graded trial of every run failed / passed: no GRPO signal, a candidate to
  retire (or a broken task);
- `flaky verifier` when Harbor's regrade of a stored trial (`grpoflow.run.regrade`, `report.regrade_per_task`)
  gave another reward than the run recorded;
- its infrastructure errors (trials that ended without a verdict because the sandbox or the verifier failed, by
  sandbox provider), the hot spots of a flaky provider;
- `left out by the gate` when the dataset gate of the latest run that saw it left it out of training (its
  `gate.json`: the oracle missed, the no-op passed, or the task was refused), with that verdict.
Runs are read from their dirs: `run.json`, and the small `tasks.json` a train run writes when it ends (else its
`details/*/samples.jsonl`, counted, and its `regrades.jsonl`); a dir that is not a run, or a run still without
samples, is left out.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpoflow.config import read_config_file
from grpoflow.errors import ConfigError, RunDirError, one_line
from grpoflow.fileio import write_json_atomic
from grpoflow.paths import RunPaths
from grpoflow.rollout.journal import SAMPLES, read_samples
from grpoflow.run.info import read_run_info
from grpoflow.run.regrade import read_regrades
from grpoflow.samples import INFRASTRUCTURE_STATUSES, PASS

INFRA_STATUSES = INFRASTRUCTURE_STATUSES | {"VerifierError"}  # no verdict, and not the policy's doing


@dataclass
class TaskRun:
    """One task in one run."""

    run_id: str
    graded: int = 0
    passed: int = 0
    infra_errors: int = 0
    regraded: int = 0  # stored trials Harbor's regrade gave a reward
    regrade_differs: int = 0  # of those, how many got another reward than the run recorded
    regrade_failed: int = 0  # regrades that gave no reward (unreadable record, changed task, sandbox, verifier)
    left_out: str | None = None  # the dataset gate's verdict when it left the task out of this run (gate.json)

    @property
    def pass_rate(self) -> float | None:
        return self.passed / self.graded if self.graded else None


@dataclass
class TaskHealth:
    task: str
    runs: list[TaskRun] = field(default_factory=list)
    infra_by_provider: dict[str, int] = field(default_factory=dict)

    @property
    def regrades(self) -> tuple[int, int, int]:
        """(regrades that differed, regrades that gave a reward, regrades that gave none), over every run."""
        return (
            sum(r.regrade_differs for r in self.runs),
            sum(r.regraded for r in self.runs),
            sum(r.regrade_failed for r in self.runs),
        )

    @property
    def flag(self) -> str:
        graded = sum(r.graded for r in self.runs)
        passed = sum(r.passed for r in self.runs)
        flags = []
        if self.runs and self.runs[-1].left_out:  # the latest run's gate: what the next run will do with it
            flags.append(f"left out by the gate: {self.runs[-1].left_out}")
        elif graded == 0:
            flags.append("never graded")
        elif passed == 0:
            flags.append("always 0")
        elif passed == graded:
            flags.append("always 1")
        if self.regrades[0]:
            flags.append("flaky verifier")
        return ", ".join(flags)


def run_dirs(output_dir: Path) -> list[tuple[str, Path]]:
    """(created_at, run dir) of every run under `output_dir` with a readable run.json, oldest first."""
    out = []
    for root in sorted(Path(output_dir).iterdir()) if Path(output_dir).is_dir() else []:
        if not RunPaths(root).run_info.is_file():
            continue
        try:
            info = read_run_info(RunPaths(root))
        except RunDirError:
            continue  # a damaged run.json: that run says so when it is resumed; here it is skipped
        out.append((info.created_at, root))
    return sorted(out)


def run_tasks(root: Path, recount: bool = False) -> tuple[str, dict[str, TaskRun]]:
    """(sandbox provider, per task its counts) of one run: from its `tasks.json`, or counted from its samples
    (`recount`, a run that has not ended, or one from before the file existed). Written when a run ends: the
    index reads these, not samples."""
    paths = RunPaths(root)
    path = paths.tasks
    if path.is_file() and not recount:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return data["provider"], {k: TaskRun(root.name, **v) for k, v in data["tasks"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # damaged: count again from the samples
    seen: dict[str, TaskRun] = {}
    for details in sorted(paths.all_details.glob("*")) if paths.all_details.is_dir() else []:
        if not (details / SAMPLES).is_file():
            continue
        for s in read_samples(details):
            if s.segment_index:
                continue  # one row per trial: its first segment
            tr = seen.setdefault(s.instance_id, TaskRun(root.name))
            if s.reward is not None:
                tr.graded += 1
                tr.passed += s.reward >= PASS
            elif s.exit_status in INFRA_STATUSES:
                tr.infra_errors += 1
            tr.infra_errors += int(s.metrics.get("retries", 0))  # attempts lost to the sandbox, then retried
    for r in read_regrades(root):
        tr = seen.setdefault(r.task, TaskRun(root.name))
        tr.regraded += r.regraded is not None
        tr.regrade_differs += r.differs
        tr.regrade_failed += r.regraded is None
    for name, verdict in _left_out(paths).items():
        seen.setdefault(name, TaskRun(root.name)).left_out = verdict
    return _provider(root), seen


def _left_out(paths: RunPaths) -> dict[str, str]:
    """The tasks the run's dataset gate left out, with their verdicts (none for a run without gate.json)."""
    if not paths.gate.is_file():
        return {}
    try:
        tasks = json.loads(paths.gate.read_text(encoding="utf-8"))["tasks"]
        return {t["name"]: t["verdict"] for t in tasks if not t["admitted"]}
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{paths.gate}: not a gate report ({one_line(err, 120)})") from err


def write_run_tasks(root: Path) -> Path:
    """`tasks.json` of a run that ended: what `task_health` reads of it."""
    provider, counts = run_tasks(root, recount=True)  # a resumed run ends again: count what it has now
    tasks = {k: {f: n for f, n in asdict(t).items() if f != "run_id"} for k, t in counts.items()}
    path = RunPaths(root).tasks
    write_json_atomic(path, {"provider": provider, "tasks": tasks})
    return path


def task_health(output_dir: Path, unreadable: list[str] | None = None) -> tuple[list[str], list[TaskHealth]]:
    """(the run ids read, oldest first; every task's health, by name). A run whose records cannot be read is left
    out, and named in `unreadable` (with why) when given: one damaged run must not hide the others."""
    tasks: dict[str, TaskHealth] = {}
    run_ids: list[str] = []
    for _, root in run_dirs(output_dir):
        try:
            provider, seen = run_tasks(root)
        except (OSError, ValueError) as err:  # a damaged samples.jsonl, or one of another grpoflow's schema
            if unreadable is not None:
                unreadable.append(f"{root.name}: {one_line(err, 200)}")
            continue
        if seen:
            run_ids.append(root.name)
        for name, tr in sorted(seen.items()):
            health = tasks.setdefault(name, TaskHealth(name))
            health.runs.append(tr)
            if tr.infra_errors:
                health.infra_by_provider[provider] = health.infra_by_provider.get(provider, 0) + tr.infra_errors
    return run_ids, [tasks[k] for k in sorted(tasks)]


def _provider(root: Path) -> str:
    try:
        return str(read_config_file(RunPaths(root).config)["rollout"]["sandbox"]["backend"])
    except (ConfigError, KeyError, TypeError):
        return "unknown"


def health_markdown(run_ids: list[str], tasks: list[TaskHealth], unreadable: list[str] | None = None) -> str:
    """A table: a row per task, a column per run (pass rate, `-` where the run did not run it), the flags, the
    regrades whose reward differed of those that gave one (and how many gave none), and the infrastructure errors
    (failed or retried attempts) by provider; then the runs left out."""
    head = ["task", *run_ids, "flag", "regrades differing", "infra errors"]
    lines = [
        f"# Task health over {len(run_ids)} runs",
        "",
        "| " + " | ".join(head) + " |",
        "|---" * len(head) + "|",
    ]
    for t in tasks:
        by_run = {r.run_id: r for r in t.runs}
        cells = [_rate(by_run.get(run)) for run in run_ids]
        infra = ", ".join(f"{p}: {n}" for p, n in sorted(t.infra_by_provider.items())) or "-"
        differ, regraded, failed = t.regrades
        regrades = f"{differ} of {regraded}" + (f", {failed} failed" if failed else "") if regraded or failed else "-"
        lines.append("| " + " | ".join([t.task, *cells, t.flag or "-", regrades, infra]) + " |")
    if unreadable:
        lines += ["", "Left out (unreadable): " + "; ".join(unreadable)]
    return "\n".join(lines) + "\n"


def _rate(tr: TaskRun | None) -> str:
    if tr is None:
        return "-"
    if tr.left_out:
        return f"left out ({tr.left_out})"
    rate = tr.pass_rate
    return f"{rate:.2f} ({tr.graded})" if rate is not None else f"no verdict ({tr.infra_errors})"

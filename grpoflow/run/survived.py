"""What a run came through on its way to the end: its resumes (when, after what, how long it stood still), its
engines' exits and restarts in place (`grpoflow.engine.restart`), the steps whose sandbox starts the breaker held
back (`grpoflow.rollout.breaker`), and the trials run again after their sandbox failed. Written with the run's
report: a section of its summary, and run.json's `survived`."""

from __future__ import annotations

from typing import Any

from grpoflow.run.info import RunInfo, Survived
from grpoflow.run.metrics import training_rows

OPENINGS, OPEN_S, RETRIES = "rollout/sandbox_breaker_openings", "rollout/sandbox_breaker_open_s", "rollout/retries"


def survived(info: RunInfo, records: list[dict[str, Any]]) -> Survived:
    """The totals: resumes and the seconds the run stood still before them, engine restarts and the seconds from
    each exit to generating again, breaker openings and the seconds it held starts back, sandbox retries; over
    `records` (`read_step_records`)."""
    rows = training_rows(records)
    back = [r for r in info.engine_restarts if r.error is None]
    return Survived(
        resumes=len(info.resumes),
        idle_s=round(sum(r.idle_s or 0.0 for r in info.resumes), 1),
        engine_restarts=len(back),
        engine_restart_s=round(sum(r.seconds for r in back), 1),
        breaker_openings=int(sum(r.get(OPENINGS, 0) for r in rows)),
        breaker_open_s=round(sum(r.get(OPEN_S, 0.0) for r in rows), 1),
        sandbox_retries=int(sum(r.get(RETRIES, 0) for r in rows)),
    )


def survived_markdown(info: RunInfo, records: list[dict[str, Any]]) -> list[str]:
    """The summary's section: a row per resume, per engine exit and per step that a fault cost time or trials."""
    rows = []
    for r in info.resumes:
        stood = "-" if r.idle_s is None else f"{r.idle_s:.0f}"
        rows.append(
            f"| {r.at} | resumed at step {r.from_step} | {r.after or 'not known to this Prefect server'} | {stood} |"
        )
    for e in info.engine_restarts:
        what = f"engine restarted, weight version {e.weight_version}" if e.error is None else "engine left down"
        why = f"{e.engine} exited ({e.exit})" + (f": {e.error}" if e.error else "")
        rows.append(f"| {e.at} | {what} | {why} | {e.seconds:.0f} |")
    for r in training_rows(records):
        if r.get(OPENINGS):
            why = f"sandbox starts failed above the breaker's rate: opened {int(r[OPENINGS])}x"
            rows.append(f"| step {r['step']} | starts held back | {why} | {r.get(OPEN_S, 0.0):.0f} |")
        if r.get(RETRIES):
            rows.append(f"| step {r['step']} | sandbox retries: {int(r[RETRIES])} | a trial's sandbox failed | - |")
    head = ["## What the run survived", ""]
    if not rows:
        return [*head, "Nothing: no resume, no engine exit, no breaker opening, no sandbox retry.", ""]
    return [*head, "| when | what | why | seconds lost |", "|---|---|---|---|", *rows, ""]

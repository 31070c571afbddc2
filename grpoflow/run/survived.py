"""What a run came through on its way to the end: its resumes (when, after what, how long it stood still) and the
steps whose sandbox starts the breaker held back (`grpoflow.rollout.breaker`), and the trials run again after their
sandbox failed. Written with the run's report: a section of its summary, and run.json's `survived`."""

from __future__ import annotations

from typing import Any

from grpoflow.run.info import RunInfo, Survived
from grpoflow.run.metrics import training_rows

OPENINGS, OPEN_S, RETRIES = "rollout/sandbox_breaker_openings", "rollout/sandbox_breaker_open_s", "rollout/retries"


def survived(info: RunInfo, records: list[dict[str, Any]]) -> Survived:
    """The totals: resumes and the seconds the run stood still before them, breaker openings and the seconds it
    held starts back, sandbox retries; over `records` (`read_step_records`)."""
    rows = training_rows(records)
    return Survived(
        resumes=len(info.resumes),
        idle_s=round(sum(r.idle_s or 0.0 for r in info.resumes), 1),
        breaker_openings=int(sum(r.get(OPENINGS, 0) for r in rows)),
        breaker_open_s=round(sum(r.get(OPEN_S, 0.0) for r in rows), 1),
        sandbox_retries=int(sum(r.get(RETRIES, 0) for r in rows)),
    )


def survived_markdown(info: RunInfo, records: list[dict[str, Any]]) -> list[str]:
    """The summary's section: a row per resume and per step that a fault cost time or trials."""
    rows = []
    for r in info.resumes:
        stood = "-" if r.idle_s is None else f"{r.idle_s:.0f}"
        rows.append(
            f"| {r.at} | resumed at step {r.from_step} | {r.after or 'not known to this Prefect server'} | {stood} |"
        )
    for r in training_rows(records):
        if r.get(OPENINGS):
            why = f"sandbox starts failed above the breaker's rate: opened {int(r[OPENINGS])}x"
            rows.append(f"| step {r['step']} | starts held back | {why} | {r.get(OPEN_S, 0.0):.0f} |")
        if r.get(RETRIES):
            rows.append(f"| step {r['step']} | sandbox retries: {int(r[RETRIES])} | a trial's sandbox failed | - |")
    head = ["## What the run survived", ""]
    if not rows:
        return [*head, "Nothing: no resume, no breaker opening, no sandbox retry.", ""]
    return [*head, "| when | what | why | seconds lost |", "|---|---|---|---|", *rows, ""]

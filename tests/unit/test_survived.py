"""What a run survived: totals for run.json and the report's section, from run.json's resumes and the step rows;
and the bound on how often a crashed run is resumed by itself."""

from __future__ import annotations

import os
from datetime import datetime, timezone

import pytest

from grpoflow.engine.restart import Restart
from grpoflow.errors import GrpoflowError
from grpoflow.run.info import Resume, RunInfo
from grpoflow.run.resume import check_resume_budget, last_write
from grpoflow.run.survived import survived, survived_markdown


def _info(*resumes: Resume, restarts: tuple[Restart, ...] = ()) -> RunInfo:
    return RunInfo.model_construct(resumes=list(resumes), engine_restarts=list(restarts))


def _row(step: int, **figures: float) -> dict:
    return {"step": step, "rollout/reward_mean": 0.5, **{f"rollout/{k}": v for k, v in figures.items()}}


def test_a_night_with_a_resume_a_breaker_opening_and_retries_is_told_step_by_step():
    info = _info(
        Resume(at="2026-12-07T02:10:00+00:00", from_step=3, after="Crashed: Execution was aborted", idle_s=1204.5),
        Resume(at="2026-12-07T04:00:00+00:00", from_step=5, idle_s=30.0),
        restarts=(
            Restart(
                at="2026-12-07T02:40:00+00:00",
                engine="http://127.0.0.1:30000",
                exit="SIGKILL",
                seconds=12.3,
                weight_version="4",
            ),
            Restart(
                at="2026-12-07T03:00:00+00:00",
                engine="http://127.0.0.1:30000",
                exit="code 1",
                seconds=20.1,
                error="restart failed: SGLang server exited with code 1 during startup",
            ),
        ),
    )
    rows = [
        _row(0, retries=0.0, sandbox_breaker_openings=0.0, sandbox_breaker_open_s=0.0),
        _row(1, retries=2.0, sandbox_breaker_openings=2.0, sandbox_breaker_open_s=61.4),
        _row(2, retries=1.0),
        {"step": 6, "eval/trained/pass_at_1": 0.5},  # the final evaluation's row has no rollout figures
    ]
    total = survived(info, rows)
    assert total.model_dump() == {
        "resumes": 2,
        "idle_s": 1234.5,
        "breaker_openings": 2,
        "breaker_open_s": 61.4,
        "sandbox_retries": 3,
        "engine_restarts": 1,
        "engine_restart_s": 12.3,
    }
    lines = survived_markdown(info, rows)
    assert lines[0] == "## What the run survived"
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| when")]
    assert table == [
        "| 2026-12-07T02:10:00+00:00 | resumed at step 3 | Crashed: Execution was aborted | 1204 |",
        "| 2026-12-07T04:00:00+00:00 | resumed at step 5 | not known to this Prefect server | 30 |",
        "| 2026-12-07T02:40:00+00:00 | engine restarted, weight version 4 | http://127.0.0.1:30000 exited (SIGKILL) "
        "| 12 |",
        "| 2026-12-07T03:00:00+00:00 | engine left down | http://127.0.0.1:30000 exited (code 1): restart failed: "
        "SGLang server exited with code 1 during startup | 20 |",
        "| step 1 | starts held back | sandbox starts failed above the breaker's rate: opened 2x | 61 |",
        "| step 1 | sandbox retries: 2 | a trial's sandbox failed | - |",
        "| step 2 | sandbox retries: 1 | a trial's sandbox failed | - |",
    ]


def test_a_quiet_night_says_nothing_went_wrong():
    rows = [_row(0, retries=0.0, sandbox_breaker_openings=0.0, sandbox_breaker_open_s=0.0)]
    assert survived(_info(), rows).model_dump() == {
        "resumes": 0,
        "idle_s": 0.0,
        "breaker_openings": 0,
        "breaker_open_s": 0.0,
        "sandbox_retries": 0,
        "engine_restarts": 0,
        "engine_restart_s": 0.0,
    }
    assert "Nothing: no resume, no engine exit, no breaker opening, no sandbox retry." in survived_markdown(
        _info(), rows
    )


def test_the_resume_budget_counts_the_last_24_hours_only():
    now = datetime(2026, 12, 7, 6, 0, tzinfo=timezone.utc)
    old = Resume(at="2026-12-06T05:00:00+00:00", from_step=1)  # 25 h ago: another night
    recent = [Resume(at=f"2026-12-07T0{h}:00:00+00:00", from_step=h, after="Crashed: SIGTERM") for h in (2, 4)]
    info = RunInfo.model_construct(run_id="night-1", resumes=[old, *recent])
    check_resume_budget(info, 3, now)  # two in the window: a third is allowed
    with pytest.raises(GrpoflowError) as err:
        check_resume_budget(info, 2, now)
    assert str(err.value) == (
        "run night-1 was resumed 2 times in the last 24 h (max_resumes 2), the last after Crashed: SIGTERM: not "
        "again; resume it by hand once its cause is fixed"
    )


def test_last_write_is_the_newest_file_anywhere_in_the_run_dir(tmp_path):
    (tmp_path / "details" / "step_1").mkdir(parents=True)
    journal, metrics = tmp_path / "details" / "step_1" / "journal.jsonl", tmp_path / "metrics.jsonl"
    journal.write_text("{}\n")
    metrics.write_text("{}\n")
    os.utime(metrics, (1_000, 1_000))
    os.utime(journal, (2_000, 2_000))
    for d in (tmp_path / "details" / "step_1", tmp_path / "details", tmp_path):
        os.utime(d, (500, 500))
    assert last_write(tmp_path) == 2_000

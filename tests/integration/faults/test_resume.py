"""Kill-and-resume: a train run SIGKILLed mid-rollout, mid-train, mid-checkpoint-write, mid-append or mid-way
through its final evaluation resumes under its run_id from its last full checkpoint, leaves no torn file, runs no
finished trial again (steps after the full checkpoint train again on their journaled trials), and ends with the
same metrics.jsonl bytes and final weights as a run that was never interrupted.

The killed run is the real command line in a subprocess (tests/integration/faults/kill_at.py arms the kill point), talking
to this session's Prefect test server; the resume runs in-process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL

from flows.cli import main
from flows.serve import read_specs
from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.fileio import sha256_tree
from grpoflow.paths import RunPaths
from grpoflow.run.info import DeploymentRef, read_run_info, update_run_info
from grpoflow.run.resume import complete_steps
from grpoflow.train.fsdp import OPTIMIZER_DCP
from tests.fakes.proc import descendants_running
from tests.fakes.triggers import fires
from tests.integration.faults.events import run_events
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]

REPO = Path(__file__).resolve().parents[3]
STEPS, TRIALS = 3, 8  # per step: 2 prompts x 4 samples


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    base = tmp_path_factory.mktemp("resume")
    model = fence_policy(tiny_model_dir, base / "policy")
    data = reward_tasks(base / "tasks")
    runs = base / "runs"
    train_flow(parse_run_config(run_config(runs, model, data, "reference", steps=STEPS)))
    return model, data, runs


def _final_weights(root: Path) -> tuple[int, str]:
    last = complete_steps(RunPaths(root))[-1]
    return last, sha256_tree(root / "checkpoints" / f"step_{last}", "*.safetensors")


def _kill_run(
    runs: Path,
    model,
    data,
    run_id: str,
    point: str,
    step: int,
    n: int = 1,
    steps: int = STEPS,
    evals: int = 0,
    overrides: dict | None = None,
) -> subprocess.CompletedProcess:
    cfg_file = runs.parent / f"{run_id}.json"
    cfg = _with(run_config(runs, model, data, run_id, steps=steps, evals=evals), overrides)
    cfg_file.write_text(json.dumps(cfg))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}  # this session's server: no second start-up
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests/integration/faults/kill_at.py"),
            point,
            str(step),
            str(n),
            "--",
            "train",
            "--config",
            str(cfg_file),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, f"the run was not killed at {point} (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


def _with(cfg: dict, overrides: dict | None) -> dict:
    """`cfg` with the sections of `overrides` merged in."""
    for section, values in (overrides or {}).items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


DISK = {"engine": {"weight_sync": {"mode": "disk"}}}
LORA = {
    "engine": {"weight_sync": {"mode": "adapter"}},
    "train": {"lora": {"rank": 4, "alpha": 8}, "optimizer": {"learning_rate": 3e-2}},
}


def _journal(root: Path, step: int) -> list[dict]:
    return _journal_of(root / "details" / f"step_{step}")


def _trial_dirs(root: Path, step: int) -> list[str]:
    d = root / "trials" / f"step_{step}"
    return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.exists() else []


def _assert_resumed_like_reference(root: Path, ref: Path) -> None:
    # no torn file: every jsonl parses line by line; no temp file or dir of an interrupted write is left
    for path in root.rglob("*.jsonl"):
        if "trials" not in path.parts:
            for line in path.read_text().splitlines():
                json.loads(line)
    leftovers = [p for p in root.rglob(".*") if "trials" not in p.relative_to(root).parts]
    assert [p for p in leftovers if (p.parent.name, p.name) != (OPTIMIZER_DCP, ".metadata")] == []  # DCP's own index
    # same result as the run that was never interrupted
    assert (root / "metrics.jsonl").read_bytes() == (ref / "metrics.jsonl").read_bytes()
    assert _final_weights(root) == _final_weights(ref)
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step_1", f"step_{STEPS - 1}"]
    timings = [json.loads(x)["step"] for x in (root / "timings.jsonl").read_text().splitlines()]
    assert timings == list(range(STEPS))
    # every trial of every step journaled exactly once: nothing redone, nothing lost
    for step in range(STEPS):
        ids = [s["rollout_id"] for s in _journal(root, step)]
        assert len(ids) == len(set(ids)) == TRIALS
        # the step's traces: the same trials in the same order, the same tokens and rewards as the reference
        assert _traces(root, step) == _traces(ref, step)


def _traces(root: Path, step: int) -> list[tuple]:
    lines = (root / "details" / f"step_{step}" / "samples.jsonl").read_text().splitlines()
    return [(s["rollout_id"], s["tokens"], s["reward"], s["weight_version"]) for s in map(json.loads, lines)]


def _resume(runs: Path, run_id: str, capfd, caplog) -> str:
    caplog.clear()
    assert main(["resume", run_id, "--output-dir", str(runs)]) == 0
    cap = capfd.readouterr()
    return cap.out + caplog.text  # the flow's own lines reach the console through Prefect's log handler


def test_killed_mid_rollout_keeps_finished_trials(setup, capfd, caplog):
    model, data, runs = setup
    _kill_run(runs, model, data, "mid-rollout", "rollout", step=1, n=3)
    root = runs / "mid-rollout"
    nightly = DeploymentRef(id="0f6c2a53-5d8e-4a52-9d6c-6f1d1c1f0a11", name="nightly-train")
    update_run_info(RunPaths(root), deployment=nightly)  # as a run the nightly-train deployment started records
    before = {s["rollout_id"] for s in _journal(root, 1)}
    dirs_before = _trial_dirs(root, 1)
    assert len(before) == 3 and complete_steps(RunPaths(root)) == []  # step 0 wrote no full checkpoint
    _resume(runs, "mid-rollout", capfd, caplog)
    _assert_resumed_like_reference(root, runs / "reference")
    # run.json says what the run survived: a flow killed without a word (Prefect still holds it Running)
    info = read_run_info(RunPaths(root))
    (resume,) = info.resumes
    assert resume.from_step == 0 and resume.after.startswith("Running: its process ended without reporting")
    assert 0 <= resume.idle_s < 600 and (info.survived.resumes, info.survived.idle_s) == (1, resume.idle_s)
    # the 3 journaled trials ran once (one dir each, attempt a0); unfinished attempts' dirs were not reused
    dirs = _trial_dirs(root, 1)
    for rid in before:
        inst, k = rid.removeprefix("step1-").rsplit("-", 1)
        assert [d for d in dirs if d.startswith(f"{inst}__{k}__")] == [f"{inst}__{k}__a0"]
    assert set(dirs_before) <= set(dirs) and len(dirs) == TRIALS + (len(dirs_before) - 3)
    assert _trial_dirs(root, 0) == _trial_dirs(runs / "reference", 0)  # step 0 trained again, ran no trial
    # the killed train flow never announced an end; the resume flow did, with the whole run's summary
    (ev,) = run_events("mid-rollout", expect=1)
    assert (ev.event, ev.payload["flow"], ev.payload["steps"], ev.payload["resumed_from_step"]) == (
        "grpoflow.run.completed",
        "resume",
        STEPS,
        0,
    )
    # ...as from the deployment that started the run, so nightly-evaluate follows it as it follows a nightly run
    assert any(r.id == f"prefect.deployment.{nightly.id}" and r.role == "deployment" for r in ev.related)
    (trigger,) = {s.name: s for s in read_specs()}["nightly-evaluate"].triggers
    assert fires(trigger, ev)
    # resuming the complete run again changes nothing and announces no second end of the nightly run
    assert read_run_info(RunPaths(root)).ended is not None
    _resume(runs, "mid-rollout", capfd, caplog)
    again = run_events("mid-rollout", expect=2)[-1]
    assert again.event == "grpoflow.run.completed" and not fires(trigger, again)
    # killed in its report (every step recorded, no end): a resume writes the report and announces the end
    update_run_info(RunPaths(root), ended=None)
    (root / "viewer.html").unlink()
    out = _resume(runs, "mid-rollout", capfd, caplog)
    assert f"has all {STEPS} steps but never ended: writing its report" in out and (root / "viewer.html").is_file()
    assert fires(trigger, run_events("mid-rollout", expect=3)[-1])


@pytest.mark.parametrize(
    ("point", "step", "resumes_at"),
    [
        ("train", 1, 1),
        ("metrics", 0, 1),
        ("metrics", 1, 3),
        ("checkpoint", 2, 3),
        ("metrics", 2, None),
    ],
)
def test_killed_after_rollout_resumes_without_rerunning_trials(setup, capfd, caplog, point, step, resumes_at):
    """With save_interval 2 of 3 steps, steps 1 and 2 write full checkpoints and step 0 does not: a kill before
    step 1's full checkpoint is in place resumes from the start, training step 0 (and 1) again on their
    journaled trials; a kill after it resumes at step 3; a kill after the last one only appends the cut row."""
    model, data, runs = setup
    run_id = f"mid-{point}-{step}"
    _kill_run(runs, model, data, run_id, point, step=step)
    root = runs / run_id
    assert len(_journal(root, step)) == TRIALS  # the step's rollout had finished
    out = _resume(runs, run_id, capfd, caplog)
    if resumes_at is None:  # killed after its last row, before its report: the resume writes the report
        assert f"run {run_id} has all {STEPS} steps but never ended: writing its report" in out
        assert read_run_info(RunPaths(root)).ended is not None and (root / "viewer.html").is_file()
    else:
        assert f"resuming run {run_id} at step {resumes_at}/{STEPS}" in out
    if point == "metrics":
        assert "torn last line" in out
        assert (f"appended the row of step {step}" in out) == (step > 0)  # step 0 is done again instead
    _assert_resumed_like_reference(root, runs / "reference")
    for s in range(STEPS):
        assert len(_trial_dirs(root, s)) == TRIALS  # no trial ran twice


@pytest.fixture(scope="module")
def disk_reference(setup):
    model, data, runs = setup
    train_flow(parse_run_config(_with(run_config(runs, model, data, "disk-reference", steps=STEPS), DISK)))
    return runs / "disk-reference"


@pytest.mark.parametrize(
    ("step", "resumed"), [(1, "step 1/3 (no step had completed"), (2, "step 3/3 (checkpoint step_1")]
)
def test_killed_with_a_disk_sync_resumes_like_its_reference(setup, disk_reference, capfd, caplog, step, resumed):
    """The tests above sync in memory (the embedded engine's default); with engine.weight_sync.mode=disk every step
    writes its dir for the engine: killed in step 1's update the run resumes from the start (step 0's dir was
    no full checkpoint), killed in step 2's from step 1's, whose dir the engine loads. Either way the steps
    since train again on their journaled trials, and the run ends as one never interrupted."""
    model, data, runs = setup
    run_id = f"disk-killed-{step}"
    _kill_run(runs, model, data, run_id, "train", step=step, overrides=DISK)
    root = runs / run_id
    full = sorted(p.name for p in (root / "checkpoints").glob("step_*") if (p / "optimizer.pt").is_file())
    assert full == (["step_1"] if step == 2 else [])
    out = _resume(runs, run_id, capfd, caplog)
    assert f"resuming run {run_id} at {resumed}" in out
    _assert_resumed_like_reference(root, disk_reference)
    for s in range(STEPS):
        assert len(_trial_dirs(root, s)) == TRIALS  # no trial ran twice


def test_a_killed_lora_run_resumes_from_its_adapter_checkpoint(setup, capfd, caplog):
    """train.lora (synced as the adapter alone): killed in step 2's update, the run resumes from step 1's full
    checkpoint, which holds the adapter and its optimizer state only; the adapter reaches the engine again and
    the run ends as one never interrupted, merged export included."""
    model, data, runs = setup
    train_flow(parse_run_config(_with(run_config(runs, model, data, "lora-reference", steps=STEPS), LORA)))
    _kill_run(runs, model, data, "lora-killed", "train", step=2, overrides=LORA)
    root = runs / "lora-killed"
    mid = root / "checkpoints" / "step_1"
    assert (mid / "adapter" / "adapter_model.safetensors").is_file() and not list(mid.glob("*.safetensors"))
    out = _resume(runs, "lora-killed", capfd, caplog)
    assert "resuming run lora-killed at step 3/3 (checkpoint step_1" in out
    _assert_resumed_like_reference(root, runs / "lora-reference")


SHARDED = {"cluster": {"train_ranks": 2}}  # train.sharding auto: FSDP over 2 gloo ranks


@pytest.fixture(scope="module")
def sharded_reference(setup):
    model, data, runs = setup
    train_flow(parse_run_config(_with(run_config(runs, model, data, "sharded-reference", steps=STEPS), SHARDED)))
    return runs / "sharded-reference"


def test_a_killed_sharded_run_resumes_to_the_same_bytes(setup, sharded_reference, capfd, caplog):
    """2 sharded trainer ranks (FSDP): killed in step 2's update, the run resumes from step 1's full checkpoint
    (the weights an HF dir written from the shards, AdamW's shards in optimizer.dcp/), shards it over 2 ranks
    again and ends with the uninterrupted sharded run's metrics and weights, byte for byte."""
    model, data, runs = setup
    _kill_run(runs, model, data, "sharded-killed", "train", step=2, overrides=SHARDED)
    root = runs / "sharded-killed"
    mid = root / "checkpoints" / "step_1"
    assert (mid / "optimizer.dcp" / ".metadata").is_file() and not (mid / "optimizer.pt").exists()
    assert (mid / "model.safetensors").is_file() and not (mid / "sharded").exists()
    out = _resume(runs, "sharded-killed", capfd, caplog)
    assert "resuming run sharded-killed at step 3/3 (checkpoint step_1" in out
    _assert_resumed_like_reference(root, sharded_reference)


def test_killed_during_the_final_evaluation_resumes_it(setup, tmp_path, capfd, caplog):
    """The evaluation after the last step has a metrics row of its own; a kill mid-way keeps its finished trials,
    and the resume runs only the others, ending with the rows of a run that was never interrupted."""
    model, data, _ = setup
    runs = tmp_path / "runs"
    train_flow(parse_run_config(run_config(runs, model, data, "evals-ref", steps=1, evals=2)))
    _kill_run(runs, model, data, "evals-killed", "eval", step=1, n=2, steps=1, evals=2)
    root = runs / "evals-killed"
    assert len(_journal_of(root / "details" / "eval_1")) == 2
    out = _resume(runs, "evals-killed", capfd, caplog)
    assert "resuming run evals-killed at its final evaluation" in out
    assert (root / "metrics.jsonl").read_bytes() == (runs / "evals-ref" / "metrics.jsonl").read_bytes()
    rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and "eval/trained/pass_at_1" in rows[1]
    assert len(_journal_of(root / "details" / "eval_1")) == 4  # the 2 finished trials were not run again


def _journal_of(details: Path) -> list[dict]:
    path = details / "journal.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_resume_of_a_complete_run_says_so(setup, capfd, caplog):
    _, _, runs = setup
    before = (runs / "reference" / "metrics.jsonl").read_bytes()
    out = _resume(runs, "reference", capfd, caplog)
    assert f"run reference is already complete ({STEPS} of {STEPS} steps): nothing to resume" in out
    assert (runs / "reference" / "metrics.jsonl").read_bytes() == before


def test_resume_without_config_names_the_file(tmp_path, capfd):
    (tmp_path / "broken").mkdir()
    assert main(["resume", "broken", "--output-dir", str(tmp_path)]) == 2
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert err == f"grpoflow: error: {tmp_path / 'broken' / 'config.json'}: config file not found"


def test_resume_refuses_a_run_id_that_is_a_path(tmp_path, capfd):
    assert main(["resume", "../etc", "--output-dir", str(tmp_path)]) == 2
    assert "RUN_ID '../etc': a run id is lowercase letters" in capfd.readouterr().err
    assert main(["resume", "nope", "--output-dir", str(tmp_path)]) == 2
    assert capfd.readouterr().err.strip() == f"grpoflow: error: run dir {tmp_path / 'nope'} does not exist"


def test_killed_mid_overlap_resumes_like_the_uninterrupted_async_run(setup, capfd, caplog):
    """With `max_staleness` 1, step 2's rollout runs while step 1 trains: killed then, the resume keeps step 2's
    finished trials, runs the rest on the same weight version as before (the schedule is fixed), and ends with
    the uninterrupted async run's metrics and weights."""
    model, data, runs = setup
    overlap = {"train": {"max_staleness": 1}}
    reference = _with(run_config(runs, model, data, "async-reference", steps=STEPS), overlap)
    train_flow(parse_run_config(reference))
    _kill_run(runs, model, data, "async-mid-train", "train", step=1, overrides=overlap)
    root = runs / "async-mid-train"
    finished = {s["rollout_id"] for s in _journal(root, 2)}  # step 2's trials done before the kill
    dirs_before = _trial_dirs(root, 2)
    _resume(runs, "async-mid-train", capfd, caplog)
    _assert_resumed_like_reference(root, runs / "async-reference")  # each trial journaled once, none lost
    assert [len(_trial_dirs(root, s)) for s in (0, 1)] == [TRIALS, TRIALS]
    # the overlapped step's finished trials did not run again; its cut-off attempts ran again in new dirs
    assert finished <= {s["rollout_id"] for s in _journal(root, 2)}
    assert len(_trial_dirs(root, 2)) == TRIALS + len(dirs_before) - len(finished)
    assert {v for *_, v in _traces(root, 2)} == {"1"}  # one step off, before and after the kill


def test_an_engine_killed_three_times_is_restarted_and_the_run_ends_as_its_reference(setup, monkeypatch):
    """The embedded engine SIGKILLed in step 0's rollout (serving the prepared model), right after step 1's update
    (before its weights are synced) and in step 2's rollout (serving the weights of 2 updates, in memory): each time
    it comes back on its port with the weights it served or the trainer's, the trials waiting for it go on, none
    runs again, and the run ends as the one never interrupted."""
    import grpoflow.rollout.journal as journal
    import grpoflow.train.ranks as ranks

    model, data, runs = setup
    real_append, real_update, seen = journal.append_jsonl, ranks.grpo_update, {"step_0": 0, "step_2": 0}

    def kill_engine() -> None:
        (group,) = {os.getpgid(p) for p in descendants_running("grpoflow.embedded.engine.server")}
        os.killpg(group, signal.SIGKILL)

    def append(path, record):
        real_append(path, record)
        where = Path(path).parent.name
        if Path(path).name == "journal.jsonl" and where in seen:
            seen[where] += 1
            if seen[where] == 3:  # 3 trials journaled, the others mid-flight
                kill_engine()

    def grpo_update(state, samples, cfg, at):
        out = real_update(state, samples, cfg, at)
        if at == 1:
            kill_engine()
        return out

    monkeypatch.setattr(journal, "append_jsonl", append)
    monkeypatch.setattr(ranks, "grpo_update", grpo_update)
    train_flow(parse_run_config(run_config(runs, model, data, "engine-killed", steps=STEPS)))
    root = runs / "engine-killed"
    _assert_resumed_like_reference(root, runs / "reference")
    info = read_run_info(RunPaths(root))
    assert [(r.exit, r.weight_version, r.error) for r in info.engine_restarts] == [
        ("SIGKILL", "0", None),
        ("SIGKILL", "2", None),  # the trainer's: no rollout ran, and the sync of them was due
        ("SIGKILL", "2", None),
    ]
    assert info.survived.engine_restarts == 3 and info.survived.engine_restart_s > 0
    assert (root / "engine.log").read_text().count("grpoflow: restarting") == 3

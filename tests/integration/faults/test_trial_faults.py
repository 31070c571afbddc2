"""Faults inside a rollout step, through the real trial runner, Harbor, the shell agent and the local sandbox:
hanging commands, a sandbox dying mid-episode, engine 5xx / timeouts / dropped connections, a crashing verifier.

For each: the step completes, every trial is a sample (reward, or FAILED with an exit status and a reason)."""

import shutil
import time

import pytest

from grpoflow.samples import select_trainable
from tests.fakes.scripted_engine import Reply, ScriptedEngine
from tests.integration.faults.helpers import accounted, collect, load_standin, prompt

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

SOLVE = "```bash\necho hello > /app/hello.txt\n```"


@pytest.fixture
def scripted(tiny_model_dir):
    engines = []

    def make(script):
        engines.append(ScriptedEngine(str(tiny_model_dir), script))
        return engines[-1]

    yield make
    for e in engines:
        e.stop()


def test_hanging_command_is_cut_at_its_timeout_and_124_fed_back(tmp_path, tiny_model_dir, scripted):
    replies = ["```bash\nsleep 100\n```", "DONE"]
    engine = scripted(lambda ids, i: Reply(replies[min(i, 1)]))
    t0 = time.monotonic()
    res, retried = collect(tmp_path, engine.url, tiny_model_dir, [prompt("hello-file")], command_timeout_sec=1)
    elapsed = time.monotonic() - t0
    accounted(res, 1)
    [s] = res.samples
    assert elapsed < 30, f"the trial took {elapsed:.0f}s: the hung command was not cut at 1s"
    assert (s.status, s.exit_status, s.reward) == ("COMPLETED", "Submitted", 0.0)  # verified: the file is missing
    assert s.messages[3]["role"] == "user" and s.messages[3]["content"].startswith("exit code 124")
    assert s.metrics["tool_time_s"] < 10 and retried == []


def test_sandbox_dying_mid_episode_is_retried_then_recorded(tmp_path, tiny_model_dir, scripted, faulty_sandbox):
    # Every sandbox dies at its 2nd exec (the agent's 2nd command): each attempt fails the same way.
    engine = scripted(lambda ids, i: Reply("```bash\ntouch /app/a\n```"))
    res, retried = collect(
        tmp_path,
        engine.url,
        tiny_model_dir,
        [prompt("hello-file")],
        n_samples_per_prompt=2,
        sandbox_retries=2,
        sandbox_kwargs={"die_after_execs": 1},
    )
    accounted(res, 2)
    assert len(retried) == 2 * 2  # each trial: first attempt + 2 retries, all in fresh sandboxes
    for s in res.samples:
        assert (s.status, s.exit_status, s.reward) == ("FAILED", "SandboxError", None)
        assert "SandboxDiedError" in s.exit_reason and "after 2 retries" in s.exit_reason
        assert s.metrics["retries"] == 2
    assert len(list((tmp_path / "trials").iterdir())) == 2 * 3  # one trial dir per attempt
    assert select_trainable(res.samples, "drop_group") == ([], 1)


def test_sandbox_dying_under_the_verifier_is_retried_then_recorded(tmp_path, tiny_model_dir, scripted, faulty_sandbox):
    # The agent's one command solves the task; the sandbox dies at the next exec, the verifier's: no reward may
    # be invented (the file *is* there), so the trial is retried and then recorded as a SandboxError.
    replies = [SOLVE, "DONE"]
    engine = scripted(lambda ids, i: Reply(replies[min(i % 2, 1)]))
    res, retried = collect(
        tmp_path,
        engine.url,
        tiny_model_dir,
        [prompt("hello-file")],
        sandbox_retries=1,
        sandbox_kwargs={"die_after_execs": 1},
    )
    accounted(res, 1)
    [s] = res.samples
    assert s.reward is None and s.status == "FAILED" and s.exit_status == "SandboxError"
    assert len(retried) == 1


@pytest.mark.parametrize("fault, requests", [("5xx", 4), ("drop", 4), ("slow", 2)])
def test_transient_engine_fault_is_recovered(tmp_path, tiny_model_dir, scripted, fault, requests):
    """Two faulted generations: a 5xx or a dropped connection is retried by the client; a `slow` answer (twice
    `request_timeout_s`) is waited for, within the allowance for the tokens it asked (`min_decode_tok_s`)."""
    replies = [SOLVE, "DONE"]
    engine = scripted(lambda ids, i: Reply(replies[0 if len(ids) < 200 else 1]))
    Standin = load_standin()
    with Standin(str(tiny_model_dir), upstream=engine.url) as front:
        front.faults.inject(fault, times=2, status=503, delay_s=3.0)
        res, retried = collect(
            tmp_path, front.url, tiny_model_dir, [prompt("hello-file")], engine={"request_timeout_s": 1.5, "retries": 3}
        )
        seen = front.count("/generate")
    accounted(res, 1)
    [s] = res.samples
    assert (s.status, s.exit_status, s.reward) == ("COMPLETED", "Submitted", 1.0), s.exit_reason
    assert seen == requests and retried == []  # both turns answered, after the client's own retries


@pytest.mark.parametrize("fault", ["5xx", "slow", "drop"])
def test_persistent_engine_fault_fails_samples_as_infrastructure_not_the_step(
    tmp_path, tiny_model_dir, scripted, fault
):
    """An engine that stays down past the outage budget: each trial is run again (an infrastructure fault, like a
    dead sandbox), then recorded as an EngineError, never as the policy's failure or a silent 0. A generation
    past its timeout is not re-sent by the client (one attempt); the others are retried."""
    engine = scripted(lambda ids, i: Reply(SOLVE))
    Standin = load_standin()
    with Standin(str(tiny_model_dir), upstream=engine.url) as front:
        front.faults.inject(fault, times=None, status=502, delay_s=2.0)
        res, retried = collect(
            tmp_path,
            front.url,
            tiny_model_dir,
            [prompt("hello-file"), prompt("make-dir")],
            engine={"request_timeout_s": 0.5, "min_decode_tok_s": 0, "retries": 1, "outage_wait_s": 0},
            sandbox_retries=1,
        )
    accounted(res, 2)
    for s in res.samples:
        assert (s.status, s.exit_status, s.reward) == ("FAILED", "EngineError", None)  # never a silent 0
        assert "EngineUnavailableError" in s.exit_reason
        assert ("not re-sent" if fault == "slow" else "failed after 2 attempts") in s.exit_reason
        assert s.metrics["retries"] == 1  # run again in a fresh sandbox, as infrastructure
    assert len(retried) == 2 and res.figures.computed["scored"] == 0 and res.figures.computed["exit/EngineError"] == 2
    assert select_trainable(res.samples, "drop_group") == ([], 2)


@pytest.mark.parametrize("outage_s", [5])
def test_an_engine_outage_mid_step_is_waited_out_and_drops_nothing(tmp_path, tiny_model_dir, scripted, outage_s):
    """The engine goes away for `outage_s` seconds while trials generate (every request fails in that time):
    requests wait it out (`engine.outage_wait_s`), so every trial is scored and no group is dropped; the
    long generations are not the ones lost. bench/chaos.py runs it with longer outages on a real model."""
    import threading

    replies = [SOLVE, "DONE"]
    engine = scripted(lambda ids, i: Reply(replies[0 if len(ids) < 200 else 1]))
    Standin = load_standin()
    with Standin(str(tiny_model_dir), upstream=engine.url) as front:

        def outage():
            while front.count("/generate") < 2:  # mid-step: after the first generations
                time.sleep(0.05)
            front.faults.inject("drop", times=None)
            time.sleep(outage_s)
            front.faults.clear()

        down = threading.Thread(target=outage, daemon=True)
        down.start()
        res, retried = collect(
            tmp_path,
            front.url,
            tiny_model_dir,
            [prompt("hello-file"), prompt("make-dir"), prompt("copy-file")],
            n_samples_per_prompt=2,
            engine={"request_timeout_s": 5, "retries": 1, "outage_wait_s": 60},
        )
        down.join()
    accounted(res, 6)
    assert retried == [] and res.figures.computed["scored"] == 6
    assert select_trainable(res.samples, "drop_group")[1] == 0


def test_crashing_verifier_is_a_verifier_error_and_its_group_dropped(tmp_path, tiny_model_dir, scripted):
    from grpoflow.prepare.dataset import builtin_dataset_path

    task = tmp_path / "tasks" / "hello-crash"
    shutil.copytree(builtin_dataset_path() / "hello-file", task)
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nexit 1\n")
    replies = [SOLVE, "DONE"]
    engine = scripted(lambda ids, i: Reply(replies[0 if len(ids) < 200 else 1]))
    res, retried = collect(
        tmp_path, engine.url, tiny_model_dir, [prompt(task), prompt("hello-file")], n_samples_per_prompt=2
    )
    accounted(res, 4)
    crashed = [s for s in res.samples if s.instance_id == "hello-crash"]
    fine = [s for s in res.samples if s.instance_id == "hello-file"]
    for s in crashed:
        assert (s.status, s.exit_status, s.reward) == ("FAILED", "VerifierError", None), s.exit_reason
    assert [s.reward for s in fine] == [1.0, 1.0]
    kept, dropped = select_trainable(res.samples, "drop_group")
    assert dropped == 1 and {s.instance_id for s in kept} == {"hello-file"}
    assert retried == []


@pytest.mark.parametrize("breaker", [True, False])
def test_a_sandbox_provider_outage_is_held_back_by_the_breaker(
    tmp_path, tiny_model_dir, scripted, faulty_sandbox, breaker
):
    """Every sandbox start fails for the first `OUTAGE_S` seconds (a provider down). With the breaker, no new trial
    starts while it is open, one probe at a time tries, and once a probe's sandbox starts every trial runs: all are
    scored, no group is dropped, and the failed starts during the outage cost no retry. Without it (failure_rate 1:
    never opens) the same outage spends each trial's one retry and every trial fails as a sandbox error."""
    outage_s = 30
    replies = [SOLVE, "DONE"]
    engine = scripted(lambda ids, i: Reply(replies[0 if len(ids) < 200 else 1]))
    res, retried = collect(
        tmp_path,
        engine.url,
        tiny_model_dir,
        [prompt("hello-file"), prompt("make-dir")],
        n_samples_per_prompt=4,
        sandbox={
            "retries": 1,
            "retry_backoff_s": 1.0,  # the window fills with first attempts before any retry starts
            "breaker": {"window": 4, "failure_rate": 0.5 if breaker else 1.0, "wait_s": 4, "max_wait_s": 8},
            "kwargs": {"start_outage_s": outage_s, "start_outage_file": str(tmp_path / "outage")},
        },
    )
    accounted(res, 8)
    if not breaker:
        assert [s.exit_status for s in res.samples] == ["SandboxError"] * 8
        assert res.figures.seconds["sandbox_breaker_openings"] == 0
        return
    assert [s.status for s in res.samples] == ["COMPLETED"] * 8 and res.figures.computed["scored"] == 8
    assert select_trainable(res.samples, "drop_group")[1] == 0
    assert res.figures.seconds["sandbox_breaker_openings"] >= 1
    # open until a probe's sandbox started: most of the outage, and not past its end by more than a probe's wait
    assert outage_s - 10 <= res.figures.seconds["sandbox_breaker_open_s"] <= outage_s + 8 + 5
    assert len(retried) > 8  # failed starts ran again: far more than the one retry each trial had

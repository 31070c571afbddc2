"""LocalSandbox with process_scope="trial": processes (a tmux server) live across execs, isolation stays."""

from __future__ import annotations

import asyncio
import functools
import shutil
import time
from collections.abc import Callable

import pytest

from grpoflow.embedded.sandbox.local import TIMEOUT_EXIT_CODE, LocalSandbox
from grpoflow.rollout.environments import SandboxDiedError
from tests.integration.sandbox import test_sandbox_isolation as isolation
from tests.integration.sandbox.sandbox_helpers import live_pids, new_marker, wait_gone


@pytest.fixture
def trial_sandbox(make_sandbox: Callable[..., LocalSandbox]) -> Callable[..., LocalSandbox]:
    return functools.partial(make_sandbox, process_scope="trial")


# The isolation guarantees of per-exec sandboxes hold in trial scope too (all but "background processes die with
# the exec", which trial scope gives up on purpose).
@pytest.mark.parametrize(
    "check",
    [
        isolation.test_no_network_not_even_the_hosts_loopback,
        isolation.test_cannot_write_outside_its_dirs,
        isolation.test_cannot_read_planted_host_secrets,
        isolation.test_host_environment_never_reaches_the_sandbox,
        isolation.test_fork_bomb_is_contained,
        isolation.test_memory_hog_is_contained,
        isolation.test_output_is_capped,
        isolation.test_cannot_see_or_kill_the_parent,
    ],
    ids=lambda f: f.__name__.removeprefix("test_"),
)
def test_isolation_holds_in_trial_scope(check, trial_sandbox, request) -> None:
    wanted = check.__code__.co_varnames[: check.__code__.co_argcount]
    fixtures = {name: request.getfixturevalue(name) for name in wanted if name != "make_sandbox"}
    check(make_sandbox=trial_sandbox, **fixtures)


def test_unknown_process_scope_is_refused(make_sandbox) -> None:
    with pytest.raises(ValueError, match="process_scope"):
        make_sandbox(process_scope="forever")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_a_tmux_server_survives_between_execs_and_stop_ends_it(trial_sandbox) -> None:
    marker = new_marker()

    async def main() -> tuple:
        env = trial_sandbox()
        await env.start(force_build=False)
        started = await env.exec(f"tmux new-session -d -s m{marker.replace('.', '')} -x 80 -y 20", timeout_sec=10)
        session = f"m{marker.replace('.', '')}"
        await env.exec(f"tmux send-keys -t {session} 'echo typed > /tmp/typed; sleep {marker}' Enter", timeout_sec=10)
        deadline = time.monotonic() + 5
        seen = None
        while time.monotonic() < deadline:
            seen = await env.exec("cat /tmp/typed 2>/dev/null; tmux ls", timeout_sec=10)
            if "typed" in seen.stdout:
                break
            await asyncio.sleep(0.1)
        alive_before_stop = live_pids(marker, exact=f"sleep {marker}")
        await env.stop(delete=True)
        return started, seen, alive_before_stop

    started, seen, alive_before_stop = asyncio.run(main())
    assert started.return_code == 0
    assert seen is not None and seen.stdout.startswith("typed\n") and "1 windows" in seen.stdout
    assert len(alive_before_stop) == 1  # the command typed into tmux runs on after the exec that typed it
    assert wait_gone(marker) == []  # stop() took the whole namespace down


def test_background_output_does_not_hold_the_exec_and_timeouts_kill_the_command(trial_sandbox) -> None:
    marker = new_marker()

    async def main() -> tuple:
        env = trial_sandbox()
        await env.start(force_build=False)
        t0 = time.monotonic()
        bg = await env.exec(f"sleep {marker} & echo started", timeout_sec=30)
        bg_s = time.monotonic() - t0
        t0 = time.monotonic()
        timed = await env.exec(f"echo before; sleep {marker}1", timeout_sec=1)
        timed_s = time.monotonic() - t0
        gone_fg = wait_gone(f"{marker}1")
        after = await env.exec("echo alive", timeout_sec=10)
        await env.stop(delete=True)
        return bg, bg_s, timed, timed_s, gone_fg, after

    bg, bg_s, timed, timed_s, gone_fg, after = asyncio.run(main())
    assert bg.return_code == 0 and bg.stdout == "started\n" and bg_s < 3
    assert timed.return_code == TIMEOUT_EXIT_CODE and timed.stdout == "before\n" and timed_s < 4
    assert gone_fg == []
    assert after.stdout == "alive\n"
    assert wait_gone(marker) == []


def test_orphans_are_reaped_and_inside_kills_cannot_end_the_sandbox(trial_sandbox) -> None:
    async def main() -> tuple:
        env = trial_sandbox(max_processes=64)
        await env.start(force_build=False)
        # 100 orphans > max_processes: unreaped zombies would count against RLIMIT_NPROC and block later forks.
        for _ in range(4):
            await env.exec("for i in $(seq 25); do (true &) ; done", timeout_sec=30)
        await asyncio.sleep(0.3)
        zombies = await env.exec("ps -eo stat= | grep -c '^Z' || true", timeout_sec=10)
        attack = await env.exec("kill -9 -1 1; kill -9 1; echo tried", timeout_sec=10)
        after = await env.exec("echo alive", timeout_sec=10)
        await env.stop(delete=True)
        with pytest.raises(SandboxDiedError):
            await env.exec("true")
        return zombies, attack, after

    zombies, attack, after = asyncio.run(main())
    assert zombies.stdout.strip() == "0"
    assert attack.stdout == "tried\n" and after.stdout == "alive\n"


def test_the_agents_processes_end_before_the_verifier(trial_sandbox) -> None:
    """Harbor calls prepare_logs_for_host() between the agent phase and the verifier: a process the policy left
    behind (here one that would rewrite the reward) must not outlive the agent phase."""
    marker = new_marker()

    async def main() -> tuple:
        env = trial_sandbox()
        await env.start(force_build=False)
        await env.exec(f"(while :; do echo 1 > /logs/verifier/reward.txt; sleep {marker}; done) >/dev/null 2>&1 &")
        deadline = time.monotonic() + 5
        while not (running := live_pids(marker, exact=f"sleep {marker}")) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await env.prepare_logs_for_host()
        gone = wait_gone(marker)
        after = await env.exec("echo alive", timeout_sec=10)
        await env.stop(delete=True)
        return running, gone, after

    running, gone, after = asyncio.run(main())
    assert len(running) == 1 and gone == []
    assert after.stdout == "alive\n"


def test_a_timed_out_command_whose_escaped_child_holds_the_output_still_returns(trial_sandbox) -> None:
    marker = new_marker()

    async def main() -> tuple:
        env = trial_sandbox()
        await env.start(force_build=False)
        t0 = time.monotonic()
        timed = await env.exec(f"setsid sleep {marker} & sleep {marker}1", timeout_sec=1)
        elapsed = time.monotonic() - t0
        await env.stop(delete=True)
        return timed, elapsed

    timed, elapsed = asyncio.run(main())
    assert timed.return_code == TIMEOUT_EXIT_CODE and elapsed < 8
    assert wait_gone(marker) == []  # stop() ended the escaped child too

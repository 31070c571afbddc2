"""A trial's memory, processes and cpus are limited as Docker limits a container: by a cgroup of the trial's (real
cgroups of this machine), with an address-space cap per process only where no cgroup can be had."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from grpoflow.embedded.sandbox import cgroups, local
from grpoflow.embedded.sandbox.cgroups import (
    CgroupUnavailable,
    Hierarchy,
    Limits,
    create,
    hierarchies,
    unavailable_reason,
)
from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.preflight import check_local_sandbox

RESERVE_8_GIB = "python3 -c 'import mmap; m = mmap.mmap(-1, 8 << 30); print(len(m))'"  # reserved, never touched
HOG_400_MB = "x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}"


@pytest.fixture
def with_cgroups() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no cgroup can be had on this machine: {reason}")


def _resources(env: LocalSandbox) -> dict:
    return json.loads((Path(env.trial_paths.trial_dir) / "sandbox-resources.json").read_text())


@pytest.mark.parametrize("scope", ["exec", "trial"])
def test_memory_is_the_trial_s_resident_memory(with_cgroups, make_sandbox: Callable[..., LocalSandbox], scope) -> None:
    async def main() -> tuple:
        env = make_sandbox(memory_mb=256, process_scope=scope)
        await env.start(force_build=False)
        dirs = list(env._cgroup.dirs.values())
        results = [await env.exec(cmd, timeout_sec=60) for cmd in (RESERVE_8_GIB, HOG_400_MB, "echo alive")]
        await env.stop(delete=True)
        return env, dirs, results

    env, dirs, (reserve, hog, after) = asyncio.run(main())
    assert reserve.return_code == 0 and reserve.stdout.strip() == str(8 << 30)  # address space is not memory
    assert hog.return_code != 0 and "400000000" not in hog.stdout
    assert "out of memory" in hog.stderr and "256 MiB" in hog.stderr  # said, not a bare exit 137
    assert after.stdout == "alive\n"
    used = _resources(env)
    assert used["limited_by"].startswith("cgroup") and used["memory_mb"] == 256 and used["oom_kills"] >= 1
    assert 0 < used["peak_memory_mb"] <= 256
    assert not any(d.exists() for d in dirs)  # the trial's cgroup went with it


def test_the_task_s_memory_applies_unless_the_settings_give_one(with_cgroups, make_sandbox) -> None:
    task, given = make_sandbox(), make_sandbox(memory_mb=300)
    assert task.memory_mb == task.task_env_config.memory_mb and given.memory_mb == 300
    assert make_sandbox(override_memory_mb=700).memory_mb == 700  # Harbor's override, as its Docker applies it


def test_cpus_are_a_quota_on_the_whole_trial(with_cgroups, make_sandbox: Callable[..., LocalSandbox]) -> None:
    # Two busy loops for 2 s of wall time: unlimited they take ~4 CPU-seconds on two cores; at cpus=0.5, ~1.
    busy = "for i in 1 2; do timeout 2 bash -c 'while :; do :; done' & done; wait; times"

    async def main() -> str:
        env = make_sandbox(override_cpus=0.5)
        await env.start(force_build=False)
        result = await env.exec(busy, timeout_sec=60)
        await env.stop(delete=True)
        return result.stdout

    children = asyncio.run(main()).splitlines()[-1]  # `times`: children's user and system time
    seconds = sum(int(m) * 60 + float(s) for m, s in re.findall(r"(\d+)m([\d.]+)s", children))
    assert seconds < 1.5, children


def test_without_a_cgroup_memory_is_an_address_space_cap_and_preflight_says_so(
    make_sandbox: Callable[..., LocalSandbox], monkeypatch, caplog
) -> None:
    monkeypatch.setattr(local, "unavailable_reason", lambda: "no cgroup here (test)")

    async def main() -> tuple:
        env = make_sandbox(memory_mb=512)
        await env.start(force_build=False)
        result = await env.exec(RESERVE_8_GIB, timeout_sec=60)
        await env.stop(delete=True)
        return env, result

    env, reserve = asyncio.run(main())
    assert reserve.return_code != 0 and "Cannot allocate memory" in reserve.stderr
    assert _resources(env) == {
        "limited_by": "RLIMIT_AS",
        "memory_mb": 512,
        "cpus": None,
        "max_processes": 256,
        "address_space_mb": 512,
    }
    assert not LocalSandbox.resource_capabilities().memory_limit
    with caplog.at_level("WARNING"):
        assert check_local_sandbox() == []  # a notice, not a failure
    [notice] = [r.getMessage() for r in caplog.records if "RLIMIT_AS" in r.getMessage()]
    assert "no cgroup here (test)" in notice


# What /proc says on the two layouts a machine has: v1 controllers beside a bare v2 (this kind of machine, in a
# memory cgroup of its own), and systemd's pure v2 (a service's cgroup).
HYBRID_MOUNTINFO = """\
30 25 0:26 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 30 0:29 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
35 30 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_CGROUP = "8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"
V2_MOUNTINFO = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V2_CGROUP = "0::/system.slice/grpoflow.service\n"


def test_the_trial_cgroup_goes_under_this_process_s_own_cgroup_in_each_hierarchy() -> None:
    hybrid = hierarchies(HYBRID_MOUNTINFO, HYBRID_CGROUP)
    assert {name: str(h.own) for name, h in hybrid.items()} == {
        "pids": "/sys/fs/cgroup/pids",
        "memory": "/sys/fs/cgroup/memory/process_api/abc",
        "cpu": "/sys/fs/cgroup/cpu",
        "": "/sys/fs/cgroup/unified",
    }
    [v2] = hierarchies(V2_MOUNTINFO, V2_CGROUP).values()
    assert str(v2.own) == "/sys/fs/cgroup/system.slice/grpoflow.service" and v2.controller == ""
    # A hierarchy mounted from another namespace's subtree that does not hold ours shows no cgroup of ours.
    other = V2_MOUNTINFO.replace(" / /sys/fs/cgroup ", " /user.slice /sys/fs/cgroup ")
    assert hierarchies(other, V2_CGROUP) == {}


def test_a_cgroup_that_cannot_be_made_is_a_reason_not_a_crash(tmp_path, monkeypatch) -> None:
    # The first mkdir fails (as for a non-root user, or a container's read-only cgroupfs): create() cleans up
    # what it made (nothing) and says why; no v2 hierarchy is tried (none given).
    found = {name: Hierarchy(name, tmp_path / name, tmp_path / name) for name in ("memory", "pids")}
    for h in found.values():
        h.own.mkdir()
    monkeypatch.setattr(cgroups, "_new_name", lambda: "grpoflow-1-1")
    (found["memory"].own / "grpoflow-1-1").write_text("")  # in the way of the memory dir
    with pytest.raises(CgroupUnavailable, match=r"^v1: .*File exists"):
        create(Limits(memory_bytes=2**26, pids=8, cpus=None), found)
    assert list(found["pids"].own.iterdir()) == []

"""A task's image as Docker runs it (issue 42): every dir the Dockerfile filled (/app by COPY and RUN, /root, /tmp,
a USER's home) is in the trial as built, the image's USER is the account commands run under, and each trial has
a copy-on-write layer of its own over the shared tree (as root: an overlay mount, gone when the trial stops)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from grpoflow.embedded.sandbox import orphans
from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.embedded.sandbox.rootfs import mount_layer, overlay_mount_points, tree_bytes, unmount_layer
from grpoflow.rollout.environments import ImageBuildError
from tests.integration.docker.conftest import task_with_dockerfile
from tests.integration.sandbox.conftest import sandbox_factory

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the overlay layer is made as root")

# A Dockerfile as corpora write them: data COPY'd into /app, a file built there, state left in /root and /tmp, a
# user of its own with a home, 8 MB of data the trials share and never copy.
FAITHFUL = r"""FROM debian:bookworm-slim
COPY data/ /app/
RUN cd /app && awk -F, 'NR > 1 { s += $2 } END { print s }' sales.csv > built.txt && \
    head -c 8000000 /dev/urandom > /app/shared.bin && \
    mkdir -p /root/.config && echo root-state > /root/.config/seed && echo tmp-state > /tmp/seed && \
    useradd --create-home --shell /bin/bash builder && echo builder-state > /home/builder/.profile-seed
USER builder
WORKDIR /app
"""


@pytest.fixture
def faithful(image_cache: Path, tmp_path: Path) -> Iterator[Callable[..., LocalSandbox]]:
    task = task_with_dockerfile(tmp_path, "faithful", FAITHFUL)
    yield from sandbox_factory(lambda _: task, task.name, tmp_path, image_cache_dir=str(image_cache))


def test_the_image_s_dirs_and_user_are_the_trial_s_on_a_layer_of_its_own(
    faithful: Callable[..., LocalSandbox],
) -> None:
    async def main() -> tuple:
        first, second = faithful(), faithful()
        await first.start(force_build=False)
        await second.start(force_build=False)
        assert first._root is not None
        mounted = str(first._root / "rootfs") in overlay_mount_points()
        upper = tree_bytes([first._root / "layer" / "upper"], 2**40)
        seen = await first.exec(
            "pwd; cat built.txt; wc -c < shared.bin; cat /root/.config/seed /tmp/seed $HOME/.profile-seed; "
            "whoami; echo $HOME $USER; stat -c %U /app /home/builder"
        )
        wrote = await first.exec("echo changed > built.txt && echo new > $HOME/new && rm shared.bin && echo ok")
        other = await second.exec("cat built.txt; ls $HOME; ls /app")
        root = first._root
        await first.stop(delete=True)
        return first, seen, wrote, other, mounted, upper, root

    first, seen, wrote, other, mounted, upper, root = asyncio.run(main())
    assert seen.return_code == 0, seen.stderr
    assert seen.stdout.split("\n")[:8] == [
        "/app",  # WORKDIR
        "47",  # RUN built it in /app from what COPY put there
        "8000000",
        "root-state",  # the image's /root and /tmp, kept
        "tmp-state",
        "builder-state",  # USER's home
        "builder",  # USER is the account commands run under
        "/home/builder builder",
    ]
    assert seen.stdout.split()[-2:] == ["builder", "builder"]  # the trial's own dirs belong to that account
    assert wrote.stdout.strip() == "ok", wrote.stderr
    assert other.stdout.split() == ["47", "built.txt", "sales.csv", "shared.bin"]  # the first trial's writes
    tree = first.image.rootfs
    assert (tree / "app" / "built.txt").read_text() == "47\n" and (tree / "app" / "shared.bin").is_file()
    # An overlay at the trial's /, whose upper dir took the chowns as inodes, not 8 MB of copies.
    assert mounted
    assert upper < 4_000_000, upper
    assert not root.exists() and str(root) not in Path("/proc/self/mountinfo").read_text()  # unmounted first


def test_a_user_the_image_does_not_have_fails_at_start_in_one_line(image_cache: Path, tmp_path: Path) -> None:
    task = task_with_dockerfile(tmp_path, "no-user", "FROM debian:bookworm-slim\nUSER ghost\n")
    factory = sandbox_factory(lambda _: task, task.name, tmp_path, image_cache_dir=str(image_cache))
    make = next(factory)
    try:
        with pytest.raises(ImageBuildError, match=r"the image's USER ghost is not in its /etc/passwd") as info:
            asyncio.run(make().start(force_build=False))
        assert "\n" not in str(info.value)
    finally:
        next(factory, None)


def test_the_janitor_unmounts_a_dead_run_s_layer_before_removing_it(tmp_path: Path) -> None:
    """A run killed with a trial's overlay mounted: its dir goes, and the delete never walks into the mount (the
    shared tree below it keeps every file)."""
    lower = tmp_path / "tree"
    (lower / "app").mkdir(parents=True)
    (lower / "app" / "kept.txt").write_text("shared\n")
    base = tmp_path / "work"
    trial = base / "grpoflow-sandbox-dead-1"
    trial.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (trial / orphans.OWNER_FILE).write_text(
        f'{{"pid": {dead.pid}, "start": 1, "pidns": "{os.readlink("/proc/self/ns/pid")}", '
        f'"boot": "{Path("/proc/sys/kernel/random/boot_id").read_text().strip()}"}}\n'
    )
    mount_layer(lower, trial / "layer", trial / "rootfs")
    assert (trial / "rootfs" / "app" / "kept.txt").is_file()
    assert orphans.sweep(base) == [trial]
    assert not trial.exists() and str(base) not in Path("/proc/self/mountinfo").read_text()
    assert (lower / "app" / "kept.txt").read_text() == "shared\n"


def test_only_a_layer_of_ours_mounted_exactly_there_is_detached(tmp_path: Path) -> None:
    """A trial dir in a shared temp dir may be anyone's: a link (to /) or another user's dir is never a reason to
    detach a mount, whatever is mounted under it."""
    lower = tmp_path / "tree"
    lower.mkdir()
    link = tmp_path / "grpoflow-sandbox-link"
    link.symlink_to("/")
    unmount_layer(link)  # would name /rootfs, or every mount under / if the link were followed
    assert os.path.ismount("/proc")
    theirs = tmp_path / "grpoflow-sandbox-theirs"
    theirs.mkdir()
    mount_layer(lower, theirs / "layer", theirs / "rootfs")
    os.chown(theirs, 12345, 12345)
    try:
        unmount_layer(theirs)
        assert str(theirs / "rootfs") in overlay_mount_points()
    finally:
        os.chown(theirs, 0, 0)
        unmount_layer(theirs)
    assert str(theirs / "rootfs") not in overlay_mount_points()

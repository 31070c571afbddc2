"""Task images for the local sandbox: a task's `environment/` built with a real `docker build`, its filesystem
exported once, and the image's WORKDIR and ENV, so trials run under the same bubblewrap sandbox on that tree
instead of the host's /usr.

Why bubblewrap on the exported tree rather than `docker run`: the sandbox's isolation (no network, no host
secrets or loopback, writes only inside the trial, process cleanup, per-trial uid) stays one piece of code, and a
trial starts as fast as on the host rootfs (figures: docs/embedded.md, bench/sandbox_env.py).

Everything is cached by the build context's digest (every file of `environment/`): the image is tagged
`grpoflow-env:<digest>`, its tree unpacked once under `<cache>/<digest>/rootfs` (read-only to trials), its build
log kept at `<cache>/<digest>.build.log`. A failed build raises `ImageBuildError` (a sandbox failure of that
task) with the builder's last lines; it is remembered for the life of the process, so a trial's retries do not
rebuild what just failed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from grpoflow.fileio import sha256_tree
from grpoflow.rollout.environments import ImageBuildError

IMAGE_REPO = "grpoflow-env"
BUILD_TIMEOUT_S = 1800
LOG_TAIL_LINES = 6  # of the builder's output in the error: the failing step, its output and the exit
_BUILDER_NOISE = ("--->", "Removing intermediate container")  # layer ids: no help in finding what failed
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the builder colours a RUN's stderr
DIGEST_CHARS = 24  # of the context's sha256: the tag and the cache dir's name

_failed: dict[str, ImageBuildError] = {}  # context digest -> its failed build (this process)


@dataclass(frozen=True)
class TaskImage:
    tag: str
    rootfs: Path  # the image's exported filesystem (shared by every trial; bound read-only)
    workdir: str | None  # the image's WORKDIR (None: not set)
    env: dict[str, str]  # the image's ENV
    build_log: Path
    built: bool  # this call built it (False: it came from the cache)


def context_digest(environment_dir: Path) -> str:
    return sha256_tree(environment_dir)[:DIGEST_CHARS]


def task_image(environment_dir: Path, cache_dir: Path) -> TaskImage:
    """The task's image, built and unpacked unless the cache has it. Safe to call from many trials (threads or
    processes) at once: one builds, the others wait on a lock and reuse it."""
    digest = context_digest(environment_dir)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{IMAGE_REPO}:{digest}"
    done, log = cache_dir / digest, cache_dir / f"{digest}.build.log"
    with open(cache_dir / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if digest in _failed:  # failed in this process (another trial's, or this one's before its retry)
            raise ImageBuildError(str(_failed[digest]), _failed[digest].log)
        meta = done / "image.json"
        if meta.is_file():
            return _read(meta, tag, log, built=False)
        try:
            _build(environment_dir, tag, log)
            _unpack(tag, done)
        except ImageBuildError as err:
            _failed[digest] = err
            raise
        return _read(meta, tag, log, built=True)


def _build(environment_dir: Path, tag: str, log: Path) -> None:
    # The legacy builder: this engine has no BuildKit plugin, and it never pulls a FROM image it already has.
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                ["docker", "build", "--rm", "-t", tag, str(environment_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=BUILD_TIMEOUT_S,
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"none: timed out after {BUILD_TIMEOUT_S} s"
    if rc != 0:
        lines = [_ANSI.sub("", line).strip() for line in log.read_text(errors="replace").splitlines()]
        tail = " | ".join([line for line in lines if line and not line.startswith(_BUILDER_NOISE)][-LOG_TAIL_LINES:])
        raise ImageBuildError(f"docker build failed (exit {rc}): {tail}", log)


def _unpack(tag: str, done: Path) -> None:
    """`docker create` + `docker export` into `done/rootfs`, with the image's WORKDIR and ENV in image.json."""
    info = json.loads(_docker("image", "inspect", "--format", "{{json .Config}}", tag).stdout)
    staging = Path(tempfile.mkdtemp(prefix=f".{done.name}-", dir=done.parent))
    container = _docker("create", tag, "/bin/true").stdout.strip()
    try:
        (staging / "rootfs").mkdir()
        export = subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE)
        untar = subprocess.run(
            ["tar", "-x", "--numeric-owner", "-C", str(staging / "rootfs")],
            stdin=export.stdout,
            capture_output=True,
            text=True,
        )
        assert export.stdout is not None
        export.stdout.close()
        if export.wait() != 0 or untar.returncode != 0:
            raise ImageBuildError(f"could not export {tag} (docker export exit {export.returncode}): {untar.stderr}")
    finally:
        _docker("rm", "-f", container, check=False)
    env = dict(item.split("=", 1) for item in info.get("Env") or [] if "=" in item)
    meta = {"tag": tag, "workdir": info.get("WorkingDir") or None, "env": env}
    (staging / "image.json").write_text(json.dumps(meta, indent=1))
    if done.exists():  # a half-unpacked tree from a process that died: never marked done
        shutil.rmtree(done)
    staging.rename(done)


def _read(meta: Path, tag: str, log: Path, built: bool) -> TaskImage:
    data = json.loads(meta.read_text())
    return TaskImage(tag, meta.parent / "rootfs", data["workdir"], dict(data["env"]), log, built)


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise ImageBuildError(f"docker {args[0]} {args[1] if len(args) > 1 else ''} failed: {proc.stderr.strip()}")
    return proc

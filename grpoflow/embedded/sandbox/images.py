"""Task images for the local sandbox: a task's `environment/` built with a real `docker build`, its filesystem
exported once, and the image's WORKDIR and ENV, so trials run under the same bubblewrap sandbox on that tree
instead of the host's /usr.

Why bubblewrap on the exported tree rather than `docker run`: the sandbox's isolation (no network, no host
secrets or loopback, writes only inside the trial, process cleanup, per-trial uid) stays one piece of code, and a
trial starts as fast as on the host rootfs (figures: docs/embedded.md, bench/sandbox_env.py).

Everything is cached by the build context's digest (every file of `environment/`) and the image IDs its `FROM`
images resolve to (`grpoflow.dockerfile.resolve_base_images`: `dataset.base_images` applied, pulled when a registry
answers), so a base tag that moved rebuilds; the build starts from exactly those IDs. The image is tagged
`grpoflow-env:<digest>`, its tree unpacked once under `<cache>/<digest>/rootfs` (read-only to trials), its build
log kept at `<cache>/<digest>.build.log`. The cache is collected least recently used first down to a size budget
(`collect`: after each new image, and by `grpoflow cache gc`); a tree in use by a live sandbox (which holds a
shared lock on `<digest>.hold`) is never removed. A failed build raises `ImageBuildError` (a sandbox failure of that
task) with the builder's last lines; it is remembered for the life of the process, so a trial's retries do not
rebuild what just failed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from grpoflow.dockerfile import BaseImage, UnresolvedBaseImage, pinned_dockerfile, resolve_base_images
from grpoflow.embedded.sandbox.rootfs import rmtree, tree_bytes
from grpoflow.fileio import sha256_tree
from grpoflow.rollout.environments import ImageBuildError
from grpoflow.sandbox_settings import LocalSandboxSettings

IMAGE_REPO = "grpoflow-env"
BUILD_TIMEOUT_S = 1800
LOG_TAIL_LINES = 6  # of the builder's output in the error: the failing step, its output and the exit
# Lines that never say what failed: layer ids, the legacy builder's deprecation notice (printed first, so a build
# that fails at parse would show only it), and our own note of the base images at the log's head.
_BUILDER_NOISE = (
    "--->",
    "Removing intermediate container",
    "DEPRECATED: The legacy builder",
    "BuildKit is currently disabled",
    "environment-variable.",
    "# base: ",
    "Sending build context to Docker daemon",
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the builder colours a RUN's stderr
DIGEST_CHARS = 24  # of the cache key's sha256: the tag and the cache dir's name

_failed: dict[str, ImageBuildError] = {}  # context digest -> its failed build (this process)


@dataclass(frozen=True)
class TaskImage:
    tag: str
    rootfs: Path  # the image's exported filesystem (shared by every trial: the lower dir of its layer)
    workdir: str | None  # the image's WORKDIR (None: not set)
    env: dict[str, str]  # the image's ENV
    user: str | None  # the image's USER (None: not set, root)
    build_log: Path
    built: bool  # this call built it (False: it came from the cache)
    bases: tuple[BaseImage, ...] = ()  # the FROM images it was built from


def image_digest(environment_dir: Path, bases: list[BaseImage]) -> str:
    """The cache key: the build context's files and the image IDs its FROM images resolved to."""
    parts = [sha256_tree(environment_dir), *(f"{b.reference} {b.id}" for b in bases)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:DIGEST_CHARS]


def image_key(environment_dir: Path, base_images: dict[str, str] | None = None) -> str:
    """`image_digest` with the FROM images resolved now (`base_images`: `dataset.base_images`)."""
    return image_digest(environment_dir, resolve_base_images(environment_dir, base_images))


DEFAULT_IMAGE_MAX_MB: int = LocalSandboxSettings.model_fields["image_max_mb"].default
DEFAULT_CACHE_MAX_MB = 32768  # the image cache's budget, collected after each new image
USED = "used"  # touched in <digest>/ each time a trial takes the image: the LRU order
RECENT_S = 600  # an entry used this recently is never collected (a trial takes it, then holds it)


def task_image(
    environment_dir: Path,
    cache_dir: Path,
    max_mb: int = DEFAULT_IMAGE_MAX_MB,
    base_images: dict[str, str] | None = None,
) -> TaskImage:
    """The task's image, built and unpacked unless the cache has it; `base_images` maps FROM references to
    local images (`dataset.base_images`). Safe to call from many trials (threads or processes) at once: one
    builds, the others wait on a lock and reuse it."""
    try:
        bases = resolve_base_images(environment_dir, base_images)
    except UnresolvedBaseImage as err:
        raise ImageBuildError(str(err)) from None
    digest = image_digest(environment_dir, bases)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{IMAGE_REPO}:{digest}"
    done, log = cache_dir / digest, cache_dir / f"{digest}.build.log"
    with open(cache_dir / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if digest in _failed:  # failed in this process (another trial's, or this one's before its retry)
            raise ImageBuildError(str(_failed[digest]), _failed[digest].log)
        meta = done / "image.json"
        if meta.is_file() and "user" in json.loads(meta.read_text()):  # else unpacked before USER was kept
            (done / USED).touch()
            return _read(meta, tag, log, False, bases)
        try:
            _build(environment_dir, bases, tag, log)
            _unpack(tag, done, max_mb)
        except ImageBuildError as err:
            _failed[digest] = err
            raise
        (done / USED).touch()
        image = _read(meta, tag, log, True, bases)
    collect(cache_dir, DEFAULT_CACHE_MAX_MB * 2**20, keep=digest)
    return image


def hold(image: TaskImage) -> int:
    """A shared lock on the image's cache entry for as long as the returned fd stays open: `collect` skips it."""
    fd = os.open(_hold_path(image.rootfs.parent), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _hold_path(entry: Path) -> Path:
    # Not the build's lock: a sandbox holding it shared must not block another trial's build or cache lookup.
    return entry.parent / f"{entry.name}.hold"


@dataclass(frozen=True)
class Collected:
    removed: list[tuple[str, int]]  # (digest, bytes) of each entry removed, oldest first
    kept_bytes: int
    busy: list[str]  # entries over the budget left because a sandbox uses them


def collect(cache_dir: Path, budget_bytes: int, keep: str | None = None) -> Collected:
    """Remove unpacked images, least recently used first, until the cache is within `budget_bytes`: the tree,
    the build log and the engine's tag. `keep` (an entry just made) and entries a live sandbox holds stay."""
    entries = []
    for entry in Path(cache_dir).iterdir() if Path(cache_dir).is_dir() else []:
        if entry.is_dir() and not entry.is_symlink() and (entry / "image.json").is_file():
            used = entry / USED
            stamp = used.stat().st_mtime if used.exists() else (entry / "image.json").stat().st_mtime
            entries.append((stamp, entry, tree_bytes([entry], 2**62)))
    total = sum(size for _, _, size in entries)
    removed, busy = [], []
    for stamp, entry, size in sorted(entries, key=lambda e: e[0]):
        if total <= budget_bytes:
            break
        if entry.name == keep:
            continue
        if time.time() - stamp < RECENT_S:  # taken by a trial just now, maybe not yet held
            busy.append(entry.name)
            continue
        with open(_hold_path(entry), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy.append(entry.name)
                continue
            tag = json.loads((entry / "image.json").read_text()).get("tag")
            rmtree(entry)
            for leftover in (".build.log", ".build.Dockerfile"):
                (entry.parent / f"{entry.name}{leftover}").unlink(missing_ok=True)
            if tag:
                _docker("rmi", "-f", tag, check=False)
        removed.append((entry.name, size))
        total -= size
    return Collected(removed, total, busy)


def _build(environment_dir: Path, bases: list[BaseImage], tag: str, log: Path) -> None:
    # The legacy builder: this engine has no BuildKit plugin, and it never pulls a FROM image it already has.
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    # The Dockerfile with its FROM images pinned to their IDs, beside the log (outside the build context).
    pinned = log.with_suffix(".Dockerfile")
    try:
        pinned.write_text(pinned_dockerfile((environment_dir / "Dockerfile").read_text(encoding="utf-8"), bases))
    except UnresolvedBaseImage as err:
        raise ImageBuildError(str(err)) from None
    with open(log, "w") as out:
        out.write("".join(f"# base: FROM {b.reference} -> {b.image} ({b.id})\n" for b in bases))
        out.flush()
        try:
            proc = subprocess.run(
                ["docker", "build", "--rm", "-t", tag, "-f", str(pinned), str(environment_dir)],
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
        lines = [line for line in lines if line and not line.startswith(_BUILDER_NOISE)]
        # From the failing step on (the last `Step N/M`): earlier steps' lines (the pinned FROM's 71-character ID
        # among them) would push what failed out of the reason's length.
        steps = [i for i, line in enumerate(lines) if line.startswith("Step ")]
        tail = " | ".join(lines[steps[-1] if steps else 0 :][-LOG_TAIL_LINES:])
        raise ImageBuildError(f"docker build failed (exit {rc}): {tail}", log)


def _unpack(tag: str, done: Path, max_mb: int) -> None:
    """`docker create` + `docker export` into `done/rootfs`, with the image's WORKDIR, ENV and USER in image.json.

    The export is third-party bytes: unpacked by `_tree_member`'s rules (no owners, no setuid/setgid bits, no
    device nodes, FIFOs or sockets, nothing outside the tree), and no larger than `max_mb` (an image over it is
    refused before the export and removed from the engine).
    """
    info = json.loads(_docker("image", "inspect", "--format", "{{json .}}", tag).stdout)
    size_mb = int(info.get("Size") or 0) / 2**20
    if size_mb > max_mb:
        _docker("rmi", "-f", tag, check=False)
        raise ImageBuildError(f"the image is {size_mb:.0f} MB, over the local sandbox's image_max_mb={max_mb}")
    config = info.get("Config") or {}
    staging = Path(tempfile.mkdtemp(prefix=f".{done.name}-", dir=done.parent))
    container = _docker("create", tag, "/bin/true").stdout.strip()
    skipped: list[str] = []
    try:
        (staging / "rootfs").mkdir()
        export = subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE)
        assert export.stdout is not None
        try:
            with tarfile.open(fileobj=export.stdout, mode="r|") as tar:
                _extract(tar, staging / "rootfs", max_mb * 2**20, skipped)
            # tarfile stops at the end-of-archive blocks; what docker still writes after them (padding) must be
            # read, or `docker export` dies of SIGPIPE and a good image reads as a failed export.
            while export.stdout.read(1 << 20):
                pass
        except (tarfile.TarError, OSError) as exc:
            export.kill()
            raise ImageBuildError(f"could not unpack {tag}: {exc}") from exc
        finally:
            export.stdout.close()
            export.wait()
        if export.returncode != 0:
            raise ImageBuildError(f"could not export {tag} (docker export exit {export.returncode})")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        _docker("rm", "-f", container, check=False)
    env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
    meta = {
        "tag": tag,
        "workdir": config.get("WorkingDir") or None,
        "env": env,
        "user": config.get("User") or None,
        "skipped": skipped,
    }
    (staging / "image.json").write_text(json.dumps(meta, indent=1))
    if done.exists():  # a half-unpacked tree from a process that died: never marked done
        shutil.rmtree(done)
    staging.rename(done)


def _extract(tar: tarfile.TarFile, dest: Path, max_bytes: int, skipped: list[str]) -> None:
    total = 0
    regular: set[str] = set()  # names of the regular files unpacked so far: what a hard link may name
    for member in tar:
        safe = _tree_member(member, str(dest))
        if safe is not None and safe.islnk() and safe.linkname not in regular:
            safe = None  # tarfile would re-read its skipped target (a device node, a FIFO) from the archive
        if safe is None:
            skipped.append(member.name)
            continue
        if safe.isreg():
            regular.add(safe.name)
        total += safe.size if safe.isreg() else 0
        if total > max_bytes:
            raise ImageBuildError(f"the image's tree is over the local sandbox's image_max_mb={max_bytes // 2**20}")
        tar.extract(safe, dest, filter="fully_trusted")  # `safe` already passed the rules


def _tree_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """The member as unpacked into an image tree, or None when it is skipped: only regular files, dirs and links,
    inside the tree (tarfile's `tar_filter`: no absolute or escaping names, no setuid/setgid/sticky or
    group/other-write bits), owned by whoever unpacks (the tree is read-only to every trial)."""
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        return None  # a device node, FIFO or socket: nothing a trial may open from the host's cache
    try:
        safe = tarfile.tar_filter(member, dest)
    except tarfile.FilterError:
        return None
    return safe.replace(uid=None, gid=None, uname=None, gname=None, deep=False)


def _read(meta: Path, tag: str, log: Path, built: bool, bases: list[BaseImage]) -> TaskImage:
    data = json.loads(meta.read_text())
    return TaskImage(
        tag, meta.parent / "rootfs", data["workdir"], dict(data["env"]), data["user"], log, built, tuple(bases)
    )


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        if check:
            raise ImageBuildError("docker is not installed") from None
        return subprocess.CompletedProcess(["docker", *args], 127, "", "docker is not installed")
    if check and proc.returncode != 0:
        raise ImageBuildError(f"docker {args[0]} {args[1] if len(args) > 1 else ''} failed: {proc.stderr.strip()}")
    return proc

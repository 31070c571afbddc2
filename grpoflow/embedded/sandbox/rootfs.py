"""The per-trial host tree behind a `LocalSandbox`'s /: building it, bwrap's mounts over it, mapping sandbox
paths onto host paths, and copying files in and out without following links the sandbox planted.

The system dirs come from a `Base`: the host's (/usr and /etc) or a task image's exported tree (every top-level
dir of it read-only, but the one holding its WORKDIR, which each trial gets a writable copy of).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from grpoflow.embedded.sandbox.launch import STAGE

SANDBOX_HOME = "/root"
# Host dirs shown read-only. Everything else of the host stays invisible.
HOST_RO_DIRS = ("/usr", "/etc")
# Top-level names that are symlinks into /usr on a merged-/usr host (or real dirs to bind read-only otherwise).
HOST_LIB_NAMES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Per-trial dirs the sandbox user owns (relative to rootfs).
OWNED_DIRS = ("app", "tmp", "root", "tests", "solution")
# Top-level names of an image's tree that are never bound from it: per-trial dirs, kernel filesystems, Harbor's logs.
IMAGE_SKIPPED = frozenset({*OWNED_DIRS, "logs", "proc", "dev", "sys", "run"})


@dataclass(frozen=True)
class Base:
    """Where the sandbox's system dirs come from: `root` (the host's /, or an image's exported tree), the
    sandbox paths bound read-only from it, and the top-level dirs each trial gets a writable copy of."""

    root: Path
    ro_dirs: tuple[str, ...]
    seeded: tuple[str, ...] = ()

    @property
    def not_trial_paths(self) -> tuple[str, ...]:
        return (*self.ro_dirs, "/proc", "/dev", *(f"/{n}" for n in HOST_LIB_NAMES))


HOST_BASE = Base(Path("/"), HOST_RO_DIRS)
# Sandbox paths that are host or kernel filesystems, never per-trial files: uploads/downloads there are refused.
NOT_TRIAL_PATHS = HOST_BASE.not_trial_paths


def image_base(tree: Path, workdir: str) -> Base:
    """The base for an image's exported `tree`: its top-level dirs read-only, but the one holding `workdir`
    (e.g. /workspace with the data its Dockerfile copied), which each trial gets its own writable copy of."""
    parts = PurePosixPath(posixpath.normpath(workdir)).parts
    top = parts[1] if len(parts) > 1 else None
    if top in ("usr", "etc", *HOST_LIB_NAMES):
        raise ValueError(f"the image's working directory {workdir} is under /{top}, which trials see read-only")
    ro, seeded = [], []
    for entry in sorted(tree.iterdir()):
        if entry.name in IMAGE_SKIPPED or entry.name in HOST_LIB_NAMES or entry.is_symlink() or not entry.is_dir():
            continue
        (seeded if entry.name == top else ro).append(f"/{entry.name}")
    return Base(tree, tuple(ro), tuple(seeded))


@dataclass(frozen=True)
class Bind:
    target: PurePosixPath  # path in the sandbox
    source: Path  # host dir
    read_only: bool


# ---- Harbor's mounts ------------------------------------------------------------------------------------------


def harbor_binds(host_mounts: list[dict[str, Any]]) -> list[Bind]:
    """Harbor's host mounts (log dirs, user mounts) as bwrap binds, parents before children."""
    binds = []
    for mount in host_mounts:
        if mount["type"] != "bind":
            raise ValueError(f"LocalSandbox supports bind mounts only, got {mount['type']!r} for {mount['target']}")
        target = PurePosixPath(posixpath.normpath(mount["target"]))
        if not target.is_absolute() or target == PurePosixPath("/") or under(target, NOT_TRIAL_PATHS):
            raise ValueError(f"LocalSandbox cannot mount over {target}")
        binds.append(Bind(target, Path(mount["source"]).resolve(), bool(mount.get("read_only"))))
    return sorted(binds, key=lambda b: len(b.target.parts))


def log_binds(binds: list[Bind]) -> list[Bind]:
    """Harbor's log dirs (/logs/agent, /logs/verifier, /logs/artifacts), bound from the trial dir."""
    return [b for b in binds if not b.read_only and under(b.target, ("/logs",))]


# ---- building the tree ----------------------------------------------------------------------------------------


def make_trial_dir(work_dir: str | None, session_id: str) -> Path:
    """A fresh per-trial temp dir under `work_dir` (default: the system temp dir)."""
    base = Path(work_dir) if work_dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", session_id)[:60]
    return Path(tempfile.mkdtemp(prefix=f"grpoflow-sandbox-{name}-", dir=base))


def build_rootfs(
    rootfs: Path,
    app: Path,
    binds: list[Bind],
    uid: int | None,
    auto_mounting: bool,
    base: Base = HOST_BASE,
    storage_bytes: int | None = None,
) -> list[str]:
    """Create the sandbox's / at `rootfs`, pre-filled from the task's `app` dir and the base's seeded dirs (no
    larger together than `storage_bytes`: `BaseTreeError` before any copy); the base's lib dirs to bind read-only
    (one without merged /usr)."""
    if storage_bytes is not None:
        seeded = tree_bytes([app, *(base.root / s[1:] for s in base.seeded)], storage_bytes)
        if seeded > storage_bytes:
            raise BaseTreeError(
                f"the task's working directory ({', '.join(base.seeded) or '/app'}) is over the trial's storage "
                f"cap of {storage_bytes // 2**20} MB before the trial starts"
            )
    rootfs.mkdir(mode=0o755)
    extra_ro: list[str] = []
    for lib in HOST_LIB_NAMES:
        host = base.root / lib
        if host.is_symlink():
            (rootfs / lib).symlink_to(os.readlink(host))
        elif host.is_dir():
            extra_ro.append(f"/{lib}")  # a base without merged /usr: show the real dir read-only
    for owned in OWNED_DIRS:
        (rootfs / owned).mkdir()
    (rootfs / "tmp").chmod(0o1777)
    if app.is_dir():
        shutil.copytree(app, rootfs / "app", symlinks=True, dirs_exist_ok=True)
    for seeded in base.seeded:
        shutil.copytree(base.root / seeded[1:], rootfs / seeded[1:], symlinks=True)
        give(rootfs / seeded[1:], uid)
    for owned in OWNED_DIRS:
        give(rootfs / owned, uid)
    for bind in binds:
        bind.source.mkdir(parents=True, exist_ok=True)
        if uid is not None and bind in log_binds(binds):
            bind.source.chmod(0o777)  # as Harbor does for Docker: the sandbox user writes its logs there
    # bwrap runs unprivileged: every mount point must exist before it starts (it cannot create them in rootfs)
    for ro in extra_ro:
        (rootfs / ro[1:]).mkdir(exist_ok=True)
    repair_mount_points(rootfs, binds, base)
    if not auto_mounting:
        # Harbor's log dirs are then plain sandbox dirs that Harbor downloads; the sandbox writes them.
        for rel in ("logs/agent", "logs/verifier", "logs/artifacts"):
            (rootfs / rel).mkdir(parents=True, exist_ok=True)
            give(rootfs / rel, uid)
    return extra_ro


class Sources:
    """The host paths bwrap mounts, as it will name them. As root, bwrap runs as the sandbox uid, which may not be
    able to enter the dirs above a source (a 0700 home, pytest's temp dir): the launcher then binds each source
    at `STAGE/<n>` in a mount namespace of its own (`launch.stage`), refusing a link. Otherwise the path is used
    as it is."""

    def __init__(self, staged: bool):
        self.staged = staged
        self.paths: list[str] = []

    def __call__(self, path: Path) -> str:
        if not self.staged:
            return str(path)
        self.paths.append(str(path))
        return f"{STAGE}/{len(self.paths) - 1}"

    def stage(self) -> list[tuple[str, str]]:
        """The launcher's `--stage`s: (path, name) per source."""
        return [(path, str(n)) for n, path in enumerate(self.paths)]


def bwrap_argv(
    bwrap: str,
    root: Path,
    binds: list[Bind],
    uid: int,
    extra_ro: list[str],
    sources: Sources,
    base: Base = HOST_BASE,
) -> list[str]:
    """bwrap's argv up to the command ("--" last): the mounts over root/rootfs and the namespaces to unshare.

    bwrap runs as `uid` (the launcher dropped to it) and makes a user namespace that maps only that uid: nothing
    inside holds a capability of the host's. It also writes the passwd/group files (in `root`) that it binds over
    the base's, with a `sandbox` entry for the uid: tools that look the user up (git, whoami, ssh) fail when the
    uid has no name.
    """
    argv = [bwrap, "--unshare-user", "--uid", str(uid), "--gid", str(uid), "--cap-drop", "ALL"]
    argv += ["--bind", sources(root / "rootfs"), "/"]
    for ro in (*base.ro_dirs, *extra_ro):
        argv += ["--ro-bind", sources(base.root / ro[1:]), ro]
    for name, line in (
        ("passwd", f"sandbox:x:{uid}:{uid}:sandbox:{SANDBOX_HOME}:/bin/bash\n"),
        ("group", f"sandbox:x:{uid}:\n"),
    ):
        text = read_tree_file(base.root, f"etc/{name}")
        (root / name).write_text(text + ("" if text.endswith("\n") or not text else "\n") + line)
        argv += ["--ro-bind", sources(root / name), f"/etc/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for bind in binds:
        argv += ["--ro-bind" if bind.read_only else "--bind", sources(bind.source), str(bind.target)]
    argv += [
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--chdir",
        "/",
        "--",
    ]
    return argv


TREE_FILE_MAX_BYTES = 1 << 20  # passwd/group: far above any real one


def read_tree_file(tree: Path, rel: str, limit: int = TREE_FILE_MAX_BYTES) -> str:
    """A small text file of a base's tree ("" when absent), read on the host without following any link on the
    way and without blocking: a link (to /proc/self/environ, a host key), a FIFO or a device in an image is an
    error naming the file, never a read of something outside the tree."""
    parts = PurePosixPath(rel).parts
    fd = os.open(tree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
    except FileNotFoundError:
        return ""
    except OSError as exc:  # ELOOP (a link), ENOTDIR
        raise BaseTreeError(
            f"/{rel} of the sandbox's base is a link or under one, not a regular file: refused"
        ) from exc
    finally:
        os.close(fd)
    with os.fdopen(leaf, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise BaseTreeError(f"/{rel} of the sandbox's base is not a regular file: refused")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BaseTreeError(f"/{rel} of the sandbox's base is over {limit} bytes: refused")
    return data.decode("utf-8", errors="replace")


class BaseTreeError(ValueError):
    """What a trial starts from cannot be made: a file the host reads from the base's tree is a link, a special
    file or too large, or the working dir is over the trial's storage cap."""


def repair_mount_points(rootfs: Path, binds: list[Bind], base: Base = HOST_BASE) -> None:
    """Make every bind target under rootfs a real dir again before bwrap mounts over it.

    bwrap runs with privilege and follows symlinks in mount targets; a sandbox that replaced e.g. /logs with
    a link to a host path must not make the next bwrap create dirs there. (Root-owned rootfs prevents that
    when we run as root; this also covers running as a normal user.)
    """
    targets = [PurePosixPath(p) for p in (*base.ro_dirs, "/proc", "/dev")] + [b.target for b in binds]
    for target in targets:
        path = rootfs
        for part in target.parts[1:]:
            path = path / part
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                remove(path)
            if not path.exists():
                path.mkdir(mode=0o755)


def give(path: Path, uid: int | None) -> None:
    """Hand a per-trial path (recursively) to the sandbox uid, so the sandbox can change what we put there."""
    if uid is None:
        return
    os.lchown(path, uid, uid)
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                os.lchown(os.path.join(dirpath, name), uid, uid)


# ---- files in and out -----------------------------------------------------------------------------------------


def host_path(
    rootfs: Path, binds: list[Bind], workdir: str, sandbox_path: str, base: Base = HOST_BASE
) -> tuple[Path, Path]:
    """(host path, host dir it must stay inside) for a path in the sandbox (relative ones from `workdir`)."""
    path = PurePosixPath(posixpath.normpath(posixpath.join(workdir, sandbox_path)))
    for bind in reversed(binds):  # deepest first
        if path == bind.target or path.is_relative_to(bind.target):
            return bind.source.joinpath(*path.relative_to(bind.target).parts), bind.source
    if under(path, base.not_trial_paths):
        raise ValueError(f"{sandbox_path} is a host or kernel path in the sandbox, not a per-trial file")
    return rootfs.joinpath(*path.parts[1:]), rootfs


def real_dir_chain(base: Path, host_dir: Path, uid: int | None) -> None:
    """Create host_dir under base as real dirs, replacing any symlink the sandbox planted on the way."""
    path = base
    for part in host_dir.relative_to(base).parts:
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            remove(path)
        if not path.exists():
            path.mkdir()
            give(path, uid)


def copy_file_in(source: Path, target: Path, base: Path, uid: int | None) -> None:
    """Copy a host file to `target` (a host path under `base`, from `host_path`), owned by the sandbox uid."""
    real_dir_chain(base, target.parent, uid)
    if target.is_symlink() or target.is_dir():
        remove(target)  # never write through a link the sandbox planted
    shutil.copy2(source, target)
    give(target, uid)


def copy_dir_in(source: Path, target: Path, base: Path, uid: int | None) -> None:
    """Copy a host dir's contents into `target` (a host path under `base`), owned by the sandbox uid."""
    real_dir_chain(base, target, uid)
    for dirpath, dirnames, filenames in os.walk(source):
        rel = Path(dirpath).relative_to(source)
        here = target / rel
        for name in dirnames:
            real_dir_chain(base, here / name, uid)
        for name in filenames:
            dest = here / name
            if dest.is_symlink() or dest.is_dir():
                remove(dest)
            shutil.copy2(Path(dirpath, name), dest, follow_symlinks=True)
            give(dest, uid)


def resolve_inside(sandbox_path: str, source: Path, base: Path) -> Path:
    """The real host file behind `source`, refusing links that lead out of the sandbox's own files (`base`)."""
    real = Path(os.path.realpath(source))
    if not inside(real, base):
        raise PermissionError(f"{sandbox_path} resolves outside the sandbox's files; not copied to the host")
    return real


def copy_file_out(sandbox_path: str, real: Path, target: Path) -> None:
    """Copy the sandbox file `sandbox_path` (host path `real`, from `resolve_inside`) to `target` on the host."""
    if not real.is_file():
        raise FileNotFoundError(f"{sandbox_path} is not a regular file in the sandbox")
    if target.exists() and os.path.samefile(real, target):
        return  # a mounted path: already on the host
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(real, target)


def copy_dir_out(sandbox_path: str, real: Path, target: Path) -> None:
    """Copy the sandbox dir `sandbox_path` (host path `real`, from `resolve_inside`) into `target` on the host."""
    if not real.is_dir():
        raise FileNotFoundError(f"{sandbox_path} is not a directory in the sandbox")
    target.mkdir(parents=True, exist_ok=True)
    if os.path.samefile(real, target):
        return  # a mounted path: already on the host
    # symlinks=True copies links as links (never reads a host file through one); FIFOs and devices are
    # skipped (reading a FIFO would block forever).
    shutil.copytree(real, target, symlinks=True, dirs_exist_ok=True, ignore=_special_files)


def scrub_log_symlinks(binds: list[Bind]) -> None:
    """Delete symlinks in the mounted Harbor log dirs that point outside them.

    Harbor reads those dirs on the host (as root, maybe): a link to a host file must not turn into a copy
    of it in the trial's results.
    """
    for bind in log_binds(binds):
        if not bind.source.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(bind.source):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                if os.path.islink(path) and not inside(Path(os.path.realpath(path)), bind.source):
                    with contextlib.suppress(FileNotFoundError):  # removed meanwhile: what we wanted
                        os.unlink(path)


# ---- disk use ---------------------------------------------------------------------------------------------------


def tree_bytes(paths: list[Path], limit: int) -> int:
    """Bytes of disk the files under `paths` take (links not followed), counted until past `limit`: the return is
    then only known to be over it."""
    total = 0
    stack = [str(p) for p in paths]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue  # removed meanwhile, or a dir the sandbox made unreadable to us (only when not root)
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            total += info.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
        if total > limit:
            return total
    return total


# ---- path helpers ---------------------------------------------------------------------------------------------


def under(path: PurePosixPath, prefixes: tuple[str, ...]) -> bool:
    return any(path == PurePosixPath(p) or path.is_relative_to(p) for p in prefixes)


def inside(path: Path, base: Path) -> bool:
    real_base = Path(os.path.realpath(base))
    return path == real_base or path.is_relative_to(real_base)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        rmtree(path)
    else:
        path.unlink()


def rmtree(path: Path) -> None:
    def retry_writable(func: Any, failed: str, exc: BaseException) -> None:
        # The sandbox may leave dirs without write permission (chmod 000); as a normal user we must restore
        # it before deleting their contents. Root never gets here.
        if not isinstance(exc, PermissionError):
            raise exc
        parent = os.path.dirname(failed)
        os.chmod(parent, stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, stat.S_IRWXU)
            shutil.rmtree(failed, onexc=retry_writable)
        else:
            func(failed)

    shutil.rmtree(path, onexc=retry_writable)


def _special_files(directory: str, names: list[str]) -> set[str]:
    skipped = set()
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            skipped.add(name)
    return skipped

"""The per-trial host tree behind a `LocalSandbox`'s /: building it, bwrap's mounts over it, mapping sandbox
paths onto host paths, and copying files in and out without following links the sandbox planted.

The system dirs come from a `Base`: the host's (/usr and /etc) or a task image's exported tree. An image's tree is
the trial's / as Docker would run it: /usr and /etc read-only, every other dir as the image built it (its /app,
/tmp, /root, WORKDIR, home dirs), on a copy-on-write layer of the trial's own and owned by the sandbox uid. As
root, that layer is an overlay mount with the shared tree as its lower dir (`mount_layer`); otherwise each trial
gets a copy of those dirs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from grpoflow.embedded.sandbox import launch
from grpoflow.embedded.sandbox.launch import STAGE

SANDBOX_HOME = "/root"
SANDBOX_USER = "sandbox"  # the sandbox uid's name when the image names no USER
# Host dirs shown read-only. Everything else of the host stays invisible.
HOST_RO_DIRS = ("/usr", "/etc")
# Top-level names that are symlinks into /usr on a merged-/usr host (or real dirs to bind read-only otherwise).
HOST_LIB_NAMES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Per-trial dirs the sandbox user owns (relative to rootfs).
OWNED_DIRS = ("app", "tmp", "root", "tests", "solution")
# Top-level names of an image's tree that are never part of the trial's layer: kernel filesystems bwrap mounts.
KERNEL_DIRS = frozenset({"proc", "dev", "sys"})


@dataclass(frozen=True)
class Account:
    """Who the sandbox uid is inside: the name its passwd entry gives it and its home (an image's USER, else
    `sandbox` at /root)."""

    name: str = SANDBOX_USER
    home: str = SANDBOX_HOME
    in_image: bool = False  # the image's /etc/passwd has the name: its entry takes the sandbox uid


@dataclass(frozen=True)
class Base:
    """Where the sandbox's system dirs come from: `root` (the host's /, or an image's exported tree), the
    sandbox paths bound read-only from it, and the top-level dirs the trial owns (its own layer of them)."""

    root: Path
    ro_dirs: tuple[str, ...]
    writable: tuple[str, ...] = ()
    account: Account = Account()

    @property
    def is_image(self) -> bool:
        return self.root != HOST_BASE_ROOT

    @property
    def not_trial_paths(self) -> tuple[str, ...]:
        return (*self.ro_dirs, "/proc", "/dev", *(f"/{n}" for n in HOST_LIB_NAMES))


HOST_BASE_ROOT = Path("/")
HOST_BASE = Base(HOST_BASE_ROOT, HOST_RO_DIRS)
# Sandbox paths that are host or kernel filesystems, never per-trial files: uploads/downloads there are refused.
NOT_TRIAL_PATHS = HOST_BASE.not_trial_paths


def image_base(tree: Path, workdir: str, user: str | None = None) -> Base:
    """The base for an image's exported `tree`: its /usr and /etc read-only, every other top-level dir the
    trial's own (but the kernel's), and the image's `user` (Docker's USER: name or uid, maybe `:group`) as the
    account the sandbox uid runs under."""
    parts = PurePosixPath(posixpath.normpath(workdir)).parts
    top = parts[1] if len(parts) > 1 else None
    if top in ("usr", "etc", *HOST_LIB_NAMES):
        raise ValueError(f"the image's working directory {workdir} is under /{top}, which trials see read-only")
    ro, writable = [], []
    for entry in sorted(tree.iterdir()):
        if entry.name in KERNEL_DIRS or entry.name in HOST_LIB_NAMES or entry.is_symlink() or not entry.is_dir():
            continue
        (ro if f"/{entry.name}" in HOST_RO_DIRS else writable).append(f"/{entry.name}")
    return Base(tree, tuple(ro), tuple(writable), image_account(tree, user))


def image_account(tree: Path, user: str | None) -> Account:
    """The account an image's USER names, looked up in its /etc/passwd as Docker does: a name must be there; a
    uid without an entry runs with / as its home; root (or none) is the default `sandbox` account."""
    name = (user or "").split(":", 1)[0]
    if name in ("", "root", "0"):
        return Account()
    for line in read_tree_file(tree, "etc/passwd").splitlines():
        fields = line.split(":")
        if len(fields) >= 7 and name in (fields[0], fields[2]):
            return Account(fields[0], fields[5] or "/", in_image=True)
    if name.isdigit():
        return Account(SANDBOX_USER, "/")
    raise BaseTreeError(f"the image's USER {name} is not in its /etc/passwd")


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
    layer: Path | None = None,
) -> list[str]:
    """Create the sandbox's / at `rootfs`: on the host base, pre-filled from the task's `app` dir; on an image,
    its writable dirs as the image has them, through an overlay whose upper dir is `layer` (when given: as root),
    else as copies (no larger together than `storage_bytes`: `BaseTreeError` before any copy). Returns the
    base's lib dirs to bind read-only (one without merged /usr)."""
    layered = layer is not None and base.is_image
    if layered:
        assert layer is not None
        mount_layer(base.root, layer, rootfs)
    else:
        sources = [base.root / w[1:] for w in base.writable] + ([] if base.is_image else [app])
        if storage_bytes is not None and tree_bytes(sources, storage_bytes) > storage_bytes:
            raise BaseTreeError(
                f"the task's files ({', '.join(base.writable) or '/app'}) are over the trial's storage cap of "
                f"{storage_bytes // 2**20} MB before the trial starts"
            )
        rootfs.mkdir(mode=0o755)
    extra_ro: list[str] = []
    for lib in HOST_LIB_NAMES:
        host = base.root / lib
        if host.is_symlink():
            if not layered:  # the layer shows the image's own link
                (rootfs / lib).symlink_to(os.readlink(host))
        elif host.is_dir():
            extra_ro.append(f"/{lib}")  # a base without merged /usr: show the real dir read-only
    for owned in OWNED_DIRS:
        real_dir_chain(rootfs, rootfs / owned, None)  # an image's own, else new (a link it has in their place goes)
    (rootfs / "tmp").chmod(0o1777)
    if not base.is_image and app.is_dir():
        # The host base reproduces `COPY app /app`; an image's /app is what its Dockerfile put there.
        shutil.copytree(app, rootfs / "app", symlinks=True, dirs_exist_ok=True)
    for top in base.writable:
        if not layered:
            shutil.copytree(base.root / top[1:], rootfs / top[1:], symlinks=True, dirs_exist_ok=True)
        give(rootfs / top[1:], uid)
    for owned in OWNED_DIRS:
        if f"/{owned}" not in base.writable:  # an image's /app, /tmp, /root were given above: walked once
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


# Characters overlayfs reads as separators in its mount options: a path holding one cannot be a layer.
_OVERLAY_SEPARATORS = re.compile(r"[,:\\]")


def mount_layer(tree: Path, layer: Path, target: Path) -> None:
    """Mount an overlay at `target` (made here): `tree` as its read-only lower dir, shared by every trial of the
    image and never written; `layer/upper` takes whatever the trial changes, `layer/work` is overlayfs's own.

    `metacopy=on` makes handing a dir to the sandbox uid cheap (a chown copies up the inode, not the data). It is
    safe here because neither layer can hold the overlay's own xattrs: the tree was unpacked without xattrs, and
    the sandbox (no capability in the host's user namespace) cannot set `trusted.*` ones on the upper dir.
    Kernels without metacopy get a plain overlay (a chown then copies the file)."""
    upper, work = layer / "upper", layer / "work"
    for path in (tree, upper, work):
        if _OVERLAY_SEPARATORS.search(str(path)):
            raise OSError(f"{path} has a character overlayfs cannot take in a path (',', ':' or a backslash)")
    upper.mkdir(parents=True)
    work.mkdir()
    target.mkdir()
    for path, mode in ((upper, 0o755), (work, 0o700), (target, 0o755)):
        path.chmod(mode)  # the overlay's / takes the upper dir's mode: never the umask's
    options = f"lowerdir={tree},upperdir={upper},workdir={work}"
    flags = launch.MS_NOSUID | launch.MS_NODEV
    try:
        launch.mount("overlay", str(target), "overlay", flags, options + ",metacopy=on")
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        launch.mount("overlay", str(target), "overlay", flags, options)


def unmount_layer(trial_dir: Path) -> None:
    """Detach the overlay at `trial_dir/rootfs` (a trial's layer) before the dir is removed: a recursive delete
    must not walk into it. The dir is opened without following a link and must be this user's (a dir in a shared
    temp dir may be anyone's); only an overlay mounted exactly there is detached."""
    try:
        fd = os.open(trial_dir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, a link, not a dir: no layer of ours
        return
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return
        if os.path.join(os.readlink(f"/proc/self/fd/{fd}"), "rootfs") in overlay_mount_points():
            launch.unmount(f"/proc/self/fd/{fd}/rootfs")
    finally:
        os.close(fd)


def overlay_mount_points() -> set[str]:
    """Where overlays are mounted in this process's mount namespace."""
    points = set()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields, _, rest = line.partition(" - ")
            if rest.split(" ", 1)[0] == "overlay":
                # The 5th field is the mount point, with space, tab, newline and backslash as octal escapes.
                points.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields.split(" ")[4]))
    return points


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
    network: bool = False,
) -> list[str]:
    """bwrap's argv up to the command ("--" last): the mounts over root/rootfs and the namespaces to unshare.
    With `network`, bwrap keeps the network namespace the launcher joined and binds root/etc's resolv.conf and
    hosts (`network.TrialNetwork`) over the base's; otherwise it makes an empty one.

    bwrap runs as `uid` (the launcher dropped to it) and makes a user namespace that maps only that uid: nothing
    inside holds a capability of the host's. It also writes the passwd/group files (in `root`) that it binds over
    the base's, naming the uid (`account_files`): tools that look the user up (git, whoami, ssh) fail when
    the uid has no name.
    """
    argv = [bwrap, "--unshare-user", "--uid", str(uid), "--gid", str(uid), "--cap-drop", "ALL"]
    argv += ["--bind", sources(root / "rootfs"), "/"]
    for ro in (*base.ro_dirs, *extra_ro):
        argv += ["--ro-bind", sources(base.root / ro[1:]), ro]
    for name, text in account_files(base, uid).items():
        (root / name).write_text(text)
        argv += ["--ro-bind", sources(root / name), f"/etc/{name}"]
    if network:
        for name in ("resolv.conf", "hosts"):
            argv += ["--ro-bind", sources(root / "etc" / name), f"/etc/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for bind in binds:
        argv += ["--ro-bind" if bind.read_only else "--bind", sources(bind.source), str(bind.target)]
    if not network:
        argv.append("--unshare-net")
    argv += [
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


def account_files(base: Base, uid: int) -> dict[str, str]:
    """The base's /etc/passwd and /etc/group with the sandbox uid named: the image USER's entry (and its private
    group) take the uid in place of the image's ids; otherwise a `sandbox` entry (home /root) is added."""
    passwd = [line.split(":") for line in read_tree_file(base.root, "etc/passwd").splitlines()]
    group = [line.split(":") for line in read_tree_file(base.root, "etc/group").splitlines()]
    account = base.account
    if not account.in_image:
        passwd.append([account.name, "x", str(uid), str(uid), account.name, account.home, "/bin/bash"])
    else:
        for fields in passwd:
            if len(fields) >= 7 and fields[0] == account.name:
                fields[2] = fields[3] = str(uid)
    # The uid's own group: the user's private group (same name) takes its gid; a shared one (root's, staff) keeps
    # its own, and the uid gets a group of its own beside it.
    private = [f for f in group if len(f) >= 3 and f[0] == account.name]
    for fields in private:
        fields[2] = str(uid)
    if not private:
        group.append([account.name, "x", str(uid), ""])
    return {name: "".join(":".join(f) + "\n" for f in lines) for name, lines in (("passwd", passwd), ("group", group))}


def network_mount_points(base: Base) -> None:
    """A sandbox with a network has its resolv.conf and hosts bound over the base's (`bwrap_argv`): both must be
    regular files of the base's /etc (read-only, so bwrap cannot make them; a link would be followed outside)."""
    for name in ("resolv.conf", "hosts"):
        read_tree_file(base.root, f"etc/{name}")  # refuses a link or anything not a regular file
        if not (base.root / "etc" / name).is_file():
            raise BaseTreeError(
                f"the sandbox's base has no /etc/{name}, where a sandbox with a network names its hosts"
            )


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

"""The host side of every process a `LocalSandbox` starts: run by the host's Python (`python -I -S launch.py OPTIONS
-- ARGV`), never from the sandbox's tree, so nothing a task image ships runs before its privileges are gone.

In order, with OPTIONS (`--cgroup PROCS_FILE`, `--netns PATH`, `--rlimit NAME=VALUE`, `--uid N`,
`--stage PATH NAME`, `--enter PID --seccomp-fd FD`) saying what applies:
1. `cgroup`: this process joins the trial's cgroup (each hierarchy's cgroup.procs), while it still may; all it
   starts is charged there. `netns` (as root only): it joins the trial's network namespace (`network.py`), which
   bwrap then keeps instead of making an empty one.
2. `rlimits`: set (soft and hard) here, on the host; they survive every exec below.
3. `stage` (as root only): bwrap runs as the sandbox uid and must reach its mount sources by path, which may lie
   under dirs that uid cannot enter (a 0700 home, pytest's temp dir). This process unshares a mount namespace of
   its own, mounts a tmpfs on `STAGE` and binds each source (opened without following a link) at
   `STAGE/<name>`. The host sees none of it, and it ends with this process tree.
4. `uid`: drop to it (groups cleared, gid and uid set), then no-new-privs: no capability is left in the host's
   user namespace, and no setuid file can give one back.
5. Either exec ARGV (bwrap, which makes the sandbox's user namespace and applies the seccomp filter itself), or,
   with `enter` (a holder's pid 1), join that sandbox's namespaces: the user namespace that owns them first, then
   them, then the holder's own user namespace (bwrap nests one to forbid more), then its root; then fork, so the
   child is in the sandbox's pid namespace, install the seccomp filter read from `seccomp_fd`, and exec ARGV
   there. The parent waits and exits as the child did (re-raising a signal that killed it, as nsenter does).

The environment of what runs is `ENV` alone: nothing of the caller's (or a task's) reaches a host-side process.
Standard library only, and little of it (no json, no signal until needed): this runs once per command.
"""

import ctypes
import fcntl
import os
import resource
import stat
import sys

STAGE = "/run/grpoflow-stage"
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}  # the whole environment of what this execs
NS_GET_USERNS = 0xB701  # ioctl on a namespace fd: an fd of the user namespace that owns it
NAMESPACES = (("mnt", os.CLONE_NEWNS), ("pid", os.CLONE_NEWPID), ("net", os.CLONE_NEWNET))
NAMESPACES += (("ipc", os.CLONE_NEWIPC), ("uts", os.CLONE_NEWUTS), ("cgroup", os.CLONE_NEWCGROUP))
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_SLAVE = 2, 4, 4096, 16384, 1 << 19
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def unmount(target: str) -> None:
    """Detach the mount at `target` (lazily: a process still inside keeps its view until it ends); a link as the
    last component is not followed."""
    _check(_libc.umount2(target.encode(), ctypes.c_int(MNT_DETACH | UMOUNT_NOFOLLOW)), f"umount {target}")


def stage(sources: list[tuple[str, str]]) -> None:
    """Bind each [path, name] at STAGE/name in a mount namespace of this process's own; a path whose last
    component is a link is refused (a bind mount would follow it)."""
    os.makedirs(STAGE, mode=0o755, exist_ok=True)
    st = os.lstat(STAGE)
    if not os.path.isdir(STAGE) or os.path.islink(STAGE) or st.st_uid != 0:
        raise OSError(f"{STAGE} is not a directory owned by root")
    os.unshare(os.CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_SLAVE, None)  # nothing mounted here propagates to the host
    mount("tmpfs", STAGE, "tmpfs", 0, "mode=0711,size=64k")
    for path, name in sources:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW)
        mode = os.fstat(fd).st_mode
        if stat.S_ISLNK(mode):
            raise OSError(f"{path} is a symlink: not mounted into the sandbox")
        target = f"{STAGE}/{name}"
        if stat.S_ISDIR(mode):
            os.mkdir(target, 0o755)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None)
        os.close(fd)


def drop(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def no_new_privs() -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def seccomp(fd: int) -> None:
    program = b""
    while chunk := os.read(fd, 65536):
        program += chunk
    os.close(fd)
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


def enter(pid: int, uid: int | None) -> None:
    """Join the namespaces and root of `pid` (opened as the caller, joined as `uid`)."""
    ns = {name: os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY) for name, _ in (*NAMESPACES, ("user", 0))}
    same = {name for name, _ in (*NAMESPACES, ("user", 0)) if _same_ns(ns[name], f"/proc/self/ns/{name}")}
    owner = fcntl.ioctl(ns["mnt"], NS_GET_USERNS)
    nested = not _same_ns(ns["user"], f"/proc/self/fd/{owner}")  # before any setns: /proc changes with them
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY)
    if uid is not None:
        drop(uid)
    os.setns(owner, os.CLONE_NEWUSER)  # caps in the namespaces it owns, as their owner's uid
    for name, kind in NAMESPACES:
        if name not in same:  # e.g. no cgroup namespace of its own: joining the host's would need host caps
            os.setns(ns[name], kind)
    if nested:
        os.setns(ns["user"], os.CLONE_NEWUSER)  # the holder's nested one, where no more can be made
    os.fchdir(root)
    os.chroot(".")
    os.chdir("/")
    for fd in (*ns.values(), owner, root):
        os.close(fd)


def _same_ns(fd: int, path: str) -> bool:
    a, b = os.fstat(fd), os.stat(path)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def wait_and_exit(child: int, signal) -> None:  # noqa: ANN001  (the module, imported before the chroot)
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the command decides; a SIGKILL of the group ends both
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def parse(args: list[str]) -> tuple[dict, list[str]]:
    """(options, ARGV) from `OPTIONS -- ARGV`."""
    opts: dict = {"cgroup": [], "rlimit": {}, "stage": [], "uid": None, "enter": None, "seccomp_fd": None}
    opts["netns"] = None
    i = 0
    while args[i] != "--":
        flag = args[i]
        if flag == "--rlimit":
            name, _, value = args[i + 1].partition("=")
            opts["rlimit"][name] = int(value)
        elif flag == "--cgroup":
            opts["cgroup"].append(args[i + 1])
        elif flag == "--netns":
            opts["netns"] = args[i + 1]
        elif flag == "--stage":
            opts["stage"].append((args[i + 1], args[i + 2]))
            i += 1
        elif flag in ("--uid", "--enter", "--seccomp-fd"):
            opts[flag[2:].replace("-", "_")] = int(args[i + 1])
        else:
            raise SystemExit(f"launch.py: unknown option {flag}")
        i += 2
    return opts, args[i + 1 :]


def main() -> None:
    opts, argv = parse(sys.argv[1:])
    os.chdir("/")
    for procs in opts["cgroup"]:
        fd = os.open(procs, os.O_WRONLY)
        os.write(fd, b"0")  # "0": the writing process itself
        os.close(fd)
    if opts["netns"] is not None:
        fd = os.open(opts["netns"], os.O_RDONLY)
        os.setns(fd, os.CLONE_NEWNET)
        os.close(fd)
    for name, value in opts["rlimit"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if opts["stage"]:
        stage(opts["stage"])
    if opts["enter"] is not None:
        import signal  # now: after the chroot below, nothing of the host's stdlib can be imported

        enter(opts["enter"], opts["uid"])
        child = os.fork()
        if child:
            wait_and_exit(child, signal)
        no_new_privs()
        seccomp(opts["seccomp_fd"])
    else:
        if opts["uid"] is not None:
            drop(opts["uid"])
        no_new_privs()
    os.execve(argv[0], argv, ENV)


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        print(f"grpoflow sandbox launcher: {exc}", file=sys.stderr)
        os._exit(125)

"""The seccomp filter every sandbox process runs under: what no terminal task needs, denied as Docker's default
profile denies it (new namespaces, mounts, kernel modules and kexec, keyrings, bpf, perf, file handles, swap,
clock and reboot, io_uring), so a task cannot reach for a kernel interface even where its namespaces would let it.

A classic BPF program (`struct sock_filter[]`), built here for the machine's architecture: bwrap loads it from an
fd (`--seccomp`), the launcher (`launch.py`) with prctl for commands that join a trial's namespaces. ptrace stays
allowed (debuggers, strace): the sandbox's pid namespace shows it only its own processes. Tasks that need a
denied call (Docker-in-Docker, FUSE) cannot run on the local sandbox.
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import struct

# Namespace flags of clone(2): a new user namespace would give back every capability inside it.
CLONE_NAMESPACE_FLAGS = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
X32_SYSCALL_BIT = 0x40000000

# Denied with EPERM. clone3 gets ENOSYS, so libc falls back to clone, whose flags the filter can read (clone3's
# are behind a pointer); clone is denied only with a namespace flag.
_DENIED = (
    "mount umount2 pivot_root move_mount open_tree fsopen fsconfig fsmount fspick mount_setattr unshare setns "
    "init_module finit_module delete_module kexec_load kexec_file_load keyctl add_key request_key bpf "
    "perf_event_open open_by_handle_at name_to_handle_at userfaultfd acct swapon swapoff reboot settimeofday "
    "clock_settime clock_adjtime adjtimex quotactl syslog io_uring_setup io_uring_enter io_uring_register"
).split()
# name -> (x86_64, aarch64) numbers (linux/arch/*/syscall tables)
_NUMBERS = {
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "move_mount": (429, 429),
    "open_tree": (428, 428), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442), "unshare": (272, 97), "setns": (308, 268),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "bpf": (321, 280), "perf_event_open": (298, 241), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264), "userfaultfd": (323, 282), "acct": (163, 89), "swapon": (167, 224),
    "swapoff": (168, 225), "reboot": (169, 142), "settimeofday": (164, 170), "clock_settime": (227, 112),
    "clock_adjtime": (305, 266), "adjtimex": (159, 171), "quotactl": (179, 60), "syslog": (103, 116),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "clone": (56, 220), "clone3": (435, 435),
}  # fmt: skip
# machine -> (AUDIT_ARCH_*, syscall table)
ARCHES = {
    machine: (audit, {name: pair[i] for name, pair in _NUMBERS.items()})
    for i, (machine, audit) in enumerate((("x86_64", 0xC000003E), ("aarch64", 0xC00000B7)))
}

_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (args[0]'s low word: little-endian)


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@functools.cache
def filter_program(machine: str | None = None) -> bytes:
    """The filter as `struct sock_filter[]` bytes for `machine` (default: this one's); ValueError elsewhere."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise ValueError(f"the local sandbox's seccomp filter knows {', '.join(ARCHES)}, not {machine}")
    audit_arch, table = ARCHES[machine]
    denied = [table[name] for name in _DENIED]
    eperm, enosys = _ERRNO | errno.EPERM, _ERRNO | errno.ENOSYS
    # Layout: arch check, the syscall number, one JEQ per denied call (to DENY), clone3, clone, ALLOW,
    # DENY, the clone flags check. Jump offsets count instructions after the jump.
    body = [_insn(_LD_W_ABS, _ARCH), _insn(_JEQ, audit_arch, 1, 0), _insn(_RET, enosys), _insn(_LD_W_ABS, _NR)]
    if machine == "x86_64":  # x32 numbers alias the same calls under another number
        body += [_insn(_JGE, X32_SYSCALL_BIT, 0, 1), _insn(_RET, enosys)]
    n = len(denied)
    for i, nr in enumerate(denied):
        # to DENY: past the rest of the JEQs (n-1-i), clone3's pair (2), clone's JEQ (1), ALLOW (1)
        body.append(_insn(_JEQ, nr, n - 1 - i + 4, 0))
    body += [
        _insn(_JEQ, table["clone3"], 0, 1),
        _insn(_RET, enosys),
        _insn(_JEQ, table["clone"], 2, 0),  # to the flags check, past ALLOW and DENY
        _insn(_RET, _ALLOW),
        _insn(_RET, eperm),  # DENY
        _insn(_LD_W_ABS, _ARG0),
        _insn(_JSET, CLONE_NAMESPACE_FLAGS, 0, 1),
        _insn(_RET, eperm),
        _insn(_RET, _ALLOW),
    ]
    return b"".join(body)


def filter_fd() -> int:
    """A fresh memfd holding the filter, at offset 0 (bwrap reads it to the end: one per process started)."""
    fd = os.memfd_create("grpoflow-seccomp", os.MFD_CLOEXEC)
    os.write(fd, filter_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd

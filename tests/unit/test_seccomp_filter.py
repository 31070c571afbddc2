"""The sandbox's seccomp program, run by a classic-BPF interpreter written here for both architectures it is built
for (the real kernel runs it in tests/integration/docker/test_hostile_images.py, on this machine's)."""

from __future__ import annotations

import errno
import struct

import pytest

from grpoflow.embedded.sandbox.seccomp import ARCHES, CLONE_NAMESPACE_FLAGS, filter_program

ALLOW = "allow"


def run(program: bytes, arch: int, nr: int, arg0: int = 0) -> str | int:
    """What the filter returns for one call: "allow", or the errno it fails with."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld word at absolute offset
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:  # ret
            return ALLOW if k == 0x7FFF0000 else k & 0xFFFF
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")
        assert pc < len(insns), "a jump past the end of the program"


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_the_filter_denies_what_no_task_needs_and_allows_the_rest(machine: str) -> None:
    audit, table = ARCHES[machine]
    program = filter_program(machine)
    for name in ("mount", "unshare", "setns", "init_module", "finit_module", "keyctl", "bpf", "open_by_handle_at"):
        assert run(program, audit, table[name]) == errno.EPERM, name
    assert run(program, audit, table["clone3"]) == errno.ENOSYS  # libc falls back to clone
    assert run(program, audit, table["clone"], 0x11) == ALLOW  # fork: SIGCHLD only
    assert run(program, audit, table["clone"], 0x3D0F00) == ALLOW  # a thread
    assert run(program, audit, table["clone"], 0x10000000 | 0x11) == errno.EPERM  # CLONE_NEWUSER
    assert run(program, audit, table["clone"], CLONE_NAMESPACE_FLAGS) == errno.EPERM
    for nr in (0, 1, 3, 59 if machine == "x86_64" else 221, 101 if machine == "x86_64" else 117):  # read, exec, ptrace
        assert run(program, audit, nr) == ALLOW, nr
    assert run(program, 0x40000003, 1) == errno.ENOSYS  # another ABI (i386) reaches nothing


def test_x32_numbers_cannot_alias_a_denied_call() -> None:
    audit, table = ARCHES["x86_64"]
    assert run(filter_program("x86_64"), audit, 0x40000000 | table["mount"]) == errno.ENOSYS


def test_an_unknown_architecture_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="knows x86_64, aarch64, not riscv64"):
        filter_program("riscv64")

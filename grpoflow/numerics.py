"""Reproducible CPU arithmetic: what makes an update's bits independent of the thread count and of the process's
history, and what a run records so a rerun can tell whether it ran on the same arithmetic.

torch's CPU matmuls are MKL's. With its conditional numerical reproducibility off (MKL's default), MKL picks
kernels by CPU, thread count and buffer alignment: on an Intel CPU with AVX-512 the same update gave other bits on
2 threads than on 1, and after a resume than in the uninterrupted process. `MKL_CBWR=AUTO,STRICT` keeps MKL's
fastest code path for the CPU (AUTO) but makes its results independent of the thread count and alignment
(STRICT). It must be set before MKL's first call in the process: `grpoflow/__init__.py` sets it (a value already
in the environment wins, e.g. `COMPATIBLE` for the same bits across CPU families, at a cost in speed), and child
processes (trainer ranks, the embedded engine, Ray workers) inherit it.
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import cache
from pathlib import Path

MKL_CBWR_DEFAULT = "AUTO,STRICT"

# mkl_cbwr.h: the branch in the low 16 bits, STRICT as a flag above them.
_MKL_BRANCHES = {
    0: "OFF",
    1: "OFF",  # MKL_CBWR_BRANCH_OFF: reproducibility not requested
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    12: "AVX512",
    14: "AVX512_E1",
}
_MKL_STRICT = 0x10000
_MKL_ALL = -1  # MKL_CBWR_ALL (~0): the whole setting


def reproducible_cpu_env() -> None:
    """MKL's reproducible mode for this process and its children, unless the environment already chose one."""
    os.environ.setdefault("MKL_CBWR", MKL_CBWR_DEFAULT)


@cache
def _mkl_cbwr_get():
    import torch  # only when asked: importing grpoflow must not load torch

    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    try:
        get = lib.mkl_serv_cbwr_get
    except AttributeError:  # a torch built without MKL (e.g. on aarch64): no such mode to report
        return None
    get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    return get


def mkl_mode() -> str:
    """MKL's reproducibility setting as this process runs it, in MKL_CBWR's words (`AUTO,STRICT`, `OFF`, ...);
    `no MKL` where torch has none."""
    get = _mkl_cbwr_get()
    if get is None:
        return "no MKL"
    mode = get(_MKL_ALL)
    name = _MKL_BRANCHES.get(mode & 0xFFFF, f"branch {mode & 0xFFFF}")
    return f"{name},STRICT" if mode & _MKL_STRICT else name


def cpu_arithmetic() -> str:
    """What decides a CPU update's bits beyond the code: the CPU model, the vector extensions MKL and torch may
    pick kernels by, and MKL's mode, e.g. `AMD EPYC (avx2) MKL AUTO,STRICT`. Runs that differ here need not agree
    bit for bit."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({' '.join(isa) or 'no avx2'}) MKL {mkl_mode()}"

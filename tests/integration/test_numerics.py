"""The trainer's CPU arithmetic is reproducible whatever the thread count and the process's history: MKL runs in
its reproducible mode in every process grpoflow starts, and the same update gives the same bits in a fresh process
on one thread as here on two. A CPU whose kernels split work by thread count or alignment fails these here, not
only in the resume and rerun tests on that CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.numerics import MKL_CBWR_DEFAULT, cpu_arithmetic, mkl_mode
from tests.fakes.update_fingerprint import update_fingerprint

ROOT = Path(__file__).resolve().parents[2]
MODE_OF_A_CHILD = (
    "import grpoflow, torch; torch.randn(64, 64) @ torch.randn(64, 64); print(grpoflow.numerics.mkl_mode())"
)


def _child_mode(**env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run(
        [sys.executable, "-c", MODE_OF_A_CHILD], env=base | env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_mkl_runs_in_its_reproducible_mode_in_every_process_grpoflow_starts():
    assert mkl_mode() == MKL_CBWR_DEFAULT  # this test process (conftest imports grpoflow before any torch op)
    assert _child_mode() == MKL_CBWR_DEFAULT  # a process whose environment did not ask for it
    assert _child_mode(MKL_CBWR="COMPATIBLE") == "COMPATIBLE"  # a user's own choice wins
    assert mkl_mode() in cpu_arithmetic()


@pytest.mark.slow
def test_an_update_gives_the_same_bits_in_a_fresh_process_on_one_thread_as_here_on_two():
    here = update_fingerprint(threads=2)
    out = subprocess.run(
        [sys.executable, "-m", "tests.fakes.update_fingerprint", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    assert fresh == here

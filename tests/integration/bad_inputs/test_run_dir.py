"""An existing run dir is never touched; an output dir that cannot hold run dirs is one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.errors import DatasetError, RunDirError

from .conftest import assert_one_line

REPO = Path(__file__).resolve().parents[3]


def _snapshot(root):
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def _existing_run(runs):
    old = runs / "bad-1"
    (old / "checkpoints" / "step_3").mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"step": 0}\n')
    (old / "config.json").write_text('{"run_id": "bad-1"}\n')
    (old / "checkpoints" / "step_3" / "model.safetensors").write_bytes(b"\x01\x02")
    return old, _snapshot(old)


def test_existing_run_dir_is_refused_and_left_byte_for_byte(prepare, dataset):
    call, runs = prepare
    old, before = _existing_run(runs)
    with pytest.raises(RunDirError) as info:
        call(dataset={"path": str(dataset)})
    assert_one_line(info.value, old, "already exists")
    assert _snapshot(old) == before


def test_bad_input_with_an_existing_run_dir_still_leaves_it_alone(prepare, dataset):
    call, runs = prepare
    old, before = _existing_run(runs)
    for instruction in dataset.glob("*/instruction.md"):  # every task malformed: a dataset with nothing left
        instruction.unlink()
    with pytest.raises(DatasetError):
        call(dataset={"path": str(dataset)})
    assert _snapshot(old) == before


def test_output_dir_that_is_a_file(tmp_path, tiny_model_dir, dataset):
    from grpoflow.config import parse_run_config
    from grpoflow.run.start import prepare_run

    f = tmp_path / "runs-file"
    f.write_text("not a dir\n")
    cfg = parse_run_config(
        {
            "run_id": "r1",
            "output_dir": str(f),
            "model": {"source": str(tiny_model_dir)},
            "dataset": {"path": str(dataset)},
        }
    )
    with pytest.raises(RunDirError) as info:
        prepare_run(cfg, cache_dir=tmp_path / "cache")
    msg = assert_one_line(info.value, f, "is a file, not a directory")
    assert "already exists" not in msg
    assert f.read_text() == "not a dir\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_output_dir(tmp_path, tiny_model_dir, dataset):
    from grpoflow.config import parse_run_config
    from grpoflow.run.start import prepare_run

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    cfg = parse_run_config(
        {
            "run_id": "r1",
            "output_dir": str(ro),
            "model": {"source": str(tiny_model_dir)},
            "dataset": {"path": str(dataset)},
        }
    )
    with pytest.raises(RunDirError) as info:
        prepare_run(cfg, cache_dir=tmp_path / "cache")
    assert_one_line(info.value, ro / "r1")


def test_output_dir_below_a_file(tmp_path, prepare, dataset):
    call, runs = prepare
    runs.parent.mkdir(parents=True, exist_ok=True)
    runs.write_text("not a dir\n")  # output_dir is runs/: its parent chain holds a file
    with pytest.raises(RunDirError) as info:
        call(dataset={"path": str(dataset)}, output_dir=str(runs / "nightly"))
    assert_one_line(info.value, runs, "is a file, not a directory")


@pytest.fixture
def read_only_dir(tmp_path):
    """A dir on a read-only filesystem (a tmpfs mounted ro): unwritable even for root."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_preflight_says_a_read_only_output_dir_is_not_writable(read_only_dir, tiny_model_dir, dataset):
    from grpoflow.config import parse_run_config
    from grpoflow.preflight import check_run

    cfg = parse_run_config({"run_id": "r1", "output_dir": str(read_only_dir / "runs")})
    problems = check_run(cfg, "prepare")
    assert problems == [f"output dir {read_only_dir / 'runs'}: {read_only_dir} is not writable"]


def _run_dir_exists(tmp_path):
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    return tmp_path / "runs"


def _a_file(tmp_path, below=""):
    (tmp_path / "runs").write_text("not a dir\n")
    return tmp_path / "runs" / below


CLI_CASES = [
    # id, how the output dir is broken (a function of tmp_path, returning the --output-dir), words of the line
    ("run-dir-exists", _run_dir_exists, ["already exists"]),
    ("output-dir-is-a-file", _a_file, ["is a file, not a directory"]),
    ("output-dir-below-a-file", lambda t: _a_file(t, "nightly"), ["is a file, not a directory"]),
]


@pytest.mark.parametrize(("make", "words"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_run_dir_problems_are_said_before_prefect_starts(tmp_path, tiny_model_dir, make, words):
    # A fresh interpreter: whether the flow modules (and Prefect with them) were imported is then this call's doing.
    out = make(tmp_path)
    probe = (
        "import sys\nfrom flows.cli import main\n"
        f"rc = main(['prepare', '--run-id', 'r1', '--model', {str(tiny_model_dir)!r}, '--output-dir', {str(out)!r}])\n"
        "print(rc, 'flows.common' in sys.modules, 'prefect' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.stdout.splitlines()[-1] == "2 False False", res.stdout + res.stderr
    err = res.stderr.strip()
    assert "\n" not in err and err.startswith("grpoflow: error: "), err
    assert all(w in err for w in words), err

"""An existing run dir is never touched; an output dir that cannot hold run dirs is one clear line."""

from __future__ import annotations

import os

import pytest

from grpoflow.errors import DatasetError, RunDirError

from .conftest import assert_one_line


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
    (dataset / "make-dir" / "instruction.md").unlink()
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
    assert_one_line(info.value, f / "r1")
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

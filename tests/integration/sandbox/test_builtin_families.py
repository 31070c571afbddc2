"""Every generated instance of the built-in task families, through the dataset gate in the real bubblewrap
sandbox: its oracle earns the full reward and a no-op agent does not pass."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import load_dataset
from grpoflow.scoring.gate import GateSettings, run_gate


def test_every_generated_instance_passes_its_oracle_and_fails_its_nop(bwrap: str, tmp_path: Path) -> None:
    # Seed 0 is the main job's seed; the other seed's instances differ in every family (tests/unit/test_families.py).
    for seed in (0, 1):
        dataset = load_dataset("builtin", seed=seed, cache_dir=tmp_path, local_sandbox=True)
        # A gate cache per seed: two seeds may draw one identical instance, which a shared cache would not run again.
        # One oracle run each: this asks whether every instance is solvable, not whether its verifier is stable.
        report = run_gate(
            dataset, parse_run_config({}).rollout, tmp_path / f"gate-{seed}", settings=GateSettings(oracle_runs=1)
        )
        assert {t.name: t.verdict for t in report.tasks} == {t.name: "verified" for t in dataset.tasks}, report.lines()
        assert report.trials_run == 2 * len(dataset.tasks)


def test_text_written_where_an_empty_file_is_asked_earns_nothing(bwrap: str, tmp_path: Path) -> None:
    # `echo ... > path` solves write-text; on empty-file it must not earn a share, or it pulls every family to it.
    builtin = load_dataset("builtin", seed=0, cache_dir=tmp_path, local_sandbox=True)
    task = next(t for t in builtin.tasks if t.name.startswith("empty-file-"))
    wrong = tmp_path / "wrong" / task.name
    shutil.copytree(task.path, wrong)
    solve = wrong / "solution" / "solve.sh"
    path = solve.read_text().split("touch ", 1)[1].split()[0]
    solve.write_text(f"#!/bin/bash\necho hello > {path}\n")
    report = run_gate(
        load_dataset(str(wrong.parent), local_sandbox=True), parse_run_config({}).rollout, tmp_path / "gate"
    )
    (gated,) = report.tasks
    assert (gated.verdict, gated.oracle_reward) == ("oracle-fails", 0.0), report.lines()

"""The built-in dataset's generated task families (`grpoflow.prepare.families`): reproducible from the seed, valid
Harbor task dirs, and no two instances of a family alike in what decides their answer."""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter
from itertools import permutations
from pathlib import Path

import pytest
from harbor.lint.models import LintRule
from harbor.lint.task import lint_task

import grpoflow.prepare.families as families_module
from grpoflow.prepare.dataset import load_dataset
from grpoflow.prepare.families import FAMILIES, INSTANCES, VERSION, generate, instances, leaks, solves
from grpoflow.prepare.prompts import build_prompts, side_of
from grpoflow.prepare.split import FamilyRule, families


def _tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root`: relative path -> (bytes, mode)."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mode & 0o777)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_seed_same_bytes_other_seed_other_instances(tmp_path: Path) -> None:
    a = generate(7, tmp_path / "a")
    b = generate(7, tmp_path / "b")
    assert a.name == b.name == f"v{VERSION}-seed7"
    assert _tree(a) == _tree(b)
    c = generate(8, tmp_path / "a")
    assert c != a and _tree(c) != _tree(a)
    # Other instances in every family, not just somewhere.
    for family in FAMILIES:
        mine = {tuple(p[k] for k in family.key) for f, p in instances(7).values() if f is family}
        theirs = {tuple(p[k] for k in family.key) for f, p in instances(8).values() if f is family}
        assert mine != theirs, family.name


def test_a_second_generate_reuses_the_cached_dir(tmp_path: Path) -> None:
    root = generate(3, tmp_path)
    stamp = (root / "write-text-1" / "task.toml").stat().st_mtime_ns
    assert generate(3, tmp_path) == root
    assert (root / "write-text-1" / "task.toml").stat().st_mtime_ns == stamp
    assert [p.name for p in root.parent.iterdir()] == [root.name]  # no temp dir left beside it


@pytest.mark.parametrize("seed", [0, 1, 2, 12345])
def test_no_two_instances_of_a_family_share_an_answer_parameter(seed: int) -> None:
    drawn = instances(seed)
    assert Counter(f.name for f, _ in drawn.values()) == {f.name: INSTANCES for f in FAMILIES}
    for family in FAMILIES:
        params = [p for f, p in drawn.values() if f is family]
        for key in family.key:
            values = [p[key] for p in params]
            assert len(set(values)) == len(values), (family.name, key, values)


def test_generated_tasks_load_as_a_dataset_with_declared_families(tmp_path: Path) -> None:
    dataset = load_dataset("builtin", seed=0, cache_dir=tmp_path, local_sandbox=True)
    assert dataset.left_out == ()
    assert len(dataset) == len(FAMILIES) * INSTANCES
    assert dataset.root == generate(0, tmp_path).resolve()
    groups = families(dataset.tasks, FamilyRule())
    assert sorted(groups) == sorted(f.name for f in FAMILIES)
    for task in dataset.tasks:
        files = [p.relative_to(task.path).as_posix() for p in task.path.rglob("*") if p.is_file()]
        # Every file is inside the task dir and the Dockerfile asks only what the local sandbox reproduces.
        assert all(not f.startswith("..") for f in files)
        dockerfile = (task.path / "environment" / "Dockerfile").read_text().splitlines()
        assert dockerfile[:2] == ["FROM debian:bookworm-slim", "WORKDIR /app"]
        assert set(dockerfile[2:]) <= {"COPY app/ /app/"}
        assert ("COPY app/ /app/" in dockerfile) == (task.path / "environment" / "app").is_dir()
        for script in ("tests/test.sh", "solution/solve.sh"):
            assert os.access(task.path / script, os.X_OK)
        test_sh = (task.path / "tests" / "test.sh").read_text()
        assert re.search(r"^set -u$", test_sh, re.M) and not re.search(r"^\s*set -\w*e", test_sh, re.M)
        assert test_sh.index("echo 0 > /logs/verifier/reward.txt") < test_sh.index("finish 1")
        assert "/app/" in task.instruction and "{" not in task.instruction


def test_instances_of_a_family_differ_in_wording_or_paths(tmp_path: Path) -> None:
    dataset = load_dataset("builtin", seed=0, cache_dir=tmp_path)
    for fam, tasks in families(dataset.tasks, FamilyRule()).items():
        assert len({t.instruction for t in tasks}) == len(tasks), fam


def test_auto_split_holds_families_out_and_instances_of_trained_ones(tmp_path: Path) -> None:
    dataset = load_dataset("builtin", seed=0, cache_dir=tmp_path)
    recs = build_prompts(dataset, 0, 0.25, difficulties=["easy"])
    sides = Counter(side_of(r) for r in recs)
    assert set(sides) == {"trained", "heldout", "unseen"}, sides
    by_family: dict[str, set[str]] = {}
    for r in recs:
        by_family.setdefault(r.metadata["family"], set()).add(side_of(r))
    for fam, seen in by_family.items():
        assert seen <= {"unseen"} or "unseen" not in seen, (fam, seen)


def test_a_generated_file_outside_its_task_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A generated dataset obeys the rules of any dataset: a parameter or template never writes outside the task dir.
    escaping = dataclasses.replace(FAMILIES[0], app={"../../../escaped.txt": "x"})
    monkeypatch.setattr(families_module, "FAMILIES", (escaping,))
    with pytest.raises(ValueError, match="outside its task dir"):
        families_module.write_tasks(tmp_path, 0)


def test_generated_tasks_pass_harbor_lint(tmp_path: Path) -> None:
    # As the hand-written tasks' lint test (tests/unit/test_dataset.py): what Harbor's model would silently ignore.
    rules = {LintRule.INVALID_TASK_CONFIG, LintRule.UNKNOWN_CONFIG_FIELD, LintRule.INVALID_TASK_FILES}
    for task in load_dataset("builtin", seed=0, cache_dir=tmp_path).tasks:
        assert lint_task(task.path, selected_rules=rules) == [], task.name


def test_a_family_too_small_for_its_instances_stops_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    one_path = dataclasses.replace(FAMILIES[1], draw=lambda rng: {"path": "/app/out"})
    monkeypatch.setattr(families_module, "FAMILIES", (one_path,))
    with pytest.raises(ValueError, match=r"family make-dir: 1000 draws gave 1 of 4 distinct instances"):
        instances(0)


def _family(name: str):
    return next(f for f in FAMILIES if f.name == name)


def test_a_nested_make_dir_pair_leaks_and_no_seed_keeps_a_leaking_pair_of_one_category() -> None:
    """Seed 2 of generator version 4 drew `make-dir` instances `/app/archive/cache` and `/app/archive`: the first's
    `mkdir -p` also solves the second. The check finds that pair, and the generator now draws no such pair."""
    make_dir = _family("make-dir")
    nested, outer = (make_dir, {"path": "/app/archive/cache"}), (make_dir, {"path": "/app/archive"})
    assert solves(nested, outer) and not solves(outer, nested) and leaks(outer, nested)
    assert not leaks((make_dir, {"path": "/app/archive"}), (make_dir, {"path": "/app/cache/archive"}))
    for seed in (0, 1, 2):
        drawn = instances(seed)
        kin = [(a, b) for a, b in permutations(drawn, 2) if drawn[a][0].category == drawn[b][0].category]
        assert len(kin) > 400 and [(a, b) for a, b in kin if solves(drawn[a], drawn[b])] == []


def test_a_rename_whose_source_is_a_delete_tasks_junk_leaks_across_families() -> None:
    """A near-sibling leak (one category): `mv junk elsewhere` leaves a delete task's files as its verifier wants."""
    rename = (
        _family("rename-file"),
        {"src": "/app/log.md", "dst": "/app/plan.txt", "body": "x\n", "src_name": "log.md"},
    )
    delete = (
        _family("delete-file"),
        {"junk": "/app/log.md", "keep": "/app/memo.txt", "junk_name": "log.md", "keep_name": "memo.txt",
         "junk_body": "a\n", "keep_body": "b\n"},
    )  # fmt: skip
    assert solves(rename, delete) and not solves(delete, rename)
    elsewhere = (delete[0], delete[1] | {"junk": "/app/todo.md", "junk_name": "todo.md"})
    assert not leaks(rename, elsewhere)


def test_a_family_whose_model_disagrees_with_its_own_oracle_stops_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    never = dataclasses.replace(_family("make-dir"), grade=lambda tree, params: 0.0)
    monkeypatch.setattr(families_module, "FAMILIES", (never,))
    with pytest.raises(ValueError, match=r"make-dir-1: its oracle does not pass family make-dir's model"):
        instances(0)
    always = dataclasses.replace(_family("make-dir"), grade=lambda tree, params: 1.0)
    monkeypatch.setattr(families_module, "FAMILIES", (always,))
    with pytest.raises(ValueError, match=r"make-dir-1: the untouched files pass family make-dir's model"):
        instances(0)

"""Every generated instance of the built-in task families, through the dataset gate in the real bubblewrap
sandbox: its oracle earns the full reward and a no-op agent does not pass."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from harbor.models.trial.config import AgentConfig

from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import load_dataset
from grpoflow.prepare.families import FAMILIES, instances, leaks, start_tree, task_files, write_task
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.prepare.tree import Stop
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials
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


def _pairs_to_check() -> list[tuple[str, tuple, tuple]]:
    """(name, a, b): instance `a`'s oracle to run in instance `b`'s sandbox. The two leaks a seed drew before the
    generator checked for them (seed 2: a nested `make-dir`, and a rename whose source is a delete task's junk),
    then, for seed 0, each family's first instance in its second one's sandbox and in the first one's of every
    other family of its category: pairs the generator let stand, which must not pass in the sandbox either."""
    make_dir, delete, rename = (
        next(f for f in FAMILIES if f.name == n) for n in ("make-dir", "delete-file", "rename-file")
    )
    rename_src = {"wording": "0", "src": "/app/log.md", "src_name": "log.md", "dst": "/app/plan.txt", "body": "x y\n"}
    junk = {"wording": "0", "junk": "/app/log.md", "junk_name": "log.md", "junk_body": "apple kettle\nlemon\n"}
    keep = {"keep": "/app/memo.txt", "keep_name": "memo.txt", "keep_body": "orange\nquartz river\n"}
    drawn = [
        (
            "nested",
            (make_dir, {"path": "/app/archive/cache", "wording": "0"}),
            (make_dir, {"path": "/app/archive", "wording": "1"}),
        ),
        ("rename-junk", (rename, rename_src), (delete, junk | keep)),
    ]
    seed0 = instances(0)
    for family in FAMILIES:
        a = seed0[f"{family.name}-1"]
        drawn += [(f"{family.name}-in-2", a, seed0[f"{family.name}-2"])]
        for other in FAMILIES:
            if other.category == family.category and other is not family:
                drawn += [(f"{family.name}-in-{other.name}", a, seed0[f"{other.name}-1"])]
    return drawn


def test_the_families_model_gives_the_sandboxs_reward_for_one_oracle_in_anothers_task(
    bwrap: str, tmp_path: Path
) -> None:
    """The leak check trusts `Family.effect` and `Family.grade`: for each pair, a task made of `b`'s files with
    `a`'s oracle runs in the real sandbox, and its reward is the model's."""
    pairs = _pairs_to_check()
    prompts, modelled = [], {}
    for name, a, b in pairs:
        task = tmp_path / "tasks" / name
        write_task(task, task_files(*b) | {"solution/solve.sh": task_files(*a)["solution/solve.sh"]})
        prompts.append(PromptRecord(instance_id=name, task_path=str(task), instruction="-", split="train"))
        tree = start_tree(*b)
        try:
            a[0].effect(tree, a[1])
        except Stop:
            pass
        modelled[name] = b[0].grade(tree, b[1])
    assert modelled["nested"] == modelled["rename-junk"] == 1.0  # leaks, by the model
    assert leaks(pairs[0][1], pairs[0][2]) and leaks(pairs[1][1], pairs[1][2])
    cfg = parse_run_config({"rollout": {"concurrency": 4}})
    result = asyncio.run(
        collect_step(
            "t",
            0,
            plan_group_trials(prompts, 0, 1, 0),
            cfg.rollout,
            PolicyAccess(lambda spec: AgentConfig(name="oracle")),
            sandbox_config(cfg.rollout),
            tmp_path / "trials",
            tmp_path / "details",
        )
    )
    assert {s.instance_id: s.reward for s in result.samples} == modelled

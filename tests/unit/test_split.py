"""The split by task family: siblings of one scenario never sit on both the trained and the unseen side."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from grpoflow.config import parse_run_config
from grpoflow.errors import ConfigError, DatasetError
from grpoflow.paths import RunPaths
from grpoflow.prepare.dataset import Dataset, TaskSpec, load_dataset
from grpoflow.prepare.model import PreparedModel
from grpoflow.prepare.prompts import FAMILY_KEY, SIDE_KEY, build_prompts, load_prompts, side_of, write_prompts
from grpoflow.prepare.split import FamilyRule, resolve_split_by
from grpoflow.run.info import DatasetInfo, RunInfo, SplitInfo, read_run_info, write_run_info

SCENARIOS = [f"scenario{i}" for i in range(12)]


def _task(name: str, **metadata: object) -> TaskSpec:
    difficulty = str(metadata.get("difficulty", "medium"))
    return TaskSpec(
        name=name,
        path=Path("/data") / name,
        instruction=f"do {name}",
        difficulty=difficulty,
        category=str(metadata.get("category", "unknown")),
        agent_timeout_sec=60.0,
        verifier_timeout_sec=60.0,
        metadata=dict(metadata),
    )


def _dataset(tasks: list[TaskSpec]) -> Dataset:
    return Dataset(root=Path("/data"), tasks=tuple(sorted(tasks, key=lambda t: t.name)), sha256="0" * 64)


def variants() -> Dataset:
    """As the public corpus ships them: most scenarios as `_medium` and `_hard` variants, some alone, one with a
    numbered third instance; `category` and `tags` shared across scenarios, so neither is a family."""
    tasks = []
    for i, s in enumerate(SCENARIOS):
        meta = {"category": ["file", "text", "shell"][i % 3], "tags": ["bash"]}
        if i % 4 == 3:  # a scenario with one task only
            tasks.append(_task(s, **meta))
            continue
        tasks += [_task(f"{s}_medium", difficulty="medium", **meta), _task(f"{s}_hard", difficulty="hard", **meta)]
        if i % 5 == 0:
            tasks.append(_task(f"{s}_3", **meta))
    return _dataset(tasks)


def declared() -> Dataset:
    """Families declared in task.toml [metadata].family, with names that say nothing about them."""
    return _dataset([_task(f"t{i:02d}", family=f"fam{i % 7}", category="file") for i in range(30)])


def _sides(records) -> dict[str, set[str]]:
    """family -> the sides its instances are on."""
    out: dict[str, set[str]] = defaultdict(set)
    for r in records:
        out[r.metadata[FAMILY_KEY]].add(side_of(r))
    return out


def test_family_of_a_task_declared_first_then_the_name():
    rule = FamilyRule()
    assert rule.family(_task("backup_logs_hard")) == "backup_logs"
    assert rule.family(_task("backup-logs-2-medium")) == "backup-logs"
    assert rule.family(_task("count-lines")) == "count-lines"  # no suffix: a family of its own
    assert rule.family(_task("backup_logs_hard", family="logs")) == "logs"  # declared wins
    assert FamilyRule(key="category").family(_task("x_hard", category="text")) == "text"
    assert FamilyRule(pattern=r"(?P<family>[a-z]+)\d*").family(_task("abc12")) == "abc"
    with pytest.raises(DatasetError, match=r"x_hard/task.toml: \[metadata\].family must be a non-empty string"):
        rule.family(_task("x_hard", family=3))


@pytest.mark.parametrize("make", [variants, declared])
def test_no_family_is_on_both_the_trained_and_the_unseen_side_for_any_seed(make):
    data = make()
    for seed in range(300):
        recs = build_prompts(data, seed, eval_fraction=0.25, split_by="family")
        assert sorted(r.instance_id for r in recs) == sorted(t.name for t in data.tasks)
        for family, sides in _sides(recs).items():
            assert sides == {"unseen"} or "unseen" not in sides, (seed, family, sides)
            # a trained family trains at least one of its instances
            assert "unseen" in sides or "trained" in sides, (seed, family, sides)
        for r in recs:
            assert (r.split == "train") == (r.metadata[SIDE_KEY] == "trained")
        assert {side_of(r) for r in recs} == {"trained", "heldout", "unseen"}


def test_shares_of_families_and_instances():
    data = variants()  # 12 families, 23 tasks
    recs = build_prompts(data, 5, eval_fraction=0.25, split_by="family", instance_eval_fraction=0.2)
    by_side = _sides(recs)
    assert sum(sides == {"unseen"} for sides in by_side.values()) == 3  # a quarter of 12 families
    trained_instances = [r for r in recs if side_of(r) != "unseen"]
    assert sum(side_of(r) == "heldout" for r in recs) == round(0.2 * len(trained_instances))


def test_same_seed_same_split_other_seed_other_split():
    data = variants()
    key = lambda rs: [(r.instance_id, r.split, r.metadata[SIDE_KEY]) for r in rs]  # noqa: E731
    a, b = (build_prompts(data, 11, 0.25, split_by="family") for _ in range(2))
    assert key(a) == key(b)
    assert key(a) != key(build_prompts(data, 12, 0.25, split_by="family"))


def test_auto_is_family_when_the_dataset_groups_tasks_else_task():
    rule = FamilyRule()
    assert resolve_split_by(variants().tasks, "auto", rule) == "family"  # siblings by name
    assert resolve_split_by(declared().tasks, "auto", rule) == "family"  # declared
    builtin = load_dataset("builtin-fixed")
    assert resolve_split_by(builtin.tasks, "auto", rule) == "task"
    # the built-in set keeps today's split by difficulty, and its records gain no split metadata
    recs = build_prompts(builtin, 0, 0.25)
    assert recs == build_prompts(builtin, 0, 0.25, split_by="task")
    assert not any(FAMILY_KEY in r.metadata for r in recs)
    assert SplitInfo.of_prompts(recs).by == "task"


def test_no_eval_fraction_trains_everything_and_one_family_is_never_all_unseen():
    assert all(r.split == "train" for r in build_prompts(variants(), 0, 0.0, split_by="family"))
    one = _dataset([_task("a_medium"), _task("a_hard")])
    recs = build_prompts(one, 0, 0.5, split_by="family")
    assert sorted(side_of(r) for r in recs) == ["heldout", "trained"]


def test_split_is_recorded_and_a_written_prompts_file_keeps_it(tmp_path):
    recs = build_prompts(variants(), 3, 0.25, split_by="family")
    info = SplitInfo.of_prompts(recs)
    assert info.by == "family" and list(info.tasks) == ["trained", "heldout", "unseen"]
    unseen = {f for f, side in info.families.items() if side == "unseen"}
    assert unseen and {r.metadata[FAMILY_KEY] for r in recs if side_of(r) == "unseen"} == unseen
    assert sorted(n for names in info.tasks.values() for n in names) == sorted(r.instance_id for r in recs)
    assert json.loads(info.model_dump_json())["families"] == info.families
    # run.json holds it and reads it back
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    model = PreparedModel("m", "/m", "0" * 64, "", "LlamaForCausalLM", 8)
    run = {"created_at": "now", "python": "3", "platform": "x", "code_commit": None, "packages": {}}
    dataset = DatasetInfo(path="/d", sha256="0" * 64, tasks=[])
    write_run_info(paths, RunInfo(run_id="run", model=model, dataset=dataset, split=info, **run))
    assert read_run_info(paths).split == info


def test_a_prompts_file_whose_side_contradicts_its_split_is_refused(tmp_path):
    task = tmp_path / "x_hard"
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "task.toml").write_text('[metadata]\ndifficulty = "hard"\n')
    (task / "instruction.md").write_text("Do x.\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n")
    f = tmp_path / "p.jsonl"
    rec = {"instance_id": "x", "task_path": "x_hard", "split": "train", "metadata": {SIDE_KEY: "unseen"}}
    f.write_text(json.dumps(rec) + "\n")
    with pytest.raises(DatasetError) as exc:
        load_prompts(f)
    assert str(exc.value).startswith(f"{f}:1: field `metadata.{SIDE_KEY}`") and "\n" not in str(exc.value)
    rec["split"] = "eval"
    f.write_text(json.dumps(rec) + "\n")
    [loaded] = load_prompts(f)
    assert side_of(loaded) == "unseen"
    write_prompts(tmp_path / "again.jsonl", [loaded])


def test_declared_families_from_task_toml(tmp_path):
    for i in range(6):
        d = tmp_path / f"task{i}"
        (d / "tests").mkdir(parents=True)
        (d / "solution").mkdir()
        (d / "environment").mkdir()
        (d / "task.toml").write_text(f'[metadata]\ndifficulty = "easy"\nfamily = "f{i % 3}"\n')
        (d / "instruction.md").write_text(f"Do {i}.\n")
        (d / "tests" / "test.sh").write_text("#!/bin/bash\n")
        (d / "solution" / "solve.sh").write_text("#!/bin/bash\n")
    recs = build_prompts(load_dataset(tmp_path), 0, 0.34)
    assert {r.metadata[FAMILY_KEY] for r in recs} == {"f0", "f1", "f2"}
    assert all(len(sides) == 1 or "unseen" not in sides for sides in _sides(recs).values())


@pytest.mark.parametrize(
    "data, field",
    [
        ({"prompts": {"split_by": "scenario"}}, "prompts.split_by"),
        ({"prompts": {"family_pattern": "(unclosed"}}, "prompts.family_pattern"),
        ({"prompts": {"family_pattern": r"[a-z]+_hard"}}, "prompts.family_pattern"),
        ({"prompts": {"family_key": ""}}, "prompts.family_key"),
        ({"prompts": {"instance_eval_fraction": 1.5}}, "prompts.instance_eval_fraction"),
        ({"prompts": {"path": "p.jsonl", "split_by": "family"}}, "prompts.split_by"),
        ({"dataset": {"split_by": "family"}}, "prompts.split_by"),
    ],
)
def test_bad_split_settings_are_one_line_naming_the_field(data, field):
    with pytest.raises(ConfigError) as exc:
        parse_run_config(data)
    msg = str(exc.value)
    assert field in msg and "\n" not in msg


def test_split_settings_reach_the_prompts(tmp_path):
    from grpoflow.run.start import make_prompts

    cfg = parse_run_config({"prompts": {"split_by": "family", "family_key": "category", "eval_fraction": 0.34}})
    recs = make_prompts(cfg, variants())
    assert {r.metadata[FAMILY_KEY] for r in recs} == {"file", "text", "shell"}
    assert sum(sides == {"unseen"} for sides in _sides(recs).values()) == 1


def test_a_family_split_evaluates_three_sides_and_the_verdict_has_three_rows():
    from grpoflow.samples import Sample
    from grpoflow.scoring.evaluation import MIN_CLUSTERS, before_after_lines, eval_families, eval_plan, plan_metrics

    prompts = build_prompts(variants(), 7, 0.25, split_by="family")

    def results(version: int, passed) -> tuple[list[Sample], dict]:
        """The plan of weight version `version`'s evaluation and its synthetic trials: `passed(side, index)`."""
        plan = eval_plan(prompts, version, 4, seed=7)
        return [
            Sample(
                run_id="r",
                step=0,
                instance_id=s.instance_id,
                group_id=s.group_id,
                sample_index=s.sample_index,
                rollout_id=s.rollout_id,
                tokens=[1, 2],
                loss_mask=[0, 1],
                rollout_logprobs=[0.0, -1.0],
                prompt_len=1,
                reward=float(passed(side, s.sample_index)),
                status="COMPLETED",
                exit_status="Submitted",
            )
            for side, specs in plan.items()
            for s in specs
        ], plan

    base, plan0 = results(0, lambda side, k: k == 0)
    after, plan1 = results(1, lambda side, k: side == "trained" or (side == "heldout" and k < 2))
    families = eval_families(prompts)
    first, last = plan_metrics(plan0, base, None, families), plan_metrics(plan1, after, base, families)
    assert set(plan1) == {"trained", "heldout", "unseen"}
    n = {side: 4 * sum(side_of(p) == side for p in prompts) for side in plan1}
    # clusters: the trained instances; the held-out sides' families
    k = {
        side: len(
            {p.instance_id if side == "trained" else families[p.instance_id] for p in prompts if side_of(p) == side}
        )
        for side in plan1
    }
    lines = before_after_lines(first, last)
    assert [line.split(":")[0] for line in lines] == [
        "trained tasks",
        "held-out instances of trained families",
        "unseen families",
    ]
    for line, side in zip(lines, ("trained", "heldout", "unseen"), strict=True):
        assert line.endswith(f"({n[side]} paired trials in {k[side]} clusters)")
        assert ("[too few clusters]: not judged" in line) == (k[side] < MIN_CLUSTERS)
    assert k["trained"] < MIN_CLUSTERS or ": better (" in lines[0]


def test_a_run_saved_before_split_by_keeps_splitting_by_task(tmp_path):
    from grpoflow.config import upgrade
    from grpoflow.run.resume import load_saved_config

    saved = parse_run_config({"run_id": "s"}).model_dump(mode="json")
    del saved["prompts"]["split_by"], saved["config_version"]  # as a run saved it before either
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_saved_config(tmp_path).prompts.split_by == "task"
    saved["prompts"]["split_by"] = "auto"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_saved_config(tmp_path).prompts.split_by == "auto"
    from_file = {"prompts": {"path": "p.jsonl"}}  # a prompts file brings its own split
    assert upgrade(from_file, saved=True) == from_file


def _builtin_family_tasks() -> Dataset:
    """The built-in families' instances as a dataset declares them: each its family and its family's category."""
    from grpoflow.prepare.families import FAMILIES, INSTANCES

    return _dataset(
        [_task(f"{f.name}-{i}", family=f.name, category=f.category) for f in FAMILIES for i in range(INSTANCES)]
    )


def test_a_split_by_category_never_puts_one_category_on_both_sides():
    dataset = _builtin_family_tasks()
    categories = {t.category for t in dataset.tasks}
    assert len(categories) >= 3
    for seed in range(300):
        recs = build_prompts(dataset, seed, 0.34, split_by="category")
        sides: dict[str, set[str]] = {}
        for r in recs:
            sides.setdefault(r.metadata["category"], set()).add(side_of(r))
        unseen = {c for c, s in sides.items() if s == {"unseen"}}
        assert all(s == {"unseen"} or "unseen" not in s for s in sides.values()), (seed, sides)
        assert len(unseen) == 1 and set(sides) == categories  # a third of three categories, never all
        trained = {r.metadata[FAMILY_KEY] for r in recs if side_of(r) == "trained"}
        assert trained == {r.metadata[FAMILY_KEY] for r in recs if side_of(r) != "unseen"}  # each still trains
    assert SplitInfo.of_prompts(recs).by == "category"  # run.json says what was held out whole
    assert SplitInfo.of_prompts(build_prompts(dataset, 0, 0.34, split_by="family")).by == "family"


def test_a_split_by_category_refuses_a_family_of_two_categories():
    tasks = [_task("a-1", family="a", category="file"), _task("a-2", family="a", category="text")]
    tasks += [_task("b-1", family="b", category="shell")]
    with pytest.raises(DatasetError, match=r"family 'a' spans categories file, text .*\[metadata\]\.category"):
        build_prompts(_dataset(tasks), 0, 0.5, split_by="category")

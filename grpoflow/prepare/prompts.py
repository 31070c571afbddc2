"""prompts.jsonl: one record per task instance, ordered and split deterministically by the seed.

Built from a dataset (shuffled by the seed; the eval split taken per difficulty so both splits span the grades,
or by task family: `grpoflow.prepare.split`), or read from an existing jsonl (e.g. a Terminal-Bench 2 training
list), which is validated line by line.

A split by family marks each record's `metadata` with `split_family` and `split_side` (`trained`, `heldout`: an
instance of a trained family, `unseen`: of a family never trained); `side_of` reads a record's side.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpoflow.errors import DatasetError
from grpoflow.fileio import write_jsonl_atomic
from grpoflow.prepare.dataset import Dataset, TaskSpec, load_task
from grpoflow.prepare.split import SIDES, FamilyRule, Side, SplitBy, resolve_split_by, split_by_family

Split = Literal["train", "eval"]
FAMILY_KEY, SIDE_KEY = "split_family", "split_side"  # the metadata a split by family adds to each record
UNIT_KEY = "split_unit"  # and a split by category, what it held out whole (absent: families)


class PromptRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_id: str = Field(min_length=1, max_length=200, description="Unique id of this task instance.")
    task_path: str = Field(min_length=1, description="Harbor task directory (absolute in prompts.jsonl).")
    instruction: str = Field(description="The task's instruction.md text, as the agent sees it.")
    split: Split = Field("train", description="`train` or `eval`.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Difficulty, category, source, ...")


def build_prompts(
    dataset: Dataset,
    seed: int,
    eval_fraction: float,
    max_prompts: int | None = None,
    difficulties: Sequence[str] = (),
    *,
    split_by: str = "auto",
    family_rule: FamilyRule | None = None,
    instance_eval_fraction: float | None = None,
) -> list[PromptRecord]:
    """Seeded shuffle of the dataset's tasks (of the given `difficulties` only, when any are given), then the
    eval split: `eval_fraction` of each difficulty's tasks (`split_by` task), or of the task families (or of their
    categories), with `instance_eval_fraction` (default `eval_fraction`) of the trained families' instances
    (`split_by` family or category; `auto`: `grpoflow.prepare.split.resolve_split_by`)."""
    rng = random.Random(seed)
    tasks = list(dataset.tasks)  # sorted by name, so the shuffle depends on the seed only
    if difficulties:
        tasks = [t for t in tasks if t.difficulty in difficulties]
        if not tasks:
            grades = sorted({t.difficulty for t in dataset.tasks})
            raise DatasetError(
                f"prompts.difficulties {list(difficulties)}: the dataset has no such task (its "
                f"grades: {', '.join(grades)})"
            )
    rng.shuffle(tasks)
    if max_prompts is not None:
        tasks = tasks[:max_prompts]
    rule = family_rule or FamilyRule()
    if (by := resolve_split_by(tasks, split_by, rule)) != "task":
        fraction = eval_fraction if instance_eval_fraction is None else instance_eval_fraction
        sides = split_by_family(tasks, rng, eval_fraction, fraction, rule, unit=by)
        unit = {UNIT_KEY: by} if by == "category" else {}
        return [_record(t, "train" if sides[t.name][1] == "trained" else "eval", sides[t.name], unit) for t in tasks]
    by_grade: dict[str, list[TaskSpec]] = defaultdict(list)
    for t in tasks:
        by_grade[t.difficulty].append(t)
    eval_names = {t.name for grade in by_grade.values() for t in grade[: round(len(grade) * eval_fraction)]}
    return [_record(t, "eval" if t.name in eval_names else "train") for t in tasks]


def _record(
    task: TaskSpec, split: Split, family_side: tuple[str, Side] | None = None, unit: dict[str, str] | None = None
) -> PromptRecord:
    meta = {"task_name": task.name, "difficulty": task.difficulty, "category": task.category, **task.metadata}
    if family_side is not None:
        meta |= {FAMILY_KEY: family_side[0], SIDE_KEY: family_side[1], **(unit or {})}
    return PromptRecord(
        instance_id=task.name, task_path=str(task.path), instruction=task.instruction, split=split, metadata=meta
    )


def load_prompts(path: Path) -> list[PromptRecord]:
    """Read and validate an existing prompts jsonl; each problem is one `DatasetError` naming `file:line`.

    `task_path` may be relative to the jsonl's directory; it must be a valid Harbor task. A missing
    `instruction` is read from the task's instruction.md.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"{path}: prompts file not found") from None
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 ({err.reason} at byte {err.start})") from None
    records: list[PromptRecord] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(raw, dict):
            raise DatasetError(f"{where}: each line must be a JSON object")
        rec = _parse_line(raw, path.parent, where)
        if rec.instance_id in seen:
            raise DatasetError(
                f"{where}: duplicate instance_id `{rec.instance_id}` (first on line {seen[rec.instance_id]})"
            )
        seen[rec.instance_id] = n
        records.append(rec)
    if not records:
        raise DatasetError(f"{path}: no prompt records")
    return records


def _parse_line(raw: dict[str, Any], base: Path, where: str) -> PromptRecord:
    task_path = raw.get("task_path")
    if not isinstance(task_path, str) or not task_path:
        raise DatasetError(f"{where}: field `task_path` is required (a Harbor task directory)")
    resolved = (base / task_path).resolve()
    try:
        task = load_task(resolved)
    except DatasetError as err:  # its message names the task dir; say which line pointed there
        raise DatasetError(f"{where}: field `task_path`: {err}") from None
    raw = {**raw, "task_path": str(resolved)}
    raw.setdefault("instruction", task.instruction)
    raw.setdefault("metadata", {"task_name": task.name, "difficulty": task.difficulty, "category": task.category})
    try:
        rec = PromptRecord.model_validate(raw)
    except ValidationError as err:
        e = err.errors()[0]
        field = ".".join(str(x) for x in e["loc"])
        raise DatasetError(f"{where}: field `{field}`: {e['msg']}") from None
    side = rec.metadata.get(SIDE_KEY)
    # Evaluation reports a record by its side; one that contradicts its split would be reported on the wrong row.
    if side is not None and (side not in SIDES or (side == "trained") != (rec.split == "train")):
        raise DatasetError(
            f"{where}: field `metadata.{SIDE_KEY}`: {side!r} does not fit split `{rec.split}` (`trained` goes "
            "with `train`, `heldout` or `unseen` with `eval`)"
        )
    return rec


def write_prompts(path: Path, records: list[PromptRecord]) -> None:
    write_jsonl_atomic(path, (r.model_dump() for r in records))


def side_of(record: PromptRecord) -> Side:
    """Where a prompt stands: `trained`, or held out: `unseen` when a split by family marked its family unseen,
    else `heldout`."""
    if record.split == "train":
        return "trained"
    return "unseen" if record.metadata.get(SIDE_KEY) == "unseen" else "heldout"


def family_of(record: PromptRecord) -> str | None:
    """The family a split by family (or category) put the record in; None for a split by task."""
    family = record.metadata.get(FAMILY_KEY)
    return None if family is None else str(family)


def split_kind(records: Sequence[PromptRecord]) -> SplitBy:
    """`category` or `family` when the records carry such a split (a record names its family, and with a split by
    category the unit), else `task`."""
    if any(r.metadata.get(UNIT_KEY) == "category" for r in records):
        return "category"
    return "family" if any(family_of(r) is not None for r in records) else "task"

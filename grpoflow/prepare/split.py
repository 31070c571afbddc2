"""Task families and a split by family: held-out tasks that are not siblings of trained ones.

Many datasets ship one scenario as several tasks (`backup_logs_medium`, `backup_logs_hard`). A split by task puts
one variant in training and its sibling in evaluation, and the held-out score then measures memory. A split by
family keeps each family's variants together on the unseen side, so evaluation can report three numbers: trained
tasks, held-out instances of trained families (`heldout`), and wholly unseen families (`unseen`).

A task's family is its `[metadata].<family_key>` in task.toml when it declares one, else the group `family` of
`family_pattern` matched against the task name (by default the name without `_easy`/`_medium`/`_hard`/`_<digits>`
suffixes), else the task name itself.

A split by category holds out whole kinds of work instead (`[metadata].category`: every family of an unseen
category is unseen), so that near-sibling families (copying and renaming a file) never stand on both sides and the
`unseen` row measures transfer to another kind of task, not to a sibling template.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from grpoflow.config import DEFAULT_FAMILY_PATTERN
from grpoflow.errors import DatasetError
from grpoflow.prepare.dataset import TaskSpec

# Where a prompt stands: trained on, held out from a family that is trained, or of a family never trained.
Side = Literal["trained", "heldout", "unseen"]
SIDES: tuple[Side, ...] = ("trained", "heldout", "unseen")
SplitBy = Literal["task", "family", "category"]


@dataclass(frozen=True)
class FamilyRule:
    """How a task's family is found: a declared metadata key first, then a pattern on its name."""

    key: str = "family"
    pattern: str = DEFAULT_FAMILY_PATTERN

    def declares(self, task: TaskSpec) -> bool:
        return self.key in task.metadata

    def family(self, task: TaskSpec) -> str:
        if self.declares(task):
            declared = task.metadata[self.key]
            if not isinstance(declared, str) or not declared.strip():
                raise DatasetError(
                    f"{task.path / 'task.toml'}: [metadata].{self.key} must be a non-empty string (the task's "
                    f"family), got {declared!r}"
                )
            return declared
        match = re.fullmatch(self.pattern, task.name)
        return match.group("family") if match and match.group("family") else task.name


def families(tasks: Sequence[TaskSpec], rule: FamilyRule) -> dict[str, list[TaskSpec]]:
    """Family -> its tasks, in the order given."""
    out: dict[str, list[TaskSpec]] = {}
    for task in tasks:
        out.setdefault(rule.family(task), []).append(task)
    return out


def resolve_split_by(tasks: Sequence[TaskSpec], split_by: str, rule: FamilyRule) -> SplitBy:
    """`prompts.split_by` with `auto` resolved: `family` when the tasks are grouped at all (a declared family,
    or two names of one family), since a split by task would then put siblings on both sides; else `task`, which
    keeps the per-difficulty split of datasets whose tasks all stand alone (`builtin-fixed`)."""
    if split_by in ("task", "family", "category"):
        return split_by  # type: ignore[return-value]
    if any(rule.declares(t) for t in tasks):
        return "family"
    return "family" if any(len(group) > 1 for group in families(tasks, rule).values()) else "task"


def split_by_family(
    tasks: Sequence[TaskSpec],
    rng: random.Random,
    eval_fraction: float,
    instance_fraction: float,
    rule: FamilyRule,
    unit: Literal["family", "category"] = "family",
) -> dict[str, tuple[str, Side]]:
    """Task name -> (its family, its side). The units held out whole (families, or with `unit` category the
    categories of the families) are shuffled by `rng` (from their sorted names, so the split is a function of the
    seed and the task set only); `eval_fraction` of them go wholly to `unseen` (at least one when the fraction is
    above 0, and never all); then `instance_fraction` of the trained families' instances are held out (at least
    one when the fraction is above 0), drawn from every trained family's instances but one, so each trained
    family still trains."""
    groups = families(tasks, rule)
    members = {name: [name] for name in groups} if unit == "family" else _by_category(groups)
    names = sorted(members)
    rng.shuffle(names)
    n_unseen = _share(len(names), eval_fraction, limit=len(names) - 1)
    unseen = [fam for name in names[:n_unseen] for fam in members[name]]
    trained = [fam for name in names[n_unseen:] for fam in members[name]]
    candidates: list[TaskSpec] = []
    for fam in trained:
        members = sorted(groups[fam], key=lambda t: t.name)
        rng.shuffle(members)
        candidates += members[1:]  # members[0] is this family's instance that is surely trained
    rng.shuffle(candidates)
    n_trained = sum(len(groups[fam]) for fam in trained)
    held = {t.name for t in candidates[: _share(n_trained, instance_fraction, limit=len(candidates))]}
    out: dict[str, tuple[str, Side]] = {}
    for fam in unseen:
        out |= {t.name: (fam, "unseen") for t in groups[fam]}
    for fam in trained:
        out |= {t.name: (fam, "heldout" if t.name in held else "trained") for t in groups[fam]}
    return out


def _by_category(groups: dict[str, list[TaskSpec]]) -> dict[str, list[str]]:
    """Category -> its families (sorted); a family whose tasks declare different categories is refused."""
    out: dict[str, list[str]] = {}
    for fam, tasks in sorted(groups.items()):
        kinds = sorted({t.category for t in tasks})
        if len(kinds) > 1:
            raise DatasetError(
                f"prompts.split_by=category: family {fam!r} spans categories {', '.join(kinds)} "
                f"({tasks[0].path / 'task.toml'} and its siblings): give its tasks one [metadata].category"
            )
        out.setdefault(kinds[0], []).append(fam)
    return out


def _share(n: int, fraction: float, limit: int) -> int:
    """`fraction` of `n`, rounded half up, at least one when the fraction is above 0, at most `limit`."""
    if fraction <= 0 or n <= 0:
        return 0
    return max(0, min(limit, max(1, math.floor(n * fraction + 0.5))))

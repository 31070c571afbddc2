"""The config's sections that are one of several types (the engine, the harness, the sandbox), told apart by a tag
setting; what reads a config that is not validated yet (the upgrade, `--set`, error messages) finds them here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from grpoflow.config.engine import ENGINE_TYPES
from grpoflow.config.rollout import HARNESS_TYPES, SANDBOX_TYPES


@dataclass(frozen=True)
class Variants:
    path: tuple[str, ...]  # where the section is in the config
    tag: str  # the setting that names the variant
    types: dict[str, type[BaseModel]]  # tag value -> its type
    default: str  # the variant of a section that names none

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    def section(self, data: dict[str, Any]) -> dict[str, Any] | None:
        """The section in raw config `data` (a dict there, else None)."""
        node: Any = data
        for p in self.path:
            node = node.get(p) if isinstance(node, dict) else None
        return node if isinstance(node, dict) else None

    def type_of(self, section: dict[str, Any]) -> type[BaseModel] | None:
        """The type `section` names (the default variant's when it names none); None for an unknown name."""
        return self.types.get(str(section.get(self.tag, self.default)))

    def foreign(self, section: dict[str, Any]) -> list[str]:
        """The settings of `section` that its variant does not take (none when the variant is unknown)."""
        kind = self.type_of(section)
        return [] if kind is None else [k for k in section if k not in kind.model_fields]


VARIANTS: tuple[Variants, ...] = (
    Variants(("engine",), "backend", ENGINE_TYPES, "embedded"),
    Variants(("rollout", "harness"), "name", HARNESS_TYPES, "shell"),
    Variants(("rollout", "sandbox"), "backend", SANDBOX_TYPES, "local"),
)


def name_variants(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (changed in place) with every variant section that names none given its default: what a config that
    names none runs on. Sections only, so that parts of a config merged before validation stay as they are."""
    for v in VARIANTS:
        section = v.section(data)
        if section is not None and v.tag not in section:
            section[v.tag] = v.default
    return data

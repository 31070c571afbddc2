"""Prepare a run: resolve the model, validate the dataset, build prompts, then write the run dir.

Everything that can fail on bad input (model path, GGUF, task dirs, prompts file) runs before the run dir is
created, so a failed prepare leaves no half-written run behind and never touches an existing one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpoflow.config import RunConfig
from grpoflow.errors import RunDirError
from grpoflow.fileio import write_json_atomic
from grpoflow.prepare.dataset import Dataset, load_dataset
from grpoflow.prepare.model import PreparedModel, prepare_model
from grpoflow.prepare.prompts import (
    PromptRecord,
    build_prompts,
    load_prompts,
    write_prompts,
)
from grpoflow.run.paths import RunPaths, create_run_dir, environment_info


@dataclass(frozen=True)
class PreparedRun:
    paths: RunPaths
    model: PreparedModel
    dataset_sha256: str
    n_tasks: int
    n_prompts: dict[str, int]  # by split


def make_prompts(cfg: RunConfig, dataset: Dataset) -> list[PromptRecord]:
    if cfg.prompts.path:
        return load_prompts(Path(cfg.prompts.path))
    return build_prompts(dataset, cfg.seed, cfg.prompts.eval_fraction, cfg.prompts.max_prompts,
                         cfg.prompts.difficulties)  # fmt: skip


def record_run(
    cfg: RunConfig, model: PreparedModel, dataset: Dataset, prompts: list[PromptRecord], flow_run_id: str | None = None
) -> PreparedRun:
    """Create runs/<run_id>/ and write config.json, run.json (provenance) and prompts.jsonl."""
    paths = create_run_dir(cfg.output_dir, cfg.run_id)
    write_json_atomic(paths.config, cfg.model_dump(mode="json"))
    info = {
        "run_id": cfg.run_id,
        "flow_run_id": flow_run_id,
        **environment_info(),
        "model": model.to_dict(),
        "dataset": {"path": str(dataset.root), "sha256": dataset.sha256, "tasks": [t.name for t in dataset.tasks]},
    }
    write_json_atomic(paths.run_info, info)
    write_prompts(paths.prompts, prompts)
    splits: dict[str, int] = {}
    for p in prompts:
        splits[p.split] = splits.get(p.split, 0) + 1
    return PreparedRun(paths, model, dataset.sha256, len(dataset.tasks), splits)


def prepare_run(cfg: RunConfig, cache_dir: Path | None = None) -> PreparedRun:
    model = prepare_model(cfg.model.source, cache_dir)
    dataset = load_dataset(cfg.dataset.path)
    return record_run(cfg, model, dataset, make_prompts(cfg, dataset))


def read_run_info(paths: RunPaths) -> dict[str, Any]:
    """run.json (provenance); one line naming the file when it is missing or not JSON."""
    try:
        info = json.loads(paths.run_info.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{paths.run_info}: not found (the run never finished preparing)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{paths.run_info}: unreadable: {err}") from None
    if not isinstance(info, dict):
        raise RunDirError(f"{paths.run_info}: top level must be a JSON object")
    return info


def update_run_info(paths: RunPaths, **fields: Any) -> dict[str, Any]:
    """Add or replace top-level fields of run.json (atomically); returns the new record."""
    info = {**read_run_info(paths), **fields}
    write_json_atomic(paths.run_info, info)
    return info


def reopen_run(cfg: RunConfig, cache_dir: Path | None = None) -> PreparedRun:
    """An existing run dir, for resuming it: the model and dataset are resolved again and must be the very ones
    the run started with (run.json's sha256s), or the resumed steps would train something else."""
    paths = RunPaths(cfg.run_dir)
    info = read_run_info(paths)
    model = prepare_model(cfg.model.source, cache_dir)
    dataset = load_dataset(cfg.dataset.path)
    then_model = (info.get("model") or {}).get("weights_sha256")
    then_data = (info.get("dataset") or {}).get("sha256")
    if then_model != model.weights_sha256:
        raise RunDirError(f"{paths.run_info}: model {cfg.model.source} has weights sha256 {model.weights_sha256}, "
                          f"the run started with {then_model}: resume needs the same model")  # fmt: skip
    if then_data != dataset.sha256:
        raise RunDirError(f"{paths.run_info}: dataset {cfg.dataset.path} has sha256 {dataset.sha256}, the run "
                          f"started with {then_data}: resume needs the same tasks")  # fmt: skip
    splits: dict[str, int] = {}
    for p in load_prompts(paths.prompts):
        splits[p.split] = splits.get(p.split, 0) + 1
    return PreparedRun(paths, model, dataset.sha256, len(dataset.tasks), splits)

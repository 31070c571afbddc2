"""Prepare a run: resolve the model, validate the dataset, build prompts, then write the run dir.

Everything that can fail on bad input (model path, GGUF, task dirs, prompts file) runs before the run dir is
created, so a failed prepare leaves no half-written run behind and never touches an existing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpoflow.config import RunConfig
from grpoflow.dataset import Dataset, load_dataset
from grpoflow.fileio import write_json_atomic
from grpoflow.model import PreparedModel, prepare_model
from grpoflow.prompts import PromptRecord, build_prompts, load_prompts, write_prompts
from grpoflow.rundir import RunPaths, create_run_dir, environment_info


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
    return build_prompts(dataset, cfg.seed, cfg.prompts.eval_fraction, cfg.prompts.max_prompts)


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

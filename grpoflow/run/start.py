"""Prepare a run: validate the dataset, resolve the model, build prompts, then write the run dir.

Everything that can fail on bad input (model path, GGUF, task dirs, prompts file) runs before the run dir is
created, so a failed prepare leaves no half-written run behind and never touches an existing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpoflow.config import RunConfig
from grpoflow.errors import ModelError, RunDirError
from grpoflow.fileio import write_json_atomic
from grpoflow.paths import RunPaths, create_run_dir
from grpoflow.prepare.dataset import Dataset, load_dataset
from grpoflow.prepare.model import PreparedModel, prepare_model
from grpoflow.prepare.prompts import (
    PromptRecord,
    build_prompts,
    load_prompts,
    write_prompts,
)
from grpoflow.prepare.split import FamilyRule
from grpoflow.run.info import DeploymentRef, Provenance, RunInfo, SplitInfo, parent_of, read_run_info, write_run_info
from grpoflow.tokens import TemplateError, check_chat_template, load_tokenizer


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
    p = cfg.prompts
    return build_prompts(
        dataset,
        cfg.seed,
        p.eval_fraction,
        p.max_prompts,
        p.difficulties,
        split_by=p.split_by,
        family_rule=FamilyRule(p.family_key, p.family_pattern),
        instance_eval_fraction=p.instance_eval_fraction,
    )


def record_run(
    cfg: RunConfig,
    model: PreparedModel,
    dataset: Dataset,
    prompts: list[PromptRecord],
    flow_run_id: str | None = None,
    deployment: DeploymentRef | None = None,
) -> PreparedRun:
    """Create runs/<run_id>/ and write config.json, run.json (provenance; the flow run and the deployment that
    started it; the split: which tasks and families on which side) and prompts.jsonl."""
    if cfg.rollout.harness == "shell":  # it extends the chat token by token; the session server can re-tokenise
        try:
            check_chat_template(load_tokenizer(model.path))
        except TemplateError as err:
            raise ModelError(f"model {model.path}: {err}: the shell agent cannot keep a chat's exact tokens") from None
    paths = create_run_dir(cfg.output_dir, cfg.run_id)
    write_json_atomic(paths.config, cfg.model_dump(mode="json"))
    provenance = Provenance.now(model, dataset)
    parent = parent_of(cfg.model.source)  # lineage: a checkpoint of an earlier run
    write_run_info(
        paths,
        RunInfo(
            run_id=cfg.run_id,
            flow_run_id=flow_run_id,
            deployment=deployment,
            parent=parent,
            split=SplitInfo.of_prompts(prompts),
            **dict(provenance),
        ),
    )
    write_prompts(paths.prompts, prompts)
    splits: dict[str, int] = {}
    for p in prompts:
        splits[p.split] = splits.get(p.split, 0) + 1
    return PreparedRun(paths, model, dataset.sha256, len(dataset.tasks), splits)


def prepare_run(cfg: RunConfig, cache_dir: Path | None = None) -> PreparedRun:
    dataset = load_dataset(cfg.dataset.path)  # first: cheap, and a bad task set needs no model converted
    model = prepare_model(cfg.model.source, cache_dir)
    return record_run(cfg, model, dataset, make_prompts(cfg, dataset))


def reopen_run(cfg: RunConfig, cache_dir: Path | None = None) -> PreparedRun:
    """An existing run dir, for resuming it: the model and dataset are resolved again and must be the very ones
    the run started with (run.json's sha256s), or the resumed steps would train something else."""
    paths = RunPaths(cfg.run_dir)
    info = read_run_info(paths)
    model = prepare_model(cfg.model.source, cache_dir)
    dataset = load_dataset(cfg.dataset.path)
    then_model, then_data = info.model.weights_sha256, info.dataset.sha256
    if then_model != model.weights_sha256:
        raise RunDirError(
            f"{paths.run_info}: model {cfg.model.source} has weights sha256 {model.weights_sha256}, "
            f"the run started with {then_model}: resume needs the same model"
        )
    if then_data != dataset.sha256:
        raise RunDirError(
            f"{paths.run_info}: dataset {cfg.dataset.path} has sha256 {dataset.sha256}, the run "
            f"started with {then_data}: resume needs the same tasks"
        )
    splits: dict[str, int] = {}
    for p in load_prompts(paths.prompts):
        splits[p.split] = splits.get(p.split, 0) + 1
    return PreparedRun(paths, model, dataset.sha256, len(dataset.tasks), splits)

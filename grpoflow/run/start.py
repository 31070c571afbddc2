"""Prepare a run: validate the dataset, resolve the model, build prompts, then write the run dir.

Everything that can fail on bad input (model path, GGUF, task dirs, prompts file) runs before the run dir is
created, so a failed prepare leaves no half-written run behind and never touches an existing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpoflow.config import ChatHarness, RunConfig
from grpoflow.errors import DatasetError, ModelError, RunDirError
from grpoflow.fileio import write_json_atomic
from grpoflow.paths import RunPaths, create_run_dir
from grpoflow.prepare.dataset import Dataset, is_builtin, load_dataset
from grpoflow.prepare.model import PreparedModel, default_cache_dir, prepare_model
from grpoflow.prepare.prompts import (
    PromptRecord,
    build_prompts,
    load_prompts,
    write_prompts,
)
from grpoflow.prepare.split import FamilyRule
from grpoflow.run.info import DeploymentRef, Provenance, RunInfo, SplitInfo, parent_of, read_run_info, write_run_info
from grpoflow.scoring.gate import GateReport, GateSettings, admitted_dataset, run_gate, ungated_report
from grpoflow.tokens import TemplateError, check_chat_template, load_tokenizer


@dataclass(frozen=True)
class PreparedRun:
    paths: RunPaths
    model: PreparedModel
    dataset_sha256: str
    n_tasks: int
    n_prompts: dict[str, int]  # by split
    n_left_out: int = 0  # task dirs of the dataset left out (malformed, refused, or by the gate): gate.json


def gate_wanted(cfg: RunConfig) -> bool:
    """`dataset.validate` as set; unset: on for every dataset but the built-in one, whose tasks the test suite
    proves (so the main job's wall time does not grow)."""
    return cfg.dataset.validate if cfg.dataset.validate is not None else not is_builtin(cfg.dataset.path)


def load_run_dataset(cfg: RunConfig, cache_dir: Path | None = None) -> Dataset:
    """The dataset as the run's sandbox sees it: for the local sandbox, tasks whose environment it does not
    reproduce are left out (`grpoflow.dockerfile`). The built-in one is generated from the run's seed (into
    `cache_dir`), so a resumed run finds the very tasks it started with."""
    return load_dataset(
        cfg.dataset.path,
        local_sandbox=cfg.rollout.sandbox.local,
        seed=cfg.seed,
        cache_dir=cache_dir,
        build_images=cfg.dataset.build_images,
        base_images=cfg.dataset.base_images,
    )


def gate_dataset(cfg: RunConfig, cache_dir: Path | None = None, fresh: bool = False) -> tuple[Dataset, GateReport]:
    """Load the dataset and run the dataset gate on it (`grpoflow.scoring.gate`; unless `gate_wanted` says no;
    `fresh`: no cached verdict read): the admitted tasks, and every task dir's verdict. Prints the gate's progress
    and table (one line per task left out); a dataset with nothing left raises `DatasetError` in one line, after
    the table."""
    dataset = load_run_dataset(cfg, cache_dir)
    if gate_wanted(cfg):
        report = run_gate(
            dataset,
            cfg.rollout,
            Path(cache_dir or default_cache_dir()),
            cfg.dataset.reward_rule(),
            GateSettings.of(cfg.dataset, fresh),
            progress=lambda line: print(f"grpoflow: {line}", flush=True),
        )
    else:
        report = ungated_report(dataset, cfg.rollout.sandbox.backend)
    if report.gated or report.left_out:
        for line in report.lines():
            print(f"grpoflow: {line}", flush=True)
    return admitted_dataset(dataset, report), report


def make_prompts(cfg: RunConfig, dataset: Dataset) -> list[PromptRecord]:
    if cfg.prompts.path:
        records = load_prompts(Path(cfg.prompts.path))
        # A prompts file may name tasks the dataset left out (refused, or by the gate): they never train.
        out = {str(x.path) for x in dataset.left_out}
        kept = [p for p in records if str(Path(p.task_path).resolve()) not in out]
        if not kept:
            raise DatasetError(f"{cfg.prompts.path}: every prompt names a task the dataset left out (see gate.json)")
        return kept
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
    gate: GateReport | None = None,
) -> PreparedRun:
    """Create runs/<run_id>/ and write config.json, run.json (provenance; the flow run and the deployment that
    started it; the split: which tasks and families on which side), prompts.jsonl and, with `gate`, gate.json
    (the dataset gate's verdict per task dir)."""
    # The shell agent extends a chat token by token; the session server of the chat harnesses can re-tokenise.
    if not isinstance(cfg.rollout.harness, ChatHarness):
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
    if gate is not None:
        write_json_atomic(paths.gate, gate.to_json())
    splits: dict[str, int] = {}
    for p in prompts:
        splits[p.split] = splits.get(p.split, 0) + 1
    return PreparedRun(paths, model, dataset.sha256, len(dataset.tasks), splits, len(dataset.left_out))


def prepare_run(cfg: RunConfig, cache_dir: Path | None = None) -> PreparedRun:
    dataset, gate = gate_dataset(cfg, cache_dir)  # first: a bad task set needs no model converted
    model = prepare_model(cfg.model.source, cache_dir)
    return record_run(cfg, model, dataset, make_prompts(cfg, dataset), gate=gate)


def reopen_run(cfg: RunConfig, cache_dir: Path | None = None) -> PreparedRun:
    """An existing run dir, for resuming it: the model and dataset are resolved again and must be the very ones
    the run started with (run.json's sha256s), or the resumed steps would train something else."""
    paths = RunPaths(cfg.run_dir)
    info = read_run_info(paths)
    model = prepare_model(cfg.model.source, cache_dir)
    dataset = load_run_dataset(cfg, cache_dir)  # not gated again: prompts.jsonl already holds only the admitted tasks
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

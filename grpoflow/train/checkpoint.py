"""Checkpoint files: an HF dir written atomically (a LoRA run's: its adapter, and the merged model when asked),
optionally with the AdamW state, trainer counters and the step's record (then it is a full checkpoint, a resume
point), and the trainer's state restored from one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from grpoflow.errors import CheckpointError, one_line
from grpoflow.fileio import publish_dir
from grpoflow.train.fsdp import OPTIMIZER_DCP
from grpoflow.train.lora import ADAPTER_DIR, has_lora, load_adapter, save_adapter, serving_tensors
from grpoflow.train.trainer import TrainerState

OPTIMIZER_FILE = "optimizer.pt"  # AdamW state: a resumed run continues the same moments
TRAINER_FILE = "trainer.json"  # trainer counters
STEP_FILE = "step.json"  # the step's metrics + timings record; its presence marks a complete step


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: Any | None,
    out_dir: str | Path,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    counters: dict[str, Any] | None = None,
    step_record: dict[str, Any] | None = None,
    durable: bool = True,
    weights: bool = True,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an HF dir (safetensors, config, tokenizer) atomically: a temp sibling renamed into place.

    With `optimizer`, `counters` and `step_record` the dir is the commit point of a training step: the optimizer
    state, the trainer counters and the step's record (`step.json`) land in the same rename as the weights, so a
    crash leaves either no checkpoint of the step or a complete one. Readers (the engine's weight update globs
    `*.safetensors`) never see a half-written dir. An existing `out_dir` (a retried step) is replaced.
    `durable` fsyncs the files before the rename (a power loss keeps them); off for checkpoints nothing resumes
    from. A LoRA model (`grpoflow.train.lora`) writes its adapter (`adapter/`) and, with `weights`, the merged
    model the engine serves; without, only its config (the adapter is its whole trained state). A model without
    adapters always writes its weights. `dtype`: the weights in that dtype (a dir only an engine reads, in the
    dtype it serves); the model's own otherwise.
    """
    out_dir = Path(out_dir)
    lora = has_lora(model)
    with publish_dir(out_dir, replace=True, durable=durable) as tmp:
        try:
            if lora:
                save_adapter(model, tmp / ADAPTER_DIR)
            if weights or not lora:  # a model without adapters always writes its weights: its trained state
                tensors = serving_tensors(model) if lora or dtype is not None else None  # None: save_pretrained's
                if dtype is not None:
                    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
                model.save_pretrained(tmp, safe_serialization=True, state_dict=tensors)
            else:
                model.config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if optimizer is not None:
                torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            if counters is not None:
                (tmp / TRAINER_FILE).write_text(json.dumps(counters, indent=2) + "\n", encoding="utf-8")
            if step_record is not None:  # the rename that publishes the dir publishes it with everything else
                (tmp / STEP_FILE).write_text(json.dumps(step_record) + "\n", encoding="utf-8")
        except BaseException as err:
            failure = write_failure(out_dir, err)  # here, before the temp dir's removal frees the space it measures
            if failure is None:
                raise
            raise failure from err
    return out_dir


def write_failure(path: Path, err: BaseException) -> CheckpointError | None:
    """`err`, raised while writing the checkpoint `path`, as one line if the filesystem is at fault (an OS error,
    safetensors' I/O error, or anything raised on a full disk: torch.save's is a bare RuntimeError); else None."""
    try:
        fs = os.statvfs(path.parent)
        free = fs.f_bavail * fs.f_frsize
    except OSError:
        free = None
    if isinstance(err, OSError):
        why = err.strerror or str(err)
    elif type(err).__name__ == "SafetensorError" or (
        isinstance(err, RuntimeError) and free is not None and free < FULL
    ):
        why = one_line(str(err), 200)
    else:
        return None
    room = "" if free is None else f" ({free // 1024} KiB free on its filesystem)"
    return CheckpointError(f"cannot write checkpoint {path}: {why}{room}")


FULL = 1 << 20  # bytes: a filesystem with less free space is taken to be full


def save_sharded_checkpoint(
    trainer: TrainerState,
    out_dir: str | Path,
    *,
    step_record: dict[str, Any],
    durable: bool,
    weights: bool,
    dtype: torch.dtype | None,
) -> Path:
    """`save_checkpoint` (without the optimizer: `StepCommits` adds it) for a sharded trainer, on rank 0: every
    rank writes its shards of the weights into the temp dir (`grpoflow.train.dcp.write_weights`), which becomes
    the same plain HF dir."""
    from grpoflow.train.dcp import write_weights
    from grpoflow.train.parallel import on_other_ranks

    out_dir = Path(out_dir)
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
    with publish_dir(out_dir, replace=True, durable=durable) as tmp:
        with on_other_ranks(trainer, write_weights, str(tmp), weights, dtype_name):
            write_weights(trainer, str(tmp), weights, dtype_name)
        if trainer.tokenizer is not None:
            trainer.tokenizer.save_pretrained(tmp)
        (tmp / STEP_FILE).write_text(json.dumps(step_record) + "\n", encoding="utf-8")
    return out_dir


def holds_optimizer(ckpt: Path) -> bool:
    """Whether a checkpoint dir holds the AdamW state (a full checkpoint: a resume point)."""
    return (ckpt / OPTIMIZER_FILE).is_file() or (ckpt / OPTIMIZER_DCP).is_dir()


def restore_training_state(state: TrainerState, ckpt: str | Path) -> dict[str, Any]:
    """Load a step checkpoint's weights, AdamW state and counters into `state` (a trainer from `load_trainer` on
    the same model); returns the counters. The model keeps its device and dtype (fp32)."""
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    if has_lora(state.model):
        load_adapter(state.model, ckpt)
        return _restore_optimizer(state, ckpt)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        weights.update(load_file(f, device=str(state.device)))
    # Tied weights (lm_head = embed_tokens) are saved once; strict=False lets the tie fill the other name.
    missing, unexpected = state.model.load_state_dict(weights, strict=False)
    params = state.model.state_dict(keep_vars=True)
    loaded = {params[n].data_ptr() for n in weights if n in params}
    untied = [n for n in missing if params[n].data_ptr() not in loaded]
    if unexpected or untied:
        raise ValueError(
            f"{ckpt}: weights do not match the model (missing {sorted(untied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    return _restore_optimizer(state, ckpt)


def _restore_optimizer(state: TrainerState, ckpt: Path) -> dict[str, Any]:
    if (ckpt / OPTIMIZER_DCP).is_dir() and state.sharded:  # each rank reads its shards once sharded
        state.pending_optimizer = ckpt / OPTIMIZER_DCP
    elif (ckpt / OPTIMIZER_DCP).is_dir():  # a sharded run's, whole, into a trainer that is not
        from grpoflow.train.dcp import load_optimizer

        load_optimizer(state, ckpt / OPTIMIZER_DCP)
    else:
        state.optimizer.load_state_dict(torch.load(ckpt / OPTIMIZER_FILE, map_location=state.device, weights_only=True))
    counters = json.loads((ckpt / TRAINER_FILE).read_text(encoding="utf-8"))
    state.optimizer_steps = int(counters.get("optimizer_steps", 0))
    return counters

"""A step's commit: its checkpoint dir, the full checkpoint made in the background, then its log rows.

Every step writes `checkpoints/step_<N>/` (the weights the engine loads next, and `step.json`, the step's record)
by one atomic rename; the engine syncs from it. After every `train.checkpoint.interval` steps and after the last, the
dir is made a *full* checkpoint in a background thread (`StepCommits`): the AdamW state and the trainer counters
join it and everything is fsynced. Other steps skip both (the optimizer state is twice the size of the weights),
so most steps' commit costs one unsynced write of the weights. A step's metrics.jsonl / timings.jsonl rows follow
its dir (a full one's once it is complete), then older checkpoints that are not full are pruned.
"""

from __future__ import annotations

import copy
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpoflow.fileio import fsync_files, fsync_path, is_temp_sibling
from grpoflow.paths import RunPaths, step_of
from grpoflow.run.metrics import MetricsLog
from grpoflow.run.record import StepRecord
from grpoflow.train.checkpoint import (
    OPTIMIZER_DCP,
    OPTIMIZER_FILE,
    STEP_FILE,
    TRAINER_FILE,
    holds_optimizer,
    save_checkpoint,
    save_sharded_checkpoint,
    write_failure,
)
from grpoflow.train.fsdp import is_sharded
from grpoflow.train.trainer import TrainerState


def is_full_checkpoint(step: int, steps: int, save_interval: int) -> bool:
    """Whether step `step` (from 0) of a `steps`-step run writes a full checkpoint (a resume point): after every
    `save_interval` steps, and after the last."""
    return (step + 1) % save_interval == 0 or step == steps - 1


@dataclass(frozen=True)
class StepDir:
    """What a step writes to `checkpoints/step_<N>/` (`step_dir`): whether a LoRA run writes the merged model
    there too (a model without adapters always writes its weights), and the dtype of the weights."""

    weights: bool
    dtype: torch.dtype | None


def step_dir(full: bool, last: bool, engine_loads_it: bool, engine_dtype: torch.dtype) -> StepDir | None:
    """The step's dir, or None when the step writes none: a full checkpoint (`is_full_checkpoint`) or a dir the
    engine loads the weights from (a disk sync). A LoRA run's merged model goes only where the engine loads it
    and into the last step's dir (the run's plain HF export); a dir that is no full checkpoint is read by the
    engine alone, so it holds the weights in the dtype the engine serves (bf16 for SGLang)."""
    if not (full or engine_loads_it):
        return None
    cast = not full and engine_dtype != torch.float32
    return StepDir(weights=engine_loads_it or last, dtype=engine_dtype if cast else None)


def save_step(
    trainer: TrainerState, paths: RunPaths, step: int, record: StepRecord, plan: StepDir = StepDir(True, None)
) -> Path:
    """`checkpoints/step_<step>/` as `plan` says, atomically, with step.json (not fsynced: nothing resumes from it
    unless `StepCommits` makes it a full checkpoint)."""
    if is_sharded(trainer.model):
        return save_sharded_checkpoint(
            trainer,
            paths.checkpoint(step),
            step_record=record.to_json(),
            durable=False,
            weights=plan.weights,
            dtype=plan.dtype,
        )
    return save_checkpoint(
        trainer.model,
        trainer.tokenizer,
        paths.checkpoint(step),
        step_record=record.to_json(),
        durable=False,
        weights=plan.weights,
        dtype=plan.dtype,
    )


class StepCommits:
    """The end of each step's commit, after `save_step` and the engine's weight sync.

    A step that writes no full checkpoint logs its metrics/timings rows at once (`log_step`). A full one is
    completed in a background thread while the run goes on: a snapshot of the AdamW state and the counters are
    written into its dir, every file is fsynced, and the optimizer file's rename makes the dir a resume point
    (`complete_steps`). Its rows are logged only then, by `flush`, which every later save and the end of the run
    call: rows never run ahead of what a resume would keep. `flush` raises what the thread raised. `served`: the
    checkpoint dir the engines were loaded from (None: none, or in memory), which pruning keeps: a restarted engine
    is given its weights again from there."""

    def __init__(self, paths: RunPaths, log: MetricsLog, served: Callable[[], Path | None] = lambda: None) -> None:
        self.paths, self.log, self.served = paths, log, served
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: tuple[int, StepRecord] | None = None

    def finish(self, trainer: TrainerState, ckpt: Path | None, step: int, record: StepRecord, full: bool) -> None:
        self.flush()
        if not full:
            log_step(self.paths, step, record, self.log, self.served())
            return
        t0 = time.perf_counter()
        if is_sharded(trainer.model):  # every rank writes its shards now (DCP); published below like optimizer.pt
            state = _write_sharded_optimizer(trainer, Path(ckpt))
        else:
            state = _cpu_copy(trainer.optimizer.state_dict())  # the next step updates the live tensors in place
        counters = {"step": step, "optimizer_steps": trainer.optimizer_steps}
        record.times.commit += time.perf_counter() - t0  # the caller's too
        self._pending = (step, record)
        final = record.to_json()  # with what the sync added to the record
        self._thread = threading.Thread(
            target=self._complete,
            args=(Path(ckpt), state, counters, final),
            name=f"full-checkpoint-{step}",
            daemon=True,
        )
        self._thread.start()

    def _complete(
        self, ckpt: Path, state: dict[str, Any] | Path, counters: dict[str, Any], final: dict[str, Any]
    ) -> None:
        record_tmp = ckpt / f".{STEP_FILE}.tmp"
        if isinstance(state, Path):  # a sharded trainer's, written by every rank
            tmp, published = state, ckpt / OPTIMIZER_DCP
        else:
            tmp, published = ckpt / f".{OPTIMIZER_FILE}.tmp", ckpt / OPTIMIZER_FILE
        try:
            if not isinstance(state, Path):
                torch.save(state, tmp)
            (ckpt / TRAINER_FILE).write_text(json.dumps(counters, indent=2) + "\n", encoding="utf-8")
            # the step's whole record: the one save_step wrote was taken before the weight sync
            record_tmp.write_text(json.dumps(final) + "\n", encoding="utf-8")
            record_tmp.rename(ckpt / STEP_FILE)
            fsync_files(ckpt)  # the publishing rename is only as durable as the bytes it points at
            tmp.rename(published)
            fsync_path(ckpt)
            fsync_path(ckpt.parent)  # the step dir's own entry (its rename into checkpoints/ was not synced)
        except BaseException as err:  # raised again in the run's thread by flush()
            failure = write_failure(ckpt, err)  # measured before the cleanup frees the space
            if failure is not None:
                failure.__cause__ = err
            self._error = failure or err
            # the dir stays what save_step published: no resume point, nothing torn
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            record_tmp.unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait for a full checkpoint being completed, then log its step's rows."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        pending, self._pending = self._pending, None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if pending is not None:
            log_step(self.paths, *pending, self.log, self.served())


def _write_sharded_optimizer(trainer: TrainerState, ckpt: Path) -> Path:
    """Every rank's shards of AdamW's state into a temp dir of `ckpt` (`grpoflow.train.dcp.write_optimizer`)."""
    import shutil

    from grpoflow.train.dcp import write_optimizer
    from grpoflow.train.parallel import on_other_ranks

    tmp = ckpt / f".{OPTIMIZER_DCP}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with on_other_ranks(trainer, write_optimizer, str(tmp)):
        write_optimizer(trainer, str(tmp))
    return tmp


def _cpu_copy(state: Any) -> Any:
    """A copy of an optimizer state dict with every tensor in CPU memory (no second copy on the GPU)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _cpu_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cpu_copy(v) for v in state)
    return copy.deepcopy(state)


def log_step(paths: RunPaths, step: int, record: StepRecord, log: MetricsLog, served: Path | None) -> None:
    """The step's metrics/timings rows, then pruning of older checkpoints that are not full (but `served`)."""
    log.log(step, record.metrics(), record.timings())
    prune_checkpoints(paths.checkpoint(step).parent, latest=step, keep=served)


def prune_checkpoints(root: str | Path, latest: int, keep: Path | None = None) -> list[Path]:
    """Delete `root/step_<n>` dirs with n < latest that are not full checkpoints (no optimizer state) or `keep`;
    return the deleted paths.

    Full checkpoints (resume points), the latest step and `keep` are kept, and steps after `latest` are left
    alone. Leftover temp dirs of an interrupted save are removed too.
    """
    removed = []
    kept = Path(keep).resolve() if keep is not None else None
    for p in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        n = step_of(p)
        if is_temp_sibling(p) or (n is not None and n < latest and not holds_optimizer(p) and p.resolve() != kept):
            shutil.rmtree(p)
            removed.append(p)
    return removed

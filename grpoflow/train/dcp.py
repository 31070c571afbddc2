"""A sharded trainer's checkpoint files, written with torch's distributed checkpoint (DCP): every rank writes its
own shards, and what the step's dir holds stays a plain HF dir.

- Weights: DCP's `HuggingFaceStorageWriter`, each rank its shards (under `sharded/`), then consolidated into HF
  safetensors files (`model.safetensors`, or `model-0000i-of-0000N.safetensors` and
  `model.safetensors.index.json` above `MAX_FILE_BYTES`, as `save_pretrained` names them) that `from_pretrained`, the embedded engine and SGLang load as they are; `sharded/` is
  removed. The consolidation copies byte ranges of the shard files: no rank holds the whole model. A LoRA run's
  adapter is gathered (it is small) and written by rank 0 in PEFT's format, and its merged weights are computed
  shard by shard.
- AdamW's state (a full checkpoint): by parameter name, in DCP's own format (`optimizer.dcp/`), each rank its
  shards. A resumed sharded run's ranks read their shards of it (`shard_trainer`; DCP reshards, so the number
  of ranks may differ from the writer's); an unsharded trainer reads it whole (`load_optimizer`).

The functions that write run on every rank at once (rank 0's `on_other_ranks` hands them to the others), into a
dir rank 0 chose.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from grpoflow.train.fsdp import _serving_entries, full

if TYPE_CHECKING:
    from grpoflow.train.trainer import TrainerState

MAX_FILE_BYTES = 4 << 30  # weights per safetensors file, as HF models ship them
_SHARDED = "sharded"  # where HuggingFaceStorageWriter puts the ranks' own files before consolidating them
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def serving_shards(model: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """This rank's shards of the tensors an engine loads (`grpoflow.train.fsdp.serving_stream`'s, not gathered),
    in `dtype` when given. A LoRA layer's merged weight is its base shard plus scaling x B @ A, computed on the
    shards (DTensor ops)."""
    out = {}
    with torch.no_grad():
        for name, t, lora in _serving_entries(model):
            if lora is not None:
                if getattr(lora, "fan_in_fan_out", False) or lora.use_dora.get("default", False):
                    raise NotImplementedError(f"{name}: merging a fan-in-fan-out or DoRA adapter is not supported")
                a, b = lora.lora_A["default"].weight, lora.lora_B["default"].weight
                t = t + ((b @ a) * lora.scaling["default"]).to(t.dtype)
            out[name] = t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()
    return out


def file_index(tensors: dict[str, torch.Tensor], max_bytes: int | None = None) -> dict[str, int]:
    """Which safetensors file (1..N) each tensor goes to: in order, a new file once one holds `max_bytes`
    (`MAX_FILE_BYTES`)."""
    max_bytes = MAX_FILE_BYTES if max_bytes is None else max_bytes
    index, size, out = 1, 0, {}
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > max_bytes:
            index, size = index + 1, 0
        out[name] = index
        size += nbytes
    return out


def write_weights(state: TrainerState, out_dir: str, weights: bool, dtype_name: str | None) -> None:
    """Every rank: the step's weights into `out_dir` (as `save_checkpoint` decides: a LoRA model's adapter, and
    its merged model with `weights`; a full model's weights always), in `dtype_name` when given; rank 0 adds
    config.json and generation_config.json."""
    from grpoflow.train.lora import ADAPTER_DIR, adapter_tensors, has_lora, save_adapter

    model, out, rank0 = state.model, Path(out_dir), state.dp.rank == 0
    dtype = getattr(torch, dtype_name) if dtype_name else None
    lora = has_lora(model)
    if lora:
        adapter = {k: full(v).detach().cpu().contiguous() for k, v in adapter_tensors(model).items()}
        if rank0:
            save_adapter(model, out / ADAPTER_DIR, tensors=adapter)
    if weights or not lora:
        tensors = serving_shards(model, dtype)
        writer = HuggingFaceStorageWriter(
            str(out), save_distributed=True, enable_consolidation=True, fqn_to_index_mapping=file_index(tensors)
        )
        dcp.save(tensors, storage_writer=writer, process_group=state.dp.group)
        if rank0:
            shutil.rmtree(out / _SHARDED)
            files = sorted(out.glob("model-*-of-*.safetensors"))
            if len(files) == 1:  # one file: named as `save_pretrained` names it, without an index
                files[0].rename(out / SINGLE_FILE)
                (out / INDEX_FILE).unlink()
    if rank0:
        model.config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)


def write_optimizer(state: TrainerState, out_dir: str) -> None:
    """Every rank: its shards of AdamW's state, by parameter name, into `out_dir` (DCP's format, fsynced)."""
    osd = get_optimizer_state_dict(state.model, state.optimizer)
    dcp.save({"optimizer": osd}, storage_writer=FileSystemWriter(out_dir), process_group=state.dp.group)


def load_optimizer(state: TrainerState, path: str | Path) -> None:
    """AdamW's state from a sharded checkpoint's `optimizer.dcp/`, whole, into an unsharded trainer (rank 0's
    before `shard_trainer`, or a single process's): DCP joins the shards, whatever number of ranks wrote them."""
    osd = get_optimizer_state_dict(state.model, state.optimizer)  # the tensors to fill, named and shaped
    dcp.load({"optimizer": osd}, checkpoint_id=str(path), no_dist=True)
    set_optimizer_state_dict(state.model, state.optimizer, osd)

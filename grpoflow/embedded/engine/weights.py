"""Load new weights (a folder of safetensors, or tensors received from the trainer) into a live model,
all-or-nothing.

Every tensor is read and checked (names, shapes) before any parameter is written, so a bad checkpoint leaves
the serving model untouched. A tensor tied to one that is present (e.g. `lm_head.weight` sharing
`model.embed_tokens.weight`, which `save_pretrained` leaves out) may be absent.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from grpoflow.errors import ModelError


def read_safetensors_dir(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of `model_path/*.safetensors`, by name."""
    folder = Path(model_path)
    if not folder.is_dir():
        raise ModelError(f"weights folder {folder} does not exist or is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors file in {folder}")
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            loaded.update(load_file(f))
        except (SafetensorError, OSError) as e:
            raise ModelError(f"cannot read {f}: {e}") from e
    return loaded


def load_named_tensors(model: torch.nn.Module, loaded: dict[str, torch.Tensor], source: str, whole: bool = True) -> int:
    """Copy `loaded` into `model` (cast to each parameter's dtype) after checking every name and shape, so a bad
    set leaves the model untouched; `source` names where they came from in errors. `whole`: every tensor of the
    model must be there (a checkpoint); else any part of them (a bucket of an in-memory sync, as SGLang takes
    one). Returns how many were copied."""
    target = model.state_dict()
    unexpected = sorted(loaded.keys() - target.keys())
    if unexpected:
        raise ModelError(f"{source}: {len(unexpected)} tensors the model does not have, e.g. {unexpected[:3]}")
    loaded_ptrs = {target[name].data_ptr() for name in loaded}
    missing = sorted(n for n in target.keys() - loaded.keys() if target[n].data_ptr() not in loaded_ptrs)
    if whole and missing:
        raise ModelError(f"{source}: {len(missing)} model tensors missing, e.g. {missing[:3]}")
    for name, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(target[name].shape):
            raise ModelError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target[name].shape)}"
            )

    with torch.no_grad():
        for name, tensor in loaded.items():
            target[name].copy_(tensor.to(target[name].dtype))
    return len(loaded)


def load_safetensors_dir(model: torch.nn.Module, model_path: str | Path) -> int:
    """Copy every tensor of `model_path/*.safetensors` into `model`; return how many were copied."""
    return load_named_tensors(model, read_safetensors_dir(model_path), str(Path(model_path)))

"""LoRA training (`train.lora`): PEFT adapters injected into the policy in place, the only weights trained.

The model stays the HF model (PEFT's `inject_adapter_in_model`), so the logprob path, the checkpoint code and
the engine see the same modules as without LoRA. What the engine serves is the merged model: every adapted
linear's base weight plus its LoRA delta, under the base model's own tensor names (`serving_tensors`), synced like
full weights. What is trained, checkpointed and restored is the adapter alone (`adapter_tensors`), in PEFT's
format (`<checkpoint>/adapter/`: `adapter_model.safetensors` + `adapter_config.json`, loadable with
`peft.PeftModel.from_pretrained(base, dir)`), with the optimizer state of the adapter's parameters only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from grpoflow.config import LoraSettings
from grpoflow.train.logprobs import token_logprobs

ADAPTER_DIR = "adapter"  # inside a checkpoint dir: PEFT's adapter_model.safetensors + adapter_config.json
_ADAPTER_FILE = "adapter_model.safetensors"
_BASE = ".base_layer."  # PEFT's name part for the wrapped linear of an adapted module


def add_lora(model: torch.nn.Module, cfg: LoraSettings) -> torch.nn.Module:
    """Inject LoRA adapters into `model` (in place) and freeze every other weight. B starts at zero, so the
    adapted model is the base model until the first update."""
    model = inject_adapter_in_model(_peft_config(cfg), model)  # keeps its config in `model.peft_config`
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def has_lora(model: torch.nn.Module) -> bool:
    return any(isinstance(m, LoraLayer) for m in model.modules())


@torch.no_grad()
def serving_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an engine loads, as a checkpoint holds them: the state dict, each shared tensor once (a tied
    `lm_head.weight` is left to its embedding, as `save_pretrained` does). A LoRA model's are the merged model's
    under the base model's names: each adapted linear's weight is base + scaling * B @ A, and the adapter's own
    tensors are left out."""
    deltas = {
        f"{name}{_BASE}weight": module.get_delta_weight("default")
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name.replace(_BASE, ".")] = t + deltas[name].to(t.dtype) if name in deltas else t
    return out


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """For the block, every adapted linear computes its base layer alone: the model is the base model, exactly.
    (PEFT's `enable_adapters(False)` would also clear the adapters' requires_grad, which the optimizer, and a
    sharded model's FSDP state, hold on to: only the flag its forward reads is switched.)"""
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before, strict=True):
            m._disable_adapters = was


class AdapterOff:
    """A LoRA policy seen with its adapters off, as the KL reference: the frozen base model it trains on, with no
    second copy of its weights. `token_logprobs` takes it like a model."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def grpoflow_token_logprobs(self, input_ids, mask, autocast_dtype=None, temperature=1.0):
        with adapters_off(self.model):
            return token_logprobs(self.model, input_ids, mask, autocast_dtype, temperature)


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return get_peft_model_state_dict(model)


def save_adapter(
    model: torch.nn.Module,
    out: Path,
    dtype: torch.dtype | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """The adapter in PEFT's format, in `out` (a checkpoint's is `<checkpoint>/adapter/`); in `dtype` when given
    (an engine's copy), else the trainer's (a checkpoint's). `tensors`: the adapter's, already gathered (a
    sharded model's)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(model) if tensors is None else tensors
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
    save_file(tensors, out / _ADAPTER_FILE)
    model.peft_config["default"].save_pretrained(out)


def load_adapter(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """Load `<ckpt_dir>/adapter/` into `model`'s adapters; a ValueError names a missing or mismatched file."""
    path = Path(ckpt_dir) / ADAPTER_DIR / _ADAPTER_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no LoRA adapter in this checkpoint (was the run trained with train.lora?)")
    tensors = load_file(path, device=str(next(model.parameters()).device))
    wanted = set(adapter_tensors(model))
    if set(tensors) != wanted:
        extra, missing = sorted(set(tensors) - wanted), sorted(wanted - set(tensors))
        raise ValueError(
            f"{path}: the adapter does not match the model's (train.lora changed?): "
            f"{len(missing)} missing, e.g. {missing[:2]}; {len(extra)} unexpected, e.g. {extra[:2]}"
        )
    set_peft_model_state_dict(model, tensors)


def _peft_config(cfg: LoraSettings) -> LoraConfig:
    # No dropout: train-time logprobs must match the engine's.
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=list(cfg.target_modules),
        lora_dropout=0.0,
        bias="none",
    )

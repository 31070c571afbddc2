"""A LoRA adapter served by the embedded engine: SGLang's `/load_lora_adapter` and `/unload_lora_adapter`.

SGLang keeps adapters apart from the base weights and applies the one a request names (`lora_path`). The
embedded engine serves one adapter at a time, merged: loading reads PEFT's adapter dir (`adapter_config.json`,
`adapter_model.safetensors`), keeps the base weights of the linears it adapts and writes base + (alpha / r) *
B @ A into them; unloading writes the base weights back. So while an adapter is loaded every request must name
it (a request for the base model, or another adapter, is refused rather than served the wrong weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from grpoflow.errors import ModelError

_PEFT_PREFIX = "base_model.model."  # PEFT's key prefix when saved from a PeftModel wrapper


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, tensors) of PEFT's adapter dir; a ModelError names what is missing or unreadable."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ModelError(
                f"{folder}: no {f.name} (a PEFT adapter dir holds {config_file.name} and {weights_file.name})"
            )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        tensors = load_file(weights_file)
    except (OSError, ValueError, SafetensorError) as e:
        raise ModelError(f"{folder}: unreadable adapter: {e}") from e
    return config, tensors


def adapter_deltas(model: torch.nn.Module, config: dict, tensors: dict[str, torch.Tensor], source: str):
    """{parameter name: its LoRA delta (out, in)} for the linears the adapter covers, checked against `model`."""
    if config.get("use_rslora") or config.get("use_dora"):
        raise ModelError(f"{source}: rsLoRA and DoRA adapters are not supported")
    r, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", 0))
    if r <= 0:
        raise ModelError(f"{source}: adapter_config.json has no rank `r`")
    params = dict(model.named_parameters())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name:
                module = name.split(marker)[0]
                pairs.setdefault(module, {})[part] = t
                break
        else:
            raise ModelError(f"{source}: {key} is not a LoRA A or B matrix")
    deltas = {}
    for module, ab in sorted(pairs.items()):
        weight = f"{module}.weight"
        if weight not in params or set(ab) != {"lora_A", "lora_B"}:
            raise ModelError(f"{source}: {module} is not a linear of the model, or lacks its A or B matrix")
        delta = (ab["lora_B"].float() @ ab["lora_A"].float()) * (alpha / r)  # (out, r) @ (r, in)
        if delta.shape != params[weight].shape:
            raise ModelError(f"{source}: {module}: delta {tuple(delta.shape)} vs weight {tuple(params[weight].shape)}")
        deltas[weight] = delta
    if not deltas:
        raise ModelError(f"{source}: the adapter holds no LoRA matrices")
    return deltas


class AdapterSlot:
    """The one adapter merged into the served weights, and the base weights it replaced."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.name: str | None = None
        self._base: dict[str, torch.Tensor] = {}

    def load(self, name: str, path: str | Path) -> int:
        """Merge the adapter at `path` as `name`; returns how many linears it adapts. Nothing changes on error."""
        if self.name is not None:
            raise ModelError(f"adapter {self.name!r} is loaded: unload it first (one adapter at a time here)")
        config, tensors = read_adapter(path)
        deltas = adapter_deltas(self.model, config, tensors, str(path))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for weight, delta in deltas.items():
                self._base[weight] = params[weight].detach().clone()
                params[weight].add_(delta.to(params[weight].dtype))
        self.name = name
        return len(deltas)

    def unload(self, name: str) -> None:
        if self.name != name:
            raise ModelError(f"adapter {name!r} is not loaded" + (f" ({self.name!r} is)" if self.name else ""))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for weight, base in self._base.items():
                params[weight].copy_(base)
        self._base.clear()
        self.name = None

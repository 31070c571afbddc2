"""Loading safetensors into a live model: tied tensors, mismatches, all-or-nothing."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpoflow.embedded.engine.weights import load_safetensors_dir
from grpoflow.errors import ModelError


def _model(seed: int, tie: bool = True) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(cfg).eval()


def test_tied_head_may_be_absent(tmp_path):
    src, dst = _model(1), _model(2)
    src.save_pretrained(tmp_path)  # writes embed_tokens only; lm_head is tied to it
    n = load_safetensors_dir(dst, tmp_path)
    assert n == len(src.state_dict()) - 1
    for name, t in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], t), name
    assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()


def test_untied_head_missing_is_an_error(tmp_path):
    src, dst = _model(1, tie=False), _model(2, tie=False)
    state = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match="missing.*lm_head.weight"):
        load_safetensors_dir(dst, tmp_path)


def test_unexpected_tensor_is_an_error_and_nothing_is_copied(tmp_path):
    src, dst = _model(1), _model(2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    state = dict(src.state_dict())
    state.pop("lm_head.weight")
    state["model.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match="does not have.*model.extra.weight"):
        load_safetensors_dir(dst, tmp_path)
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in before.items())


def test_sharded_checkpoint_loads(tmp_path):
    src, dst = _model(1, tie=False), _model(2, tie=False)
    items = sorted(src.state_dict().items())
    half = len(items) // 2
    save_file({k: v.contiguous() for k, v in items[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: v.contiguous() for k, v in items[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert load_safetensors_dir(dst, tmp_path) == len(items)
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in items)


def test_empty_or_missing_folder(tmp_path):
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        load_safetensors_dir(_model(1), tmp_path)
    with pytest.raises(ModelError, match="does not exist"):
        load_safetensors_dir(_model(1), tmp_path / "nope")

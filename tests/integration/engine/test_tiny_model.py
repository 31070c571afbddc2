"""The tiny test model: deterministic, loadable, ChatML-capable."""

from __future__ import annotations

from transformers import AutoTokenizer

from grpoflow.fileio import sha256_file, sha256_tree
from tests.fakes.tiny_model import IM_END, build_tiny_model


def test_same_seed_same_files_other_seed_other_weights(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert sha256_tree(again) == sha256_tree(tiny_model_dir)
    assert sha256_file(other / "tokenizer.json") == sha256_file(tiny_model_dir / "tokenizer.json")
    assert sha256_file(other / "model.safetensors") != sha256_file(tiny_model_dir / "model.safetensors")


def test_tokenizer_and_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert 900 <= len(tok) <= 1100
    assert tok.eos_token == IM_END
    text = tok.apply_chat_template([{"role": "user", "content": "ls -la"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nls -la<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("echo héllo > /app/x.txt")) == "echo héllo > /app/x.txt"  # byte-level round trip

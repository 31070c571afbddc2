"""A bad model source, through the whole prepare stage: one `ModelError` line naming the dir or file, raised
before the run dir exists (and a corrupt GGUF leaves no cache entry)."""

from __future__ import annotations

import json
import shutil

import pytest

from grpoflow.errors import ModelError

from .conftest import assert_nothing_written, assert_one_line


def _copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def _drop(pattern):
    def change(m):
        for f in m.glob(pattern):
            f.unlink()

    return change


def _edit_config(**changes):
    def change(m):
        cfg = json.loads((m / "config.json").read_text())
        (m / "config.json").write_text(json.dumps({**cfg, **changes}))

    return change


def _no_chat_template(m):
    tc = json.loads((m / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (m / "tokenizer_config.json").write_text(json.dumps(tc))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (m / extra).unlink(missing_ok=True)


def _cut(keep):
    """model.safetensors cut to `keep(size)` bytes, as an interrupted download or copy leaves it."""

    def change(m):
        f = m / "model.safetensors"
        size = f.stat().st_size
        with open(f, "r+b") as w:
            w.truncate(keep(size))

    return change


def _garble_header(m):
    with open(m / "model.safetensors", "r+b") as w:
        w.seek(12)
        w.write(b"\xff\xfe\x00")


def _append(m):
    with open(m / "model.safetensors", "ab") as w:
        w.write(b"\x00" * 64)


def _index_naming_a_missing_shard(m):
    (m / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )


CASES = [
    ("no-tokenizer", _drop("tokenizer*.json"), ["no tokenizer"]),
    ("no-config", _drop("config.json"), ["no config.json"]),
    ("no-weights", _drop("*.safetensors"), ["no *.safetensors"]),
    ("tokenizer-larger-than-vocab", _edit_config(vocab_size=16), ["vocab_size is 16"]),
    ("config-not-json", lambda m: (m / "config.json").write_text("{ nope"), ["cannot load config/tokenizer"]),
    ("no-chat-template", _no_chat_template, ["chat_template"]),
    # checked from the header alone (no weights read): fails at prepare, before config.json or run.json exist
    ("safetensors-cut-in-half", _cut(lambda n: n // 2), ["model.safetensors is truncated or corrupt"]),
    ("safetensors-one-byte-short", _cut(lambda n: n - 1), ["model.safetensors is truncated or corrupt"]),
    ("safetensors-empty", _cut(lambda n: 0), ["model.safetensors is truncated or corrupt"]),
    ("safetensors-header-garbled", _garble_header, ["model.safetensors is truncated or corrupt"]),
    ("safetensors-trailing-bytes", _append, ["model.safetensors is truncated or corrupt"]),
    ("shard-missing", _index_naming_a_missing_shard, ["model-00002-of-00002.safetensors", "lacks"]),
]


@pytest.mark.parametrize(("breaker", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_model_dir_fails_prepare(tiny_model_dir, tmp_path, prepare, breaker, words):
    call, runs = prepare
    m = _copy(tiny_model_dir, tmp_path)
    breaker(m)
    with pytest.raises(ModelError) as info:
        call(model={"source": str(m)})
    assert_one_line(info.value, m.resolve(), *words)
    assert_nothing_written(runs)


def test_corrupt_gguf_fails_prepare_and_leaves_no_cache_entry(tmp_path, prepare):
    call, runs = prepare
    bad = tmp_path / "policy.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 8)
    with pytest.raises(ModelError) as info:
        call(model={"source": str(bad)})
    assert_one_line(info.value, "policy.gguf", "corrupt")
    assert_nothing_written(runs)
    models = tmp_path / "cache" / "models"
    assert not models.exists() or not any(models.iterdir())


def test_truncated_gguf_fails_prepare(tmp_path, prepare):
    call, runs = prepare
    bad = tmp_path / "empty.gguf"
    bad.write_bytes(b"")
    with pytest.raises(ModelError) as info:
        call(model={"source": str(bad)})
    assert_one_line(info.value, "empty.gguf")
    assert_nothing_written(runs)


def test_non_gguf_file_fails_prepare(tmp_path, prepare):
    call, runs = prepare
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x00" * 16)
    with pytest.raises(ModelError) as info:
        call(model={"source": str(f)})
    assert_one_line(info.value, str(f), "must be a .gguf")
    assert_nothing_written(runs)


def test_unknown_model_name_fails_prepare(prepare):
    call, runs = prepare
    with pytest.raises(ModelError) as info:
        call(model={"source": "smollm2-9000b"})
    assert_one_line(info.value, "smollm2-9000b", "smollm2-135m-instruct")
    assert_nothing_written(runs)

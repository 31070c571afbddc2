"""oneDNN-packed linears: same parameters and outputs as nn.Linear, refreshed after in-place weight writes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from grpoflow.embedded.engine.packed_linear import (
    PackedLinear,
    pack_linears,
    repack_linears,
)


@pytest.fixture
def models(tiny_model_dir):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    if pack_linears(packed) == 0:
        pytest.skip("oneDNN packed linears are not supported by this torch build")
    return plain, packed


def test_packing_keeps_parameters_and_outputs(models):
    plain, packed = models
    n_linear = sum(type(m) is nn.Linear for m in plain.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == n_linear > 0
    assert list(packed.state_dict()) == list(plain.state_dict())
    if plain.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.get_input_embeddings().weight
    ids = torch.tensor([[1, 302, 201, 538, 439], [9, 8, 7, 6, 5]])  # (B, T)
    with torch.inference_mode():
        assert torch.allclose(packed(ids).logits, plain(ids).logits, atol=1e-5)


def test_packed_linear_takes_any_input_layout():
    torch.manual_seed(0)
    lin = nn.Linear(24, 40)
    ref = nn.Linear(24, 40)
    ref.load_state_dict(lin.state_dict())
    assert pack_linears(nn.Sequential(lin)) == 1
    x = torch.randn(3, 7, 24)
    for inp in (x, x[:, -1:], x.transpose(0, 1), x[0]):  # 3-D, a sliced view, non-contiguous, 2-D
        assert torch.allclose(lin(inp), ref(inp), atol=1e-5)


def test_repack_follows_in_place_weight_writes(models):
    plain, packed = models
    with torch.no_grad():
        for model in (plain, packed):
            for p in model.parameters():
                p.mul_(1.5)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode():
        stale = packed(ids).logits
        repack_linears(packed)
        fresh = packed(ids).logits
        want = plain(ids).logits
    assert not torch.allclose(stale, want, atol=1e-3)  # the packed copy is a snapshot...
    assert torch.allclose(fresh, want, atol=1e-5)  # ...until repacked


def test_repack_refreshes_only_the_linears_written_since_they_were_packed(models):
    """A bucket of a weight sync writes a part of the model: only the linears it wrote are repacked (by the
    weight's version counter, which a tied weight shares), and the model then serves them all."""
    plain, packed = models
    assert repack_linears(packed) == 0  # nothing written since packing
    linears = [name for name, m in packed.named_modules() if isinstance(m, PackedLinear)]
    written = linears[0]
    with torch.no_grad():
        for model in (plain, packed):
            model.get_submodule(written).weight.mul_(1.5)
    assert repack_linears(packed) == 1
    assert repack_linears(packed) == 0
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode():
        assert torch.allclose(packed(ids).logits, plain(ids).logits, atol=1e-5)

"""The in-place growing KV cache behaves like transformers' concatenating DynamicCache."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from grpoflow.embedded.engine.kv_cache import BatchKVCache, GrowingLayer, kv_tensors


def test_growing_layer_appends_like_cat_across_regrowth():
    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    layer = GrowingLayer(k0, v0)
    ks, vs = [k0], [v0]
    for step in range(200):  # well past the first capacity, so the buffer is regrown
        n = 1 if step % 7 else 3
        k, v = torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)
        out_k, out_v = layer.update(k, v)
        ks.append(k)
        vs.append(v)
    assert torch.equal(out_k, torch.cat(ks, dim=2)) and torch.equal(out_v, torch.cat(vs, dim=2))
    assert layer.get_seq_length() == out_k.shape[2]


def test_model_decodes_the_same_with_either_cache(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 302, 201, 538, 439], [9, 8, 7, 6, 5]])  # (B, T)
    with torch.inference_mode():
        kv = kv_tensors(model(input_ids=ids, use_cache=True).past_key_values)
        caches = [DynamicCache(ddp_cache_data=kv), BatchKVCache(kv)]
        logits = [[], []]
        tok = ids[:, -1:]  # (B, 1)
        for step in range(80):
            for c, out in zip(caches, logits):
                pos = torch.full((2, 1), 5 + step)
                out.append(model(input_ids=tok, position_ids=pos, past_key_values=c, use_cache=True).logits)
            tok = logits[0][-1][:, -1].argmax(-1, keepdim=True)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*logits))
    assert caches[1].get_seq_length() == 5 + 80

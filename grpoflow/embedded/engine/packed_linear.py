"""Linear layers on oneDNN with their weights packed once, instead of MKL's sgemm on every call.

Why: torch's fp32 `F.linear` on CPU goes through MKL, which takes a slow code path on non-Intel CPUs. Measured
on one core of an AMD EPYC (Zen 5, AVX-512), SmolLM2-135M's linears at M=8 rows (an 8-row decode step) run at
~70 GFLOP/s with MKL and 2.5x faster with oneDNN on a weight reordered once into its blocked layout; the lm_head
GEMV (M=1) is ~2x faster, prefill GEMMs (M=256) ~2x. A decode step of 8 rows drops from ~75 ms to ~36 ms, of
1 row from ~40 ms to ~24 ms.

Still fp32 (fp32 accumulation; no bf16 down-conversion unless someone sets torch's mkldnn fp32 precision): the
result differs from MKL's only in summation order. On SmolLM2-135M the engine's logprobs of ~1300 sampled tokens
agree with a plain full-sequence forward (MKL) to 3.6e-5 at most, 1.5e-5 without packing; the bound is 1e-4.

Cost: a second copy of every linear weight (the nn.Parameter stays, for state_dict and weight updates: +540 MB
for a 135M model), ~1 s at startup (oneDNN builds its kernels) and ~0.2 s per weight update (`repack_linears`).

This leans on two private torch ops, the ones inductor's CPU backend uses for the same purpose
(`torch.ops.mkldnn._reorder_linear_weight`, `torch.ops.mkldnn._linear_pointwise`). `pack_linears` probes them
against `F.linear` and leaves the model alone if they are missing or disagree, so a torch upgrade that drops
them costs speed, not correctness.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for; any M works. 8-64 measured alike, 1 was ~1.6x slower at M=8.
_BATCH_HINT = 16


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward multiplies by a oneDNN-packed copy of its weight.

    Modules become one by a class swap (`pack_linears`), so parameters, state_dict keys, weight tying and
    hooks stay exactly as they were. The packed copy is a snapshot: call `repack()` after writing the weight.
    """

    packed: torch.Tensor
    packed_at: int  # the weight's version counter (torch bumps it on every in-place write) when it was packed

    def repack(self) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _BATCH_HINT)
        self.packed_at = self.weight._version

    @property
    def stale(self) -> bool:
        return self.weight._version != self.packed_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (..., in_features)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*shape[:-1], y.shape[-1])  # (..., out_features)


def pack_linears(model: nn.Module) -> int:
    """Turn every fp32 CPU `nn.Linear` of `model` into a `PackedLinear`; return how many (0 if unsupported)."""
    linears = [
        m
        for m in model.modules()
        if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
    ]
    if not linears or not _supported(linears[0]):
        return 0
    for m in linears:
        m.__class__ = PackedLinear
        m.repack()
    return len(linears)


def repack_linears(model: nn.Module) -> int:
    """Refresh the packed copies whose weights were written in place since they were packed (an update may load
    a part of the model: a bucket of a weight sync); returns how many."""
    stale = [m for m in model.modules() if isinstance(m, PackedLinear) and m.stale]
    for m in stale:
        m.repack()
    return len(stale)


def _supported(probe: nn.Linear) -> bool:
    """Do the oneDNN ops exist here and agree with F.linear on `probe`'s weight?"""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad():
            x = torch.randn(3, probe.in_features, generator=torch.Generator().manual_seed(0))
            packed = torch.ops.mkldnn._reorder_linear_weight(probe.weight.detach(), _BATCH_HINT)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, probe.bias, "none", [], "")
            want = F.linear(x, probe.weight, probe.bias)
    except (AttributeError, RuntimeError) as e:
        log.warning("oneDNN packed linears unavailable (%s); using F.linear", e)
        return False
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        log.warning(
            "oneDNN packed linears disagree with F.linear (max diff %.3g); using F.linear",
            (got - want).abs().max().item(),
        )
        return False
    return True

"""Quantization-aware training: train through the rounding, so the weights learn to live on the grid.

Jacob et al. 2018 ("Quantization and Training of Neural Networks for Efficient Integer-Arithmetic-Only
Inference"), Bengio et al. 2013 for the straight-through estimator. Post-training quantization
(lesson 12) rounds trained weights once; at 8 bits that costs little, at 4 bits (15 levels per
channel) it costs a lot. QAT runs the forward pass with fake-quantized weights, q(w) = s ·
clamp(round(w / s), -qmax, qmax), and passes the gradient straight through the rounding: dq/dw = 1
inside the clipping range, 0 outside. The optimizer still updates full-precision weights; they
settle where rounding hurts the loss least. The torch twin of `fake_quantize` is
`torch.fake_quantize_per_channel_affine` (the op torch's own QAT modules call), with the same STE.

Invariant: `fake_quantize` equals torch's op bit for bit and its gradient is 1 inside [-qmax·s, qmax·s]
and 0 outside (tests).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab.compression.pruning import prunable

__all__ = ["QATLinear", "fake_quantize", "channel_scale", "ptq", "qat_model"]


def channel_scale(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Per output channel absmax scale, (out, 1): the largest |w| of a row maps to qmax."""
    qmax = 2 ** (bits - 1) - 1
    return (w.detach().abs().amax(dim=1, keepdim=True) / qmax).clamp_min(1e-12)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
        r = w / scale
        ctx.save_for_backward((r >= -qmax) & (r <= qmax))
        return torch.round(r).clamp(-qmax, qmax) * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None  # straight through inside the range, nothing outside


def fake_quantize(w: torch.Tensor, bits: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """w rounded to a symmetric `bits`-bit grid per output channel (scale (out, 1), absmax by default)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
        raise ValueError(f"bits must be an int in [2, 16], got {bits!r}")
    scale = channel_scale(w, bits) if scale is None else scale
    return _FakeQuant.apply(w, scale, 2 ** (bits - 1) - 1)


class QATLinear(nn.Linear):
    """A Linear whose forward uses its fake-quantized weight; `bits` is what it will be stored in."""

    bits: int = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quantize(self.weight, self.bits), self.bias)


def _swap(model: nn.Module, bits: int) -> nn.Module:
    for layer in prunable(model):
        layer.__class__ = QATLinear  # same parameters, new forward
        layer.bits = bits
        layer._compression_bits = bits  # what `pack` stores
    return model


def qat_model(model: nn.Module, bits: int) -> nn.Module:
    """A copy of `model` whose block Linears train through `bits`-bit fake quantization."""
    return _swap(copy.deepcopy(model), bits)


@torch.no_grad()
def ptq(model: nn.Module, bits: int) -> nn.Module:
    """Post-training quantization: a copy with every block Linear's weight rounded once, no training."""
    out = _swap(copy.deepcopy(model), bits)
    for layer in prunable(out):
        layer.weight.copy_(fake_quantize(layer.weight, bits))
    return out

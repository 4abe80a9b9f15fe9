"""An FP8 linear layer from scratch: e4m3 forward, e5m2 backward, per-tensor scales.

Forward y = x Wᵀ + b with x and W cast to e4m3; backward dX = dY W and dW = dYᵀ x with dY cast to
e5m2 (gradients need range more than resolution: Micikevicius et al. 2022, section 4). Each of the
three tensors has its own scale, current (this tensor's amax) or delayed (the largest amax of the
last steps, `fp8.DelayedScaling`). The products run one of two ways over the same fp8 values:
"simulated" (dequantize the fp8 values to float32 and multiply in float32) and "scaled_mm"
(`torch._scaled_mm`, the fp8 GEMM that GPUs of compute capability 8.9+ (Ada, Hopper) run in
hardware; here on the CPU). On CUDA `_scaled_mm` needs the inner dimension and both dimensions of
the second operand to be multiples of 16 (an H100 refused a 32x40 first operand; its row count is
free), and the backward makes the token count an inner dimension, so operands are zero-padded to
multiples of 16 in every dimension on every device (zeros add nothing to a product; the CPU runs
the GPU's code path).
On an older GPU "scaled_mm" falls back to "simulated", with a warning. The bias is added in float32,
outside the fp8 product.

Every cast counts what it lost: values that saturated (|x·scale| beyond where rounding would still
land on the format's largest finite value) and values that underflowed (nonzero before, zero after).

Invariant: current scaling never saturates; on the CPU the "simulated" and "scaled_mm" results agree
up to the order of float32 accumulation (tests: 1e-5), since both multiply the same fp8 values. An
H100's fp8 tensor cores accumulate differently: measured there (torch 2.11, 32x64 @ 64x48, e4m3,
two draws) the two differ by 1.7e-4 and 2.6e-4 of the largest output, so the 1e-5 agreement is a
CPU fact (`make gpu-check` bounds it by 1e-3 on a GPU).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from parallel_lab.precision.fp8 import DelayedScaling, amax_to_scale, dequantize_fp8, fp8_format, quantize_fp8

RECIPES = ("current", "delayed")
MATMULS = ("simulated", "scaled_mm")


@dataclass
class CastStats:
    """What one tensor's casts lost, summed over calls."""

    casts: int = 0
    values: int = 0
    overflow: int = 0
    underflow: int = 0
    amax: list[float] = field(default_factory=list)


class Fp8Scaler:
    """The scale of one tensor (input, weight or grad_output) under a recipe, with its cast stats."""

    def __init__(self, fmt: str, recipe: str, history: int = 16):
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        self.fmt, self.recipe = fmt, recipe
        self.delayed = DelayedScaling(fmt, history) if recipe == "delayed" else None
        self.stats = CastStats()

    def cast(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(x in fp8, the scale used)."""
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        scale = amax_to_scale(amax, self.fmt) if self.delayed is None else self.delayed.scale
        x8 = quantize_fp8(x.detach(), self.fmt, scale)
        s = self.stats
        s.casts, s.values = s.casts + 1, s.values + x.numel()
        s.overflow += int((x.detach().float().abs() * scale > fp8_format(self.fmt).overflow_above).sum())
        s.underflow += int(((x8.float() == 0) & (x.detach() != 0)).sum())
        s.amax.append(amax)
        if self.delayed is not None:
            self.delayed.record(amax)  # for the next step: this step's scale came from the earlier ones
        return x8, scale


def fp8_mm(a8: torch.Tensor, sa: float, b8: torch.Tensor, sb: float, how: str) -> torch.Tensor:
    """(a8 / sa) @ (b8 / sb) in float32: a8 (n, k), b8 (k, m)."""
    if how == "scaled_mm" and a8.is_cuda and torch.cuda.get_device_capability(a8.device) < (8, 9):
        warnings.warn(
            f"matmul='scaled_mm' needs fp8 tensor cores (compute capability 8.9+); this GPU has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(a8.device)))}: running 'simulated'",
            stacklevel=2,
        )
        how = "simulated"
    if how == "simulated":
        return dequantize_fp8(a8, sa) @ dequantize_fp8(b8, sb)  # (n, m)
    one = lambda s: torch.tensor(1.0 / s, dtype=torch.float32, device=a8.device)  # noqa: E731
    n, m = a8.shape[0], b8.shape[1]
    a, b = _pad16(a8), _pad16(b8)  # (n16, k16), (k16, m16): CUDA's rule, kept on every device
    # _scaled_mm wants the first operand row-major and the second column-major
    out = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=one(sa), scale_b=one(sb),
                           out_dtype=torch.float32)  # fmt: skip
    return out[:n, :m]  # (n, m)


def _pad16(t: torch.Tensor) -> torch.Tensor:
    """`t` (2-D, fp8) with zero rows and columns appended up to multiples of 16."""
    r, c = (-(-d // 16) * 16 for d in t.shape)
    if (r, c) == tuple(t.shape):
        return t
    out = torch.zeros(r, c, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, w, layer):
        x8, sx = layer.scalers["input"].cast(x)  # (N, in) e4m3
        w8, sw = layer.scalers["weight"].cast(w)  # (out, in) e4m3
        fctx.save_for_backward(x8, w8)
        fctx.scales, fctx.layer = (sx, sw), layer
        return fp8_mm(x8, sx, w8.t(), sw, layer.matmul)  # (N, out)

    @staticmethod
    def backward(fctx, dy):
        x8, w8 = fctx.saved_tensors
        (sx, sw), layer = fctx.scales, fctx.layer
        g8, sg = layer.scalers["grad_output"].cast(dy)  # (N, out) e5m2
        dx = fp8_mm(g8, sg, w8, sw, layer.matmul)  # (N, in)
        dw = fp8_mm(g8.t(), sg, x8, sx, layer.matmul)  # (out, in)
        return dx, dw, None


class Fp8Linear(nn.Module):
    """`nn.Linear` whose two matmuls run in fp8 (e4m3 forward, e5m2 for the gradient), bias in float32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "delayed",
                 matmul: str = "simulated", history: int = 16):  # fmt: skip
        super().__init__()
        if matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {matmul!r}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.matmul = matmul
        self.scalers = {
            "input": Fp8Scaler("e4m3", recipe, history),
            "weight": Fp8Scaler("e4m3", recipe, history),
            "grad_output": Fp8Scaler("e5m2", recipe, history),
        }

    @classmethod
    def from_linear(cls, lin: nn.Linear, **kw) -> Fp8Linear:
        m = cls(lin.in_features, lin.out_features, lin.bias is not None, **kw).to(lin.weight.device)
        with torch.no_grad():
            m.weight.copy_(lin.weight)
            if lin.bias is not None:
                m.bias.copy_(lin.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self)  # (N, out)
        y = y.reshape(*lead, -1)
        return y if self.bias is None else y + self.bias


def fp8_model(model: nn.Module, **kw) -> nn.Module:
    """Swap every `nn.Linear` inside the transformer blocks for an `Fp8Linear` with the same weights (in
    place; returns the model). The embedding and the output head stay in high precision, as FP8 recipes
    keep them (Micikevicius et al. 2022, section 5)."""
    for block in getattr(model, "blocks", []):
        for child in list(block.modules()):
            for attr, sub in list(child.named_children()):
                if isinstance(sub, nn.Linear):
                    setattr(child, attr, Fp8Linear.from_linear(sub, **kw))
    return model


def cast_stats(model: nn.Module) -> dict[str, CastStats]:
    """{"blocks.0.attn.qkv.input": stats, ...} for every Fp8Linear in `model`."""
    return {f"{n}.{k}": s.stats for n, m in model.named_modules() if isinstance(m, Fp8Linear)
            for k, s in m.scalers.items()}  # fmt: skip


__all__ = ["MATMULS", "RECIPES", "CastStats", "Fp8Linear", "Fp8Scaler", "cast_stats", "fp8_mm", "fp8_model"]

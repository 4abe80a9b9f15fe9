"""FP8: two 8-bit float formats, per-tensor scaling, and a linear layer that computes in them.

Micikevicius et al. 2022, "FP8 Formats for Deep Learning": E4M3 (4 exponent bits, 3 mantissa bits,
largest finite 448, no infinity) for weights and activations, where resolution matters; E5M2 (5, 2,
largest 57344) for gradients, where range matters. 8 bits cannot hold a tensor's values unscaled, so
each tensor is multiplied by a scale that maps its largest magnitude (amax) near the format's
largest finite value before the cast, and divided by it after. Casts saturate: a value beyond the
largest finite one becomes that value, not inf or nan.

Scaling recipes: *current* scaling takes this tensor's amax (one more pass over it before the cast;
torchao's dynamic scaling); *delayed* scaling takes the largest amax of the last few steps (a
history, as Transformer Engine's DelayedScaling does), so the scale is known before the tensor is,
and the amax of this step is recorded for the next.

Invariant: `fp8_round` (written from the bit layout) equals torch's cast bit for bit on every value
the format can reach, and saturates beyond; `quantize_fp8` / `dequantize_fp8` round-trip a value
within half a unit in the last place of its scaled magnitude.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format: its torch dtype and its bit layout."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float  # largest finite value

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def overflow_above(self) -> float:
        """Magnitudes above this lose more than rounding does: they would round past `max`, and saturate."""
        return self.max + 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits) / 2

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)


FORMATS = {
    # E4M3 "fn": finite only; the all-ones exponent holds normal numbers except S.1111.111 (nan): max 1.75 * 2^8
    "e4m3": Fp8Format("e4m3", torch.float8_e4m3fn, 4, 3, 7, 448.0),
    # E5M2: IEEE-like, the all-ones exponent is inf/nan: max 1.75 * 2^15
    "e5m2": Fp8Format("e5m2", torch.float8_e5m2, 5, 2, 15, 57344.0),
}


def fp8_format(fmt: str) -> Fp8Format:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def fp8_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x rounded to the nearest value of the format (ties to even), saturated, as float32.

    From the bit layout: a normal number 2^e * 1.m keeps `mantissa_bits` bits after the point, so its
    spacing is 2^(e - mantissa_bits); below the smallest normal the spacing stays at the subnormal
    step 2^(1 - bias - mantissa_bits)."""
    f = fp8_format(fmt)
    x = x.float()
    mag = x.abs()
    e = torch.floor(torch.log2(mag.clamp_min(f.min_normal)))  # exponent; subnormals use the smallest
    step = torch.exp2(e - f.mantissa_bits)  # (same shape as x): the spacing of the format around x
    q = torch.round(x / step) * step  # torch.round rounds half to even, as the hardware casts do
    return q.clamp(-f.max, f.max).where(~torch.isnan(x), x)


def _check_scale(scale) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32)
    if s.numel() != 1 or not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError(f"scale must be one finite positive number, got {scale!r}")
    return s


def quantize_fp8(x: torch.Tensor, fmt: str, scale) -> torch.Tensor:
    """The fp8 tensor (`torch.float8_e4m3fn` or `torch.float8_e5m2`) of x * scale, saturated to the
    format's largest finite value."""
    f, s = fp8_format(fmt), _check_scale(scale).to(x.device)
    return fp8_round(x.float() * s, fmt).to(f.dtype)  # exact: every value is already representable


def dequantize_fp8(x8: torch.Tensor, scale) -> torch.Tensor:
    """x8 / scale in float32."""
    if x8.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"x8 must be a float8_e4m3fn or float8_e5m2 tensor, got {x8.dtype}")
    return x8.float() / _check_scale(scale).to(x8.device)


def amax_to_scale(amax: float, fmt: str, margin: int = 0) -> float:
    """The scale that maps `amax` to the format's largest finite value / 2^margin (1.0 when amax is 0)."""
    f = fp8_format(fmt)
    if not math.isfinite(amax) or amax < 0:
        raise ValueError(f"amax must be finite and >= 0, got {amax}")
    return 1.0 if amax == 0 else f.max / amax / 2.0**margin


class DelayedScaling:
    """One tensor's scale from the largest amax of its last `history` uses (Transformer Engine's recipe).

    `scale` is known before the tensor is (taken from earlier steps); `record(amax)` adds this step's.
    Before any record the scale is 1."""

    def __init__(self, fmt: str, history: int = 16, margin: int = 0):
        fp8_format(fmt)
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a positive int, got {history!r}")
        self.fmt, self.margin = fmt, margin
        self.amaxes: deque[float] = deque(maxlen=history)

    @property
    def scale(self) -> float:
        return amax_to_scale(max(self.amaxes), self.fmt, self.margin) if self.amaxes else 1.0

    def record(self, amax: float) -> None:
        self.amaxes.append(float(amax))


__all__ = ["FORMATS", "DelayedScaling", "Fp8Format", "amax_to_scale", "dequantize_fp8", "fp8_format", "fp8_round",
           "quantize_fp8"]  # fmt: skip

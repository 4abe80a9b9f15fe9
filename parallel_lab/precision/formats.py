"""fp16 / bf16 / fp32 in numbers: ranges, resolution, and where small updates vanish.

Invariant: every figure comes from torch.finfo and real tensor arithmetic in the
format, never from a table typed in by hand.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: The dtypes a lesson names, by the name it uses.


# ----------------------------------------------------------------------------- the formats, in numbers
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'fp32' | 'fp16' | 'bf16' (or the torch dtype itself) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(
        f"dtype must be one of {tuple(DTYPES)} (or torch.float32/float16/bfloat16), got {dtype!r}"
    )


def format_table() -> list[dict[str, Any]]:
    """Bits and limits of fp32, fp16 and bf16, straight from `torch.finfo`."""

    rows = []
    for name, dt in DTYPES.items():
        fi = torch.finfo(dt)
        rows.append({
            "dtype": name, "bits": fi.bits, "exponent_bits": fi.bits - 1 - round(-math.log2(fi.eps)),
            "mantissa_bits": round(-math.log2(fi.eps)), "max": fi.max, "smallest_normal": fi.smallest_normal,
            "smallest_subnormal": fi.smallest_normal * fi.eps, "eps": fi.eps,
        })  # fmt: skip
    return rows


def classify(value: float, dtype: str | torch.dtype = "fp16") -> str:
    """How `value` is stored in `dtype`: 'normal', 'subnormal', 'zero' (underflow) or 'inf' (overflow)."""

    dt = resolve_dtype(dtype)
    v = torch.tensor(value, dtype=torch.float64).to(dt).double().abs().item()
    if math.isinf(v):
        return "inf"
    if v == 0.0:
        return "zero" if value != 0 else "normal"
    return "normal" if v >= torch.finfo(dt).smallest_normal else "subnormal"


def apply_updates(
    weight: float, update: float, steps: int, dtype: str | torch.dtype = "fp16"
) -> dict[str, float]:
    """Subtract `update` from `weight` `steps` times: in `dtype` directly, and in an fp32 master copy.

    Returns the final 16-bit weight of each recipe and the exact answer (float64).
    """

    dt = resolve_dtype(dtype)
    w16 = torch.tensor(weight, dtype=dt)
    master = torch.tensor(weight, dtype=torch.float32)
    u16, u32 = torch.tensor(update, dtype=dt), torch.tensor(update, dtype=torch.float32)
    for _ in range(steps):
        w16 = w16 - u16  # (): rounded to 16 bits after every step
        master = master - u32  # (): fp32 keeps the small steps
    return {"naive": w16.item(), "master": master.to(dt).item(), "master_fp32": master.item(),
            "exact": weight - steps * update}  # fmt: skip


__all__ = ["DTYPES", "apply_updates", "classify", "format_table", "resolve_dtype"]

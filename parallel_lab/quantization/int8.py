"""INT8 quantization from scratch: absmax scales, int8 matmul, vector-wise scales, LLM.int8().

Absmax ("symmetric") quantization maps a float tensor x to int8 with one scale
s = max|x| / 127: q = round(x / s), x ≈ q * s (BMInf's scheme; Jacob
et al. 2018 for the integer-arithmetic view). A matmul of two quantized matrices
runs in integers, accumulates in int32 and is rescaled once by the product of
the scales: A @ B ≈ (qA @ qB) * sA * sB.

One scale per tensor fails on transformers: a few hidden features ("outliers")
are 20-100x larger than the rest, set the scale, and crush every other feature
to a handful of levels. Two fixes, from Dettmers et al. 2022, "LLM.int8(): 8-bit
Matrix Multiplication for Transformers at Scale":
- vector-wise scales: one per row of X (token) and one per column of W (output);
- mixed-precision decomposition: the few input features whose magnitude passes
  a threshold (6.0) are multiplied in 16-bit, the rest in int8.

Invariants the tests check: `quantize_absmax` gives the scales and the integer
values of `torch.quantize_per_tensor` / `torch.quantize_per_channel` (symmetric
qint8, zero point 0) bit for bit; `int32_matmul` is exact (equals an int64
reference); `dequantize` equals torch's `.dequantize()`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

INT8_MAX = 127  # symmetric range [-127, 127]: -128 is never used, so q and -q both exist
INT32_MAX = 2**31 - 1
METHODS = ("absmax", "vectorwise", "llm_int8")
#: LLM.int8()'s outlier threshold: an input feature with any |x| above it stays in 16-bit.
OUTLIER_THRESHOLD = 6.0


# ----------------------------------------------------------------------------- checks
def _check_float(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} has dtype {x.dtype}; quantize a floating-point tensor (float32, float16, bfloat16, float64)"
        )
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}): there is no absmax to take a scale from")
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} holds {bad} NaN/inf value(s): absmax quantization needs finite values")


def _check_axis(x: torch.Tensor, axis: int | None) -> int | None:
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, int) or not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis must be None or a dimension of x (ndim {x.dim()}), got {axis!r}")
    return axis % x.dim()


def _check_int8(q: torch.Tensor, name: str) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != torch.int8:
        raise TypeError(f"{name} must have dtype torch.int8, got {q.dtype}")


# ----------------------------------------------------------------------------- absmax
def absmax_scale(x: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """s = max|x| / 127 in float32: a 0-d tensor, or (with `axis`) one scale per index of
    that dimension, shaped to broadcast against x (size 1 on every other dimension)."""
    _check_float(x)
    axis = _check_axis(x, axis)
    a = x.detach().float().abs()
    if axis is None:
        amax = a.amax()  # ()
    else:
        others = [d for d in range(x.dim()) if d != axis]
        amax = a.amax(dim=others, keepdim=True) if others else a  # (1, .., n_axis, .., 1)
    # An all-zero slice has no range: scale 1 quantizes it to zeros and back exactly.
    return torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))


def quantize_absmax(x: torch.Tensor, axis: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` to int8 with absmax scales: returns (q int8, scale float32), x ≈ q * scale.

    `axis=None`: one scale for the whole tensor. `axis=k`: one scale per index along
    dimension k (torch's per-channel `axis`): k=0 on X (tokens, features) gives one
    scale per row; on an nn.Linear weight (out, in) one per output feature, i.e.
    per column of W = weight.T.
    """
    scale = absmax_scale(x, axis)  # () or broadcastable
    # torch multiplies by the float32 reciprocal and rounds half to even (std::nearbyint);
    # x / scale differs in the last bit often enough to flip a tie, so do exactly that.
    inv = 1.0 / scale
    q = torch.round(x.detach().float() * inv).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x ≈ q * scale in float32 (what torch's `.dequantize()` computes)."""
    _check_int8(q, "q")
    return q.float() * scale


def quantize_torch(x: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """The same quantization done by torch's quantized tensors (symmetric qint8, zero point 0),
    with our scale: `.int_repr()` and `.q_scale()`/`.q_per_channel_scales()` to compare."""
    scale = absmax_scale(x, axis)
    xf = x.detach().float()
    if axis is None:
        return torch.quantize_per_tensor(xf, float(scale), 0, torch.qint8)
    axis = axis % x.dim()
    flat = scale.reshape(-1)  # (n_axis,)
    zeros = torch.zeros(flat.numel(), dtype=torch.long, device=flat.device)  # beside the scales
    return torch.quantize_per_channel(xf, flat.double(), zeros, axis, torch.qint8)


# ----------------------------------------------------------------------------- int8 matmul
def int32_matmul(qa: torch.Tensor, qb: torch.Tensor) -> torch.Tensor:
    """qa (n, k) int8 @ qb (k, m) int8 -> (n, m) int32, exact.

    Each product is at most 127² = 16129, so k products fit in int32 while
    k <= 133,144; beyond that the accumulator could overflow and we refuse.
    """
    _check_int8(qa, "qa")
    _check_int8(qb, "qb")
    if qa.dim() != 2 or qb.dim() != 2 or qa.shape[1] != qb.shape[0]:
        raise ValueError(
            f"qa and qb must be (n, k) and (k, m) matrices, got {tuple(qa.shape)} and {tuple(qb.shape)}"
        )
    k = qa.shape[1]
    if k * INT8_MAX * 128 > INT32_MAX:
        raise ValueError(
            f"inner dimension k={k} could overflow an int32 accumulator (k * 127 * 128 > 2**31 - 1)"
        )
    if qa.device.type == "cuda" and qa.shape[0] > 16 and k % 8 == 0 and qb.shape[1] % 8 == 0:
        try:
            return torch._int_mm(qa.contiguous(), qb.contiguous())  # int8 tensor-core GEMM, int32 out
        except RuntimeError:  # its shape/layout limits vary by GPU and version: fall through
            pass
    if qa.device.type != "cpu":
        # integer matmul is a CPU kernel in torch: compute there, exactly, and come back
        return int32_matmul(qa.cpu(), qb.cpu()).to(qa.device)
    # torch.mm on int8 would accumulate (and wrap) in int8: widen to int32 first.
    return qa.to(torch.int32) @ qb.to(torch.int32)  # (n, m)


def int8_matmul(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """(qa * sa) @ (qb * sb) computed in integers: int32 accumulation, then one rescale.

    sa is a scalar or (n, 1) (one scale per row of A), sb a scalar or (1, m) (one per
    column of B); the rescale `acc * (sa * sb)` multiplies by their outer product.
    """
    n, m = qa.shape[0], qb.shape[-1]
    for name, scale, ok in (("sa", sa, ((), (1,), (1, 1), (n, 1))), ("sb", sb, ((), (1,), (1, 1), (1, m)))):
        shape = tuple(torch.as_tensor(scale).shape)
        if shape not in ok:  # (n,) would broadcast along the wrong axis, silently when n == m
            raise ValueError(
                f"{name} must be a scalar or shaped {ok[-1]} (one scale per {'row of A' if name == 'sa' else 'column of B'}), got shape {shape}"
            )
    acc = int32_matmul(qa, qb)  # (n, m) int32
    return acc.float() * (sa * sb)  # (n, m) float32


# ----------------------------------------------------------------------------- linear layers
def outlier_features(x: torch.Tensor, threshold: float = OUTLIER_THRESHOLD) -> torch.Tensor:
    """Indices of the input features (columns of x (tokens, features)) with any |x| > threshold."""
    return (x.abs() > threshold).any(dim=0).nonzero().flatten()  # (n_outliers,)


def _linear_int8(
    x: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    method: str,
    threshold: float,
) -> torch.Tensor:
    """x (..., in) @ dequantize(qw, sw).T + bias with x quantized on the fly by `method`."""
    x2 = x.reshape(-1, qw.shape[1]).float()  # (N, in), tokens flattened
    y16 = None
    if method == "llm_int8":
        cols = outlier_features(x2, threshold)  # (n_out,)
        if cols.numel():
            # LLM.int8(): the outlier features and the matching weight columns in 16-bit
            w16 = dequantize(qw[:, cols].contiguous(), sw).half()  # (out, n_out)
            y16 = (x2[:, cols].half() @ w16.T).float()  # (N, out)
            x2 = x2.index_fill(1, cols, 0.0)  # the int8 part sees zeros there
    axis = None if method == "absmax" else 0
    qx, sx = quantize_absmax(x2, axis)  # (N, in) int8; () or (N, 1)
    y = int8_matmul(qx, sx, qw.T, sw.reshape(1, -1) if axis is not None else sw)  # (N, out)
    if y16 is not None:
        y = y + y16
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], qw.shape[0]).to(x.dtype)  # (..., out)


def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    method: str = "vectorwise",
    threshold: float = OUTLIER_THRESHOLD,
) -> torch.Tensor:
    """y = x @ weight.T + bias with x and the weight quantized to int8 by `method`:

    "absmax": one scale for x, one for the weight. "vectorwise": one per row of x (token)
    and one per output feature of the weight (column of W = weight.T). "llm_int8":
    vectorwise on the regular features, and the outlier features (|x| > threshold in
    any token) with their weight columns in fp16.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    qw, sw = quantize_absmax(weight, None if method == "absmax" else 0)  # (out, in) int8
    return _linear_int8(x, qw, sw, bias, method, threshold)


class Int8Linear(nn.Module):
    """An nn.Linear whose weight is stored in int8 (plus float32 scales); its input is quantized
    on the fly (dynamic quantization). `Int8Linear.from_float(linear, method)` converts one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, method: str = "vectorwise"):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.in_features, self.out_features, self.method = in_features, out_features, method
        self.threshold = OUTLIER_THRESHOLD
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(() if method == "absmax" else (out_features, 1)))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_float(cls, linear: nn.Linear, method: str = "vectorwise") -> Int8Linear:
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, method)
        q, s = quantize_absmax(linear.weight, None if method == "absmax" else 0)
        m.qweight.copy_(q)
        m.scale.copy_(s)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_int8(x, self.qweight, self.scale, self.bias, self.method, self.threshold)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method!r}"


def quantize_linears(
    model: nn.Module, method: str = "vectorwise", skip: tuple[str, ...] = ("lm_head",)
) -> nn.Module:
    """Replace every nn.Linear in `model` (in place, except names in `skip`) by an Int8Linear."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for name, child in list(model.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear.from_float(child, method))
        else:
            quantize_linears(child, method, skip)
    return model


# ----------------------------------------------------------------------------- outliers
def plant_outliers(
    model: nn.Module, features: tuple[int, ...] = (3, 17), magnitude: float = 40.0
) -> nn.Module:
    """Give a TinyGPT LLM.int8-style outlier features, in place.

    In every block the LayerNorm gains (and biases) on `features` are multiplied by
    `magnitude`, so those features of the inputs to qkv and fc are ~`magnitude` times
    larger than the rest, in every token: large LayerNorm gains are where the outlier
    features of real LLMs live (Wei et al. 2022, "Outlier Suppression"). The model
    computes something else afterwards; compare a quantized copy with its own fp32 output.
    """
    if magnitude <= 0 or not math.isfinite(magnitude):
        raise ValueError(f"magnitude must be a positive finite number, got {magnitude!r}")
    idx = torch.tensor(features, dtype=torch.long)
    with torch.no_grad():
        for block in model.blocks:
            for ln in (block.ln1, block.ln2):
                if int(idx.max()) >= ln.weight.numel():
                    raise ValueError(f"features must be < d_model={ln.weight.numel()}, got {features}")
                ln.weight[idx] *= magnitude
                ln.bias[idx] *= magnitude
    return model


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius), in float64."""
    e = exact.double()
    return float((approx.double() - e).norm() / e.norm().clamp_min(1e-300))


__all__ = [
    "INT8_MAX",
    "METHODS",
    "OUTLIER_THRESHOLD",
    "Int8Linear",
    "absmax_scale",
    "dequantize",
    "int32_matmul",
    "int8_matmul",
    "outlier_features",
    "plant_outliers",
    "quantize_absmax",
    "quantize_linears",
    "quantize_torch",
    "quantized_linear",
    "relative_error",
]

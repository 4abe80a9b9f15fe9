"""Checks for lesson 12's exercises: affine (zero-point) quantization per group, an integer matmul that handles
the zero point the way integer kernels do, and the worst error of affine quantization.

`quantize_affine(x, group) -> (q, scale, zero_point)` quantizes each group of `group` consecutive elements of the
last dimension to uint8 by the rule of torch's MinMaxObserver for quint8 (the range widened to include 0, mapped
onto 0..255); compared with torch's observer and `torch.quantize_per_tensor` group by group, bit for bit given
the learner's scale and zero point. `dequantize_affine` is compared with torch's `.dequantize()`.

`int8_matmul_zp(qa, sa, za, qb, sb)` multiplies a uint8 matrix with zero point `za` by an int8 one: every matrix
product it runs must take the stored integers as they are, in an integer type (Jacob et al. 2018, section 2.3: the
zero point is handled by a correction from sums, so the kernel multiplies uint8 by int8 as VNNI's vpdpbusd does on a
CPU); products with an all-ones operand (sums) are allowed too. The function is run a second time with every
product of the stored matrices coming out larger by a constant, and its result must move by that constant times
sa * sb: the result comes from the integer product. Compared with an exact int64 reference.

`affine_worst_error(cmin, cmax, xmin, xmax)` gives the exact largest error over every real x in [xmin, xmax] of a
quantizer calibrated (observer's rule) on [cmin, cmax]: the distance to the nearest value a code stands for,
(q - zero_point) * scale, the zero point's rounding and the clamping at codes 0 and 255 included; compared with the
check's own exact value (ends of the span and the midpoints between codes inside it).

Every learner function runs under a dispatch mode that rejects torch's quantization operators (aten's
quantize_per_tensor*, quantize_per_channel*, choose_qparams*, fake_quantize*, and the quantized_decomposed
namespace), however they are reached (torch.ops included).
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lab.grading.checks import (
    WriteItYourself,
    draw_seed,
    family,
    passed,
    require_callable,
    unavailable,
)

# The lab's int8 code and torch's quantization entry points and observers, switched off while the learner's
# functions run.
FORBIDDEN = {
    **family("parallel_lab.quantization.int8", "parallel_lab.quantization.inference"),
    **{
        f"torch.{n}": ""
        for n in (
            "quantize_per_tensor",
            "quantize_per_channel",
            "quantize_per_tensor_dynamic",
            "_int_mm",
            "fake_quantize_per_tensor_affine",
            "fake_quantize_per_channel_affine",
            "_choose_qparams_per_tensor",
            "choose_qparams_optimized",
        )
    },  # fmt: skip
    **family("torch.ao.quantization.observer", missing_ok=True),
    # torch's Python quantizers: the quantized_decomposed operators' implementations (per tensor, channel, group,
    # token, and their qparams), the DDP compression hook's, and inductor's qparams decomposition (imported on the
    # first call only)
    **family("torch.ao.quantization.fx._decomposed", missing_ok=True),
    **family("torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks", missing_ok=True),
    "torch._inductor.decomposition.choose_qparams_tensor": "",
    "torch.ao.quantization.quantize_dynamic": "",
}

__all__ = ["check_affine_worst_error", "check_int8_matmul_zp", "check_quantize_affine"]

# aten operators that quantize or choose quantization parameters, by name prefix; and whole namespaces
_QUANT_OPS = ("quantize_per_tensor", "quantize_per_channel", "_choose_qparams", "choose_qparams",
              "fake_quantize", "_fake_quantize", "fused_moving_avg_obs_fake_quant", "_fused_moving_avg_obs_fq")  # fmt: skip
_QUANT_NAMESPACES = ("quantized_decomposed", "quantized")
# the same aten operators by name too: a composite one (_choose_qparams_per_tensor) decomposes before a dispatch
# mode sees it
FORBIDDEN.update({f"torch.ops.aten.{n}": "" for n in sorted({
    op.split("::")[1].split(".")[0] for op in torch._C._dispatch_get_all_op_names() if op.startswith("aten::")}
    ) if n.startswith(_QUANT_OPS)})  # fmt: skip


def _quant_op(func) -> bool:
    return func.namespace in _QUANT_NAMESPACES or func.overloadpacket.__name__.startswith(_QUANT_OPS)


class _NoQuantOps(TorchDispatchMode):
    """Rejects torch's quantization operators, however they are reached (torch.ops.aten... included)."""

    def __init__(self, exercise: str) -> None:
        super().__init__()
        self.exercise = exercise

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _quant_op(func):
            raise WriteItYourself(
                f"{self.exercise} asks you to write this yourself: torch's operator {func} is switched off while "
                "the check runs"
            )
        return func(*args, **(kwargs or {}))


def _guarded(fn: Callable, exercise: str) -> Callable:
    """`fn` run with FORBIDDEN switched off and torch's quantization operators rejected."""

    def call(*args, **kwargs):
        with unavailable(FORBIDDEN, exercise), _NoQuantOps(exercise):
            return fn(*args, **kwargs)

    return call


def _observed(x: torch.Tensor) -> tuple[float, int]:
    """torch's scale and zero point for quint8, per-tensor affine (MinMaxObserver)."""
    from torch.ao.quantization.observer import MinMaxObserver

    obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    obs(x)
    scale, zp = obs.calculate_qparams()
    return float(scale), int(zp)


def _affine_cases(rnd: random.Random) -> list[tuple[str, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(rnd.getrandbits(62))
    return [
        ("a (2, 8) tensor in groups of 4", torch.tensor([[1.2, -0.5, 3.1, 0.8, 0.1, 0.2, 0.3, 0.4],
                                                         [-2.0, -1.0, -0.5, -0.25, 5.0, 0.0, 2.5, 1.0]]), 4),
        ("all positive (the range must still hold 0)", torch.rand(3, 12, generator=g) + 2.0, 6),
        ("all negative", -torch.rand(2, 10, generator=g) - 1.0, 5),
        ("a group of zeros", torch.cat([torch.zeros(4), torch.randn(4, generator=g)]).reshape(1, 8), 4),
        ("randn(5, 48) * 3, groups of 16", torch.randn(5, 48, generator=g) * 3, 16),
        ("3-d, one group per row", torch.randn(2, 3, 7, generator=g) * 1e-2 + 0.05, 7),
        ("an outlier in one group", torch.cat([torch.randn(31, generator=g), torch.tensor([40.0])]).reshape(2, 16), 8),
    ]  # fmt: skip


def check_quantize_affine(quantize_affine: Callable, dequantize_affine: Callable) -> None:
    """`quantize_affine(x, group)` -> (q uint8, scale float32, zero_point int), per group of `group` elements of
    the last dimension, by torch's MinMaxObserver rule for quint8; `dequantize_affine(q, scale, zero_point,
    group)` -> float32."""
    require_callable(quantize_affine, "quantize_affine")
    require_callable(dequantize_affine, "dequantize_affine")
    quant = _guarded(quantize_affine, "this exercise (quantize_affine)")
    dequant = _guarded(dequantize_affine, "this exercise (dequantize_affine)")
    cases = _affine_cases(random.Random(draw_seed()))  # tensors drawn afresh every grade run
    for name, x, group in cases:
        call = f"quantize_affine(x, group={group}) on {name} (x of shape {tuple(x.shape)})"
        try:
            out = quant(x.clone(), group)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{call}: your function raised {type(e).__name__}: {e}") from e
        assert isinstance(out, (tuple, list)) and len(out) == 3, f"{call}: return (q, scale, zero_point)"
        q, scale, zp = (torch.as_tensor(v) for v in out)
        groups = x.shape[:-1] + (x.shape[-1] // group,)
        assert q.dtype == torch.uint8 and q.shape == x.shape, (
            f"{call}: q must be a torch.uint8 tensor of x's shape, got {q.dtype} {tuple(q.shape)}"
        )
        assert tuple(scale.shape) == groups and tuple(zp.shape) == groups, (
            f"{call}: scale and zero_point need one value per group, shape {tuple(groups)}; got "
            f"{tuple(scale.shape)} and {tuple(zp.shape)}"
        )
        xs = x.reshape(-1, group)
        for k, (xg, qg, s, z) in enumerate(zip(xs, q.reshape(-1, group), scale.reshape(-1), zp.reshape(-1))):
            want_s, want_z = _observed(xg)
            where = f"{call}, group {k} (values from {xg.min().item():.4g} to {xg.max().item():.4g})"
            assert abs(float(s) - want_s) <= 1e-6 * want_s, (
                f"{where}: scale {float(s):.8g}, expected {want_s:.8g}"
            )
            assert int(z) == want_z, f"{where}: zero_point {int(z)}, expected {want_z}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # quantized tensors are deprecated; still the reference
                ref = torch.quantize_per_tensor(xg, float(s), int(z), torch.quint8)
            # x / scale and x * (1 / scale) round differently on a tie: either side of a tie is right
            ratio = xg.double() / float(s)
            tie = ((ratio - ratio.floor() - 0.5).abs() < 1e-5) & (
                (qg.long() - ref.int_repr().long()).abs() == 1
            )
            bad = ((qg != ref.int_repr()) & ~tie).nonzero()
            assert not len(bad), (
                f"{where}: {len(bad)} wrong code(s); first at element {bad[0].item()}: x = "
                f"{xg[bad[0]].item():.6g} -> {qg[bad[0]].item()}, expected {ref.int_repr()[bad[0]].item()}"
            )
        try:
            back = torch.as_tensor(dequant(q.clone(), scale.clone(), zp.clone(), group))
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(
                f"dequantize_affine on {name}: your function raised {type(e).__name__}: {e}"
            ) from e
        # torch's .dequantize() is (q - zero_point) * scale in float32: applied to your own codes
        want = (
            (q.reshape(-1, group).float() - zp.reshape(-1, 1).float()) * scale.reshape(-1, 1).float()
        ).reshape(x.shape)
        assert (
            back.dtype == torch.float32
            and back.shape == x.shape
            and torch.allclose(back, want, rtol=1e-6, atol=1e-6 * float(scale.max()))
        ), (
            f"dequantize_affine on {name}: expected float32 values (q - zero_point) * scale, off by up to "
            f"{(back.float() - want).abs().max().item() if back.shape == want.shape else float('nan'):.3g}"
        )
    passed("check_quantize_affine", f"{len(cases)} tensors quantized group by group as torch's observer does")


# ----------------------------------------------------------------------------- exercise 2
_PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "_int_mm", "dot", "mv", "vdot", "addmv", "addbmm")
_SHIFT = 4096  # what each product of the stored matrices comes out larger by, in the second run


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    """A product's operand with leading size-1 dimensions dropped (einsum runs bmm on (1, n, k) views)."""
    while t.dim() > 2 and t.shape[0] == 1:
        t = t[0]
    return t


def _equal(t: torch.Tensor, ref: torch.Tensor) -> bool:
    return t.shape == ref.shape and torch.equal(t.long(), ref.long())


class _Products(TorchDispatchMode):
    """Records every matrix product run inside (operands and whether they are the stored qa and qb); with `shift`,
    each product of the stored matrices comes out `shift` larger. Rejects torch's quantization operators."""

    def __init__(self, qa: torch.Tensor, qb: torch.Tensor, shift: int = 0) -> None:
        super().__init__()
        self.qa, self.qb, self.shift = qa.long(), qb.long(), shift
        self.seen: list[
            tuple[str, torch.Tensor, torch.Tensor, bool]
        ] = []  # (op, a, b, is the stored product)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _quant_op(func):
            raise WriteItYourself(
                f"this exercise (int8_matmul_zp) asks you to write this yourself: torch's operator {func} is "
                "switched off while the check runs"
            )
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _PRODUCTS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "addmv", "addbmm") else args[:2]
            a, b = _as_matrix(a.detach()), _as_matrix(b.detach())
            stored = (
                not a.is_floating_point()
                and not b.is_floating_point()
                and (
                    (_equal(a, self.qa) and _equal(b, self.qb))
                    or (_equal(a, self.qb.T) and _equal(b, self.qa.T))
                )
            )
            self.seen.append((name, a.clone(), b.clone(), stored))
            if stored and self.shift:
                out = out + self.shift
        return out


def _describe(a: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor) -> str:
    """What one operand of a product was, in words."""
    what = f"{a.dtype} {tuple(a.shape)}"
    for name, ref in (("qa", qa), ("qb", qb), ("qa transposed", qa.T), ("qb transposed", qb.T)):
        if a.shape == ref.shape:
            d = a.double() - ref.double()
            if torch.equal(d, torch.zeros_like(d)):
                return f"{what}, the stored {name}"
            if torch.equal(d, torch.full_like(d, d.flatten()[0].item())):
                return f"{what}, {name} shifted by {d.flatten()[0].item():g}"
            if torch.allclose(d, torch.zeros_like(d), atol=0.5 * d.abs().max().item() + 1e-12, rtol=0):
                break
            return f"{what}, of {name}'s shape but other values (scaled?)"
    if a.numel() and bool((a == 1).all()):
        return f"{what}, all ones"
    return what


def _int64_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.long()[:, :, None] * b.long()[None, :, :]).sum(1)


def _zp_cases(rnd: random.Random):
    g = torch.Generator().manual_seed(rnd.getrandbits(62))

    def u8(*s):
        return torch.randint(0, 256, s, generator=g, dtype=torch.uint8)

    def i8(*s):
        return torch.randint(-127, 128, s, generator=g, dtype=torch.int8)

    big_a = torch.full((2, 8193), 255, dtype=torch.uint8)
    big_a[:, -1] = 1
    big_b = torch.cat([torch.full((4096,), 127), torch.full((4096,), -127), torch.ones(1)]).to(torch.int8)
    n, k, m = rnd.randint(3, 9), rnd.randint(8, 40), rnd.randint(2, 6)
    return [
        ("(8, 16) @ (16, 5), zero point 128", u8(8, 16), torch.tensor(0.02), 128, i8(16, 5), torch.tensor(0.5)),
        ("zero point 0 (an all-positive range)", u8(4, 32), torch.tensor(0.1), 0, i8(32, 3), torch.tensor(1.0)),
        ("per-column scales of B, zero point drawn", u8(n, k), torch.tensor(0.03), rnd.randint(1, 254), i8(k, m),
         torch.rand(1, m, generator=g) + 0.01),
        ("sums that cancel: 255*127*4096 - 255*127*4096 + 1, zero point 0", big_a, torch.tensor(1.0), 0,
         big_b[:, None].repeat(1, 3), torch.tensor(1.0)),
        ("every value at the zero point: the product is 0", torch.full((3, 7), 77, dtype=torch.uint8),
         torch.tensor(0.5), 77, i8(7, 2), torch.tensor(2.0)),
    ]  # fmt: skip


def _call_zp(fn: Callable, call: str, mode: _Products, qa, sa, za, qb, sb) -> torch.Tensor:
    try:
        with unavailable(FORBIDDEN, "this exercise (int8_matmul_zp)"), mode:
            return torch.as_tensor(fn(qa.clone(), sa.clone(), za, qb.clone(), sb.clone()))
    except NotImplementedError:
        raise
    except AssertionError:
        raise
    except Exception as e:
        raise AssertionError(f"{call}: your function raised {type(e).__name__}: {e}") from e


def check_int8_matmul_zp(fn: Callable) -> None:
    """`fn(qa, sa, za, qb, sb)` -> float32 ((qa - za) @ qb) * sa * sb, every matrix product taking the stored
    uint8 and int8 values as they are (widened to a larger integer type, not shifted, not floats; a product with
    an all-ones operand, a sum, is fine too), the result following the product of the stored matrices, exact."""
    require_callable(fn, "int8_matmul_zp")
    cases = _zp_cases(random.Random(draw_seed()))  # operands and one zero point drawn afresh every grade run
    for name, qa, sa, za, qb, sb in cases:
        call = f"int8_matmul_zp on {name}: qa {tuple(qa.shape)} uint8, za={za}, qb {tuple(qb.shape)} int8"
        products = _Products(qa, qb)
        got = _call_zp(fn, call, products, qa, sa, za, qb, sb)
        acc = _int64_matmul(qa.long() - za, qb)  # exact
        want = acc.double() * (sa.double() * sb.double())
        assert got.shape == want.shape and got.dtype == torch.float32, (
            f"{call}: return a float32 tensor of shape {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}"
        )
        assert products.seen, f"{call}: no matrix product ran: multiply the integer matrices"
        for op, a, b, stored in products.seen:
            ones = (
                not a.is_floating_point()
                and not b.is_floating_point()
                and any(t.numel() and bool((t == 1).all()) for t in (a, b))
            )
            assert stored or ones, (
                f"{call}: a matrix product ({op}) took {_describe(a, qa, qb)} and {_describe(b, qa, qb)}; every "
                "product must take the stored qa and qb as they are (widened to a larger integer type is fine; "
                "shifted by the zero point or turned into floats is not), or sum with a vector of ones: the kernel "
                "multiplies the stored bytes, and the zero point is accounted for apart from the product"
            )
        assert any(stored for *_, stored in products.seen), (
            f"{call}: no product of the stored qa and qb ran (only sums with ones): multiply the integer matrices"
        )
        err = (got.double() - want).abs()
        bad = (err > 1e-6 * want.abs() + 1e-12).nonzero()
        if len(bad):
            i = tuple(bad[0].tolist())
            raise AssertionError(
                f"{call}: {len(bad)} wrong value(s); first at {i}: got {got[i].item():.8g}, expected "
                f"{want[i].item():.8g} (the exact integer sum is {acc[i].item()})"
            )
        # the same call, every product of the stored matrices coming out _SHIFT larger: the result must follow
        moved = _call_zp(fn, call, _Products(qa, qb, shift=_SHIFT), qa, sa, za, qb, sb)
        step = (_SHIFT * sa.double() * sb.double()).expand(want.shape)
        delta = moved.double() - got.double()
        off = (delta - step).abs() > 1e-3 * step.abs() + 4 * torch.finfo(
            torch.float32
        ).eps * got.double().abs().max()
        if off.any():
            i = tuple(off.nonzero()[0].tolist())
            raise AssertionError(
                f"{call}: your result does not come from the integer product: run again with every entry of qa @ qb "
                f"coming out {_SHIFT} larger, it should move by {_SHIFT}·sa·sb ({step[i].item():.6g} at {i}), and it "
                f"moved by {delta[i].item():.6g}"
            )
    passed("check_int8_matmul_zp", f"{len(cases)} products of stored integers, zero point corrected, exact")


# ----------------------------------------------------------------------------- exercise 3
def _qparams(cmin: float, cmax: float) -> tuple[float, int]:
    """The observer's scale and zero point for quint8, in float64: the range widened to hold 0, 255 steps."""
    lo, hi = min(cmin, 0.0), max(cmax, 0.0)
    scale = max((hi - lo) / 255, float(torch.finfo(torch.float32).eps))
    return scale, min(255, max(0, -round(lo / scale)))


def _exact_worst(cmin: float, cmax: float, xmin: float, xmax: float) -> tuple[float, float]:
    """(largest |x - dequantize(quantize(x))| over x in [xmin, xmax], an x where it is reached), in float64. The
    error is the distance to the value of x's code: largest at the span's ends or halfway between two codes."""
    s, zp = _qparams(cmin, cmax)

    def err(x: float) -> float:
        q = min(255, max(0, round(x / s) + zp))
        return abs(x - (q - zp) * s)

    best = max((err(x), x) for x in (xmin, xmax))
    q = max(0, math.ceil(xmin / s + zp - 0.5))  # the first midpoint (q + 0.5 - zp) * s at or above xmin
    if q <= 254 and (q + 0.5 - zp) * s <= xmax:
        best = max(best, (s / 2, (q + 0.5 - zp) * s))
    return best


def _worst_error_cases(rnd: random.Random) -> list[tuple[str, tuple[float, float, float, float]]]:
    cases = [
        ("values spanning the calibrated range", (-1.0, 3.0, -1.0, 3.0)),
        ("a span narrower than one step, inside", (2.0, 5.0, 4.0, 4.005)),
        (
            "a narrow span at the bottom, where the zero point's rounding shifts the codes",
            (-1.3, 2.2, -1.3, -1.298),
        ),
        ("values beyond both ends of the range", (-0.02, 0.02, -0.05, 0.05)),
        ("values below an all-negative range", (-4.0, -0.5, -4.5, -3.9)),
        ("values above the range", (0.001, 250.0, 249.0, 260.0)),
    ]
    kinds = ("the calibrated range", "a span narrower than one step", "a span of a few steps",
             "a span crossing the top of the range", "a span crossing the bottom of the range", "a span beyond the top")  # fmt: skip
    for kind in kinds:
        while True:
            cmin = round(rnd.uniform(-100, 100), 4)
            cmax = round(cmin + 10 ** rnd.uniform(-1, 2.3), 4)
            s, _ = _qparams(cmin, cmax)
            frac = (-min(cmin, 0.0) / s) % 1
            if abs(frac - 0.5) > 1e-3:  # a zero point on a rounding tie would depend on float32 vs float64
                break
        lo, hi = min(cmin, 0.0), max(cmax, 0.0)
        if kind == "the calibrated range":
            xmin, xmax = cmin, cmax
        elif kind == "a span narrower than one step":
            xmin = rnd.uniform(lo, hi - s)
            xmax = xmin + rnd.uniform(0.05, 0.9) * s
        elif kind == "a span of a few steps":
            xmin = rnd.uniform(lo, hi - 6 * s)
            xmax = xmin + rnd.uniform(1.5, 6) * s
        elif kind == "a span crossing the top of the range":
            xmin, xmax = hi - rnd.uniform(0.1, 3) * s, hi + rnd.uniform(0.1, 3) * s
        elif kind == "a span crossing the bottom of the range":
            xmin, xmax = lo - rnd.uniform(0.1, 3) * s, lo + rnd.uniform(0.1, 3) * s
        else:
            xmin = hi + rnd.uniform(0.1, 2) * s
            xmax = xmin + rnd.uniform(0.1, 5) * s
        cases.append((f"{kind} (drawn)", (cmin, cmax, round(xmin, 6), round(xmax, 6))))
    return cases


def check_affine_worst_error(fn: Callable[[float, float, float, float], float]) -> None:
    """`fn(cmin, cmax, xmin, xmax)` -> the largest |x - dequantize(quantize(x))| over every real x in [xmin, xmax],
    quantized to uint8 with the scale and zero point the observer's rule gives the range [cmin, cmax]; exact."""
    require_callable(fn)
    cases = _worst_error_cases(random.Random(draw_seed()))  # six spans drawn afresh every grade run
    exercise = "this exercise (affine_worst_error)"
    with unavailable(FORBIDDEN, exercise), _NoQuantOps(exercise):  # switched off once for all twelve calls
        for what, (cmin, cmax, xmin, xmax) in cases:
            call = f"affine_worst_error(cmin={cmin}, cmax={cmax}, xmin={xmin}, xmax={xmax}), {what}"
            try:
                said = fn(cmin, cmax, xmin, xmax)
            except (NotImplementedError, AssertionError):
                raise
            except Exception as e:
                raise AssertionError(f"{call}: your function raised {type(e).__name__}: {e}") from e
            if isinstance(said, torch.Tensor) and said.numel() == 1:
                said = said.item()
            assert isinstance(said, (int, float)) and not isinstance(said, bool), (
                f"{call} must return a number"
            )
            exact, at = _exact_worst(cmin, cmax, xmin, xmax)
            # float32 arithmetic on the scale moves the answer by a few float32 ulps of the values involved
            tol = 2e-6 * max(abs(cmin), abs(cmax), abs(xmin), abs(xmax)) + 1e-9
            assert abs(said - exact) <= tol, f"{call}: you say {said:.6g}; " + (
                f"quantizing x = {at:.6g} errs by {exact:.6g}"
                if said < exact
                else f"no value of the span errs that much: the largest error is {exact:.6g}, at x = {at:.6g}"
            )
    passed("check_affine_worst_error", f"{len(cases)} spans: the exact worst error, ends, steps and clamping")

"""Checks for lesson 12's exercises: affine (zero-point) quantization per group, an integer matmul that handles
the zero point the way integer kernels do, and the worst error of affine quantization.

`quantize_affine(x, group) -> (q, scale, zero_point)` quantizes each group of `group` consecutive elements of the
last dimension to uint8 by the rule of torch's MinMaxObserver for quint8 (the range widened to include 0, mapped
onto 0..255); compared with torch's observer and `torch.quantize_per_tensor` group by group, bit for bit given
the learner's scale and zero point. `dequantize_affine` is compared with torch's `.dequantize()`.

`int8_matmul_zp(qa, sa, za, qb, sb)` multiplies a uint8 matrix with zero point `za` by an int8 one: every matrix
product it runs must take the stored integers as they are (Jacob et al. 2018, section 2.3: the zero point is
handled by a correction from sums, so the kernel multiplies uint8 by int8 as VNNI's vpdpbusd does); the result is
compared with an exact int64 reference.

`affine_error_bound(xmin, xmax)` predicts the largest error on values spanning [xmin, xmax]; measured on dense
tensors.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

# The lab's int8 code and torch's quantization entry points and observers, switched off while the learner's
# functions run.
FORBIDDEN = {
    **family("parallel_lab.quantization.int8", "parallel_lab.quantization.inference"),
    **{
        f"torch.{n}": ""
        for n in (
            "quantize_per_tensor",
            "quantize_per_channel",
            "_int_mm",
            "fake_quantize_per_tensor_affine",
            "fake_quantize_per_channel_affine",
            "_choose_qparams_per_tensor",
            "choose_qparams_optimized",
        )
    },  # fmt: skip
    **family("torch.ao.quantization.observer", missing_ok=True),
    "torch.ao.quantization.quantize_dynamic": "",
}

__all__ = ["check_affine_error_bound", "check_int8_matmul_zp", "check_quantize_affine"]


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
    quant = guarded(quantize_affine, FORBIDDEN, "this exercise (quantize_affine)")
    dequant = guarded(dequantize_affine, FORBIDDEN, "this exercise (dequantize_affine)")
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
class _Products(TorchDispatchMode):
    """Records the operands of every matrix product run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.operands: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm", "_int_mm", "dot", "mv"):
            a, b = (args[1], args[2]) if func.overloadpacket.__name__ in ("addmm", "baddbmm") else args[:2]
            self.operands.append((a.detach().clone(), b.detach().clone()))
        return func(*args, **(kwargs or {}))


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
    return [
        ("(8, 16) @ (16, 5), zero point 128", u8(8, 16), torch.tensor(0.02), 128, i8(16, 5), torch.tensor(0.5)),
        ("zero point 0 (an all-positive range)", u8(4, 32), torch.tensor(0.1), 0, i8(32, 3), torch.tensor(1.0)),
        ("per-column scales of B, zero point drawn", u8(6, 40), torch.tensor(0.03), rnd.randint(1, 254), i8(40, 4),
         torch.rand(1, 4, generator=g) + 0.01),
        ("sums that cancel: 255*127*4096 - 255*127*4096 + 1, zero point 0", big_a, torch.tensor(1.0), 0,
         big_b[:, None].repeat(1, 3), torch.tensor(1.0)),
        ("every value at the zero point: the product is 0", torch.full((3, 7), 77, dtype=torch.uint8),
         torch.tensor(0.5), 77, i8(7, 2), torch.tensor(2.0)),
    ]  # fmt: skip


def check_int8_matmul_zp(fn: Callable) -> None:
    """`fn(qa, sa, za, qb, sb)` -> float32 ((qa - za) @ qb) * sa * sb, every matrix product taking the stored
    uint8 and int8 values as they are (widened, not shifted), the sums exact."""
    require_callable(fn, "int8_matmul_zp")
    fn = guarded(fn, FORBIDDEN, "this exercise (int8_matmul_zp)")
    cases = _zp_cases(random.Random(draw_seed()))  # operands and one zero point drawn afresh every grade run
    for name, qa, sa, za, qb, sb in cases:
        call = f"int8_matmul_zp on {name}: qa {tuple(qa.shape)} uint8, za={za}, qb {tuple(qb.shape)} int8"
        products = _Products()
        try:
            with products:
                got = fn(qa.clone(), sa.clone(), za, qb.clone(), sb.clone())
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{call}: your function raised {type(e).__name__}: {e}") from e
        got = torch.as_tensor(got)
        acc = _int64_matmul(qa.long() - za, qb)  # exact
        want = acc.double() * (sa.double() * sb.double())
        assert got.shape == want.shape and got.dtype == torch.float32, (
            f"{call}: return a float32 tensor of shape {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}"
        )
        assert products.operands, f"{call}: no matrix product ran: multiply the integer matrices"
        stored_a, stored_b = qa.long(), qb.long()
        for a, b in products.operands:
            same = a.shape == stored_a.shape and b.shape == stored_b.shape
            assert same and torch.equal(a.long(), stored_a) and torch.equal(b.long(), stored_b), (
                f"{call}: a matrix product took operands other than the stored qa and qb (widened to a larger "
                "integer type is fine; shifted by the zero point or turned into floats is not): the kernel "
                "multiplies the stored bytes, and the zero point is accounted for apart from the product"
            )
        err = (got.double() - want).abs()
        bad = (err > 1e-6 * want.abs() + 1e-12).nonzero()
        if len(bad):
            i = tuple(bad[0].tolist())
            raise AssertionError(
                f"{call}: {len(bad)} wrong value(s); first at {i}: got {got[i].item():.8g}, expected "
                f"{want[i].item():.8g} (the exact integer sum is {acc[i].item()})"
            )
    passed("check_int8_matmul_zp", f"{len(cases)} products of stored integers, zero point corrected, exact")


# ----------------------------------------------------------------------------- predict, then measure
def check_affine_error_bound(fn: Callable[[float, float], float]) -> None:
    """`fn(xmin, xmax)` -> the largest error |x - dequantize(quantize(x))| affine uint8 quantization (the
    observer's rule) can make on values spanning [xmin, xmax]; predicted, then measured on dense tensors."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (affine_error_bound)")
    rnd = random.Random(draw_seed())  # two spans and every tensor drawn afresh every grade run
    spans = [(-1.0, 3.0), (2.0, 5.0), (-4.0, -0.5), (-0.02, 0.02), (0.001, 250.0)]
    for _ in range(2):
        lo = rnd.uniform(-100, 100)
        spans.append((round(lo, 4), round(lo + 10 ** rnd.uniform(-1, 2), 4)))
    for xmin, xmax in spans:
        g = torch.Generator().manual_seed(rnd.getrandbits(62))
        x = torch.rand(200_000, generator=g, dtype=torch.float64) * (xmax - xmin) + xmin
        x = x.float()
        x[0], x[1] = xmin, xmax  # both ends, exactly
        scale, zp = _observed(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            back = torch.quantize_per_tensor(x, scale, zp, torch.quint8).dequantize()
        measured = (x - back).abs().max().item()
        said = fn(xmin, xmax)
        call = f"affine_error_bound(xmin={xmin}, xmax={xmax})"
        assert isinstance(said, (int, float)) and not isinstance(said, bool), f"{call} must return a number"
        assert said >= measured * (1 - 1e-4), (
            f"{call}: you predict errors up to {said:.6g}, quantizing made {measured:.6g}"
        )
        assert said <= measured * 1.02, (
            f"{call}: you predict errors up to {said:.6g}; the largest of 200,000 dense values was {measured:.6g}, "
            f"so your bound is {said / measured:.2f}x loose"
        )
    passed("check_affine_error_bound", f"{len(spans)} bounds hold and are tight on dense tensors")

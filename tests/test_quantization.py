"""INT8 quantization: parity with torch's quantized tensors, exact integer matmul, outliers, BMInf plan."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import parallel_lab as pl
from parallel_lab import quantization as Q
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.quantization.inference import (
    bytes_per_param,
    layer_bytes_of,
    plan_layer_offload,
    run_layer_by_layer,
)
from parallel_lab.runtime.memory_state import count_bytes

# Seed 000's example: the largest magnitude is 3.1 (negative: it maps to -127).
SEED_X = torch.tensor([[1.2, -0.5, -3.1, 0.8], [0.0, 2.4, -1.7, 0.3], [-0.9, 1.5, 2.0, -2.6]])
SEED_Q = [[49, -20, -127, 33], [0, 98, -70, 12], [-37, 61, 82, -107]]


@pytest.fixture(autouse=True)
def _quiet():
    # torch.quantize_per_* warn that quantized tensors are deprecated; they still are the reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _int64_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact reference: every product and sum in int64, no BLAS."""
    return (a.long()[:, :, None] * b.long()[None, :, :]).sum(1)


def test_seed_example():
    q, s = Q.quantize_absmax(SEED_X)
    assert s.dtype == torch.float32 and s.dim() == 0
    assert s.item() == (torch.tensor(3.1) / 127).item()  # 0.024409...
    assert abs(s.item() - 0.0244) < 1e-4
    assert q.dtype == torch.int8 and q.tolist() == SEED_Q
    back = Q.dequantize(q, s)
    assert (back - SEED_X).abs().max() <= s / 2 + 1e-7  # rounding loses at most half a step
    assert back[0, 2].item() == pytest.approx(-3.1)  # the absmax itself comes back (to fp32 rounding)


def _cases():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(64, 48, generator=g) * 3
    yield torch.randn(7, 5, 3, generator=g)
    yield torch.randn(1, generator=g)
    x = torch.randn(9, 33, generator=g)
    x[4] = 0  # an all-zero row: scale 1, zeros back
    yield x
    # ties: k + 0.5 steps exactly (power-of-two scale), to see round-half-to-even
    yield torch.tensor(
        [[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0], [3.5, -3.5, 4.5, 0.0, 1.0, 2.0, 3.0, 64.0]]
    )
    yield (torch.randn(16, 16, generator=g) * 100).to(torch.bfloat16)
    yield (torch.randn(10, 12, generator=g)).to(torch.float16)


@pytest.mark.parametrize("case", range(7))
def test_per_tensor_equals_torch(case):
    x = list(_cases())[case]
    q, s = Q.quantize_absmax(x)
    ref = torch.quantize_per_tensor(x.float(), float(s), 0, torch.qint8)
    assert torch.equal(q, ref.int_repr())
    assert float(s) == ref.q_scale() and ref.q_zero_point() == 0
    assert torch.equal(Q.dequantize(q, s), ref.dequantize())
    # our scale is max|x| / 127 in float32; torch's own tensors agree through quantize_torch
    assert torch.equal(Q.quantize_torch(x).int_repr(), q)


@pytest.mark.parametrize("case", range(7))
def test_per_channel_equals_torch(case):
    x = list(_cases())[case]
    for axis in range(-1, x.dim()):
        q, s = Q.quantize_absmax(x, axis)
        ax = axis % x.dim()
        assert s.shape == tuple(x.shape[d] if d == ax else 1 for d in range(x.dim()))
        flat = s.reshape(-1)
        zeros = torch.zeros(flat.numel(), dtype=torch.long)
        ref = torch.quantize_per_channel(x.float(), flat.double(), zeros, ax, torch.qint8)
        assert torch.equal(q, ref.int_repr()), f"axis={axis}"
        assert torch.equal(ref.q_per_channel_scales().float(), flat)
        assert torch.equal(Q.dequantize(q, s), ref.dequantize())


def test_ties_round_half_to_even():
    q, s = Q.quantize_absmax(torch.tensor([0.5, 1.5, 2.5, -2.5, 127.0]))
    assert s.item() == 1.0
    assert q.tolist() == [0, 2, 2, -2, 127]  # not 1, 2, 3, -3 (round half up)


def test_vectorwise_scales_are_rows_of_x_and_columns_of_w():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 8, generator=g), torch.randn(8, 3, generator=g)  # X (tokens, in), W (in, out)
    _, sx = Q.quantize_absmax(x, 0)
    _, sw = Q.quantize_absmax(w, 1)
    assert torch.equal(sx.flatten(), x.abs().amax(1) / 127)
    assert torch.equal(sw.flatten(), w.abs().amax(0) / 127)


def test_int32_matmul_is_exact():
    g = torch.Generator().manual_seed(2)
    cases = [
        (torch.randint(-127, 128, (13, 200), generator=g), torch.randint(-127, 128, (200, 7), generator=g)),
        (torch.full((3, 4096), 127), torch.full((4096, 2), -127)),  # -66M: far past int8 and fp32's 2**24
        (torch.randint(-127, 128, (1, 1), generator=g), torch.randint(-127, 128, (1, 1), generator=g)),
    ]
    # cancellation: 127*127*4096 - 127*127*4096 + 1 = 1; fp32 accumulation loses the 1
    a = torch.full((2, 8193), 127)
    a[:, -1] = 1
    b = torch.cat([torch.full((4096,), 127), torch.full((4096,), -127), torch.ones(1)])[:, None].repeat(1, 3)
    cases.append((a, b))
    for a, b in cases:
        a8, b8 = a.to(torch.int8), b.to(torch.int8)
        got = Q.int32_matmul(a8, b8)
        assert got.dtype == torch.int32
        assert torch.equal(got.long(), _int64_matmul(a8, b8))
    assert Q.int32_matmul(a.to(torch.int8), b.to(torch.int8)).unique().tolist() == [1]
    assert (a.float() @ b.float()).unique().tolist() != [1.0]  # why int32 accumulation matters


def test_int8_matmul_rescales_by_product_of_scales():
    g = torch.Generator().manual_seed(3)
    A, B = torch.randn(6, 32, generator=g), torch.randn(32, 5, generator=g)
    for ax_a, ax_b in ((None, None), (0, 1)):
        qa, sa = Q.quantize_absmax(A, ax_a)
        qb, sb = Q.quantize_absmax(B, ax_b)
        got = Q.int8_matmul(qa, sa, qb, sb)
        acc = _int64_matmul(qa, qb)
        assert torch.equal(got, acc.float() * (sa * sb))  # int32 -> fp32 is exact below 2**24
        # and it approximates the float product: each operand is off by at most half a step
        bound = 0.5 * (
            sa * qb.float().abs().sum(0, keepdim=True) * sb + qa.float().abs().sum(1, keepdim=True) * sa * sb
        )
        bound = bound + 0.25 * 32 * sa * sb
        assert ((got - A @ B).abs() <= bound * 1.001 + 1e-6).all()


def test_bad_input():
    with pytest.raises(ValueError, match="NaN/inf"):
        Q.quantize_absmax(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="NaN/inf"):
        Q.quantize_absmax(torch.tensor([float("inf"), 1.0]), axis=0)
    with pytest.raises(ValueError, match="empty"):
        Q.quantize_absmax(torch.empty(0, 3))
    with pytest.raises(TypeError, match="floating-point"):
        Q.quantize_absmax(torch.arange(4))
    with pytest.raises(TypeError, match="torch.Tensor"):
        Q.quantize_absmax([1.0, 2.0])
    with pytest.raises(ValueError, match="axis"):
        Q.quantize_absmax(torch.ones(2, 2), axis=2)
    with pytest.raises(TypeError, match="int8"):
        Q.int32_matmul(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.int8))
    with pytest.raises(TypeError, match="int8"):
        Q.dequantize(torch.ones(2), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"\(n, k\) and \(k, m\)"):
        Q.int32_matmul(torch.ones(2, 3, dtype=torch.int8), torch.ones(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match="overflow"):
        Q.int32_matmul(torch.ones(1, 140_000, dtype=torch.int8), torch.ones(140_000, 1, dtype=torch.int8))
    with pytest.raises(ValueError, match="method"):
        Q.quantized_linear(torch.ones(2, 2), torch.ones(2, 2), method="int4")
    with pytest.raises(ValueError, match="dtype"):
        bytes_per_param("fp8")
    with pytest.raises(ValueError, match="layers"):
        plan_layer_offload(1e6, 0, 1e9)
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_layer_offload(1e6, 4, -1)


def test_outlier_experiment():
    cfg = GPTConfig(vocab=64, seq_len=32, d_model=64, n_heads=4, n_layers=2, tie_weights=False)
    base = build_model(cfg, seed=0).eval()
    planted = Q.plant_outliers(copy.deepcopy(base), features=(3, 17), magnitude=40.0)
    x, _ = synthetic_batch("tokens", 8, seq_len=32, vocab=64)
    err = {}
    with torch.no_grad():
        for name, m in (("base", base), ("planted", planted)):
            ref = m(x)
            for method in Q.METHODS:
                err[name, method] = Q.relative_error(Q.quantize_linears(copy.deepcopy(m), method)(x), ref)
        h = planted.blocks[0].ln1(planted.wte(x) + planted.wpe(torch.arange(32)))  # (B, T, C)
    assert Q.outlier_features(h.reshape(-1, 64)).tolist() == [3, 17]
    # one scale per tensor is worst with outliers; LLM.int8 recovers most of it
    assert err["planted", "absmax"] > 2 * err["planted", "vectorwise"]
    assert err["planted", "vectorwise"] > 1.5 * err["planted", "llm_int8"]
    assert err["planted", "absmax"] > 4 * err["base", "absmax"]
    assert max(err["base", m] for m in Q.METHODS) < 0.05
    # without outliers there is nothing to decompose: LLM.int8 is exactly vector-wise
    assert err["base", "llm_int8"] == err["base", "vectorwise"]


def test_int8_linear_memory_and_parity():
    lin = nn.Linear(64, 32)
    for method in Q.METHODS:
        q = Q.Int8Linear.from_float(lin, method)
        x = torch.randn(4, 7, 64)
        assert torch.equal(q(x), Q.quantized_linear(x, lin.weight, lin.bias, method))
        scales = 4 if method == "absmax" else 4 * 32
        assert count_bytes(q) == 64 * 32 + scales + 4 * 32  # int8 weight + fp32 scales + fp32 bias
    assert count_bytes(lin.weight) == 4 * count_bytes(Q.Int8Linear.from_float(lin).qweight)
    assert count_bytes(lin.weight.half()) == 2 * count_bytes(Q.Int8Linear.from_float(lin).qweight)


def test_torch_ao_dynamic_linear_side_by_side():
    from torch.ao.quantization import quantize_dynamic

    g = torch.Generator().manual_seed(4)
    lin = nn.Linear(48, 24)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 48, generator=g) * 0.1)
    tq = quantize_dynamic(nn.Sequential(lin), {nn.Linear}, dtype=torch.qint8)[0]
    w = tq.weight()
    # torch's default weight observer: symmetric, scale = max|w| / 127.5 over [-128, 127]
    assert w.q_scale() == pytest.approx(lin.weight.abs().max().item() / 127.5, rel=1e-6)
    assert torch.equal(
        w.int_repr(),
        torch.round(lin.weight * (1 / torch.tensor(w.q_scale()))).clamp(-128, 127).to(torch.int8),
    )
    x = torch.randn(16, 48, generator=g)
    ref = lin(x)
    ours = Q.quantized_linear(x, lin.weight, lin.bias, "absmax")
    assert Q.relative_error(ours, ref) < 0.02 and Q.relative_error(tq(x), ref) < 0.02


def test_bminf_plan_on_paper():
    # BMInf: 10B parameters on a 6 GB GPU. fp32 40 GB, fp16 20 GB, int8 10 GB: none fits whole
    for dtype, whole in (("fp32", 40e9), ("fp16", 20e9), ("int8", 10e9)):
        assert layer_bytes_of(10e9, 48, dtype) * 48 == pytest.approx(whole, rel=1e-8)
    plan = plan_layer_offload(layer_bytes_of(10e9, 48, "int8"), 48, 6e9, buffers=2)
    assert plan.fits and plan.resident == 26 and plan.streamed == 22 and plan.peak_bytes <= 6e9
    small = plan_layer_offload(100, 4, 1000)
    assert small.resident == 4 and small.streamed == 0 and small.transfer_bytes == 0


def _run(ctx, layers, h0, resident, buffers, want):
    out = run_layer_by_layer(ctx, layers, h0, resident, buffers)
    # compared here: a tensor returned through launch's queue travels by file descriptor
    return {"same": torch.equal(out, want), "peak": sum(ctx.memory.peak().values())}


def test_layer_by_layer_within_budget():
    cfg = GPTConfig(vocab=64, seq_len=16, d_model=64, n_heads=4, n_layers=6, tie_weights=False)
    model = build_model(cfg, seed=0).eval()
    layers = list(Q.quantize_linears(copy.deepcopy(model), "vectorwise").blocks)
    x, _ = synthetic_batch("tokens", 2, seq_len=16, vocab=64)
    with torch.no_grad():
        h0 = model.wte(x) + model.wpe(torch.arange(16))  # (B, T, C)
        want = h0
        for b in layers:
            want = b(want)
    lb = count_bytes(layers[0])
    # threads=1: this process already ran multi-threaded BLAS, which a forked rank must not join
    probe = pl.launch(_run, 1, layers, h0, 0, 1, want, track_memory=True, threads=1).values[0]
    work = probe["peak"] - lb  # one layer's activations and temporaries
    budget = 3 * lb + work + lb // 2  # room for 1 resident + 2 staging slots, not for 6 layers
    plan = plan_layer_offload(lb, 6, budget, workspace_bytes=work, buffers=2)
    assert plan.resident == 1 and plan.streamed == 5
    got = pl.launch(_run, 1, layers, h0, plan.resident, 2, want, track_memory=True, threads=1).values[0]
    assert got["same"]  # streaming changes where weights live, not the numbers
    assert got["peak"] == plan.peak_bytes <= budget
    everything = pl.launch(_run, 1, layers, h0, 6, 1, want, track_memory=True, threads=1).values[0]
    assert everything["peak"] == 6 * lb + work > budget  # the whole int8 model would not fit

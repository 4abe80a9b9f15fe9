"""Lesson 17: context parallelism. Ring and all-to-all attention against single-process SDPA
(forward and gradients), bytes against the formula, causal work per rank, bad inputs, and a
TinyGPT on a DP x CP mesh against one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel_lab.context_parallel import (
    causal_work,
    chunk_ids,
    positions,
    ring_attention,
    shard_sequence,
    train_dp_cp,
    ulysses_attention,
    unshard_sequence,
)
from parallel_lab.costmodel import ring_attention_bytes, ulysses_attention_bytes
from parallel_lab.inference import attention_lse, flash_attention, merge_attention
from parallel_lab.models import GPTConfig, build_model, synthetic_batch, train_reference
from parallel_lab.runtime.launch import launch
from parallel_lab.runtime.parallel_dims import ParallelDims

# fp32: the ring merges N partial softmaxes in a different order than SDPA sums one row: rounding only.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
B, H, T = 2, 12, 24  # H divisible by 2, 3, 4 (Ulysses); T by 2N for N = 2, 3, 4 (zigzag)


# ----------------------------------------------------------------------------- layout
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shard_then_unshard_is_the_identity(n, zigzag):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    parts = [shard_sequence(x, r, n, dim=1, zigzag=zigzag) for r in range(n)]
    assert all(p.shape == (2, 24 // n, 3) for p in parts)
    assert torch.equal(unshard_sequence(parts, dim=1, zigzag=zigzag), x)
    got = torch.cat([positions(r, n, 24, zigzag=zigzag) for r in range(n)])
    assert sorted(got.tolist()) == list(range(24))


def test_zigzag_gives_rank_i_chunks_i_and_2n_minus_1_minus_i():
    assert [chunk_ids(r, 4, zigzag=True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert positions(1, 4, 16, zigzag=True).tolist() == [2, 3, 12, 13]
    assert positions(1, 4, 16).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize(("length", "n", "zigzag", "rule"), [(10, 4, False, "world_size = 4"),
                                                            (12, 4, True, "2 x world_size = 8")])  # fmt: skip
def test_a_length_the_layout_cannot_split_is_named(length, n, zigzag, rule):
    with pytest.raises(ValueError, match=f"sequence length {length} cannot be split.*{rule}"):
        shard_sequence(torch.zeros(length), 0, n, dim=0, zigzag=zigzag)


# ----------------------------------------------------------------------------- the merge
def test_merging_two_key_blocks_is_attention_over_both_even_where_exp_overflows():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (5, 12, 12))
    q = q * 400  # scores around 1e3: exp() overflows without the max subtracted
    a, b = attention_lse(q, k[:, :, :7], v[:, :, :7]), attention_lse(q, k[:, :, 7:], v[:, :, 7:])
    out, lse = merge_attention(*a, *b)
    want = torch.softmax(q.double() @ k.double().transpose(-2, -1) / 8**0.5, -1) @ v.double()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    want_lse = torch.logsumexp(q.double() @ k.double().transpose(-2, -1) / 8**0.5, -1)
    torch.testing.assert_close(lse.double(), want_lse, atol=0, rtol=1e-6)  # float32 lse around 1e3
    empty = attention_lse(q, k[:, :, :3], v[:, :, :3], causal_offset=-10)  # no query sees any key
    assert torch.equal(empty[0], torch.zeros_like(empty[0])) and torch.isneginf(empty[1]).all()
    both_empty = merge_attention(*empty, *empty)
    assert torch.equal(both_empty[0], torch.zeros_like(both_empty[0]))
    # FlashAttention's tiles go through the same merge
    assert torch.allclose(flash_attention(q, k, v, block_q=2, block_k=4), want.float(), atol=1e-4)


# ----------------------------------------------------------------------------- parity with SDPA
def _attend(ctx, method, inputs, cases):
    n, r = ctx.world_size, ctx.rank
    out = []
    for causal, zigzag, dtype, d in cases:
        q, k, v, dout = (t[..., :d].to(dtype) for t in inputs)
        parts = [
            shard_sequence(t, r, n, dim=2, zigzag=zigzag).clone().requires_grad_(True) for t in (q, k, v)
        ]
        if method == "ring":
            o = ring_attention(ctx, *parts, causal=causal, zigzag=zigzag)
        else:
            o = ulysses_attention(ctx, *parts, causal=causal)
        o.backward(shard_sequence(dout, r, n, dim=2, zigzag=zigzag))
        out.append((o.detach(), [p.grad for p in parts]))
    return out


def _cases(method):
    zz = (False, True) if method == "ring" else (False,)
    return [
        (c, z, dt, d)
        for c in (False, True)
        for z in zz
        for dt in (torch.float32, torch.bfloat16)
        for d in (8, 16)
    ]


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_output_and_gradients_equal_single_process_sdpa(n, method):
    g = torch.Generator().manual_seed(n)
    inputs = [torch.randn(B, H, T, 16, generator=g) for _ in range(4)]
    cases = _cases(method)
    res = launch(_attend, n, method, inputs, cases).values
    for i, (causal, zigzag, dtype, d) in enumerate(cases):
        q, k, v, dout = (t[..., :d].to(dtype) for t in inputs)
        ref = [
            t.float().requires_grad_(True) for t in (q, k, v)
        ]  # the reference in float32 on the same values
        want = F.scaled_dot_product_attention(*ref, is_causal=causal)
        want.backward(dout.float())
        what = f"{method}, {n} ranks, causal={causal}, zigzag={zigzag}, {dtype}, head dim {d}"
        got = unshard_sequence([r[i][0] for r in res], dim=2, zigzag=zigzag)
        assert got.dtype == dtype, what
        torch.testing.assert_close(
            got.float(), want, **TOL[dtype], msg=lambda m, what=what: f"{what} output: {m}"
        )
        for j, name in enumerate("qkv"):
            grad = unshard_sequence([r[i][1][j] for r in res], dim=2, zigzag=zigzag)
            torch.testing.assert_close(
                grad.float(),
                ref[j].grad,
                **TOL[dtype],
                msg=lambda m, what=what, name=name: f"{what} d{name}: {m}",
            )


# ----------------------------------------------------------------------------- bytes, work, overlap
def _bytes(ctx, method, zigzag, d, dtype):
    n, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(1)
    q, k, v = (shard_sequence(torch.randn(B, H, T, d, generator=g), r, n, dim=2, zigzag=zigzag).to(dtype)
               .requires_grad_(True) for _ in range(3))  # fmt: skip
    fn = (
        (lambda *a: ring_attention(ctx, *a, causal=True, zigzag=zigzag))
        if method == "ring"
        else (lambda *a: ulysses_attention(ctx, *a, causal=True))
    )
    o = fn(q, k, v)
    fwd = ctx.recorder.comm_totals()["sent"]
    o.sum().backward()
    return fwd, ctx.recorder.comm_totals()["sent"] - fwd


@pytest.mark.parametrize(("method", "zigzag", "dtype"), [("ring", False, torch.float32), ("ring", True, torch.bfloat16),
                                                         ("ulysses", False, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("n", [2, 4])
def test_bytes_sent_per_rank_equal_the_formula(n, method, zigzag, dtype):
    res = launch(_bytes, n, method, zigzag, 8, dtype).values
    formula = (ring_attention_bytes if method == "ring" else ulysses_attention_bytes)(
        B, H, T // n, 8, n, itemsize=torch.empty(0, dtype=dtype).element_size()
    )
    for rank, (fwd, bwd) in enumerate(res):
        assert (fwd, bwd) == (formula["forward"], formula["backward"]), (rank, fwd, bwd, formula)


def _work(ctx, zigzag):
    n, r = ctx.world_size, ctx.rank
    q = shard_sequence(torch.randn(1, 2, 32, 8), r, n, dim=2, zigzag=zigzag)
    ring_attention(ctx, q, q.clone(), q.clone(), causal=True, zigzag=zigzag)


@pytest.mark.parametrize("n", [2, 4])
def test_zigzag_balances_the_causal_work_contiguous_does_not(n):
    ratio = {}
    for zigzag in (False, True):
        res = launch(_work, n, zigzag)
        work = [sum(e["args"]["scores"] for e in res.spans(kind="compute", rank=r, name="ring attention"))
                for r in range(n)]  # fmt: skip
        # the blocks the ring computed hold exactly the (query, key) pairs the mask lets through
        assert work == [causal_work(r, n, 32, zigzag=zigzag) for r in range(n)], (zigzag, work)
        assert sum(work) == 32 * 33 // 2
        ratio[zigzag] = max(work) / min(work)
    assert ratio[True] == 1.0
    # contiguous: rank N-1 does N-1 full blocks and a diagonal, rank 0 one diagonal: (2N-1)x as chunks grow
    assert ratio[False] >= 2 * n - 2


def test_the_next_block_is_in_flight_while_this_one_is_computed():
    res = launch(_work, 4, True)
    for r in range(4):
        comp = res.spans(kind="compute", rank=r, name="ring attention")
        xfer = [e for e in res.spans(kind="comm", rank=r) if e["name"] == "isendrecv"]
        assert len(comp) == 4 and len(xfer) == 3
        for c, x in zip(comp, xfer):  # step s's transfer was posted before step s's compute, waited after it
            assert x["start"] <= c["start"] and x["end"] >= c["end"], (r, c, x)


# ----------------------------------------------------------------------------- bad inputs
def _bad(ctx, case):
    r = ctx.rank
    q = torch.randn(1, 4, 8, 8)
    k, v, kw, fn = q.clone(), q.clone(), {"causal": True}, ring_attention
    if case == "shapes" and r == 1:
        k = torch.randn(1, 4, 6, 8)
    elif case == "odd zigzag":
        q = k = v = torch.randn(1, 4, 7, 8)
        kw["zigzag"] = True
    elif case == "heads":
        fn = ulysses_attention
    elif case == "layout":
        kw["zigzag"] = r == 0
    try:
        fn(ctx, q, k, v, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(("case", "n", "want"), [
    ("shapes", 2, "rank 1: q (1, 4, 8, 8), k (1, 4, 6, 8), v (1, 4, 8, 8): q, k and v must be 4-D"),
    ("odd zigzag", 2, "T_local must be even"),
    ("heads", 3, "the number of heads must be divisible by the group size (each rank attends over H / group heads) (H = 4, group size 3)"),
    ("layout", 2, "the ranks disagree on the layout (rank 0: (B, H, T_local, D) = (1, 4, 8, 8), float32, causal=True, zigzag=True; rank 1"),
])  # fmt: skip
def test_bad_inputs_raise_the_same_clear_error_on_every_rank(case, n, want):
    msgs = launch(_bad, n, case, timeout=60).values
    assert all(want in m for m in msgs), msgs
    assert len(set(msgs)) == 1, msgs


# ----------------------------------------------------------------------------- DP x CP training
CFG = GPTConfig(vocab=64, seq_len=32, d_model=32, n_heads=4, n_layers=2)


@pytest.mark.parametrize(("method", "zigzag", "dp", "cp"), [("ring", True, 2, 2), ("ring", False, 1, 4),
                                                            ("ulysses", False, 2, 2)])  # fmt: skip
def test_tiny_gpt_on_a_dp_x_cp_mesh_trains_like_one_process(method, zigzag, dp, cp):
    batches = [synthetic_batch("tokens", 4, seed=i, seq_len=32, vocab=64) for i in range(3)]
    ref = build_model(CFG, 0)
    want = train_reference(ref, batches, "adam", 1e-2)
    res = launch(lambda ctx: train_dp_cp(ctx, build_model(CFG, 0), batches, dp=dp, cp=cp, method=method,
                                         zigzag=zigzag), 4).values  # fmt: skip
    for rank, r in enumerate(res):
        assert r["losses"] == pytest.approx(want, abs=2e-5), rank
        for a, b in zip(r["params"], ref.parameters()):
            # Adam divides by sqrt(v): a gradient near zero turns rounding into up to lr * 1e-2
            torch.testing.assert_close(a, b.detach(), atol=2e-4, rtol=0)


def test_parallel_dims_places_cp_between_tp_and_dp():
    d = ParallelDims(dp=2, cp=2, tp=2, world_size=8)
    assert d.coords(5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert d.rank_of(dp=1, cp=1, tp=0) == 6
    assert d.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("tp")[0] == [0, 1] and d.groups("dp")[0] == [0, 4]
    assert ParallelDims(dp=2, tp=2).coords(3) == {"pp": 0, "dp": 1, "tp": 1}  # cp = 1: lesson 10's layout
    with pytest.raises(
        ValueError, match=r"dp \* cp \* tp \* pp = 2 \* 3 \* 1 \* 1 = 6 must equal world_size = 4"
    ):
        ParallelDims(dp=2, cp=3, world_size=4)
    with pytest.raises(ValueError, match="heads .5. must be divisible by cp .2."):
        ulysses_attention_bytes(1, 5, 8, 8, 2)

"""Collectives from scratch: parity with torch.distributed on real gloo ranks, exact byte counts.

Many checks run inside one launch per world size (a launch costs ~0.2 s, the checks
themselves milliseconds); each rank returns a list of failure strings and the test
asserts that every list is empty, so one failing case names itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel_lab import RankError, RunResult, launch
from parallel_lab import comms as C

REPO = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


# ----------------------------------------------------------------------------- formulas (no ranks)
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_ring_bytes_even_is_textbook(p):
    numel, itemsize = 24 * 1000, 4
    size = numel * itemsize
    rows = C.ring_bytes_per_rank(numel, p, itemsize, "all_reduce")
    assert rows == [(2 * (p - 1) * size // p, 2 * (p - 1) * size // p)] * p
    assert C.ring_bytes_per_rank(numel, p, itemsize, "reduce_scatter")[0] == ((p - 1) * size // p,) * 2


def test_ring_bytes_uneven_by_hand():
    # n = 7, p = 3: chunks 3, 2, 2 (the first n % p chunks get one more)
    assert C.chunk_sizes(7, 3) == [3, 2, 2]
    rs = C.ring_bytes_per_rank(7, 3, 1, "reduce_scatter")
    assert rs == [(7 - 3, 7 - 2), (7 - 2, 7 - 3), (7 - 2, 7 - 2)]  # sent n - c_r, recv n - c_(r-1)
    ag = C.ring_bytes_per_rank(7, 3, 1, "all_gather")
    assert ag == [(7 - 2, 7 - 3), (7 - 2, 7 - 2), (7 - 3, 7 - 2)]  # sent n - c_(r+1), recv n - c_r
    ar = C.ring_bytes_per_rank(7, 3, 2, "all_reduce")
    assert ar == [(2 * (a + b), 2 * (c + d)) for (a, c), (b, d) in zip(rs, ag)]
    # every byte sent is received by someone
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        for n, p in [(0, 3), (1, 4), (5, 8), (1001, 6)]:
            rows = C.ring_bytes_per_rank(n, p, 2, op)
            assert sum(s for s, _ in rows) == sum(r for _, r in rows)


def test_tree_bytes():
    # p = 8, root 0: rank 0 sends to 1, 2, 4; rank 1 to 3, 5; rank 2 to 6; rank 3 to 7
    rows = C.tree_bytes_per_rank(10, 8, 4, "broadcast")
    assert [s for s, _ in rows] == [120, 80, 40, 40, 0, 0, 0, 0]
    assert [r for _, r in rows] == [0] + [40] * 7
    assert sum(s for s, _ in rows) == 7 * 40
    red = C.tree_bytes_per_rank(10, 5, 4, "reduce", root=2)
    assert red[2] == (0, 3 * 40)  # the root hears from relative ranks 1, 2 and 4
    assert sum(s for s, _ in red) == sum(r for _, r in red) == 4 * 40
    assert sorted(s for s, _ in red) == [0, 40, 40, 40, 40]


def test_formula_bad_input():
    with pytest.raises(ValueError, match="op must be"):
        C.ring_bytes_per_rank(4, 2, 4, "broadcast")
    with pytest.raises(ValueError, match="world_size"):
        C.ring_bytes_per_rank(4, 0, 4, "all_reduce")
    with pytest.raises(ValueError, match="algorithm"):
        C.alpha_beta_seconds("star", 10, 2, 1e-6, 1e9)
    # ring wins on big messages, the tree on tiny ones (8 ranks)
    big, small = 1 << 28, 8
    assert C.alpha_beta_seconds("ring", big, 8, 1e-5, 1e10) < C.alpha_beta_seconds("tree", big, 8, 1e-5, 1e10)
    assert C.alpha_beta_seconds("tree", small, 8, 1e-5, 1e10) < C.alpha_beta_seconds(
        "ring", small, 8, 1e-5, 1e10
    )


def test_three_multinode_all_reduce_models():
    """Single-NIC ring, multi-rail ring (one ring per NIC), hierarchical: bandwidth and latency terms."""
    nv, ib, nbytes, g = 450e9, 50e9, 2.6e9, 8
    for n in (2, 4, 32):
        p = n * g
        single = C.multinode_all_reduce_seconds(nbytes, n, g, nv, ib, hierarchical=False)
        multi = C.multirail_all_reduce_seconds(nbytes, n, g, nv, ib)
        hier = C.multinode_all_reduce_seconds(nbytes, n, g, nv, ib)
        assert single == pytest.approx(2 * (p - 1) / p * nbytes / ib)
        # all g NICs carry the ring traffic (slower than the NVLink share at these bandwidths)
        assert multi == pytest.approx(2 * (p - 1) / p * nbytes / (g * ib))
        assert hier == pytest.approx(2 * (g - 1) / g * nbytes / nv + 2 * (n - 1) / n * nbytes / g / ib)
        assert multi < hier < single
    # two nodes: the numbers lesson 16 prints
    assert C.multirail_all_reduce_seconds(nbytes, 2, g, nv, ib) == pytest.approx(12.19e-3, rel=1e-3)
    assert C.multinode_all_reduce_seconds(nbytes, 2, g, nv, ib) == pytest.approx(16.61e-3, rel=1e-3)
    # when NVLink is the slower share, it sets the pace: (g-1)/g of each rank's bytes over NVLink
    slow_nv = C.multirail_all_reduce_seconds(nbytes, 2, g, 60e9, ib)
    assert slow_nv == pytest.approx(2 * 15 / 16 * nbytes * 7 / 8 / 60e9)
    # one node: all three are the same ring over NVLink
    one = C.alpha_beta_seconds("ring", nbytes, g, 1e-6, nv)
    assert C.multirail_all_reduce_seconds(nbytes, 1, g, nv, ib, 1e-6) == one
    assert C.multinode_all_reduce_seconds(nbytes, 1, g, nv, ib, 1e-6, hierarchical=False) == one
    assert C.multinode_all_reduce_seconds(nbytes, 1, g, nv, ib, 1e-6) == one
    # latency: 2(ng-1) steps for either ring, 2(g-1) + 2(n-1) for the hierarchy
    a, n = 1e-5, 16
    assert C.multirail_all_reduce_seconds(0, n, g, nv, ib, a) == pytest.approx(2 * (n * g - 1) * a)
    assert C.multinode_all_reduce_seconds(0, n, g, nv, ib, a, hierarchical=False) == pytest.approx(
        2 * (n * g - 1) * a
    )
    assert C.multinode_all_reduce_seconds(0, n, g, nv, ib, a) == pytest.approx(
        (2 * (g - 1) + 2 * (n - 1)) * a
    )
    with pytest.raises(ValueError, match="must be >= 1"):
        C.multirail_all_reduce_seconds(nbytes, 0, g, nv, ib)


# ----------------------------------------------------------------------------- parity on ranks
def _data(rank: int, numel: int, dtype, integer: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if integer:  # small integers: every summation order gives the exact same answer, even in bf16
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _tol(x: torch.Tensor, p: int) -> torch.Tensor:
    """Two summation orders of p terms differ by at most (p-1) * eps * sum|x_i| (each is within
    (p-1) * u * sum|x_i| of the exact sum, u = eps / 2). This is the bound stated for bf16 too:
    like gloo we round to bf16 after every add."""
    absum = x.abs().double()
    dist.all_reduce(absum)
    return (max(p - 1, 1) * torch.finfo(x.dtype).eps * absum + 1e-30).to(torch.float64)


def _delta(ctx, before: dict, op: str) -> tuple[int, int]:
    now = ctx.recorder.comm.get(op, {"sent": 0, "recv": 0})
    was = before.get(op, {"sent": 0, "recv": 0})
    return now["sent"] - was["sent"], now["recv"] - was["recv"]


def _snap(ctx) -> dict:
    return {k: dict(v) for k, v in ctx.recorder.comm.items()}


def _parity(ctx, numels, dtypes) -> list[str]:
    """Every from-scratch collective against its torch.distributed twin; returns failures."""
    p, r = ctx.world_size, ctx.rank
    bad: list[str] = []

    def same(name, got, want, tol=None):
        if got.shape != want.shape:
            bad.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        elif tol is None and not torch.equal(got, want):
            bad.append(f"{name}: max diff {(got.double() - want.double()).abs().max().item()}")
        elif tol is not None and not bool(((got.double() - want.double()).abs() <= tol).all()):
            bad.append(
                f"{name}: outside tolerance, max diff {(got.double() - want.double()).abs().max().item()}"
            )

    def bytes_ok(name, before, op, want):
        got = _delta(ctx, before, op)
        if got != tuple(want):
            bad.append(f"{name}: bytes (sent, recv) {got} != formula {tuple(want)}")

    for dtype in dtypes:
        b = torch.tensor([], dtype=dtype).element_size()
        for n in numels:
            for integer in (True, False):
                tag = f"p={p} rank={r} n={n} {str(dtype)[6:]} {'int' if integer else 'float'}"
                x = _data(r, n, dtype, integer)
                ref = x.clone()
                dist.all_reduce(ref)
                tol = None if integer else _tol(x, p)
                # all-reduce, three ways, plus avg/max
                for fn in (
                    C.ring_all_reduce,
                    C.ring_all_reduce_pipelined,
                    C.tree_all_reduce,
                    C.naive_all_reduce,
                ):
                    before = _snap(ctx)
                    y = x.clone()
                    out = fn(ctx, y)
                    same(f"{fn.__name__} {tag}", out, ref, tol)
                    if out.data_ptr() != y.data_ptr():
                        bad.append(f"{fn.__name__} {tag}: not in place")
                    if fn in (C.ring_all_reduce, C.ring_all_reduce_pipelined):
                        bytes_ok(
                            f"{fn.__name__} {tag}",
                            before,
                            "ring_all_reduce",
                            C.ring_bytes_per_rank(n, p, b, "all_reduce")[r],
                        )
                if integer:
                    mx = x.clone()
                    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
                    same(f"ring max {tag}", C.ring_all_reduce(ctx, x.clone(), op="max"), mx)
                    same(f"tree min {tag}", C.tree_all_reduce(ctx, -x, op="min"), -mx)
                    av = C.ring_all_reduce(ctx, x.clone(), op="avg")
                    same(f"ring avg {tag}", av, (ref.double() / p).to(dtype))  # exact sum, one rounding
                # reduce-scatter: divmod chunks, vs dist.reduce_scatter on the same chunks
                before = _snap(ctx)
                rs = C.ring_reduce_scatter(ctx, x)
                want = torch.empty(C.chunk_sizes(n, p)[r], dtype=dtype)
                dist.reduce_scatter(want, list(x.split(C.chunk_sizes(n, p))))
                same(
                    f"ring_reduce_scatter {tag}",
                    rs,
                    want,
                    None if tol is None else tol.split(C.chunk_sizes(n, p))[r],
                )
                bytes_ok(
                    f"ring_reduce_scatter {tag}",
                    before,
                    "ring_reduce_scatter",
                    C.ring_bytes_per_rank(n, p, b, "reduce_scatter")[r],
                )
                if not torch.equal(x, _data(r, n, dtype, integer)):
                    bad.append(f"ring_reduce_scatter {tag}: modified its input")
                if not integer:
                    continue
                # all-gather (nothing is reduced: exact)
                before = _snap(ctx)
                ag = C.ring_all_gather(ctx, x)
                parts = [torch.empty_like(x) for _ in range(p)]
                dist.all_gather(parts, x)
                same(f"ring_all_gather {tag}", ag, torch.stack(parts))
                bytes_ok(
                    f"ring_all_gather {tag}",
                    before,
                    "ring_all_gather",
                    C.ring_bytes_per_rank(n * p, p, b, "all_gather")[r],
                )
                # broadcast / reduce on a root that is not 0
                root = p - 1
                before = _snap(ctx)
                bc = C.tree_broadcast(ctx, x.clone(), src=root)
                want = x.clone()
                dist.broadcast(want, src=root)
                same(f"tree_broadcast {tag}", bc, want)
                bytes_ok(
                    f"tree_broadcast {tag}",
                    before,
                    "tree_broadcast",
                    C.tree_bytes_per_rank(n, p, b, "broadcast", root)[r],
                )
                before = _snap(ctx)
                dst = p // 2
                y = x.clone()
                red = C.tree_reduce(ctx, y, dst=dst)
                want = x.clone()
                dist.reduce(want, dst=dst)
                if r == dst:
                    same(f"tree_reduce {tag}", red, want)
                elif red is not None or not torch.equal(y, x):
                    bad.append(f"tree_reduce {tag}: non-root must return None and keep its tensor")
                bytes_ok(
                    f"tree_reduce {tag}",
                    before,
                    "tree_reduce",
                    C.tree_bytes_per_rank(n, p, b, "reduce", dst)[r],
                )
                # all-to-all: piece j of rank r goes to rank j
                pieces = [x + 100 * j for j in range(p)]
                before = _snap(ctx)
                got = C.all_to_all(ctx, pieces)
                want = [torch.empty_like(x) for _ in range(p)]
                dist.all_to_all(want, pieces)
                for j in range(p):
                    same(f"all_to_all piece {j} {tag}", got[j], want[j])
                nb = (p - 1) * n * b
                bytes_ok(f"all_to_all {tag}", before, "all_to_all", (nb, nb))
    return bad


def _check(result: RunResult) -> None:
    failures = [f for per_rank in result.values for f in per_rank]
    assert not failures, f"{len(failures)} failures, first ones:\n" + "\n".join(failures[:15])


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_parity_all_collectives(p):
    # 0, 1, fewer than p, uneven, even
    _check(launch(_parity, p, [0, 1, max(p - 1, 1), 7 * p + 3, 40], DTYPES, timeout=180))


def test_parity_eight_ranks():
    _check(launch(_parity, 8, [0, 5, 8 * 3 + 5], (torch.float32, torch.bfloat16), timeout=180))


def test_parity_five_ranks_fp32_fp16():
    _check(launch(_parity, 5, [3, 21], (torch.float32, torch.float16), timeout=120))


@pytest.mark.parametrize("p", [6, 7])
def test_parity_six_and_seven_ranks(p):
    # world sizes that are neither a power of two nor prime (6) and prime (7): the tree has
    # incomplete levels, every ring chunk split is uneven for these sizes
    _check(launch(_parity, p, [2, 4 * p + 3], (torch.float64, torch.bfloat16), timeout=180))


def _big(ctx) -> list[str]:
    n = 1_000_003  # > 1M, and n % 3 = 1: uneven chunks
    x = _data(ctx.rank, n, torch.float32, False)
    ref = x.clone()
    dist.all_reduce(ref)
    tol = _tol(x, ctx.world_size)
    bad = []
    for fn in (C.ring_all_reduce, C.ring_all_reduce_pipelined):
        got = fn(ctx, x.clone())
        diff = (got.double() - ref.double()).abs()
        if not bool((diff <= tol).all()):
            bad.append(f"{fn.__name__}: max diff {diff.max().item()}")
    sent, recv = ctx.recorder.comm["ring_all_reduce"]["sent"], ctx.recorder.comm["ring_all_reduce"]["recv"]
    want = C.ring_bytes_per_rank(n, ctx.world_size, 4, "all_reduce")[ctx.rank]
    if (sent, recv) != (2 * want[0], 2 * want[1]):
        bad.append(f"bytes {(sent, recv)} != 2 x {want}")
    # the other from-scratch collectives at the same size
    p, r = ctx.world_size, ctx.rank
    sizes = C.chunk_sizes(n, p)
    rs = C.ring_reduce_scatter(ctx, x)
    want_rs = torch.empty(sizes[r])
    dist.reduce_scatter(want_rs, list(x.split(sizes)))
    if not bool(((rs.double() - want_rs.double()).abs() <= tol.split(sizes)[r]).all()):
        bad.append("ring_reduce_scatter differs from dist.reduce_scatter")
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x)
    if not torch.equal(C.ring_all_gather(ctx, x), torch.stack(parts)):
        bad.append("ring_all_gather differs from dist.all_gather")
    src = x.clone()
    dist.broadcast(src, src=p - 1)
    if not torch.equal(C.tree_broadcast(ctx, x.clone(), src=p - 1), src):
        bad.append("tree_broadcast differs from dist.broadcast")
    pieces = list(x[: n // p * p].chunk(p))  # all_to_all takes equal pieces
    got = C.all_to_all(ctx, pieces)
    want_a2a = [torch.empty_like(c) for c in pieces]
    dist.all_to_all(want_a2a, [c.clone() for c in pieces])
    if not all(torch.equal(a, b) for a, b in zip(got, want_a2a)):
        bad.append("all_to_all differs from dist.all_to_all")
    return bad


def test_more_than_a_million_elements():
    _check(launch(_big, 3, timeout=120))


# ----------------------------------------------------------------------------- groups, layouts, wrappers
def _groups_and_wrappers(ctx) -> list[str]:
    p, r = ctx.world_size, ctx.rank  # 4
    bad = []
    # sub-groups {0, 2} and {1, 3}: every rank must create both, in the same order
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    g = groups[r % 2]
    x = torch.arange(6, dtype=torch.float32) + r
    ref = x.clone()
    dist.all_reduce(ref, group=g)
    if not torch.equal(C.ring_all_reduce(ctx, x.clone(), group=g), ref):
        bad.append("ring_all_reduce on a sub-group")
    ev = [e for e in ctx.recorder.events if e["name"] == "ring_all_reduce"][-1]
    if ev["args"]["peers"] != [(r + 2) % 4]:  # the other member, as a global rank
        bad.append(f"peers should be global ranks, got {ev['args']['peers']}")
    bc = C.tree_broadcast(ctx, x.clone(), src=1, group=g)  # group rank 1 = global 2 or 3
    if not torch.equal(bc, torch.arange(6, dtype=torch.float32) + (2 + r % 2)):
        bad.append("tree_broadcast on a sub-group, src is a group rank")
    # non-contiguous input: reduced in place through the view
    m = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * (r + 1)).t()  # (4, 3), non-contiguous
    want = m.contiguous() * sum(range(1, p + 1)) / (r + 1)
    for fn in (C.ring_all_reduce, C.ring_all_reduce_pipelined, C.tree_all_reduce, C.naive_all_reduce):
        y = m.clone().t().contiguous().t()
        if not torch.equal(fn(ctx, y), want) or not torch.equal(y, want):
            bad.append(f"{fn.__name__} on a non-contiguous tensor")
    # traced built-ins: same results as torch, nominal bytes booked
    x = torch.arange(10, dtype=torch.float32) * (r + 1)
    s = float(sum(range(1, p + 1)))
    if not torch.equal(C.dist_all_reduce(ctx, x.clone()), torch.arange(10.0) * s):
        bad.append("dist_all_reduce")
    h = C.dist_all_reduce(ctx, x.clone(), op="avg", async_op=True)
    if not torch.allclose(h.wait(), torch.arange(10.0) * s / p):
        bad.append("dist_all_reduce async avg")
    sent, recv = C.ring_bytes_per_rank(10, p, 4, "all_reduce")[r]  # nominal: the ring's volume
    if ctx.recorder.comm["all_reduce"] != {"sent": 2 * sent, "recv": 2 * recv, "calls": 2}:
        bad.append(f"all_reduce nominal bytes {ctx.recorder.comm['all_reduce']}")
    if not torch.equal(C.dist_broadcast(ctx, x.clone(), src=2), torch.arange(10.0) * 3):
        bad.append("dist_broadcast")
    red = C.dist_reduce(ctx, x.clone(), dst=1)
    if r == 1 and not torch.equal(red, torch.arange(10.0) * s):
        bad.append("dist_reduce")
    ag = C.dist_all_gather(ctx, x)
    if not torch.equal(ag, torch.stack([torch.arange(10.0) * (k + 1) for k in range(p)])):
        bad.append("dist_all_gather")
    ga = C.dist_gather(ctx, x, dst=3)
    if (r == 3) != (ga is not None) or (ga is not None and not torch.equal(ga, ag)):
        bad.append("dist_gather")
    sc = C.dist_scatter(ctx, torch.empty(10), list(ag) if r == 0 else None, src=0)
    if not torch.equal(sc, x):
        bad.append("dist_scatter")
    rs = C.dist_reduce_scatter(ctx, torch.arange(10, dtype=torch.float32))
    if not torch.equal(rs, (torch.arange(10.0) * p).split(C.chunk_sizes(10, p))[r]):
        bad.append("dist_reduce_scatter (uneven divmod chunks)")
    a2a = C.dist_all_to_all(ctx, [x + j for j in range(p)])
    if not all(torch.equal(a2a[j], torch.arange(10.0) * (j + 1) + r) for j in range(p)):
        bad.append("dist_all_to_all")
    C.dist_barrier(ctx)
    # point to point: a ring of sendrecv, then isend/irecv
    left, right = (r - 1) % p, (r + 1) % p
    got = C.sendrecv(ctx, torch.full((3,), float(r)), right, torch.empty(3), left)
    if not torch.equal(got, torch.full((3,), float(left))):
        bad.append("sendrecv")
    hs = C.isend(ctx, torch.full((2,), float(r)), right)
    hr = C.irecv(ctx, torch.empty(2), left)
    if not torch.equal(hr.wait(), torch.full((2,), float(left))):
        bad.append("irecv")
    hs.wait()
    if r == 0:
        C.send(ctx, torch.ones(4), 1)
    elif r == 1:
        if not torch.equal(C.recv(ctx, torch.empty(4), 0), torch.ones(4)):
            bad.append("send/recv")
    want_p2p = {"sendrecv": (12, 12), "isend": (8, 0), "irecv": (0, 8)}
    for op, (sn, rc) in want_p2p.items():
        c = ctx.recorder.comm[op]
        if (c["sent"], c["recv"]) != (sn, rc):
            bad.append(f"{op} bytes {c}")
    # every traced op left a comm span with its bytes
    for e in ctx.recorder.events:
        if e["kind"] == "comm" and not {"op", "bytes_sent", "bytes_recv", "numel", "dtype", "peers"} <= set(
            e["args"]
        ):
            bad.append(f"span {e['name']} lacks args: {sorted(e['args'])}")
    return bad


def test_groups_layouts_wrappers_p2p():
    _check(launch(_groups_and_wrappers, 4, timeout=120))


def _steps(ctx):
    C.ring_all_reduce(ctx, torch.ones(16), trace_steps=True)
    C.tree_broadcast(ctx, torch.ones(16), trace_steps=True)
    return None


def test_trace_steps_and_span():
    res = launch(_steps, 4)
    ring = res.spans(name="ring_all_reduce", rank=2)
    assert len(ring) == 1 and ring[0]["args"]["steps"] == 6  # 2(p-1)
    assert ring[0]["args"]["bytes_sent"] == 2 * 3 * 16  # 2(p-1)/p * 64 B
    assert ring[0]["args"]["peers"] == [1, 3]
    steps = [e for e in res.spans(rank=2, kind="comm") if e["args"].get("parent") == "ring_all_reduce"]
    assert [e["name"] for e in steps] == ["ring_all_reduce:reduce-scatter"] * 3 + [
        "ring_all_reduce:all-gather"
    ] * 3
    assert len(steps) == 6 and all(
        ring[0]["start"] <= e["start"] <= e["end"] <= ring[0]["end"] for e in steps
    )
    assert res.spans(name="tree_broadcast", rank=0)[0]["args"]["steps"] == 2  # log2(4) sends from the root
    assert len(res.spans(name="ring_all_reduce:add", rank=2, kind="compute")) == 3  # one add per reduce step
    assert res.comm_bytes[0]["by_op"]["ring_all_reduce"]["sent"] == 96
    assert set(res.comm_bytes[0]["by_op"]) == {
        "ring_all_reduce",
        "tree_broadcast",
    }  # steps are drawn, not double counted


# ----------------------------------------------------------------------------- errors
def _mismatch(ctx, fn_name, what):
    n = 8 + (1 if (what == "numel" and ctx.rank == 1) else 0)
    dtype = torch.float64 if (what == "dtype" and ctx.rank == 1) else torch.float32
    x = torch.ones(n, dtype=dtype)
    getattr(C, fn_name)(ctx, [x] * ctx.world_size if fn_name == "all_to_all" else x)


@pytest.mark.parametrize(
    "fn_name,what",
    [
        ("ring_all_reduce", "numel"),
        ("ring_all_gather", "dtype"),
        ("dist_all_reduce", "numel"),
        ("ring_reduce_scatter", "numel"),
        ("tree_broadcast", "dtype"),
        ("tree_reduce", "numel"),
        ("all_to_all", "numel"),
    ],
)
def test_mismatched_shapes_are_a_clear_error(fn_name, what):
    with pytest.raises(RankError) as info:
        launch(_mismatch, 3, fn_name, what, timeout=30)
    msg = str(info.value)
    assert info.value.exc_type == "ValueError"
    assert "made different calls" in msg and "rank 1: " in msg
    assert ("(9,)" in msg) if what == "numel" else ("float64" in msg)


def _bad_dtype(ctx, fn_name):
    getattr(C, fn_name)(ctx, torch.arange(4))  # int64


@pytest.mark.parametrize(
    "fn_name", ["ring_all_reduce", "ring_reduce_scatter", "tree_reduce", "naive_all_reduce"]
)
def test_unsupported_dtype_is_a_type_error(fn_name):
    with pytest.raises(RankError) as info:
        launch(_bad_dtype, 2, fn_name, timeout=30)
    assert info.value.exc_type == "TypeError"
    assert "tensor has dtype torch.int64" in str(info.value) and "float32, float64, bfloat16" in str(
        info.value
    )


def _bad_args(ctx) -> list[str]:
    bad = []
    for call, kind, text in [
        (lambda: C.ring_all_reduce(ctx, torch.ones(3), op="prod"), ValueError, "op must be one of"),
        (lambda: C.tree_broadcast(ctx, torch.ones(3), src=2), ValueError, "src must be a rank"),
        (lambda: C.tree_reduce(ctx, torch.ones(3), dst=-1), ValueError, "dst must be a rank"),
        (lambda: C.all_to_all(ctx, [torch.ones(2)]), ValueError, "one tensor per rank"),
        (lambda: C.all_to_all(ctx, [torch.ones(2), torch.ones(3)]), ValueError, "same shape"),
        (lambda: C.all_to_all(ctx, torch.ones(2)), TypeError, "list of torch.Tensor"),
        (lambda: C.ring_all_gather(ctx, [1, 2]), TypeError, "tensor must be a torch.Tensor"),
        (
            lambda: C.ring_all_reduce_pipelined(ctx, torch.ones(3), segment_bytes=0),
            ValueError,
            "segment_bytes",
        ),
        (lambda: C.send(ctx, torch.ones(1), dst=5), ValueError, "dst must be a rank"),
    ]:
        try:
            call()
            bad.append(f"no error for: {text}")
        except kind as e:
            if text not in str(e):
                bad.append(f"message {e!s} lacks {text!r}")
    return bad


def test_bad_arguments():
    _check(launch(_bad_args, 2, timeout=30))


def _unchecked(ctx):
    x = torch.arange(5.0) * ctx.rank
    return C.ring_all_reduce(ctx, x.clone()), C.ring_all_gather(ctx, x)


def test_check_shapes_off_still_correct():
    res = launch(_unchecked, 3, check_shapes=False)
    for out, ag in res.values:
        assert torch.equal(out, torch.arange(5.0) * 3)
        assert torch.equal(ag, torch.stack([torch.arange(5.0) * k for k in range(3)]))


# ----------------------------------------------------------------------------- the script (torchrun)
def test_script_under_torchrun(tmp_path):
    """SLOW-ish (~10 s): two spawned processes each import torch."""
    trace = tmp_path / "collectives.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        str(torchrun),
        "--nproc-per-node",
        "2",
        "-m",
        "parallel_lab.scripts.collectives",
        "--trace",
        str(trace),
    ]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all collectives match torch.distributed" in out.stdout
    res = RunResult.load(str(trace))
    assert res.world_size == 2 and res.backend == "gloo"
    assert {e["name"] for e in res.timeline} >= {"ring_all_reduce", "tree_broadcast", "all_to_all"}
    assert res.comm_bytes[1]["by_op"]["ring_all_reduce"]["sent"] > 0


def _peak_after_tree(ctx):
    C.tree_all_reduce(ctx, torch.ones(10_000))  # the root keeps one receive buffer of 40 kB
    return ctx.memory.peak()


def test_receive_buffers_count_as_comm_memory():
    peaks = launch(_peak_after_tree, 2, track_memory=True).values
    assert peaks[0]["comm"] >= 40_000  # rank 0 is the root: it receives into a buffer
    assert peaks[1]["comm"] == 0  # rank 1 only sends up and receives in place


def test_script_under_accelerate_with_use_cpu(tmp_path):
    """The README's other CPU form: no config file, ACCELERATE_USE_CPU=true and --multi_gpu, so
    accelerate starts N gloo processes (its --cpu flag alone would start one)."""
    trace = tmp_path / "collectives.json"
    accelerate = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "4",  # exactly the README's command
           "-m", "parallel_lab.scripts.collectives", "--trace", str(trace)]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "all collectives match torch.distributed" in out.stdout
    res = RunResult.load(str(trace))
    assert res.world_size == 4 and res.backend == "gloo"
    assert {e["rank"] for e in res.timeline} == {0, 1, 2, 3}


def _mismatched_call(ctx, kind):
    t = torch.ones(6)
    if kind == "op":  # a sum on one rank, a max on the other
        return C.ring_all_reduce(ctx, t, op="sum" if ctx.rank == 0 else "max")
    if kind == "algorithm":  # a ring on one rank, a tree on the other
        return C.ring_all_reduce(ctx, t) if ctx.rank == 0 else C.tree_all_reduce(ctx, t)
    if kind == "root":
        return C.tree_broadcast(ctx, t, src=ctx.rank)
    if kind == "dtype":
        return C.ring_all_reduce(ctx, t if ctx.rank == 0 else t.double())
    return C.ring_all_reduce(ctx, t if ctx.rank == 0 else torch.ones(7))


@pytest.mark.parametrize(
    "kind, says",
    [("op", "ring_all_reduce sum of float32 (6,); rank 1: ring_all_reduce max"),
     ("algorithm", "rank 0: ring_all_reduce sum of float32 (6,); rank 1: tree_all_reduce sum"),
     ("root", "root=0 of float32 (6,); rank 1: tree_broadcast root=1"),
     ("dtype", "rank 1: ring_all_reduce sum of float64"),
     ("shape", "rank 1: ring_all_reduce sum of float32 (7,)")],
)  # fmt: skip
def test_mismatched_collectives_are_named_on_every_rank(kind, says):
    """Before a collective the ranks compare fingerprints: a mismatch is an error naming each rank's
    call, not a silent disagreement, a gloo abort or a hang."""
    with pytest.raises(RankError) as info:
        launch(_mismatched_call, 2, kind, timeout=30)
    assert "made different calls" in str(info.value) and says in str(info.value), str(info.value)


_DETAIL_PROBE = """
import json, sys, torch, torch.distributed as dist
from parallel_lab import LaunchTimeout, RankError, launch
from parallel_lab import comms as C

def builtin(ctx, kind):  # torch's own collectives, as a learner calls them
    t, r = torch.ones(6), ctx.rank
    if kind == "reduce op":
        dist.all_reduce(t, op=dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX)
    elif kind == "collective":
        dist.all_reduce(t) if r == 0 else dist.broadcast(t, 0)
    elif kind == "root":
        dist.broadcast(t, src=r)
    elif kind == "dtype":
        dist.all_reduce(t if r == 0 else t.double())
    else:
        dist.all_reduce(t if r == 0 else torch.ones(7))

def traced(ctx, kind):  # the same calls through the lab's comms layer
    t, r = torch.ones(6), ctx.rank
    if kind == "reduce op":
        C.dist_all_reduce(ctx, t, op="sum" if r == 0 else "max")
    elif kind == "collective":
        C.dist_all_reduce(ctx, t) if r == 0 else C.dist_broadcast(ctx, t, 0)
    elif kind == "root":
        C.dist_broadcast(ctx, t, src=r)
    elif kind == "dtype":
        C.dist_all_reduce(ctx, t if r == 0 else t.double())
    else:
        C.dist_all_reduce(ctx, t if r == 0 else torch.ones(7))

fn, check = (builtin, False) if sys.argv[1] == "torch" else (traced, True)
out = {}
for kind in ["reduce op", "collective", "root", "dtype", "shape"]:
    try:
        launch(fn, 2, kind, timeout=8, check_shapes=check)
        out[kind] = "silent"
    except RankError as e:
        out[kind] = "named" if ("mismatch" in str(e) or "different calls" in str(e)) else "crash"
    except LaunchTimeout:
        out[kind] = "hang"
print(json.dumps(out))
"""


@pytest.mark.slow
def test_fingerprint_check_catches_what_torch_detail_debug_misses(tmp_path):
    """torch's TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the process group and compares each collective's
    type, shapes and dtypes across ranks. It does not compare the reduce op or the root: a sum on one
    rank and a max on the other returns silently, two roots hang. The lab's fingerprint compares those
    too, so every kind of mismatch is named."""
    script = tmp_path / "probe.py"
    script.write_text(_DETAIL_PROBE)

    def run(which: str, **env: str) -> dict:
        out = subprocess.run([sys.executable, str(script), which], capture_output=True, text=True,
                             timeout=300, env={**os.environ, **env})  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # both probes at once: each mostly waits out its hang's timeout
        theirs = pool.submit(run, "torch", TORCH_DISTRIBUTED_DEBUG="DETAIL")
        ours = run("lab")
        torch_detail = theirs.result()
    assert torch_detail == {"reduce op": "silent", "collective": "named", "root": "hang", "dtype": "named",
                            "shape": "named"}, torch_detail  # fmt: skip
    assert ours == dict.fromkeys(torch_detail, "named"), ours


@pytest.mark.parametrize("mechanism", ["allocator", "dispatch"])
def test_a_comm_thread_jobs_scratch_is_counted_by_the_submitters_tracker(mechanism):
    """The dispatch mode (how a tracker sees allocations on a GPU) is per thread; a CommThread job
    runs under its submitter's, so both mechanisms see the job's scratch, as on a CPU."""
    from parallel_lab.comms import CommThread
    from parallel_lab.runtime.memory import MemoryTracker

    thread = CommThread()

    def job():
        scratch = torch.ones(4096)  # 16 KiB made and freed on the comm thread
        return float(scratch.sum())

    with MemoryTracker(mechanism=mechanism) as mem:
        assert thread.submit(job).wait() == 4096.0
        assert sum(mem.peak().values()) >= 16384, mem.peak()
    after = thread.submit(job)  # no tracker on the submitting thread now: none is entered there
    assert after.wait() == 4096.0 and sum(mem.peak().values()) < 2 * 16384

"""Lesson 01's exercises: the reference solution and other right answers pass with one line; wrappers of the
lab's and torch's collectives (public and private), answer tables logged in an earlier grade run and wrong
algorithms fail, each with a message naming what differed; posting orders that gloo lets through but NCCL
would hang on fail; the check's own torus all-reduce passes the check it grades against."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest
from solution_code import _check_cell, edit, fails_saying, run_check, solution_namespace

P = "import torch\nimport torch.distributed as dist\nfrom parallel_lab import comms\n"

FLAT_RING = (
    P
    + """
def torus_all_reduce(ctx, t, rows):
    p, r = ctx.world_size, ctx.rank
    chunks = list(t.view(-1).split(comms.chunk_sizes(t.numel(), p)))
    for s in range(p - 1):
        k = (r - s - 2) % p
        incoming = torch.empty_like(chunks[k])
        comms.sendrecv(ctx, chunks[(r - s - 1) % p], (r + 1) % p, incoming, (r - 1) % p)
        chunks[k] += incoming
    for s in range(p - 1):
        comms.sendrecv(ctx, chunks[(r - s) % p], (r + 1) % p, chunks[(r - s - 1) % p], (r - 1) % p)
    return t
"""
)
TO_EVERYBODY = (
    P
    + """
def torus_all_reduce(ctx, t, rows):
    p, r = ctx.world_size, ctx.rank
    total = t.clone()
    for s in range(1, p):
        got = torch.empty_like(t)
        comms.sendrecv(ctx, t, (r + s) % p, got, (r - s) % p)
        total += got
    return t.copy_(total)
"""
)
RAW_TORCH_P2P = (
    P
    + """
def torus_all_reduce(ctx, t, rows):
    p, r = ctx.world_size, ctx.rank
    total = t.clone()
    for s in range(1, p):
        got = torch.empty_like(t)
        if t.numel():
            w = dist.isend(t, (r + s) % p)
            dist.recv(got, (r - s) % p)
            w.wait()
        total += got
    return t.copy_(total)
"""
)
COLUMN_PHASES = (
    "    reduce_scatter(shard, col, i)  # the column adds its rows' partial sums of chunk j...\n"
    "    all_gather(shard, col, i)  # ...and every rank of the column gets the finished chunk j\n"
)
ALL_PHASES = (
    "    reduce_scatter(chunks, row, j)  # chunk j: the sum over my row\n"
    "    shard = list(chunks[j].split(comms.chunk_sizes(chunks[j].numel(), rows)))  # views into chunk j\n"
    + COLUMN_PHASES
    + "    all_gather(chunks, row, j)  # the row shares its finished chunks\n"
)
WHOLE_TWICE = (
    "    reduce_scatter(chunks, row, j)\n    all_gather(chunks, row, j)\n"
    "    down = list(tensor.view(-1).split(comms.chunk_sizes(tensor.numel(), rows)))\n"
    "    reduce_scatter(down, col, i)\n    all_gather(down, col, i)\n"
)
# the two-level scheme with every ring replaced by messages straight to each member: fine while a row or
# column has at most 3 ranks (each member is a neighbour), not on the 1x4 and 4x1 grids
DIRECT = edit(
    "01",
    "torus_all_reduce",
    """    def reduce_scatter(chunks, ring, me):  # the lesson's ring; position k ends with chunk k summed
        q = len(ring)
        for s in range(q - 1):
            k = (me - s - 2) % q
            incoming = torch.empty_like(chunks[k])
            comms.sendrecv(ctx, chunks[(me - s - 1) % q], ring[(me + 1) % q], incoming, ring[(me - 1) % q])
            chunks[k] += incoming

    def all_gather(chunks, ring, me):
        q = len(ring)
        for s in range(q - 1):
            comms.sendrecv(ctx, chunks[(me - s) % q], ring[(me + 1) % q], chunks[(me - s - 1) % q],
                           ring[(me - 1) % q])  # fmt: skip
""",
    """    def reduce_scatter(chunks, ring, me):  # chunk k straight to member k
        q = len(ring)
        for s in range(1, q):
            dst, src = (me + s) % q, (me - s) % q
            got = torch.empty_like(chunks[me])
            comms.sendrecv(ctx, chunks[dst], ring[dst], got, ring[src])
            chunks[me] += got

    def all_gather(chunks, ring, me):  # my chunk straight to every member
        q = len(ring)
        for s in range(1, q):
            dst, src = (me + s) % q, (me - s) % q
            comms.sendrecv(ctx, chunks[me], ring[dst], chunks[src], ring[src])
""",
)
# the column's phase as a chain: sum down to row 0, then send the result back up; the right total of bytes,
# every message to a neighbour, but the ranks in the middle of a column of 3 or 4 send twice their share
CHAIN = edit(
    "01",
    "torus_all_reduce",
    COLUMN_PHASES,
    """    x = chunks[j]
    if rows > 1 and x.numel():
        if i < rows - 1:
            got = torch.empty_like(x)
            comms.recv(ctx, got, col[i + 1])
            x += got
        if i > 0:
            comms.send(ctx, x, col[i - 1])
            comms.recv(ctx, x, col[i - 1])
        if i < rows - 1:
            comms.send(ctx, x, col[i + 1])
""",
)
# a step's send and receive posted as two batches: gloo finishes them, NCCL would not
SEPARATE_POSTS = edit(
    "01",
    "torus_all_reduce",
    "            comms.sendrecv(ctx, chunks[(me - s - 1) % q], ring[(me + 1) % q], incoming, ring[(me - 1) % q])",
    "            h = comms.isend(ctx, chunks[(me - s - 1) % q], ring[(me + 1) % q])\n"
    "            comms.irecv(ctx, incoming, ring[(me - 1) % q]).wait()\n"
    "            h.wait()",
)
GATHER_SEPARATE_POSTS = edit(
    "01",
    "ring_all_gather_v",
    "        comms.sendrecv(ctx, pieces[(r - s) % p], (r + 1) % p, pieces[(r - s - 1) % p], (r - 1) % p)",
    "        h = comms.isend(ctx, pieces[(r - s) % p], (r + 1) % p)\n"
    "        comms.irecv(ctx, pieces[(r - s - 1) % p], (r - 1) % p).wait()\n"
    "        h.wait()",
)
A2A_SEPARATE_POSTS = (
    P
    + """
def all_to_all_v(ctx, tensors):
    p, r = ctx.world_size, ctx.rank
    out = [None] * p
    out[r] = tensors[r].clone()
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        n_in = torch.empty(1, dtype=torch.int64, device=ctx.device)
        hs = comms.isend(ctx, torch.tensor([tensors[dst].numel()], device=ctx.device), dst)
        hr = comms.irecv(ctx, n_in, src)
        hs.wait(); hr.wait()
        out[src] = tensors[dst].new_empty(int(n_in.item()))
        hs = comms.isend(ctx, tensors[dst].contiguous(), dst)
        hr = comms.irecv(ctx, out[src], src)
        hs.wait(); hr.wait()
    return out
"""
)
GATHER_TO_EVERYBODY = (
    P
    + """
def ring_all_gather_v(ctx, tensor, sizes):
    p, r = ctx.world_size, ctx.rank
    out = tensor.new_empty(sum(sizes))
    pieces = list(out.split(list(sizes)))
    pieces[r].copy_(tensor)
    for s in range(1, p):
        comms.sendrecv(ctx, tensor, (r + s) % p, pieces[(r - s) % p], (r - s) % p)
    return out
"""
)
OWN_LENGTH = (
    P
    + """
def all_to_all_v(ctx, tensors):
    p, r = ctx.world_size, ctx.rank
    out = [t.clone() for t in tensors]
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        out[src] = torch.empty_like(tensors[src])
        comms.sendrecv(ctx, tensors[dst], dst, out[src], src)
    return out
"""
)
SENDS_FIRST = (
    P
    + """
def all_to_all_v(ctx, tensors):
    p, r = ctx.world_size, ctx.rank
    out = [None] * p
    out[r] = tensors[r].clone()
    for j in range(p):
        if j != r:
            comms.send(ctx, torch.tensor([tensors[j].numel()]), j)
            comms.send(ctx, tensors[j], j)
    for j in range(p):
        if j != r:
            n = comms.recv(ctx, torch.empty(1, dtype=torch.int64), j)
            out[j] = comms.recv(ctx, tensors[j].new_empty(int(n)), j)
    return out
"""
)
TRANSPOSED_BYTES = (
    P
    + """
def torus_bytes(n, rows, cols, rank, itemsize):
    i, j = divmod(rank, cols)
    c = comms.chunk_sizes(n, rows)
    d = comms.chunk_sizes(c[i], cols)
    return ((n - c[i]) + (n - c[(i + 1) % rows]) + (c[i] - d[j]) + (c[i] - d[(j + 1) % cols])) * itemsize
"""
)
WORLD = "dist.group.WORLD"

WRONG = [
    # ---- exercise 1: torus_all_reduce
    ("check_torus_all_reduce", "wraps the lab's ring",
     P + "def torus_all_reduce(ctx, t, rows):\n    return comms.ring_all_reduce(ctx, t)\n", "switched off"),
    ("check_torus_all_reduce", "wraps the lab's ring, imported first",
     P + "from parallel_lab.comms import ring_all_reduce as mine\n"
     "def torus_all_reduce(ctx, t, rows):\n    return mine(ctx, t)\n", "switched off"),
    ("check_torus_all_reduce", "wraps torch",
     P + "def torus_all_reduce(ctx, t, rows):\n    dist.all_reduce(t)\n    return t\n", "switched off"),
    ("check_torus_all_reduce", "wraps torch's process group",
     P + f"def torus_all_reduce(ctx, t, rows):\n    {WORLD}.allreduce([t]).wait()\n    return t\n", "switched off"),
    ("check_torus_all_reduce", "torch's private functional collective",
     P + "import torch.distributed._functional_collectives as fc\n"
     f"def torus_all_reduce(ctx, t, rows):\n    return t.copy_(fc.all_reduce(t, 'sum', {WORLD}))\n", "switched off"),
    ("check_torus_all_reduce", "torch's c10d operator",
     P + "def torus_all_reduce(ctx, t, rows):\n"
     f"    out = torch.ops._c10d_functional.all_reduce(t, 'sum', {WORLD}.group_name)\n"
     "    return t.copy_(torch.ops._c10d_functional.wait_tensor(out))\n", "switched off"),
    ("check_torus_all_reduce", "torch's autograd collective",
     P + "import torch.distributed.nn.functional as F\n"
     "def torus_all_reduce(ctx, t, rows):\n    return t.copy_(F.all_reduce(t))\n", "switched off"),
    ("check_torus_all_reduce", "runs the check's own torus",
     P + "from parallel_lab.grading.checks.collectives import _torus_all_reduce\n"
     "def torus_all_reduce(ctx, t, rows):\n    return _torus_all_reduce(ctx, t, rows)\n", "switched off"),
    ("check_torus_all_reduce", "torch's autograd collective, imported first",
     P + "from torch.distributed.nn.functional import all_reduce as ar\n"
     "def torus_all_reduce(ctx, t, rows):\n    return t.copy_(ar(t))\n", "switched off"),
    ("check_torus_all_reduce", "the lab's tensor-parallel all-reduce",
     P + "from parallel_lab.tensor_parallel import operators\n"
     "def torus_all_reduce(ctx, t, rows):\n    return operators.all_reduce(ctx, t, impl='builtin')\n",
     "tensor_parallel.operators.all_reduce is switched off"),
    ("check_torus_all_reduce", "the lab's ZeRO rings",
     P + "from parallel_lab.zero import comm\n"
     "def torus_all_reduce(ctx, t, rows):\n    p = ctx.world_size\n    c = comms.chunk_sizes(t.numel(), p)\n"
     "    cuts = [(sum(c[:k]), sum(c[:k + 1])) for k in range(p)]\n"
     "    comm.ring_reduce_scatter_pieces(ctx, t, cuts, 0)\n    return t\n",
     "zero.comm.ring_reduce_scatter_pieces is switched off"),
    ("check_torus_all_reduce", "the flat ring over all p ranks", FLAT_RING, "not its torus neighbour"),
    ("check_torus_all_reduce", "sends straight to every member of its row and column", DIRECT, "but not next to it"),
    ("check_torus_all_reduce", "a chain through each column", CHAIN, "more than its share"),
    ("check_torus_all_reduce", "each step's send and receive posted on their own", SEPARATE_POSTS,
     "would never finish"),
    ("check_torus_all_reduce", "row phases only", edit("01", "torus_all_reduce", COLUMN_PHASES, ""),
     "sum over this rank's row only"),
    ("check_torus_all_reduce", "whole tensors to everybody", TO_EVERYBODY, "not its torus neighbour"),
    ("check_torus_all_reduce", "all-reduces the whole tensor along rows, then along columns",
     edit("01", "torus_all_reduce", ALL_PHASES, WHOLE_TWICE),
     "only that shard crosses the column"),
    ("check_torus_all_reduce", "adds into the wrong chunk",
     edit("01", "torus_all_reduce", "k = (me - s - 2) % q", "k = (me - s - 1) % q"),
     "posted a receive buffer of"),
    ("check_torus_all_reduce", "untraced torch messages", RAW_TORCH_P2P, "sent nothing through parallel_lab.comms"),
    ("check_torus_all_reduce", "crashes on more than one rank",
     "def torus_all_reduce(ctx, t, rows):\n    return t.view(ctx.world_size, -1)\n", "your function raised RuntimeError"),
    # ---- exercise 2: ring_all_gather_v
    ("check_ring_all_gather_v", "wraps the lab's ring, padded",
     P + "def ring_all_gather_v(ctx, t, sizes):\n    m = max(sizes)\n"
     "    pad = torch.cat([t, t.new_zeros(m - t.numel())])\n    rows = comms.ring_all_gather(ctx, pad)\n"
     "    return torch.cat([rows[k, :n] for k, n in enumerate(sizes)])\n", "switched off"),
    ("check_ring_all_gather_v", "wraps torch, padded",
     P + "def ring_all_gather_v(ctx, t, sizes):\n    m = max(sizes)\n"
     "    pad = torch.cat([t, t.new_zeros(m - t.numel())])\n    rows = [torch.empty_like(pad) for _ in sizes]\n"
     "    dist.all_gather(rows, pad)\n    return torch.cat([rows[k][:n] for k, n in enumerate(sizes)])\n",
     "switched off"),
    ("check_ring_all_gather_v", "torch's private functional collective",
     P + "import torch.distributed._functional_collectives as fc\ndef ring_all_gather_v(ctx, t, sizes):\n"
     "    m = max(sizes)\n    pad = torch.cat([t, t.new_zeros(m - t.numel())])\n"
     f"    rows = fc.all_gather_tensor(pad, 0, {WORLD}).view(len(sizes), m)\n"
     "    return torch.cat([rows[k, :n] for k, n in enumerate(sizes)])\n", "switched off"),
    ("check_ring_all_gather_v", "the lab's ZeRO all-gather of uneven pieces",
     P + "from parallel_lab.zero import comm\ndef ring_all_gather_v(ctx, t, sizes):\n"
     "    out = t.new_empty(sum(sizes))\n    cuts = [(sum(sizes[:k]), sum(sizes[:k + 1])) for k in range(len(sizes))]\n"
     "    comm.all_gather_pieces(ctx, t, cuts, out, 0).wait()\n    return out\n",
     "zero.comm.all_gather_pieces is switched off"),
    ("check_ring_all_gather_v", "each step's send and receive posted on their own", GATHER_SEPARATE_POSTS,
     "would never finish"),
    ("check_ring_all_gather_v", "every receive buffer sized by the rank's own piece",
     edit("01", "ring_all_gather_v",
          "        comms.sendrecv(ctx, pieces[(r - s) % p], (r + 1) % p, pieces[(r - s - 1) % p], (r - 1) % p)",
          "        buf = torch.empty_like(tensor)\n"
          "        comms.sendrecv(ctx, pieces[(r - s) % p], (r + 1) % p, buf, (r - 1) % p)\n"
          "        pieces[(r - s - 1) % p].copy_(buf)"),
     "not the size of this rank's own piece"),
    ("check_ring_all_gather_v", "forwards its own piece every step",
     edit("01", "ring_all_gather_v", "pieces[(r - s) % p], (r + 1) % p", "pieces[r], (r + 1) % p"),
     "holds rank"),
    ("check_ring_all_gather_v", "sends straight to everybody", GATHER_TO_EVERYBODY,
     "sends only to its right neighbour"),
    # ---- exercise 3: all_to_all_v
    ("check_all_to_all_v", "wraps the lab's, padded",
     P + "def all_to_all_v(ctx, tensors):\n    m = 600\n"
     "    pads = [torch.cat([t, t.new_zeros(m - t.numel())]) for t in tensors]\n"
     "    return comms.all_to_all(ctx, pads)\n", "switched off"),
    ("check_all_to_all_v", "wraps torch",
     P + "def all_to_all_v(ctx, tensors):\n    out = [torch.empty(0) for _ in tensors]\n"
     "    dist.all_to_all(out, list(tensors))\n    return out\n", "switched off"),
    ("check_all_to_all_v", "torch's private functional collective",
     P + "import torch.distributed._functional_collectives as fc\ndef all_to_all_v(ctx, tensors):\n"
     f"    fc.all_to_all_single(torch.cat(list(tensors)), None, None, {WORLD})\n    return list(tensors)\n",
     "switched off"),
    ("check_all_to_all_v", "wraps the lab's MoE all-to-all of uneven pieces",
     P + "from parallel_lab.moe.expert_parallel import all_to_all_v as lab\ndef all_to_all_v(ctx, tensors):\n"
     "    lens = lab(ctx, [torch.tensor([t.numel()]) for t in tensors], [1] * ctx.world_size)\n"
     "    return lab(ctx, list(tensors), [int(n.item()) for n in lens])\n",
     "moe.expert_parallel.all_to_all_v is switched off"),
    ("check_all_to_all_v", "each step's sends and receives posted on their own", A2A_SEPARATE_POSTS,
     "would never finish"),
    ("check_all_to_all_v", "assumes the receiver's own length", OWN_LENGTH, "cannot know a piece's length"),
    ("check_all_to_all_v", "sends its own piece through the network",
     edit("01", "all_to_all_v", "out[r] = tensors[r].clone()",
          "out[r] = comms.sendrecv(ctx, tensors[r], r, torch.empty_like(tensors[r]), r)"),
     "never travels"),
    ("check_all_to_all_v", "every rank sends before it receives, with blocking sends", SENDS_FIRST,
     "wait for each other forever"),
    ("check_all_to_all_v", "returns the pieces in the wrong order",
     edit("01", "all_to_all_v", "    return out", "    return out[::-1]"), "the piece from rank 0"),
    # ---- exercise 4: torus_bytes
    ("check_torus_bytes", "the average for every rank",
     "def torus_bytes(n, rows, cols, rank, itemsize):\n"
     "    return 2 * (rows * cols - 1) * n * itemsize / (rows * cols)\n", "is the average over ranks"),
    ("check_torus_bytes", "the flat ring's count",
     P + "def torus_bytes(n, rows, cols, rank, itemsize):\n    p = rows * cols\n    c = comms.chunk_sizes(n, p)\n"
     "    return (2 * n - c[rank] - c[(rank + 1) % p]) * itemsize\n", "in one ring through all"),
    ("check_torus_bytes", "the column's rings outside, the row's inside", TRANSPOSED_BYTES,
     "the torus all-reduce sent"),
    ("check_torus_bytes", "the shard taken as n / cols",
     edit("01", "torus_bytes", "d = comms.chunk_sizes(c[j], rows)", "d = comms.chunk_sizes(n // cols, rows)"),
     "the torus all-reduce sent"),
    ("check_torus_bytes", "reads the lab's formula",
     "from parallel_lab.comms import cost\ndef torus_bytes(n, rows, cols, rank, itemsize):\n"
     "    return cost.ring_bytes_per_rank(n, rows * cols, itemsize, 'all_reduce')[rank][0]\n", "switched off"),
    ("check_torus_bytes", "measures the check's own torus instead of predicting",
     "import parallel_lab as pl\nfrom parallel_lab.grading.checks.collectives import _measure_torus\n"
     "def torus_bytes(n, rows, cols, rank, itemsize):\n"
     "    run = pl.launch(_measure_torus, rows * cols, ((rows, cols),), [(n, itemsize)])\n"
     "    return run.values[rank][0][0]\n", "switched off"),
    ("check_torus_bytes", "torch's cost model",
     "from torch.distributed.tensor._collective_utils import allreduce_cost\n"
     "def torus_bytes(n, rows, cols, rank, itemsize):\n    return allreduce_cost(n * itemsize, None, 0)\n",
     "switched off"),
]  # fmt: skip

CHECKS = ["check_torus_all_reduce", "check_ring_all_gather_v", "check_all_to_all_v", "check_torus_bytes"]


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capfd):
    run_check("01", check)
    out, err = capfd.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("check_")]
    assert lines == [lines[0]] and lines[0].startswith(f"{check} passed"), out
    assert not err, err


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[f"{w[0]}-{w[1]}" for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("01", check, label, source, want)


# other ways the text allows: a step's messages posted together as one batch (isendrecv, post_batch)
RIGHT = [
    ("check_torus_all_reduce", "each step posted with isendrecv",
     edit("01", "torus_all_reduce",
          "            comms.sendrecv(ctx, chunks[(me - s - 1) % q], ring[(me + 1) % q], incoming, ring[(me - 1) % q])",
          "            comms.isendrecv(ctx, chunks[(me - s - 1) % q], ring[(me + 1) % q], incoming,\n"
          "                            ring[(me - 1) % q]).wait()")),
    ("check_ring_all_gather_v", "each step posted as one batch",
     edit("01", "ring_all_gather_v",
          "        comms.sendrecv(ctx, pieces[(r - s) % p], (r + 1) % p, pieces[(r - s - 1) % p], (r - 1) % p)",
          "        sends, recvs = comms.post_batch(ctx, [(pieces[(r - s) % p], (r + 1) % p, 0)],\n"
          "                                        [(pieces[(r - s - 1) % p], (r - 1) % p, 0)])\n"
          "        for h in [*sends, *recvs]:\n            h.wait()")),
    ("check_all_to_all_v", "every step's two exchanges with isendrecv",
     P + """
def all_to_all_v(ctx, tensors):
    p, r = ctx.world_size, ctx.rank
    out = [None] * p
    out[r] = tensors[r].clone()
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        n_in = torch.empty(1, dtype=torch.int64, device=ctx.device)
        comms.isendrecv(ctx, torch.tensor([tensors[dst].numel()]), dst, n_in, src).wait()
        out[src] = tensors[dst].new_empty(int(n_in.item()))
        comms.isendrecv(ctx, tensors[dst].contiguous(), dst, out[src], src).wait()
    return out
"""),
]  # fmt: skip


@pytest.mark.parametrize(("check", "label", "source"), RIGHT, ids=[f"{w[0]}-{w[1]}" for w in RIGHT])
def test_another_right_answer_passes(check, label, source, capfd):
    run_check("01", check, source)
    out, err = capfd.readouterr()
    assert f"{check} passed" in out and not err, (label, out, err)


def test_an_unfinished_exercise_stays_not_implemented_and_a_non_function_is_refused():
    from parallel_lab.grading.checks import collectives as K

    def todo(ctx, tensor, rows):
        raise NotImplementedError("write the torus")

    with pytest.raises(NotImplementedError):
        K.check_torus_all_reduce(todo)
    with pytest.raises(TypeError, match="must be a function"):
        K.check_all_to_all_v(42)


def test_the_checks_own_torus_passes_the_check_it_grades_against(capsys):
    """The reference measured in check 4 is itself a right answer to exercise 1 (a copy: the original is
    switched off while a learner's function runs, as all of the check's helpers are)."""
    from parallel_lab.grading.checks import collectives as K

    g = dict(vars(K))  # copies of the reference and its helpers, outside the module being switched off
    for name in ("_torus_all_reduce", "_torus", "_ring_reduce_scatter", "_ring_all_gather"):
        g[name] = types.FunctionType(getattr(K, name).__code__, g, name)
    copy = g["_torus_all_reduce"]
    K.check_torus_all_reduce(copy)
    assert capsys.readouterr().out.startswith("check_torus_all_reduce passed")


def test_the_per_rank_bound_holds_for_either_order_and_the_total_is_the_rings():
    """The check's bound on one rank's bytes is never below what the reference (either level first) sends,
    and all ranks together send 2(p-1)n elements, whatever the splits."""
    ns = solution_namespace("01")
    from parallel_lab.grading.checks import collectives as K

    for rows, cols in ((1, 1), (1, 3), (2, 1), (2, 2), (2, 3), (3, 2), (3, 4), (4, 3)):
        for n in (0, 1, 2, 5, 7, 13, 100, 1001):
            for order in ("row first", "column first"):
                a, b = (rows, cols) if order == "row first" else (cols, rows)
                per = [ns["torus_bytes"](n, a, b, r, 1) for r in range(rows * cols)]
                assert max(per) <= K._torus_bound(n, rows, cols), (rows, cols, n, order)
                assert sum(per) == 2 * (rows * cols - 1) * n, (rows, cols, n, order)


# ----------------------------------------------------------------------------- cases drawn at grade time
def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("01", check), f"<check cell {check}>", "exec"), ns)  # noqa: S102


# Every rank logs (its inputs -> its answer) to a file in one grade run and answers from that file in the
# next, without sending a message: the next run's inputs are drawn anew, so the table has no answer.
TABLE = """
import hashlib, json, os
_real = {name}
def _key(ctx, *parts):
    h = hashlib.sha1(repr([p.float().cpu().tolist() if hasattr(p, "float") else
                           [q.float().cpu().tolist() for q in p] if isinstance(p, list) and p and hasattr(p[0], "float")
                           else p for p in parts]).encode())
    return h.hexdigest() + f"-{{ctx.world_size}}-{{ctx.rank}}"
def {name}(ctx, *args):
    path = f"{{_TABLE}}-{{ctx.world_size}}-{{ctx.rank}}.json"
    table = json.load(open(path)) if os.path.exists(path) else {{}}
    key = _key(ctx, *args)
    if _LOGGING:
        out = _real(ctx, *args)
        table[key] = [t.float().cpu().tolist() for t in out] if isinstance(out, list) else out.float().cpu().tolist()
        json.dump(table, open(path, "w"))
        return out
    first = args[0]
    if key not in table:
        return first
    got = table[key]
    if isinstance(first, list):
        return [torch.tensor(v, dtype=first[0].dtype) for v in got]
    return torch.tensor(got, dtype=first.dtype)
"""


@pytest.mark.parametrize(
    ("name", "check"),
    [("torus_all_reduce", "check_torus_all_reduce"), ("ring_all_gather_v", "check_ring_all_gather_v"),
     ("all_to_all_v", "check_all_to_all_v")],
)  # fmt: skip
def test_a_table_of_one_grade_runs_answers_fails_the_next(tmp_path, name, check):
    ns = solution_namespace("01")
    ns["_TABLE"] = str(tmp_path / "table")
    exec(TABLE.format(name=name), ns)  # noqa: S102 - the learner's cell, as a table-keeping cheat
    ns["_LOGGING"] = True
    _run(ns, check)
    assert list(tmp_path.iterdir()), "the table was written"
    ns["_LOGGING"] = False
    with pytest.raises(AssertionError, match="wrong element|elements"):
        _run(ns, check)


def test_a_table_of_one_grade_runs_byte_predictions_fails_the_next():
    ns = solution_namespace("01")
    real, table = ns["torus_bytes"], {}

    def logging(n, rows, cols, rank, itemsize):
        table[n, rows, cols, rank, itemsize] = out = real(n, rows, cols, rank, itemsize)
        return out

    ns["torus_bytes"] = logging
    _run(ns, "check_torus_bytes")
    ns["torus_bytes"] = lambda n, rows, cols, rank, itemsize: table.get((n, rows, cols, rank, itemsize), 0)
    with pytest.raises(AssertionError, match="the torus all-reduce sent"):
        _run(ns, "check_torus_bytes")


# ----------------------------------------------------------------------------- torch's own versions
# The search reads torch's source for functions and classes whose names say they all-reduce, all-gather,
# reduce-scatter or all-to-all. Left on, with the reason: the compiler's graph passes and lowerings
# (torch._inductor, torch._functorch: they rewrite a traced graph, they move no tensor), torch's own tests
# (torch.testing._internal), device kernels (decorated with a JIT: they run inside a compiled kernel) and
# functions defined inside another function (nobody outside can call them).
JOB = re.compile(
    r"^[ \t]*(?:class|def) (_?\w*(?:all_?reduce|all_?gather|all_?to_?all|reduce_?scatter)\w*)", re.M | re.I
)
LEFT_ON = ("torch._inductor.", "torch._functorch.", "torch.testing._internal.")


def _reachable(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names defined at module level or directly in a module-level class; and those decorated with a JIT."""
    names, kernels = set(), set()

    def note(node):
        names.add(node.name)
        if any(".jit" in ast.unparse(d) or ast.unparse(d).endswith("jit") for d in node.decorator_list):
            kernels.add(node.name)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            note(node)
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    note(sub)
    return names, kernels


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's functions that do an exercise's job (found by name in torch's source) are all in the check's
    switched-off list: a new torch that adds one fails here, not in a learner's notebook."""
    import torch

    from parallel_lab.grading.checks import collectives as K

    root = Path(torch.__file__).parent
    found = {}
    for f in root.rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        if not JOB.search(text):
            continue
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        if module.startswith(LEFT_ON):
            continue
        names, kernels = _reachable(ast.parse(text))
        hits = {m.group(1) for m in JOB.finditer(text)} & (names - kernels)
        if hits:
            found[module] = sorted(hits)
    assert "torch.distributed._functional_collectives" in found, (
        "the search finds nothing: torch's layout changed"
    )
    off = K.FORBIDDEN
    missing = {
        m: [n for n in names if not any(k.startswith(m + ".") and n in k.split(".") for k in off)]
        for m, names in found.items()
    }
    missing = {m: names for m, names in missing.items() if names}
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"
    # and the c10d operators behind them, callable as torch.ops.<namespace>.<name>
    ops = [o.split(".")[0] for o in torch._C._dispatch_get_all_op_names() if "c10d" in o.split("::")[0]]
    collective = [o for o in ops if K.TORCH_JOB.search(o.split("::")[1])]
    assert collective and all(f"torch.ops.{o.replace('::', '.')}" in off for o in collective), collective


def test_the_labs_own_versions_of_an_exercise_are_switched_off():
    """The lab's functions and classes whose names say they all-reduce, all-gather, reduce-scatter or
    all-to-all (found in the lab's source, as torch's are above) are all in the check's switched-off list: a
    lesson that adds one fails here. Left out: the grading package (a check grades, it moves no learner's
    data; this module's own helpers are switched off on their own, see the test of the check's own torus)."""
    import parallel_lab
    from parallel_lab.grading.checks import collectives as K

    root = Path(parallel_lab.__file__).parent
    found = {}
    for f in root.rglob("*.py"):
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        text = f.read_text(encoding="utf-8")
        if module.startswith("parallel_lab.grading") or not JOB.search(text):
            continue
        names, _ = _reachable(ast.parse(text))
        hits = {m.group(1) for m in JOB.finditer(text)} & names
        if hits:
            found[module] = sorted(hits)
    assert {"parallel_lab.moe.expert_parallel", "parallel_lab.zero.comm", "parallel_lab.comms.ring"} <= set(
        found
    )
    missing = {
        m: [n for n in names if not any(k.startswith(m + ".") and n in k.split(".") for k in K.FORBIDDEN)]
        for m, names in found.items()
    }
    missing = {m: names for m, names in missing.items() if names}
    assert not missing, f"the lab's functions doing an exercise's job, not switched off: {missing}"

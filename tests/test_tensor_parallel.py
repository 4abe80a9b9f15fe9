"""Tensor and sequence parallelism on real gloo ranks, against the single-process model and DTensor.

Every TP rank sees the whole batch (TP splits weights, not data). Each rank builds the
seeded single-process layer itself, so the reference runs under the same thread count
as the parallel version. Many checks run inside one launch per world size; each rank
returns a list of failure strings (empty = pass) plus measured numbers the test
compares with the formulas.

Tolerances: a column-parallel forward multiplies the same numbers in the same order as
the full matmul, so it is compared bit for bit (with the shapes used here; BLAS may pick
another kernel for other shapes), as are weight gradients of column-parallel layers.
Anything that sums over ranks (row-parallel outputs, input gradients, everything
downstream) adds in another order: fp32 rounding, ~1e-7 relative, so atol=1e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from parallel_lab import RunResult, comms, launch
from parallel_lab.models import GPTConfig, build_model, make_optimizer, synthetic_batch
from parallel_lab.tensor_parallel import (
    ColumnParallelLinear,
    ParallelBlock,
    ParallelMLP,
    ParallelSelfAttention,
    RowFirstMLP,
    RowParallelLinear,
    TensorParallelGPT,
    column_shard,
    row_shard,
    split,
    split_matmul,
    tp_activation_bytes_per_layer,
    tp_comm_bytes_per_layer,
)

REPO = Path(__file__).resolve().parents[1]
ATOL = 1e-5  # sums over ranks in another order: fp32 rounding (~1e-7 relative) on O(1) values
B, T, C, HEADS = 2, 8, 32, 4
MODES = (("tp", False, False), ("sp", True, False), ("sp+regather", True, True))


# ----------------------------------------------------------------------------- helpers (run on ranks)
def _cmp(fails: list, what: str, got: torch.Tensor, want: torch.Tensor, exact: bool = False) -> None:
    got, want = got.detach(), want.detach()
    if got.shape != want.shape:
        fails.append(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    d = (got - want).abs().max().item() if got.numel() else 0.0
    if (exact and not torch.equal(got, want)) or d > ATOL:
        fails.append(f"{what}: max |diff| {d:.3g}" + (" (expected bit-exact)" if exact else ""))


def _saved_bytes(module, fn) -> int:
    """Bytes autograd saves for backward in fn(), each storage once, parameters excluded."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _sent(ctx) -> int:
    return ctx.recorder.comm_totals()["sent"]


def _linears(ctx, fails: list) -> None:
    p, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(0)
    full = torch.nn.Linear(C, 3 * C)
    x0 = torch.randn(B, T, C, generator=g)
    gy = torch.randn(B, T, 3 * C, generator=g)
    for bias in (True, False):
        ref = torch.nn.Linear(C, 3 * C, bias=bias)
        ref.load_state_dict({k: v for k, v in full.state_dict().items() if bias or k != "bias"})
        x = x0.clone().requires_grad_()
        (ref(x) * gy).sum().backward()
        for gather in (False, True):
            col = ColumnParallelLinear.from_linear(ctx, ref, gather_output=gather)
            xs = x0.clone().requires_grad_()
            y = col(xs)
            want = ref(x0) if gather else ref(x0).chunk(p, -1)[r]
            _cmp(fails, f"column(bias={bias}, gather={gather}) forward", y, want, exact=True)
            (y * (gy if gather else gy.chunk(p, -1)[r])).sum().backward()
            _cmp(
                fails, f"column(bias={bias}) grad W", col.weight.grad, ref.weight.grad.chunk(p)[r], exact=True
            )
            if bias:
                _cmp(
                    fails, "column grad b", col.bias.grad, ref.bias.grad.chunk(p)[r]
                )  # a column sum: order may differ
            _cmp(fails, f"column(bias={bias}, gather={gather}) grad x", xs.grad, x.grad)
    frozen = torch.nn.Linear(C, 2 * C)
    frozen.weight.requires_grad_(False)
    for layer in (ColumnParallelLinear.from_linear(ctx, frozen), RowParallelLinear.from_linear(ctx, frozen)):
        if layer.weight.requires_grad or not layer.bias.requires_grad:
            fails.append(f"{type(layer).__name__}: a frozen full weight must give a frozen shard")
    ref = torch.nn.Linear(4 * C, C)
    x0 = torch.randn(B, T, 4 * C, generator=g)
    gy = torch.randn(B, T, C, generator=g)
    x = x0.clone().requires_grad_()
    (ref(x) * gy).sum().backward()
    for parallel_in in (True, False):
        row = RowParallelLinear.from_linear(ctx, ref, input_is_parallel=parallel_in)
        xs = (split(ctx, x0, -1) if parallel_in else x0).clone().requires_grad_()
        y = row(xs)
        _cmp(fails, f"row(input_is_parallel={parallel_in}) forward", y, ref(x0))
        (y * gy).sum().backward()
        _cmp(fails, "row grad W", row.weight.grad, row_shard(ref.weight.grad, p, r))
        _cmp(fails, "row grad b", row.bias.grad, ref.bias.grad, exact=True)
        _cmp(fails, "row grad x", xs.grad, split(ctx, x.grad, -1) if parallel_in else x.grad)


def _mlps_and_attention(ctx, fails: list) -> dict:
    """Megatron MLP vs the other order vs the reference; attention split by heads. Returns bytes."""
    p, r = ctx.world_size, ctx.rank
    blk = build_model(GPTConfig(seq_len=T, d_model=C, n_heads=HEADS, n_layers=1), 0).blocks[0]
    g = torch.Generator().manual_seed(1)
    x0, gy = torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)
    sent = {}
    for name, ref, make in (
        ("megatron_mlp", blk.mlp, lambda m: ParallelMLP.from_mlp(ctx, m)),
        ("row_first_mlp", blk.mlp, lambda m: RowFirstMLP.from_mlp(ctx, m)),
        ("attention", blk.attn, lambda m: ParallelSelfAttention.from_attention(ctx, m)),
    ):
        ref.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        (ref(x) * gy).sum().backward()
        par = make(ref)
        xs = x0.clone().requires_grad_()
        before = _sent(ctx)
        y = par(xs)
        (y * gy).sum().backward()
        sent[name] = _sent(ctx) - before
        _cmp(fails, f"{name} forward", y, ref(x0))
        _cmp(fails, f"{name} grad x", xs.grad, x.grad)
        first, second = (par.fc, par.proj) if name != "attention" else (par.qkv, par.proj)
        full1, full2 = (ref.fc, ref.proj) if name != "attention" else (ref.qkv, ref.proj)
        for mine, full in ((first, full1), (second, full2)):
            if isinstance(mine, ColumnParallelLinear):
                want = column_shard(full.weight.grad, p, r, mine.partitions)
            else:
                want = row_shard(full.weight.grad, p, r)
            _cmp(fails, f"{name} grad W ({type(mine).__name__})", mine.weight.grad, want)
    return sent


def _gpt_parity(ctx, fails: list, sp: bool, regather: bool, impl: str = "ring") -> None:
    cfg = GPTConfig(vocab=64, seq_len=T, d_model=C, n_heads=HEADS, n_layers=2, tie_weights=True)
    ref = build_model(cfg, 0)
    ref.wpe.weight.requires_grad_(False)  # a frozen parameter must stay frozen and untouched
    model = TensorParallelGPT(ctx, ref, sequence_parallel=sp, regather=regather, impl=impl)
    tag = f"gpt(sp={sp}, regather={regather}, impl={impl})"
    if model.wpe.weight.requires_grad or model.lm_head.weight is not model.wte.weight:
        fails.append(f"{tag}: lost the frozen wpe or the wte/lm_head tie")
    opt, opt_ref = (
        make_optimizer("momentum", model.parameters(), 0.05),
        make_optimizer("momentum", ref.parameters(), 0.05),
    )
    for step in range(3):
        x, y = synthetic_batch("tokens", 4, seq_len=T, vocab=64, seed=step)
        loss, loss_ref = model(x, y), ref(x, y)
        _cmp(fails, f"{tag} step {step} loss", loss, loss_ref)
        loss.backward()
        model.sync_grads()
        loss_ref.backward()
        for name, d in model.diff_to(ref, grads=True).items():
            if d > ATOL:
                fails.append(f"{tag} step {step} grad {name}: max |diff| {d:.3g}")
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    for name, d in model.diff_to(ref).items():
        if d > ATOL:
            fails.append(f"{tag} after 3 steps, param {name}: max |diff| {d:.3g}")
    # replicated parameters must stay identical on every TP rank, bit for bit
    rep = torch.cat(
        [model.wte.weight.detach().view(-1), model.ln_f.weight.detach(), model.blocks[0].ln1.weight.detach()]
    )
    every = comms.dist_all_gather(ctx, rep)  # (p, n)
    if not all(torch.equal(every[0], e) for e in every):
        fails.append(f"{tag}: replicated parameters drifted apart across TP ranks")
    if not torch.equal(model.wpe.weight, ref.wpe.weight):
        fails.append(f"{tag}: the frozen wpe changed")


def _layer_numbers(ctx, fails: list) -> dict:
    """Bytes one ParallelBlock sends (fwd + bwd) and bytes it saves, for each mode and impl."""
    blk = build_model(GPTConfig(seq_len=T, d_model=C, n_heads=HEADS, n_layers=1), 0).blocks[0]
    x0 = torch.randn(B, T, C, generator=torch.Generator().manual_seed(2))
    out = {}
    for mode, sp, rg in MODES:
        for impl in ("ring", "builtin"):
            par = ParallelBlock.from_block(ctx, blk, sequence_parallel=sp, regather=rg, impl=impl)
            xs = (split(ctx, x0, 1) if sp else x0).clone().requires_grad_()
            before = _sent(ctx)
            par(xs).sum().backward()
            out[mode, impl, "sent"] = _sent(ctx) - before
        xs = (split(ctx, x0, 1) if sp else x0).clone().requires_grad_()
        out[mode, "saved"] = _saved_bytes(par, lambda par=par, xs=xs: par(xs))
    return out


def _dropout_stays_replicated(ctx, fails: list) -> None:
    """Dropout in the replicated region draws the same mask on every TP rank."""
    blk = build_model(GPTConfig(seq_len=T, d_model=C, n_heads=HEADS, n_layers=1, dropout=0.2), 0).blocks[0]
    par = ParallelBlock.from_block(ctx, blk).train()
    x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(3))
    y = par(x)
    every = comms.dist_all_gather(ctx, y.detach())
    if not all(torch.equal(every[0], e) for e in every):
        fails.append("dropout: TP ranks disagree on the replicated block output")
    if torch.equal(par.eval()(x), par.train()(x)):
        fails.append("dropout: train and eval outputs are equal; dropout did nothing")


def _parity_rank(ctx) -> dict:
    fails: list[str] = []
    _linears(ctx, fails)
    mlp_bytes = _mlps_and_attention(ctx, fails)
    for _, sp, rg in MODES:
        _gpt_parity(ctx, fails, sp, rg)
    _gpt_parity(ctx, fails, False, False, impl="builtin")
    numbers = _layer_numbers(ctx, fails)
    _dropout_stays_replicated(ctx, fails)
    return {"fails": fails, "mlp_bytes": mlp_bytes, "numbers": numbers}


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("p", [1, 2, 4])
def test_parity_bytes_and_activations(p):
    res = launch(_parity_rank, p, timeout=120)
    for r, v in enumerate(res.values):
        assert v["fails"] == [], f"rank {r}: " + "; ".join(v["fails"])
    x = B * T * C  # x = b·s·h
    for r, v in enumerate(res.values):
        n = v["numbers"]
        ar = comms.ring_bytes_per_rank(x, p, 4, "all_reduce")[r][0]
        for mode, sp, rg in MODES:
            want = tp_comm_bytes_per_layer(B, T, C, p, 4, sp, rg)[r]
            for impl in ("ring", "builtin"):
                assert n[mode, impl, "sent"] == want, (mode, impl, r)
            assert n[mode, "saved"] == tp_activation_bytes_per_layer(B, T, C, HEADS, p, sp, rg), (mode, r)
        # 4 all-reduces of x per layer; sequence parallelism moves exactly as much
        assert n["tp", "ring", "sent"] == 4 * ar == n["sp", "ring", "sent"]
        assert n["tp", "ring", "sent"] == 8 * (p - 1) * x * 4 // p  # 8·b·s·h·(p-1)/p elements of 4 bytes
        # the Megatron MLP: one all-reduce forward, one backward; the other order: 4x wider
        # all-reduces plus an all-gather each way
        mb = v["mlp_bytes"]
        ag = comms.ring_bytes_per_rank(x, p, 4, "all_gather")[r][0]
        assert mb["megatron_mlp"] == 2 * ar == mb["attention"]
        assert mb["row_first_mlp"] == 2 * comms.ring_bytes_per_rank(4 * x, p, 4, "all_reduce")[r][0] + 2 * ag
        if p > 1:
            assert mb["row_first_mlp"] == 9 * mb["megatron_mlp"] // 2
    if p == 1:
        assert all(b == 0 for b in res.values[0]["mlp_bytes"].values())


def test_activation_formula_matches_megatron_shape():
    # TP shrinks 12·BTC of a layer's 16·BTC (and the softmax); SP + regather shrinks all of it
    b, s, h, a = 4, 64, 128, 8
    full = tp_activation_bytes_per_layer(b, s, h, a, 1)
    for t in (2, 4, 8):
        tp = tp_activation_bytes_per_layer(b, s, h, a, t)
        sp = tp_activation_bytes_per_layer(b, s, h, a, t, True, True)
        assert full > tp > sp
        assert tp - (full - s * s) // t - s * s > 0  # the replicated part does not shrink
        assert sp == (full - s * s) // t + s * s  # all but the (T, T) mask: exactly 1/t
    with pytest.raises(ValueError, match="heads"):
        tp_activation_bytes_per_layer(b, s, h, 6, 4)
    with pytest.raises(ValueError, match="seq"):
        tp_activation_bytes_per_layer(b, 6, h, 4, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="tp"):
        tp_comm_bytes_per_layer(b, s, h, 0)


def _seed000(ctx, split_by):
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # (3, 2): the layer's weight
    x = torch.tensor([[1.0], [2.0]])  # (2, 1): its input
    out = split_matmul(ctx, w, x, split_by)
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def test_split_matmul_seed000():
    rows = launch(_seed000, 3, "output").values  # 3 output rows on 3 ranks: one entry of y each
    cols = launch(_seed000, 2, "input").values  # 2 input columns on 2 ranks: a partial y each
    for v in rows + cols:
        assert v["y"] == [[5.0], [11.0], [17.0]]
    assert [v["local"] for v in rows] == [[[5.0]], [[11.0]], [[17.0]]]
    assert [v["local"] for v in cols] == [[[1.0], [3.0], [5.0]], [[4.0], [8.0], [12.0]]]
    assert {v["collective"] for v in rows} == {"all-gather"} and {v["collective"] for v in cols} == {
        "all-reduce"
    }
    assert [v["bytes_sent"] for v in rows] == [8, 8, 8]  # (p-1) entries of 4 bytes
    assert [v["bytes_sent"] for v in cols] == [s for s, _ in comms.ring_bytes_per_rank(3, 2, 4, "all_reduce")]


def _dtensor_rank(ctx, sp: bool) -> list[str]:
    """Our MLP against DTensor's ColwiseParallel/RowwiseParallel on the same weights, 3 Adam steps."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    fails: list[str] = []
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    mlp = build_model(GPTConfig(d_model=C), 0).blocks[0].mlp
    theirs = copy.deepcopy(mlp)
    plan = {
        "fc": ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel(),
        "proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
    }
    parallelize_module(theirs, mesh, plan)
    ours = ParallelMLP.from_mlp(ctx, mlp, sequence_parallel=sp)
    opt_t, opt_o = (
        torch.optim.Adam(theirs.parameters(), lr=1e-2),
        torch.optim.Adam(ours.parameters(), lr=1e-2),
    )
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, gy = torch.randn(4, T, C, generator=g), torch.randn(4, T, C, generator=g)
        if sp:
            x, gy = split(ctx, x, 1), split(ctx, gy, 1)  # (4, T/tp, C): this rank's tokens
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = theirs(a), ours(b)
        _cmp(fails, f"step {step} output", yb, ya)
        (ya * gy).sum().backward()
        (yb * gy).sum().backward()
        if sp:
            from parallel_lab.tensor_parallel import sync_sequence_parallel_grads

            sync_sequence_parallel_grads(ctx, ours)
        _cmp(fails, f"step {step} grad x", b.grad, a.grad)
        for name in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
            mine, their = ours.get_parameter(name), theirs.get_parameter(name)
            _cmp(fails, f"step {step} grad {name}", mine.grad, their.grad.to_local())
        opt_t.step(), opt_o.step()
        opt_t.zero_grad(), opt_o.zero_grad()
    for name in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
        _cmp(
            fails,
            f"after 3 Adam steps {name}",
            ours.get_parameter(name),
            theirs.get_parameter(name).to_local(),
        )
    return fails


@pytest.mark.parametrize("p", [2, 4])
def test_parity_with_dtensor(p):
    for sp in (False, True):
        res = launch(_dtensor_rank, p, sp)
        for r, fails in enumerate(res.values):
            assert fails == [], f"sequence_parallel={sp}, rank {r}: " + "; ".join(fails)


def _bad_input_rank(ctx) -> list[str]:
    """Every bad argument must raise ValueError naming the argument and the rule."""
    cfg = GPTConfig(seq_len=T, d_model=24, n_heads=6, n_layers=1)
    cases = {
        "out_features (6) must be divisible by the tensor-parallel size (4)": lambda: ColumnParallelLinear(
            ctx, 8, 6
        ),
        "in_features (10) must be divisible by the tensor-parallel size (4)": lambda: RowParallelLinear(
            ctx, 10, 8
        ),
        "n_heads (6) must be divisible by the tensor-parallel size (4)": lambda: ParallelSelfAttention(
            ctx, 24, 6
        ),
        "d_model (30) must be divisible by n_heads (4)": lambda: ParallelSelfAttention(ctx, 30, 4),
        "n_heads (6) must be divisible": lambda: TensorParallelGPT(ctx, build_model(cfg, 0)),
        "sequence length (6) must be divisible by the tensor-parallel size (4)": lambda: TensorParallelGPT(
            ctx,
            build_model(GPTConfig(seq_len=T, d_model=C, n_heads=4, n_layers=1), 0),
            sequence_parallel=True,
        )(torch.zeros(2, 6, dtype=torch.long)),
        "impl must be one of": lambda: ParallelMLP(ctx, C, impl="nccl"),
        "split_by must be": lambda: split_matmul(ctx, torch.ones(4, 4), torch.ones(4, 1), "rows"),
        "weight rows (output features) (3) must be divisible": lambda: split_matmul(
            ctx, torch.ones(3, 4), torch.ones(4, 1), "output"
        ),
        "dropout must be in [0, 1)": lambda: ParallelMLP(ctx, C, dropout=1.5),
        "gather_output and sequence_parallel": lambda: ColumnParallelLinear(
            ctx, 8, 8, gather_output=True, sequence_parallel=True
        ),
        "out_features must be a positive int": lambda: ColumnParallelLinear(ctx, 8, 0),
    }
    fails = []
    for msg, call in cases.items():
        try:
            call()
            fails.append(f"no error for: {msg}")
        except ValueError as e:
            if msg not in str(e):
                fails.append(f"expected {msg!r}, got {e!r}")
    return fails


def test_bad_input_is_named():
    res = launch(_bad_input_rank, 4)
    for r, fails in enumerate(res.values):
        assert fails == [], f"rank {r}: " + "; ".join(fails)


# ----------------------------------------------------------------------------- the script
def test_script_under_torchrun(tmp_path):
    """SLOW-ish (~10 s): two spawned processes each import torch."""
    trace = tmp_path / "tp.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--nproc-per-node", "2", "-m", "parallel_lab.scripts.tensor_parallel",
           "--sequence-parallel", "--seq", "8", "--d-model", "32", "--trace", str(trace)]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "matches the single-process model" in out.stdout
    res = RunResult.load(str(trace))
    assert res.world_size == 2 and res.backend == "gloo"
    names = {e["name"] for e in res.timeline}
    assert {"ring_all_gather", "ring_reduce_scatter", "forward 0"} <= names


def test_divisibility_helpers_without_ranks():
    # the formulas need no process group
    assert tp_comm_bytes_per_layer(2, 8, 32, 1) == [0]
    assert tp_comm_bytes_per_layer(2, 8, 32, 4) == [3 * 8 * 2 * 8 * 32 * 4 // 4] * 4
    # why the row-first order must all-reduce before GeLU: GeLU(a + b) != GeLU(a) + GeLU(b)
    assert F.gelu(torch.tensor(1.0) + torch.tensor(1.0)) != 2 * F.gelu(torch.tensor(1.0))

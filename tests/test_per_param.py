"""Per-parameter (dim-0, FSDP2-style) sharding beside lesson 04's flat buffer (lesson 20): the same
training as one process and as the flat layout, each rank's shard of each parameter equal to FSDP2's
`to_local()`, per-parameter optimizer state, bytes per category and on the wire against the formulas,
a frozen parameter left whole, and a checkpoint resharded row by row with lesson 13's `reshard`.
test_zero's models: a TinyGPT with tied weights and a frozen parameter, and TiedNet (259 parameters: an
11 x 7 tied embedding, 7 x 7 layers, vectors of 7: rows that 2 and 3 ranks do not divide)."""

from __future__ import annotations

import math

import pytest
import torch
from test_zero import LR, TOL_LOSS, TOL_PARAM, make

from parallel_lab import launch
from parallel_lab.models import synthetic_batch
from parallel_lab.resilience import reshard
from parallel_lab.zero import PerParamLayout, PerParamZero3, Zero3, dim0_shard, per_param_state_bytes

STEPS = 3


def _parity(ctx) -> list[str]:
    """One process, the flat Zero3 and PerParamZero3 (every step), and FSDP2's local shards (at the end)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    n, r, bad = ctx.world_size, ctx.rank, []
    for kind in ("gpt", "tied"):
        ref, vocab = make(kind)
        ropt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=LR)
        x, y = synthetic_batch("tokens", 2 * n, seq_len=8, vocab=vocab, seed=1)
        xs, ys = x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2]
        flat_m, _ = make(kind)
        flat = Zero3(ctx, flat_m, lr=LR)
        ours_m, _ = make(kind)
        ours = PerParamZero3(ctx, ours_m, lr=LR)
        theirs, _ = make(kind)
        mesh = init_device_mesh("cpu", (n,))
        for unit in theirs.blocks if kind == "gpt" else theirs.layers:
            fully_shard(unit, mesh=mesh)
        fully_shard(theirs, mesh=mesh)
        topt = torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad], lr=LR)
        for step in range(STEPS):
            ropt.zero_grad()
            ref(x, y).backward()
            ropt.step()
            losses = []
            for model, opt in ((flat_m, flat), (ours_m, ours), (theirs, topt)):
                loss = model(xs, ys)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            if max(losses) - min(losses) > TOL_LOSS:
                bad.append(f"{kind} rank {r} step {step}: losses flat / per-param / FSDP2 {losses}")
            got = ours.full_parameters()
            for k, v in ref.named_parameters(remove_duplicate=False):
                d = (got[k] - v.detach()).abs().max().item()
                if d > TOL_PARAM:
                    bad.append(f"{kind} rank {r} step {step}: {k} differs from one process by {d:.3g}")
        mine = ours.shards()
        for k, v in theirs.named_parameters():
            if not v.requires_grad:
                continue
            local = v.to_local()  # FSDP2's rows of this parameter on this rank, without its padding
            shard = mine[k]
            if shard.shape[1:] != local.shape[1:] or shard.shape[0] < local.shape[0]:
                bad.append(f"{kind} rank {r}: {k} shard {tuple(shard.shape)} vs FSDP2's {tuple(local.shape)}")
            elif (shard[: local.shape[0]] - local).abs().max().item() > TOL_PARAM:
                bad.append(f"{kind} rank {r}: {k}'s rows differ from FSDP2's local shard")
            elif shard[local.shape[0] :].abs().max().item() if shard.shape[0] > local.shape[0] else 0.0:
                bad.append(f"{kind} rank {r}: {k}'s padding rows are not zero")
        # the optimizer sees one tensor per parameter, its state in that parameter's trailing shape
        for shape, v in zip(ours.layout.shapes, ours._views):  # the Parameters are empty placeholders now
            got = tuple(ours.optimizer.state[v]["exp_avg"].shape)
            if got != (math.ceil(shape[0] / n), *shape[1:]):
                bad.append(f"{kind}: Adam's state {got} for a parameter {shape}")
    return bad


@pytest.mark.parametrize("n", [2, 3])
def test_per_param_equals_one_process_the_flat_layout_and_fsdp2s_shards(n):
    res = launch(_parity, n, timeout=240, backend="gloo")  # CPU models, whatever GPUs there are
    assert [b for v in res.values for b in v] == []


def _bytes(ctx) -> dict:
    torch.set_num_threads(1)
    model, vocab = make("gpt")
    z = PerParamZero3(ctx, model, lr=LR)
    x, y = synthetic_batch("tokens", 2, seq_len=8, vocab=vocab, seed=ctx.rank)
    ctx.recorder.reset()
    for _ in range(2):
        model(x, y).backward()
        z.step()
        z.zero_grad()
    live = ctx.memory.snapshot()
    frozen = sum(p.numel() * p.element_size() for p in z.groups.frozen)
    return {"live": {k: live[k] for k in ("param", "grad", "optim")}, "layout": z.layout, "frozen": frozen,
            "sent": {k: v["sent"] for k, v in ctx.recorder.comm_totals()["by_op"].items()}}  # fmt: skip


def test_bytes_per_category_and_on_the_wire_equal_the_formula():
    """3 ranks, 2 Adam steps: every rank holds ceil(rows/N) rows of every trainable parameter (+ a
    frozen one whole), 16 bytes each in fp32; sends (N-1) pieces per gather (two per step) and per
    reduce-scatter, a piece being its rows of every parameter: the padding travels too."""
    res = launch(_bytes, 3, track_memory=True, timeout=240, backend="gloo")
    for v in res.values:
        lay, frozen = v["layout"], v["frozen"]
        want = per_param_state_bytes(lay, "adam", "fp32")
        assert frozen > 0 and v["live"] == {k: want[k] + (frozen if k == "param" else 0) for k in v["live"]}
        once = (lay.world_size - 1) * lay.shard * 4  # one pass over the model's units
        assert v["sent"] == {"all_gather": 2 * 2 * once, "ring_reduce_scatter": 2 * once}, v["sent"]
        # per-parameter padding is more than the flat buffer's: ceil per parameter, not once
        assert lay.shard >= math.ceil(lay.numel / lay.world_size)


def test_layout_rows_padding_and_a_checkpoint_resharded_row_by_row():
    """Parameter i's shard on rank k is rows [k c, (k+1) c), c = ceil(rows/N), zero-padded; a checkpoint
    saved on 3 ranks loads on 2 with lesson 13's `reshard`, parameter by parameter, on rows."""
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(5, 3, generator=g),
        "b": torch.randn(7, generator=g),
        "e": torch.randn(11, 2, generator=g),
    }
    lay = PerParamLayout([tuple(t.shape) for t in params.values()], (1, 2), 3)
    assert lay.c == (2, 3, 4) and lay.shard == 2 * 3 + 3 + 4 * 2 and lay.padding == 3 * 17 - (15 + 7 + 22)
    assert lay.pieces(1) == [(0, 11), (11, 22), (22, 33)]  # equal pieces: rank-major gathers
    assert dim0_shard(params["w"], 3, 2).tolist() == [params["w"][4].tolist(), [0.0, 0.0, 0.0]]
    for name, t in params.items():
        rows = t.shape[0]
        saved = {k: {"p": dim0_shard(t, 3, k)} for k in range(3)}
        for rank in range(2):
            like = {"p": dim0_shard(torch.zeros_like(t), 2, rank)}
            got = reshard(rows, 3, 2, rank, saved.__getitem__, like)["p"]  # numel = rows: whole rows move
            assert torch.equal(got, dim0_shard(t, 2, rank)), (name, rank)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unit_sizes must add up"):
        PerParamLayout([(2, 2)], (2,), 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        PerParamLayout([(2, 2)], (1,), 0)


class _OddBlock(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.gain = torch.nn.Parameter(torch.tensor(0.7))  # 0-d
        self.row = torch.nn.Parameter(torch.full((1, d), 0.1))  # one row: N - 1 ranks hold padding only

    def forward(self, x):
        return x + self.gain * torch.tanh(self.lin(x)) + self.row


class _OddNet(torch.nn.Module):
    """Every parameter inside a unit (an empty root unit), a 0-d gain and a one-row bias per block."""

    def __init__(self, d: int = 5, depth: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_OddBlock(d) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def _odd(ctx) -> list[str]:
    torch.set_num_threads(1)
    bad = []
    x = torch.randn(4 * ctx.world_size, 5, generator=torch.Generator().manual_seed(0))
    mine = x[4 * ctx.rank : 4 * ctx.rank + 4]
    for precision, prefetch in (("fp32", False), ("mixed", True)):
        models = []
        for cls in (None, Zero3, PerParamZero3):
            torch.manual_seed(0)
            m = _OddNet()
            opt = (torch.optim.Adam(m.parameters(), lr=LR) if cls is None
                   else cls(ctx, m, lr=LR, precision=precision, prefetch=prefetch))  # fmt: skip
            models.append((m, opt))
        for _ in range(2):
            for k, (m, opt) in enumerate(models):
                dtype = torch.bfloat16 if k and precision == "mixed" else torch.float32  # the working dtype
                for half in (mine[:2], mine[2:]) if k else (x[: 2 * ctx.world_size], x[2 * ctx.world_size :]):
                    (
                        m(half.to(dtype)).float() / 2
                    ).backward()  # two micro-batches accumulated before the step
                opt.step()
                opt.zero_grad()
        ref = {n: p.detach() for n, p in models[0][0].named_parameters()}
        flat, ours = models[1][1].full_parameters(), models[2][1].full_parameters()
        for n in ref:
            d_flat = (ours[n].float() - flat[n].float()).abs().max().item()
            d_ref = (ours[n].float() - ref[n]).abs().max().item()
            if precision == "fp32" and d_ref > TOL_PARAM:
                bad.append(f"{precision}: {n} differs from one process by {d_ref:.3g}")
            if d_flat > (TOL_PARAM if precision == "fp32" else 1e-2):  # mixed: a bf16 rounding apart at most
                bad.append(f"{precision}: {n} differs from the flat layout by {d_flat:.3g}")
    return bad


def test_an_empty_root_a_0d_and_a_one_row_parameter_accumulation_mixed_precision_and_no_prefetch():
    """3 ranks, two micro-batches accumulated per step, 2 steps: fp32 without prefetch against one
    process, bf16 (fp32 master) with prefetch against the flat layout with the same settings."""
    res = launch(_odd, 3, timeout=240, backend="gloo")
    assert [b for v in res.values for b in v] == []

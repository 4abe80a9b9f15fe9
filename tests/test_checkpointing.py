"""Activation checkpointing: gradients equal to no checkpointing and to torch.utils.checkpoint (bit for
bit: the recomputation runs the same ops on the same values), saved activations counted against the
prediction, recomputation on the timeline and in FLOPs, a data-parallel run against one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.utils.flop_counter import FlopCounterMode

from parallel_lab import comms, launch
from parallel_lab.checkpointing import (
    SavedTensorCounter,
    checkpoint,
    checkpoint_sequential,
    gpt_forward,
    gpt_saved_bytes,
    linear_stack,
    predict_saved,
    segment_sizes,
)
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.runtime.memory import MemoryTracker


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one thread is fastest here, and ranks forked from this process then never inherit a
    busy OpenMP pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# 3 layers in 2 segments: uneven (2 + 1); dropout on, so the RNG replay matters; tied embeddings.
CFG = GPTConfig(vocab=40, seq_len=8, d_model=24, n_heads=2, n_layers=3, dropout=0.1)


def _np(x):
    """Results leave the ranks as numpy arrays (a returned tensor travels as a shared-memory descriptor
    that can vanish with the exiting rank)."""
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, (list, tuple)):
        return [_np(v) for v in x]
    if isinstance(x, dict):
        return {k: _np(v) for k, v in x.items()}
    return x


# ----------------------------------------------------------------------------- the 24 x 5 count
def test_seed_120_saved_activations_become_24():
    model = linear_stack(layers=24, linears=5, hidden=16)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorCounter(model.parameters()) as plain:
        y = model(x)
        assert plain.live_count == 120  # 24 layers x 5 linears: each keeps its input
        y.sum().backward()
    with SavedTensorCounter(model.parameters()) as ck:
        y = checkpoint_sequential(model, 24, x, checkpoint_last=True)
        assert ck.live_count == 24  # one block input per layer
        y.sum().backward()
    assert ck.peak_count == 24 + 4  # backward of the last layer: 24 inputs + its 4 ReLU outputs again


def test_saved_counts_and_bytes_match_prediction_for_every_spacing():
    """Count (SavedTensorCounter) and bytes (MemoryTracker, live after forward) for 1..24 segments,
    torch's convention (last segment not checkpointed) and the lesson's (all checkpointed)."""
    B, H, L = 4, 16, 24
    model = linear_stack(layers=L, linears=5, hidden=H)
    x = torch.randn(B, H, requires_grad=True)
    for last in (False, True):
        for k in range(1, L + 1):
            want = predict_saved([5] * L, [1] * L, k, last)
            with MemoryTracker() as mem, SavedTensorCounter(model.parameters()) as c:
                mem.register_module(model)
                mem.register(x, "activation")
                with mem.category("activation"):  # segment outputs are made under no_grad: label them too
                    y = checkpoint_sequential(model, k, x, checkpoint_last=last)
                after, live = c.live_count, mem.snapshot()["activation"]
                y.sum().backward()
            assert (after, c.peak_count) == (want["after_forward"], want["peak"]), (
                f"{k} segments, last={last}"
            )
            # bytes: every saved tensor is (B, H) fp32; plus the output y, alive but saved by nobody;
            # plus the CPU RNG state each checkpointed segment keeps to replay its forward
            # (made by the generator, not by an op: the allocator hook sees it, a dispatch mode not)
            ran_checkpointed = min(k, L) if last else min(k, L) - 1
            rng = torch.get_rng_state().numel() * ran_checkpointed if mem.mechanism == "allocator" else 0
            assert live == (want["after_forward"] + 1) * B * H * 4 + rng, f"{k} segments, last={last}"
            del y


def test_gpt_saved_bytes_match_cost_model():
    cfg = GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    model = build_model(cfg, seed=0)
    idx, tgt = synthetic_batch("tokens", 4, seq_len=16, vocab=64)
    for segments, last in [(None, False), (4, True), (2, True), (3, False), (3, True), (1, False)]:
        with SavedTensorCounter(model.parameters()) as c:
            loss = gpt_forward(model, idx, tgt, segments=segments, checkpoint_last=last)
            after = c.live_bytes
            loss.backward()
        want = gpt_saved_bytes(4, 16, 32, 4, 4, 64, segments, last)
        assert (after, c.peak_bytes) == (want["after_forward"], want["peak"]), (
            f"segments={segments}, last={last}"
        )


def test_recompute_costs_one_extra_forward_in_flops():
    """Linear layers: forward 2BHH, backward 4BHH per layer, so recomputing every layer is 4/3 of a step."""
    model = linear_stack(layers=6, linears=5, hidden=32)
    x = torch.randn(8, 32, requires_grad=True)

    def flops(**kw):
        with FlopCounterMode(display=False) as fc:
            (checkpoint_sequential(model, **kw, input=x) if kw else model(x)).sum().backward()
        return fc.get_total_flops()

    plain = flops()
    assert flops(segments=6, checkpoint_last=True) * 3 == plain * 4  # +33.3%
    assert flops(segments=3) * 9 == plain * (9 + 2)  # 4 of 6 layers recomputed: + 4/6 x 1/3


# ----------------------------------------------------------------------------- parity
def _gpt_steps(mode: str, steps: int = 3, autocast: bool = False, frozen: bool = True):
    """Train a copy of one seeded TinyGPT; `mode`: none | ours | ours_last | torch | torch_reentrant."""
    model = build_model(CFG, seed=0)
    if frozen:
        model.wpe.weight.requires_grad_(False)  # a frozen parameter inside the first segment's inputs
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(5)  # dropout masks
    out = []
    for s in range(steps):
        idx, tgt = synthetic_batch("tokens", 4, seq_len=CFG.seq_len, vocab=CFG.vocab, seed=s)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if mode.startswith("torch"):
                T = idx.shape[1]
                x = model.wte(idx) + model.wpe(torch.arange(T))
                x = tuc.checkpoint_sequential(model.blocks, 2, x, use_reentrant=mode == "torch_reentrant")
                loss = F.cross_entropy(model.lm_head(model.ln_f(x)).view(-1, CFG.vocab), tgt.reshape(-1))
            else:
                segs = None if mode == "none" else 2
                loss = gpt_forward(model, idx, tgt, segments=segs, checkpoint_last=mode == "ours_last")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        out.append(
            (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
        opt.step()
    out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _assert_same(a, b, what):
    for s, ((la, ga), (lb, gb)) in enumerate(zip(a[:-1], b[:-1])):
        assert torch.equal(la, lb), f"{what}: loss at step {s}"
        assert ga.keys() == gb.keys(), f"{what}: different parameters got gradients"
        for n in ga:
            assert torch.equal(ga[n], gb[n]), (
                f"{what}: step {s} grad {n} differs by {(ga[n] - gb[n]).abs().max()}"
            )
    for n in a[-1]:
        assert torch.equal(a[-1][n], b[-1][n]), f"{what}: parameter {n} after the steps"


def test_gradients_equal_plain_and_torch_checkpoint():
    plain = _gpt_steps("none")
    assert "wpe.weight" not in plain[0][1] and "wte.weight" in plain[0][1]  # frozen skipped, tied present
    for mode in ("ours", "ours_last", "torch", "torch_reentrant"):
        _assert_same(_gpt_steps(mode), plain, mode)


def test_autocast_state_is_replayed():
    """Under bf16 autocast the recomputation must run in bf16 too, or gradients change."""
    _assert_same(
        _gpt_steps("ours_last", steps=2, autocast=True), _gpt_steps("none", steps=2, autocast=True), "bf16"
    )


def test_input_without_grad_still_trains_first_segment():
    model = linear_stack(layers=4, linears=2, hidden=8)
    ref = copy.deepcopy(model)
    x = torch.randn(3, 8)  # raw data: requires no grad
    checkpoint_sequential(model, 4, x, checkpoint_last=True).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), n


def test_checkpoint_with_two_inputs_and_tuple_output():
    lin = torch.nn.Linear(4, 4)
    a, b = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)

    def f(u, v):
        return lin(u) * v, torch.tanh(u + v)

    o1, o2 = checkpoint(f, a, b, params=lin.parameters())
    (o1.sum() + o2.pow(2).sum()).backward()
    got = [a.grad, b.grad, lin.weight.grad, lin.bias.grad]
    for t in (a, b, lin.weight, lin.bias):
        t.grad = None
    r1, r2 = f(a, b)
    (r1.sum() + r2.pow(2).sum()).backward()
    for g, t in zip(got, (a, b, lin.weight, lin.bias)):
        assert torch.equal(g, t.grad)


# ----------------------------------------------------------------------------- ranks and timeline
def _dp_checkpointed(ctx, steps: int):
    """Each rank checkpoints its half of the batch; gradients averaged through comms."""
    torch.set_num_threads(1)
    model = build_model(GPTConfig(vocab=40, seq_len=8, d_model=24, n_heads=2, n_layers=3), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    per = 8 // ctx.world_size
    out = []
    for s in range(steps):
        idx, tgt = synthetic_batch("tokens", 8, seq_len=8, vocab=40, seed=s)
        idx, tgt = idx[ctx.rank * per : (ctx.rank + 1) * per], tgt[ctx.rank * per : (ctx.rank + 1) * per]
        opt.zero_grad()
        with ctx.span(f"forward {s}"):
            loss = gpt_forward(model, idx, tgt, segments=3 if ctx.world_size > 1 else None, ctx=ctx)
        with ctx.span(f"backward {s}"):
            loss.backward()
        if ctx.world_size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            comms.dist_all_reduce(ctx, flat, op="avg")
            o = 0
            for p in model.parameters():
                p.grad.copy_(flat[o : o + p.numel()].view_as(p))
                o += p.numel()
        out.append(
            _np({"loss": loss.detach(), "grad": torch.cat([p.grad.reshape(-1) for p in model.parameters()])})
        )
        opt.step()
    out.append(_np(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    return out


def test_data_parallel_with_checkpointing_matches_single_process():
    """2 ranks, each with its blocks checkpointed, against one process on the whole batch without.
    The only difference is where the batch sum happens (two halves, then the average), so the tolerance
    is fp32 rounding: 1e-6 of the largest gradient / weight."""
    steps = 3
    ref = launch(_dp_checkpointed, 1, steps, threads=1)
    res = launch(_dp_checkpointed, 2, steps, threads=1)
    r = ref.values[0]
    for rank, v in enumerate(res.values):
        for s in range(steps):
            g, gr = torch.from_numpy(v[s]["grad"]), torch.from_numpy(r[s]["grad"])
            assert (g - gr).abs().max() <= 1e-6 * gr.abs().max(), f"rank {rank} step {s}"
        w, wr = torch.from_numpy(v[-1]), torch.from_numpy(r[-1])
        assert (w - wr).abs().max() <= 1e-6 * wr.abs().max()
    # 3 segments, last one not checkpointed: 2 recompute spans per step per rank, inside backward
    for rank in range(2):
        rec = [e for e in res.spans(rank=rank) if e["name"].startswith("recompute")]
        assert sorted({e["name"] for e in rec}) == ["recompute block 0", "recompute block 1"]
        assert len(rec) == 2 * steps
        for s in range(steps):
            back = res.spans(rank=rank, name=f"backward {s}")[0]
            inside = [e for e in rec if back["start"] <= e["start"] <= e["end"] <= back["end"]]
            assert len(inside) == 2, f"rank {rank} step {s}: recomputation must happen during backward"


def test_bad_input():
    model = linear_stack(layers=3, linears=2, hidden=4)
    x = torch.randn(2, 4)
    for segments, err in [
        (0, ValueError),
        (-1, ValueError),
        (4, ValueError),
        (True, TypeError),
        (1.5, TypeError),
    ]:
        with pytest.raises(err, match="segments"):
            checkpoint_sequential(model, segments, x)
    with pytest.raises(ValueError, match="at least one block"):
        checkpoint_sequential([], 1, x)
    with pytest.raises(TypeError, match=r"functions\[1\]"):
        checkpoint_sequential([model[0], 3], 1, x)
    with pytest.raises(TypeError, match="input must be a tensor"):
        checkpoint_sequential(model, 1, [1.0])
    with pytest.raises(ValueError, match="at least one tensor"):
        checkpoint(model)
    with pytest.raises(TypeError, match="callable"):
        checkpoint(3, x)
    with pytest.raises(ValueError, match="one entry per block"):
        predict_saved([1, 2], [1], 1)
    with pytest.raises(ValueError, match="layers"):
        linear_stack(layers=0)
    assert segment_sizes(24, 5) == [5, 5, 5, 5, 4]

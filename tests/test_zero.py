"""ZeRO stages 0-3: parity with single-process training, bytes per category, bytes on the wire.

Rank functions return lists of failure strings (or numpy arrays: `launch` ships many
tensors unreliably), so one launch per world size checks every stage and model. The
reference (one process, full batch, torch.optim.Adam) runs inside each rank: it is tiny.

Tolerances (fp32 everywhere):
- forward loss at step 0: bit-exact (same weights, same slice, no reduction across ranks);
- averaged gradient slice vs the reference's: 1e-5 of the gradient's largest entry. The
  mean of per-rank means and the mean over the whole batch add the same terms in another
  order; the worst seen is 7e-7 of the scale (a few ulps), so the bound is ~15x above it;
- loss after updates: 1e-5 absolute; parameters after each of 5 Adam steps (lr 1e-2):
  5e-5 absolute. Adam divides by sqrt(v): an element whose gradient is near zero turns a
  1-ulp gradient difference into a visible update difference; the worst seen is 8.5e-6;
- every rank holds bit-identical parameters (the all-gather copies bytes).
On one rank nothing is reduced and everything is bit-exact.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch.nn as nn

from parallel_lab import RankError, launch
from parallel_lab.comms import ring_bytes_per_rank
from parallel_lab.costmodel import model_state_bytes
from parallel_lab.models import GPTConfig, TinyGPT, build_model, synthetic_batch
from parallel_lab.scripts.zero import comm_formula, full_params, zero_train
from parallel_lab.zero import ZeRO, ZeroOptimizer
from parallel_lab.zero.layout import ZeroLayout, check_stage, group_params, resolve_optimizer
from parallel_lab.zero.meta import PAPER_GB, count_state_bytes, expected_state_bytes, paper_table
from parallel_lab.zero.stage3 import Zero3

LR, STEPS, BATCH = 1e-2, 5, 12  # 12 sequences split evenly over 1, 2, 3 or 4 ranks
TOL_GRAD, TOL_LOSS, TOL_PARAM = 1e-5, 1e-5, 5e-5


class TiedNet(nn.Module):
    """Tied embedding/head, a frozen parameter, 3 units, Ψ = 259 = 7 x 37 (no rank count divides it)."""

    def __init__(self, vocab: int = 11, d: int = 7, depth: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d), requires_grad=False)

    def forward(self, idx, targets):
        x = self.emb(idx) * self.scale  # (B, T, d)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))  # (B, T, d)
        logits = self.head(self.norm(x))  # (B, T, vocab)
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def make(kind: str) -> tuple[nn.Module, int]:
    """('gpt': TinyGPT, tied weights, frozen wpe, Ψ = 3050: 3 and 4 don't divide it) or TiedNet.
    CPU models: the tests launch gloo ranks whatever GPUs the machine has."""
    if kind == "gpt":
        model = build_model(GPTConfig(vocab=37, seq_len=8, d_model=10, n_heads=2, n_layers=2), seed=0)
        model.wpe.weight.requires_grad_(False)
        return model, 37
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return TiedNet(), 11


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- layout (no ranks)
def test_layout_pads_the_last_slice_and_pieces_tile_every_unit():
    lay = ZeroLayout(numels=(5, 3, 4, 1), unit_sizes=(2, 2), world_size=5)
    assert (lay.numel, lay.shard, lay.padded, lay.padding) == (13, 3, 15, 2)
    assert lay.unit_range(0) == (0, 8) and lay.unit_range(1) == (8, 15)  # the last unit owns the padding
    size = lambda u: [hi - lo for lo, hi in lay.pieces(u)]  # noqa: E731
    assert size(0) == [3, 3, 2, 0, 0] and size(1) == [0, 0, 1, 3, 3]
    assert lay.pieces(0)[:3] == [(0, 3), (3, 6), (6, 8)] and lay.pieces(1)[2:] == [(8, 9), (9, 12), (12, 15)]
    for k in range(5):  # a rank's pieces add up to its slice: S each
        assert sum(hi - lo for u in (0, 1) for lo, hi in [lay.pieces(u)[k]]) == lay.shard
    even = ZeroLayout(numels=(6, 6), unit_sizes=(2,), world_size=4)
    assert (even.shard, even.padded, even.padding) == (3, 12, 0)


def test_group_params_ties_frozen_and_shared():
    model, _ = make("tied")
    g = group_params(model)
    assert g.names == ["root", "layers.0", "layers.1", "layers.2"]
    assert [p is model.emb.weight for p in g.params[0]][0] and len(
        g.params[0]
    ) == 3  # emb (= head), norm w, b
    assert g.frozen == [model.scale]
    assert sum(p.numel() for p in g.flat) == 259
    # a parameter shared by two units moves to the root
    model.layers[1].weight = model.layers[0].weight
    g = group_params(model)
    assert any(p is model.layers[0].weight for p in g.params[0])
    with pytest.raises(ValueError, match="submodules of model"):
        group_params(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="nested"):
        group_params(model, [model.layers, model.layers[0]])
    with pytest.raises(ValueError, match="repeat"):
        group_params(model, [model.norm, model.norm])
    frozen = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        group_params(frozen)


def test_bad_arguments_without_ranks():
    for bad in (4, -1, True, "3", None):
        with pytest.raises(ValueError, match="stage must be one of"):
            check_stage(bad)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        resolve_optimizer("lamb", {})
    with pytest.raises(ValueError, match="elementwise"):
        resolve_optimizer(torch.optim.LBFGS, {})
    with pytest.raises(TypeError, match="not an optimizer instance"):
        resolve_optimizer(torch.optim.Adam([nn.Parameter(torch.zeros(1))]), {})
    assert resolve_optimizer("sgd", {"momentum": 0.9}) == (torch.optim.SGD, "momentum")
    assert resolve_optimizer(torch.optim.AdamW, {}) == (torch.optim.AdamW, "adamw")
    with pytest.raises(ValueError, match="world_size"):
        count_state_bytes(nn.Linear(2, 2), 0, 1)
    with pytest.raises(ValueError, match="precision"):
        count_state_bytes(nn.Linear(2, 2), 2, 1, precision="fp8")


# ----------------------------------------------------------------------------- meta: the paper, 7B
def test_paper_numbers_counted_on_meta_equal_the_formula():
    for row in paper_table():
        assert row["counted"] == row["formula"], row
        assert round(row["counted"] / 1e9, 1) == PAPER_GB[row["stage"]], row  # 120 / 31.4 / 16.6 / 1.9


@pytest.mark.parametrize("n", [8, 5])
def test_7b_gpt_per_rank_on_meta(n):
    """LLaMA-7B's width and depth in the lab's GPT (6.7B parameters), mixed-precision Adam."""
    big = GPTConfig(vocab=32000, seq_len=4096, d_model=4096, n_heads=32, n_layers=32, tie_weights=False)
    for stage in range(4):
        got = count_state_bytes(lambda: TinyGPT(big), n, stage, rank=n - 1, precision="mixed")
        psi = got["numel"]
        lay = ZeroLayout((psi,), (1,), n)
        want = expected_state_bytes(lay, stage, "adam", "mixed")
        assert {k: got[k] for k in want} == want, (n, stage)
        # the formula, plus the padding of the replicated bf16 flat buffers (weights; stage 1 gradients too)
        formula = model_state_bytes(psi, n, stage, "adam", "mixed")
        assert want["total"] - formula["total"] == lay.padding * 2 * {1: 2, 2: 1}.get(stage, 0)
    assert psi == 6_723_084_288 and psi % 8 == 0 and psi % 5 == 3


# ----------------------------------------------------------------------------- parity on ranks
def _parity(ctx) -> tuple[list[str], dict]:
    n, r = ctx.world_size, ctx.rank
    bad, finals = [], {}
    for kind in ("gpt", "tied"):
        ref, vocab = make(kind)
        ropt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=LR)
        x, y = synthetic_batch("tokens", BATCH, seq_len=8, vocab=vocab, seed=1)
        b = BATCH // n
        xs, ys = x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]  # this rank's slice of the full batch
        traj = []  # per step: reference loss on our slice, full-batch gradients, parameters after the step
        for _ in range(STEPS):
            with torch.no_grad():
                mine = ref(xs, ys).item()
            ropt.zero_grad()
            ref(x, y).backward()
            grads = {k: p.grad.clone() for k, p in ref.named_parameters() if p.requires_grad}
            ropt.step()
            traj.append(
                (
                    mine,
                    grads,
                    {k: p.detach().clone() for k, p in ref.named_parameters(remove_duplicate=False)},
                )
            )
        for stage in range(4):
            where = f"{kind}, stage {stage}, {n} ranks, rank {r}"
            model, _ = make(kind)
            z = ZeRO(ctx, model, stage=stage, optimizer="adam", lr=LR)
            lay, names = z.layout, [z._names[id(p)] for p in z.groups.flat]
            seen = {}
            z.optimizer.register_step_pre_hook(
                lambda opt, a, k, seen=seen: seen.__setitem__(
                    "grad", opt.param_groups[0]["params"][0].grad.clone()
                )
            )
            for step, (mine, grads, params) in enumerate(traj):
                loss = model(xs, ys)
                dl = abs(loss.item() - mine)
                if (step == 0 and dl != 0) or dl > TOL_LOSS:
                    bad.append(f"{where}: step {step} loss differs by {dl:.3g}")
                loss.backward()
                z.step()
                z.zero_grad()
                full = torch.cat([grads[k].reshape(-1) for k in names] + [torch.zeros(lay.padding)])  # (P,)
                want = full[: lay.numel] if stage == 0 else full.split(lay.shard)[r]  # our slice
                dg = (seen["grad"] - want).abs().max().item() / full.abs().max().item()
                if dg > TOL_GRAD:
                    bad.append(f"{where}: step {step} gradient slice differs by {dg:.3g} of its scale")
                got = full_params(z)
                dp = max((got[k] - v).abs().max().item() for k, v in params.items())
                if dp > TOL_PARAM or (n == 1 and dp != 0):
                    bad.append(f"{where}: step {step} parameters differ by {dp:.3g}")
            if not torch.equal(
                got["scale" if kind == "tied" else "wpe.weight"],
                params["scale" if kind == "tied" else "wpe.weight"],
            ):
                bad.append(f"{where}: the frozen parameter moved")
            finals[(kind, stage)] = np.concatenate([v.reshape(-1).numpy() for v in got.values()])
    return bad, finals


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_parity_with_single_process_adam(n):
    res = launch(_parity, n, timeout=240, backend="gloo")
    assert [b for v in res.values for b in v[0]] == []
    for key, first in res.values[0][1].items():
        for r in range(1, n):
            assert np.array_equal(res.values[r][1][key], first), f"{key}: rank {r} differs from rank 0"


# ----------------------------------------------------------------------------- FSDP2 side by side
def _vs_fsdp2(ctx) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    n, r = ctx.world_size, ctx.rank
    x, y = synthetic_batch("tokens", BATCH, seq_len=8, vocab=37, seed=1)
    b = BATCH // n
    xs, ys = x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]
    ours, _ = make("gpt")
    z = Zero3(ctx, ours, optimizer="adam", lr=LR)
    theirs, _ = make("gpt")
    mesh = init_device_mesh("cpu", (n,))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opt = torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad], lr=LR)
    bad = []
    for step in range(STEPS):
        l1 = ours(xs, ys)
        l1.backward()
        z.step()
        z.zero_grad()
        l2 = theirs(xs, ys)
        l2.backward()
        opt.step()
        opt.zero_grad()
        if abs(l1.item() - l2.item()) > TOL_LOSS or (step == 0 and l1.item() != l2.item()):
            bad.append(f"rank {r} step {step}: loss {l1.item()} vs FSDP2 {l2.item()}")
    got = z.full_parameters()
    for k, v in theirs.state_dict().items():
        d = (got[k] - v.full_tensor()).abs().max().item()
        if d > TOL_PARAM:
            bad.append(f"rank {r}: {k} differs from FSDP2 by {d:.3g}")
    return bad


@pytest.mark.parametrize("n", [2, 3, 4])  # 3 ranks: uneven shards, padded by both
def test_zero3_matches_fsdp2(n):
    res = launch(_vs_fsdp2, n, timeout=240, backend="gloo")
    assert [b for v in res.values for b in v] == []


# ----------------------------------------------------------------------------- memory by category
def _memory(ctx, configs) -> list[dict]:
    out = []
    for stage, precision in configs:
        gc.collect()  # the previous config's wrapper and hooks form a cycle: free it before measuring
        ctx.memory.reset_peak()
        v = zero_train(ctx, stage, steps=2, batch=1, d_model=16, n_layers=6, seq_len=8, vocab=34, n_heads=2,
                       precision=precision, layer_samples=False)  # fmt: skip
        out.append({"stage": stage, "precision": precision, "numel": v["numel"], "live": v["live"],
                    "expected": v["expected"], "peak": sum(v["peak"].values())})  # fmt: skip
    return out


def test_memory_per_category_equals_the_formula_and_the_peak_falls():
    """TinyGPT with 6 small blocks (Ψ = 20,384; 3 ranks do not divide it), 1 x 8 tokens per rank:
    model states outweigh activations, and a block is small next to the model."""
    configs = [(s, "fp32") for s in range(4)] + [(1, "mixed"), (3, "mixed")]
    res = launch(_memory, 3, configs, track_memory=True, timeout=240, backend="gloo")
    for r, rows in enumerate(res.values):
        for row in rows:
            s, prec, psi = row["stage"], row["precision"], row["numel"]
            got = {k: row["live"][k] for k in ("param", "grad", "optim")}  # after the last step
            assert got == {k: row["expected"][k] for k in got}, (r, s, prec)
            formula = model_state_bytes(psi, 3, s, "adam", prec)
            pad = ZeroLayout((psi,), (1,), 3).padding
            item = 4 if prec == "fp32" else 2
            assert pad > 0 and psi == 20_384
            assert got["param"] - formula["param"] == (
                pad * item if s in (1, 2) else 0
            )  # padded flat weights
            assert got["grad"] - formula["grad"] == (pad * item if s == 1 else 0)  # padded flat gradients
            assert got["optim"] == formula["optim"]  # sharded: exactly ceil(Ψ/N) elements per rank
        fp32 = rows[:4]
        peaks = [row["peak"] for row in fp32]
        states = [row["expected"]["total"] for row in fp32]
        assert states == sorted(states, reverse=True) and len(set(states)) == 4
        assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks
        assert all(p > s for p, s in zip(peaks, states))  # activations and buffers come on top


# ----------------------------------------------------------------------------- bytes on the wire
def _comm(ctx, d_model: int) -> list[dict]:
    out = []
    for stage in range(4):
        ctx.recorder.reset()
        v = zero_train(
            ctx, stage, steps=2, batch=2, d_model=d_model, n_layers=2, seq_len=8, vocab=32, n_heads=2
        )
        out.append({"stage": stage, "comm": v["comm"], "numel": v["numel"], "padded": v["padded"]})
    return out


@pytest.mark.parametrize("n, d_model", [(3, 10), (4, 16)])
def test_bytes_per_step_equal_the_formula(n, d_model):
    res = launch(_comm, n, d_model, timeout=240, backend="gloo")
    for r, rows in enumerate(res.values):
        psi, padded = rows[0]["numel"], rows[0]["padded"]
        ring = ring_bytes_per_rank(padded, n, 4, "all_reduce")[r]  # ring all-reduce of the padded buffer
        ddp = ring_bytes_per_rank(psi, n, 4, "all_reduce")[r]  # plain DP: the unpadded gradients
        for row in rows:
            c, s = row["comm"], row["stage"]
            got = (c["sent"] // 2, c["recv"] // 2)  # 2 steps
            assert got == tuple(comm_formula(psi, padded, n, s, 4)[r]), (r, s, got)
            assert got == (ddp if s == 0 else ring if s < 3 else (3 * ring[0] // 2, 3 * ring[1] // 2))
        if psi % n == 0:  # no padding: ZeRO-1/2 move exactly DDP's bytes, ZeRO-3 exactly 1.5x
            assert ring == ddp and psi == padded
        else:
            assert ring != ddp and padded - psi < n
    assert {rows[0]["numel"] % n == 0 for rows in res.values} == {n == 4}


# ----------------------------------------------------------------------------- stage 2 / 3 mechanics
def _mechanics(ctx, stage: int, prefetch: bool = True) -> dict:
    model = build_model(GPTConfig(vocab=32, seq_len=8, d_model=32, n_heads=2, n_layers=3), seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    extra = {"prefetch": prefetch} if stage == 3 else {}
    z = ZeRO(ctx, model, stage=stage, lr=LR, **extra)
    x, y = synthetic_batch("tokens", 2, seq_len=8, vocab=32, seed=ctx.rank)
    for _ in range(2):
        ctx.recorder.reset()
        loss = model(x, y)
        loss.backward()
        z.step()
        z.zero_grad()
    return {
        "samples": [(s["label"], s["bytes"]["param"], s["bytes"]["grad"]) for s in ctx.recorder.samples],
        "spans": [(e["name"], e["kind"], e["start"], e["end"]) for e in ctx.recorder.events],
        "shard": z.layout.shard * 4,
        "full": n_params * 4,
        "numels": [p.numel() for p in model.parameters()],
    }


def test_stage2_frees_each_units_gradients_during_backward():
    res = launch(_mechanics, 2, 2, track_memory=True, backend="gloo")
    v = res.values[0]
    grads = [g for label, _, g in v["samples"]]
    assert max(grads) > v["shard"]  # full gradients do appear...
    assert max(grads) < v["shard"] + v["full"] // 2  # ...but never the whole model's at once
    drops = [g for label, _, g in v["samples"] if label.startswith("reduce-scattered")]
    block = 4 * (12 * 32 * 32 + 13 * 32)  # one block's gradients, fp32
    assert len(drops) == 4  # blocks 2, 1, 0, then the root (its tied embedding finishes last)
    assert all(g < v["shard"] + block // 10 for g in drops)  # each block's gradients gone at once
    assert drops[-1] == v["shard"]  # (before the root's turn only its LayerNorm gradients wait)


@pytest.mark.parametrize("prefetch", [True, False])
def test_stage3_gathers_before_a_block_frees_after_and_prefetches(prefetch):
    res = launch(_mechanics, 2, 3, prefetch, track_memory=True, backend="gloo")
    v = res.values[0]
    assert all(n == 0 for n in v["numels"])  # between steps the module holds placeholders
    params = {label: p for label, p, _ in v["samples"]}
    for b in range(3):
        assert params[f"gathered blocks.{b}"] > v["shard"]  # a block's full weights while it runs
    assert v["samples"][-1][1] == v["shard"]  # after the step: the slice, nothing gathered
    freed = [p for label, p, _ in v["samples"] if label.startswith("freed")]
    assert freed and min(freed) == v["shard"]
    spans = v["spans"]
    fwd = {name.split(" ", 1)[1]: (s, e) for name, kind, s, e in spans if name.startswith("forward blocks")}
    gathers = [(s, e) for name, kind, s, e in spans if name == "all_gather"]
    # prefetch: the next block's gather is issued before a block computes and waited after it,
    # so its span covers the block's forward (blocks 0 and 1 have a next block)
    covered = [b for b, (s, e) in fwd.items() if any(gs <= s and e <= ge for gs, ge in gathers)]
    assert sorted(covered) == (["blocks.0", "blocks.1"] if prefetch else []), covered
    bwd = {name.split(" ", 1)[1]: (s, e) for name, kind, s, e in spans if name.startswith("backward blocks")}
    covered = [b for b, (s, e) in bwd.items() if any(gs <= s and e <= ge for gs, ge in gathers)]
    assert sorted(covered) == (["blocks.1", "blocks.2"] if prefetch else []), covered  # backward: reversed


# ----------------------------------------------------------------------------- bad input on ranks
def _bad(ctx) -> list[tuple[str, str, str]]:
    out = []

    def expect(case, fn):
        try:
            fn()
            out.append((case, "no error", ""))
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out.append((case, type(e).__name__, str(e)))

    m = lambda: make("tied")[0]  # noqa: E731
    expect("stage 3 via ZeroOptimizer", lambda: ZeroOptimizer(ctx, m(), stage=3))
    expect("stage 4", lambda: ZeRO(ctx, m(), stage=4))
    expect("stage -1", lambda: ZeroOptimizer(ctx, m(), stage=-1))
    expect("optimizer lamb", lambda: ZeRO(ctx, m(), stage=1, optimizer="lamb"))
    expect("optimizer Adagrad", lambda: Zero3(ctx, m(), optimizer=torch.optim.Adagrad))
    expect("precision fp16", lambda: ZeRO(ctx, m(), stage=2, precision="fp16"))
    x, y = synthetic_batch("tokens", 2, seq_len=4, vocab=11, seed=0)

    def replaced(stage):
        model = m()
        z = ZeRO(ctx, model, stage=stage)
        model.layers[1].weight = nn.Parameter(torch.zeros(7, 7))  # a new Parameter after wrapping
        model(x, y).backward()
        z.step()

    def moved():
        model = m()
        z = ZeRO(ctx, model, stage=1)
        model.layers[0].weight.data = model.layers[0].weight.data.clone()  # no longer the flat buffer
        model(x, y).backward()
        z.step()

    def frozen_later():
        model = m()
        z = ZeRO(ctx, model, stage=2)
        model.norm.weight.requires_grad_(False)
        model(x, y).backward()
        z.step()

    for stage in (0, 1, 2, 3):
        expect(f"replaced parameter, stage {stage}", lambda s=stage: replaced(s))
    expect("moved data", moved)
    expect("frozen after wrapping", frozen_later)
    return out


def test_bad_input_is_a_clear_error():
    res = launch(_bad, 2, backend="gloo")
    got = {case: (t, msg) for case, t, msg in res.values[0]}
    for case in ("stage 3 via ZeroOptimizer", "stage 4", "stage -1"):
        assert got[case][0] == "ValueError" and "stage" in got[case][1], got[case]
    for case in ("optimizer lamb", "optimizer Adagrad"):
        assert got[case][0] == "ValueError" and "optimizer must be one of" in got[case][1], got[case]
    assert got["precision fp16"][0] == "ValueError" and "precision" in got["precision fp16"][1]
    for case in [f"replaced parameter, stage {s}" for s in range(4)] + [
        "moved data",
        "frozen after wrapping",
    ]:
        assert got[case][0] == "ValueError" and got[case][1].startswith("model:"), (case, got[case])
    assert "'layers.1.weight' is a new Parameter" in got["replaced parameter, stage 1"][1]
    assert "'layers.0.weight' no longer reads" in got["moved data"][1]
    assert "'norm.weight' changed requires_grad" in got["frozen after wrapping"][1]


def test_a_rank_error_names_the_rank():
    with pytest.raises(RankError, match="stage must be one of"):
        launch(lambda ctx: ZeRO(ctx, make("tied")[0], stage=7), 2, backend="gloo")


# ----------------------------------------------------------------------------- the script (torchrun)
def test_script_under_torchrun(tmp_path):
    """SLOW-ish (~10 s): two spawned processes each import torch."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from parallel_lab import RunResult

    trace = tmp_path / "zero.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "-m", "parallel_lab.scripts.zero", "--stage", "3",
           "--steps", "2", "--d-model", "32", "--layers", "2", "--trace", str(trace)]  # fmt: skip
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(cmd, cwd=repo, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical weights on every rank; bytes equal the formulas" in out.stdout
    res = RunResult.load(str(trace))
    assert res.world_size == 2 and {"all_gather", "ring_reduce_scatter", "optimizer.step"} <= {
        e["name"] for e in res.timeline
    }


# ----------------------------------------------------------------------------- accumulation, eval
def _accumulate(ctx) -> list[float]:
    cfg = GPTConfig(vocab=37, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    x, y = synthetic_batch("tokens", 8, seq_len=8, vocab=37, seed=ctx.rank)
    diffs = []
    for stage in range(4):
        a, b = build_model(cfg, seed=0), build_model(cfg, seed=0)
        za, zb = ZeRO(ctx, a, stage=stage, lr=LR), ZeRO(ctx, b, stage=stage, lr=LR)
        for _ in range(3):
            a(x, y).backward()  # the whole local batch at once
            za.step()
            za.zero_grad()
            with torch.no_grad():
                b(x, y)  # an evaluation forward in between changes nothing
            for half in (slice(0, 4), slice(4, 8)):  # two micro-batches, gradients accumulated
                (b(x[half], y[half]) / 2).backward()
            zb.step()
            zb.zero_grad()
        pa, pb = full_params(za), full_params(zb)
        diffs.append(max((pa[k] - pb[k]).abs().max().item() for k in pa))
    return diffs


def test_gradient_accumulation_and_an_eval_forward():
    """Two half micro-batches accumulated = one full batch, up to summation order (same tolerance)."""
    for diffs in launch(_accumulate, 2, backend="gloo").values:
        assert all(d <= TOL_PARAM for d in diffs), diffs

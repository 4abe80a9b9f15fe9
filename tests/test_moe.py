"""MoE: routers against naive loops, capacity and drops, the Switch loss, expert parallel vs one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import parallel_lab as pl
from parallel_lab.moe import Expert, MoEConfig, TopKRouter, build_moe, expert_capacity, switch_aux_loss
from parallel_lab.moe.expert_parallel import ExpertParallelMoE, all_to_all_v, dispatch_bytes, expert_owner


def _x(n: int, d: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _naive_token_choice(probs, k, capacity, order=None, keep_second=None):
    """Slots by hand: walk choices in priority order, give each the next free slot of its expert."""
    n, E = probs.shape
    top_p, top_e = probs.topk(k, dim=-1)
    order = list(range(n)) if order is None else order
    slots = {e: [] for e in range(E)}
    dropped = 0
    for c in range(k):
        for t in order:
            if c == 1 and keep_second is not None and not keep_second[t]:
                continue
            e = int(top_e[t, c])
            if len(slots[e]) < capacity:
                slots[e].append(t)
            else:
                dropped += 1
    return slots, dropped


# ----------------------------------------------------------------------------- single process
def test_capacity_formula_and_bad_input():
    assert expert_capacity(64, 8, 1.0) == 8
    assert expert_capacity(64, 8, 1.25) == 10
    assert expert_capacity(10, 4, 1.0, k=2) == 5
    assert expert_capacity(7, 3, 1.0) == 3  # ceil(7/3)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="capacity_factor must be > 0"):
            expert_capacity(8, 2, bad)
    with pytest.raises(TypeError, match="capacity_factor"):
        expert_capacity(8, 2, "1.0")
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        TopKRouter(8, 4, capacity_factor=0.0)
    with pytest.raises(ValueError, match=r"k must be an int with 1 <= k <= num_experts \(4\)"):
        TopKRouter(8, 4, k=5)
    with pytest.raises(ValueError, match="k must be"):
        TopKRouter(8, 4, k=0)
    with pytest.raises(ValueError, match="policy"):
        TopKRouter(8, 4, policy="hash")
    with pytest.raises(ValueError, match="k must be 2"):
        TopKRouter(8, 4, k=1, policy="gshard")
    with pytest.raises(ValueError, match="num_experts"):
        TopKRouter(8, 0)
    with pytest.raises(ValueError, match="groups"):
        build_moe(MoEConfig())(_x(10), groups=3)


@pytest.mark.parametrize("k,cf", [(1, 1.0), (1, 0.5), (1, 2.0), (2, 1.0), (2, 0.75), (3, 1.25)])
def test_token_choice_matches_naive_slots(k, cf):
    router = TopKRouter(16, 6, k=k, capacity_factor=cf)
    with torch.no_grad():
        router.weight.mul_(50)  # confident, unbalanced routing: plenty of overflow
    r = router(_x(40))
    C = expert_capacity(40, 6, cf, k)
    assert r.capacity == C
    slots, dropped = _naive_token_choice(r.probs, k, C)
    for e in range(6):
        n = int(r.counts[e])
        assert r.expert_tokens[e, :n].tolist() == slots[e]
        assert (r.expert_tokens[e, n:] == -1).all() and (r.expert_gates[e, n:] == 0).all()
    # drop count = the capacity formula: every expert keeps min(choices, C)
    assert r.dropped == dropped == int((r.tokens_per_expert - C).clamp(min=0).sum())
    assert r.counts.tolist() == r.tokens_per_expert.clamp(max=C).tolist()
    # gates: the chosen probabilities, renormalised over the k choices when k > 1
    top_p, top_e = r.probs.topk(k, -1)
    for e in range(6):
        for slot, t in enumerate(slots[e]):
            c = int((top_e[t] == e).nonzero())
            want = top_p[t, c] / (top_p[t].sum() if k > 1 else 1)
            assert r.expert_gates[e, slot].item() == pytest.approx(want.item(), rel=1e-6)


def test_switch_router_is_fp32_and_aux_loss_formula():
    router = TopKRouter(16, 4, k=1, capacity_factor=1.0).to(torch.bfloat16)
    r = router(_x(32).to(torch.bfloat16))
    assert r.probs.dtype == torch.float32 and r.expert_gates.dtype == torch.float32  # selective precision
    probs, E = r.probs, 4
    first = probs.argmax(-1)
    f = [sum(int(first[t]) == e for t in range(32)) / 32 for e in range(E)]
    P = [probs[:, e].mean().item() for e in range(E)]
    want = E * sum(fe * pe for fe, pe in zip(f, P))
    assert r.aux_loss.item() == pytest.approx(want, rel=1e-6)
    # uniform probabilities and a perfect spread give exactly 1; all on one expert gives E * P_e
    uniform = torch.full((8, 4), 0.25)
    assert switch_aux_loss(uniform, torch.arange(8) % 4).item() == pytest.approx(1.0)
    assert switch_aux_loss(uniform, torch.zeros(8, dtype=torch.long)).item() == pytest.approx(1.0)
    peaked = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert switch_aux_loss(peaked, torch.zeros(8, dtype=torch.long)).item() == pytest.approx(4 * 0.7)


def test_aux_loss_gradient_pushes_toward_balance():
    router = TopKRouter(16, 4, capacity_factor=2.0)
    with torch.no_grad():
        router.weight[0] += 0.5  # expert 0 favoured
    x = _x(64)
    r = router(x)
    r.aux_loss.backward()
    before = r.probs[:, 0].mean().item()
    with torch.no_grad():
        router.weight -= 1.0 * router.weight.grad
    assert router(x).probs[:, 0].mean().item() < before


def test_gshard_random_second_expert():
    router = TopKRouter(16, 8, k=2, capacity_factor=100.0, policy="gshard")  # no overflow: see the coins only
    x = _x(2000)
    r = router(x, torch.Generator().manual_seed(3))
    top_p, _ = r.probs.topk(2, -1)
    g2 = top_p[:, 1] / top_p.sum(-1)
    coin = torch.rand(2000, generator=torch.Generator().manual_seed(3))
    keep = 2 * g2 > coin
    assert int(r.counts.sum()) == 2000 + int(keep.sum())  # every first choice, plus the kept seconds
    assert abs(keep.float().mean().item() - (2 * g2).clamp(max=1).mean().item()) < 0.03
    slots, dropped = _naive_token_choice(r.probs, 2, r.capacity, keep_second=keep)
    assert all(r.expert_tokens[e, : int(r.counts[e])].tolist() == slots[e] for e in range(8))
    again = router(x, torch.Generator().manual_seed(3))
    assert torch.equal(again.expert_tokens, r.expert_tokens)  # same seed, same coins
    small = TopKRouter(16, 8, k=2, capacity_factor=0.5, policy="gshard")
    s = small(x, torch.Generator().manual_seed(3))
    assert s.dropped == int((s.tokens_per_expert - s.capacity).clamp(min=0).sum())


def test_batch_priority_routing_drops_the_least_confident():
    router = TopKRouter(16, 4, k=1, capacity_factor=0.5, policy="bpr")
    with torch.no_grad():
        router.weight.mul_(30)
    r = router(_x(64))
    top = r.probs.max(-1).values
    order = top.argsort(descending=True, stable=True).tolist()
    slots, dropped = _naive_token_choice(r.probs, 1, r.capacity, order=order)
    assert all(r.expert_tokens[e, : int(r.counts[e])].tolist() == slots[e] for e in range(4))
    assert r.dropped == dropped == int((r.tokens_per_expert - r.capacity).clamp(min=0).sum())
    # within each full expert, every kept token is at least as confident as every dropped one
    first = r.probs.argmax(-1)
    for e in range(4):
        kept = set(slots[e])
        lost = [t for t in range(64) if int(first[t]) == e and t not in kept]
        if lost:
            assert min(top[t] for t in kept) >= max(top[t] for t in lost)
    # same overflow as first-come-first-served, but less routing weight thrown away
    fcfs = TopKRouter(16, 4, k=1, capacity_factor=0.5)
    fcfs.load_state_dict(router.state_dict())
    f = fcfs(_x(64))
    assert f.dropped == r.dropped
    assert r.expert_gates.sum() > f.expert_gates.sum()


def test_expert_choice():
    router = TopKRouter(16, 4, capacity_factor=1.0, policy="expert_choice")
    r = router(_x(32))
    C = expert_capacity(32, 4, 1.0)
    assert r.capacity == C and r.counts.tolist() == [C] * 4 and r.dropped == 0
    for e in range(4):
        want = r.probs[:, e].topk(C).indices
        assert r.expert_tokens[e].tolist() == want.tolist()  # each expert takes its top-C tokens
        assert torch.equal(r.expert_gates[e], r.probs[want, e])
    covered = torch.zeros(32, dtype=torch.bool)
    covered[r.expert_tokens.flatten()] = True
    assert r.unrouted == int((~covered).sum())


@pytest.mark.parametrize("policy,k", [("token_choice", 1), ("token_choice", 2), ("expert_choice", 1)])
def test_layer_equals_per_token_loop(policy, k):
    layer = build_moe(MoEConfig(d_model=8, d_ff=16, num_experts=4, k=k, capacity_factor=1.0, policy=policy))
    x = _x(24, 8)
    y, aux, (r,) = layer(x)
    want = torch.zeros_like(x)
    for e in range(4):
        for slot in range(int(r.counts[e])):
            t = int(r.expert_tokens[e, slot])
            want[t] += r.expert_gates[e, slot] * layer.experts[e](x[t : t + 1])[0]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)  # per-token matmuls vs one per expert
    assert aux is r.aux_loss or torch.equal(aux, r.aux_loss)


# ----------------------------------------------------------------------------- expert parallel
P, N, STEPS = 4, 24, 3
CONFIGS = [
    ("exact", MoEConfig(d_model=16, d_ff=24, num_experts=8, k=1, capacity_factor=1.0)),  # Switch
    ("exact", MoEConfig(d_model=16, d_ff=24, num_experts=4, k=2, capacity_factor=0.75, policy="gshard")),
    ("exact", MoEConfig(d_model=16, d_ff=24, num_experts=8, k=1, capacity_factor=0.5, policy="bpr")),
    (
        "exact",
        MoEConfig(d_model=16, d_ff=24, num_experts=4, k=1, capacity_factor=1.0, policy="expert_choice"),
    ),
    ("padded", MoEConfig(d_model=16, d_ff=24, num_experts=8, k=2, capacity_factor=1.25)),
]


def _ep_parity(ctx, configs):
    """Each config: STEPS SGD steps of EP vs the single-process layer on the whole batch (one group per rank)."""
    torch.set_num_threads(1)
    p, r = ctx.world_size, ctx.rank
    report = []
    for variant, cfg in configs:
        ref, full = build_moe(cfg, seed=1), build_moe(cfg, seed=1)
        with torch.no_grad():
            full.router.weight[1] += 0.3  # skewed toward expert 1: overflow and drops
            ref.router.weight[1] += 0.3
            full.router.weight[-1] -= 5.0  # the last expert gets (almost) nothing: empty buffers
            ref.router.weight[-1] -= 5.0
        ep = ExpertParallelMoE(ctx, full, variant)
        L = cfg.num_experts // p
        mine = range(r * L, (r + 1) * L)
        opt_ep = torch.optim.SGD(ep.parameters(), lr=0.1)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        worst = {"fwd": 0.0, "dx": 0.0, "expert_grad": 0.0, "router_grad": 0.0, "params": 0.0}
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 + step)
            X, T = torch.randn(p * N, cfg.d_model, generator=g), torch.randn(p * N, cfg.d_model, generator=g)
            Xr = X.clone().requires_grad_()
            y_ref, aux_ref, routings = ref(Xr, groups=p, seed=step)
            ((y_ref * T).sum() + 0.1 * aux_ref).backward()  # sum over tokens: each rank's share adds up
            xs = X.chunk(p)[r].clone().requires_grad_()
            before = dict(ctx.recorder.comm)
            before = {k: v["sent"] for k, v in before.items()}
            y, aux, routing = ep(xs, seed=step)
            ((y * T.chunk(p)[r]).sum() + 0.1 * aux / p).backward()
            sent = {k: v["sent"] - before.get(k, 0) for k, v in ctx.recorder.comm.items()}
            itemsize = xs.element_size()
            want = dispatch_bytes(routing, r, p, cfg.d_model, itemsize, variant)
            assert sent["moe_dispatch"] == want == sent["moe_combine.grad"], (variant, sent, want)
            assert (
                routing.dropped
                == routings[r].dropped
                == int((routing.tokens_per_expert - routing.capacity).clamp(min=0).sum())
                or cfg.policy == "expert_choice"
            )
            # the router's gradient is a sum over every rank's tokens: all-reduce it (data parallel)
            dist.all_reduce(ep.router.weight.grad)
            exact = variant == "exact"
            diffs = {
                "fwd": (y - y_ref.chunk(p)[r]).abs().max().item(),
                "dx": (xs.grad - Xr.grad.chunk(p)[r]).abs().max().item(),
                "expert_grad": max(
                    (a.grad - b.grad).abs().max().item()
                    for j, e in enumerate(mine)
                    for a, b in zip(ep.experts[j].parameters(), ref.experts[e].parameters())
                ),
                "router_grad": (ep.router.weight.grad - ref.router.weight.grad).abs().max().item(),
            }
            if exact and step == 0:  # same weights, same tokens in the same order, same matmuls: same bits
                assert diffs["fwd"] == diffs["expert_grad"] == 0.0, (cfg, diffs)
            for k, v in diffs.items():
                worst[k] = max(worst[k], v)
            opt_ep.step()
            opt_ref.step()
            opt_ep.zero_grad()
            opt_ref.zero_grad()
            worst["params"] = max(
                worst["params"],
                max(
                    (a - b).abs().max().item()
                    for j, e in enumerate(mine)
                    for a, b in zip(ep.experts[j].parameters(), ref.experts[e].parameters())
                ),
                (ep.router.weight - ref.router.weight).abs().max().item(),
            )
        report.append(worst)
    return report


def test_expert_parallel_equals_single_process():
    res = pl.launch(_ep_parity, P, CONFIGS, timeout=120)
    for rank_report in res.values:
        for (_, cfg), worst in zip(CONFIGS, rank_report):
            # Router gradients are summed over ranks by an all-reduce (another order than one matmul
            # over all tokens): float32 rounding, ~1e-7 relative. Padded experts also sum the bias
            # gradient over the empty slots' zero rows, again another order.
            assert worst["router_grad"] < 1e-5, (cfg, worst)
            assert worst["params"] < 1e-5, (cfg, worst)
            # dx also flows back through the router: (N/p, E) @ (E, d) here, (N, E) @ (E, d) in the
            # reference; BLAS may order a row's sum differently for another number of rows. After
            # the first step the router weights carry the all-reduce's rounding, so later steps differ
            # by float32 rounding as well.
            assert max(worst["fwd"], worst["dx"], worst["expert_grad"]) < 1e-5, (cfg, worst)

    # two all-to-alls forward and two backward, on every rank, visible on the timeline
    for name in ("moe_dispatch", "moe_combine", "moe_dispatch.grad", "moe_combine.grad"):
        assert len(res.spans(kind="comm", name=name)) == P * STEPS * len(CONFIGS)


def _a2av(ctx):
    p, r = ctx.world_size, ctx.rank
    rows = [(r + 2 * j) % 3 for j in range(p)]  # uneven, some zero
    send = [torch.full((n, 5), 10.0 * r + j) for j, n in enumerate(rows)]
    recv_rows = [(j + 2 * r) % 3 for j in range(p)]
    got = all_to_all_v(ctx, send, recv_rows)
    out = torch.empty(sum(recv_rows), 5)
    dist.all_to_all_single(out, torch.cat(send), recv_rows, rows)  # the built-in, uneven splits
    return torch.equal(torch.cat(got), out), ctx.recorder.comm["all_to_all_v"]["sent"], rows


@pytest.mark.parametrize("world", [1, 3])
def test_all_to_all_v_equals_built_in(world):
    res = pl.launch(_a2av, world)
    for r, (same, sent, rows) in enumerate(res.values):
        assert same
        assert sent == sum(n for j, n in enumerate(rows) if j != r) * 5 * 4


def _ep_bad(ctx):
    with pytest.raises(ValueError, match="one entry per rank"):
        all_to_all_v(ctx, [torch.zeros(1, 2)], [1])
    with pytest.raises(ValueError, match="trailing shape"):
        all_to_all_v(ctx, [torch.zeros(1, 2)] * 3 + [torch.zeros(1, 3)], [1] * 4)
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by the number of ranks \(4\)"):
        ExpertParallelMoE(ctx, build_moe(MoEConfig(num_experts=6)))
    with pytest.raises(ValueError, match="variant"):
        ExpertParallelMoE(ctx, build_moe(MoEConfig(num_experts=4)), variant="dense")
    return True


def test_expert_parallel_bad_input():
    assert pl.launch(_ep_bad, 4).values == [True] * 4
    assert [expert_owner(e, 8, 4) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_expert_module_shapes():
    assert Expert(8, 16)(torch.zeros(0, 8)).shape == (0, 8)  # an expert with no tokens is fine
    assert math.isclose(expert_capacity(1000, 64, 1.25), 20)


def test_script_runs_and_checks(tmp_path, capsys):
    from parallel_lab.scripts import moe as script

    trace = tmp_path / "moe.json"
    assert script.main(["--nproc", "2", "--steps", "1", "--tokens", "16", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "expert parallel matches the single-process layer" in out
    loaded = pl.RunResult.load(str(trace))
    assert {e["name"] for e in loaded.spans(kind="comm")} >= {"moe_dispatch", "moe_combine"}


def test_capacity_is_the_formula_even_where_floats_round_up():
    """1.1 x 10 is 11.000000000000002 in floats: the ceiling must still be 11."""
    from parallel_lab.moe import expert_capacity

    assert expert_capacity(10, 1, 1.1) == 11
    assert expert_capacity(100, 10, 1.1) == 11
    assert expert_capacity(30, 3, 0.7) == 7  # 0.7 x 10 = 7.000000000000001
    assert expert_capacity(64, 8, 1.25) == 10 and expert_capacity(7, 2, 1.0, k=2) == 7

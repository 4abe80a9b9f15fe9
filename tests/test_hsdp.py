"""HSDP (lesson 20): ZeRO-3 inside a shard group of neighbours, the gradient slice all-reduced across
replicas. Parity with one process on the whole batch and with torch's FSDP2 `fully_shard` on a 2D
mesh (replicate, shard), on 4 and 8 gloo ranks (2x2, 2x4, 4x2), with test_zero's models: a TinyGPT
with tied weights and a frozen parameter, and TiedNet (259 parameters: no shard count divides it).
Tolerances are test_zero's (the same sums in another order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_zero import LR, TOL_LOSS, TOL_PARAM, make

from parallel_lab import launch
from parallel_lab.comms import ring_bytes_per_rank
from parallel_lab.models import synthetic_batch
from parallel_lab.zero import HSDP, HSDPMesh

STEPS = 3  # Adam steps compared (test_zero runs 5; 3 already moves every parameter off its start)


def _hsdp_parity(ctx, R: int, S: int) -> tuple[list[str], dict]:
    """Against one process (every step) and FSDP2 on the same 2D mesh (losses every step, parameters at the end)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    n, r = ctx.world_size, ctx.rank
    groups = HSDPMesh(R, S).build(ctx)
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    bad, finals = [], {}
    for axis in ("replicate", "shard"):  # our groups are torch's, rank for rank
        if R > 1 and S > 1 and dist.get_process_group_ranks(mesh.get_group(axis)) != groups.ranks(axis):
            bad.append(f"rank {r}: {axis} group {groups.ranks(axis)} is not torch's")
    batch = 2 * n  # every rank its own 2 sequences: replicas see different data
    for kind in ("gpt", "tied") if S > 1 else ("tied",):
        ref, vocab = make(kind)
        ropt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=LR)
        x, y = synthetic_batch("tokens", batch, seq_len=8, vocab=vocab, seed=1)
        xs, ys = x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2]
        ours, _ = make(kind)
        z = HSDP(ctx, ours, groups, optimizer="adam", lr=LR)
        theirs, _ = make(kind)
        units = theirs.blocks if kind == "gpt" else theirs.layers
        for block in units:
            fully_shard(block, mesh=mesh)
        fully_shard(theirs, mesh=mesh)
        topt = torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad], lr=LR)
        for step in range(STEPS):
            ropt.zero_grad()
            ref(x, y).backward()
            ropt.step()
            for model, opt in ((ours, z), (theirs, topt)):
                loss = model(xs, ys)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if model is ours:
                    l1 = loss.item()
                elif abs(l1 - loss.item()) > TOL_LOSS:
                    bad.append(f"{kind} rank {r} step {step}: loss {l1} vs FSDP2 {loss.item()}")
            got = z.full_parameters()
            for k, v in ref.named_parameters(remove_duplicate=False):
                d = (got[k] - v.detach()).abs().max().item()
                if d > TOL_PARAM:
                    bad.append(
                        f"{kind} {R}x{S} rank {r} step {step}: {k} differs from one process by {d:.3g}"
                    )
        for k, v in theirs.state_dict().items():
            d = (got[k] - v.full_tensor()).abs().max().item()
            if d > TOL_PARAM:
                bad.append(f"{kind} {R}x{S} rank {r}: {k} differs from FSDP2 by {d:.3g}")
        finals[kind] = np.concatenate([v.reshape(-1).numpy() for v in got.values()])
        finals[kind, "layout"] = (z.layout.padded, z.layout.shard)
    return bad, finals


@pytest.mark.parametrize("R,S", [(2, 2), (2, 4), (4, 2), (4, 1)])  # 4 x 1: one-rank shard groups (plain DP)
def test_hsdp_equals_one_process_and_fsdp2_on_a_2d_mesh(R, S):
    res = launch(
        _hsdp_parity, R * S, R, S, timeout=240, backend="gloo"
    )  # CPU models, whatever GPUs there are
    assert [b for v in res.values for b in v[0]] == []
    kinds = ("gpt", "tied") if S > 1 else ("tied",)
    for kind in kinds:  # the all-gather copies bytes: every rank the same model
        assert all(np.array_equal(v[1][kind], res.values[0][1][kind]) for v in res.values), kind
    # bytes per axis (the lab's collectives only: FSDP2's are not traced), per rank, over both models' steps:
    # shard axis 3 (P - P/S) per step (gather in forward and in backward, reduce-scatter), replicate axis a ring
    # all-reduce of the (P/S,) slice over R ranks, fp32
    for rank, c in enumerate(res.comm_bytes):
        rep = HSDPMesh(R, S).coords(rank)["replicate"]
        lays = [res.values[rank][1][kind, "layout"] for kind in kinds]
        once = sum(STEPS * (padded - sl) * 4 for padded, sl in lays)  # one pass over the model, per step
        replicate = sum(STEPS * ring_bytes_per_rank(sl, R, 4, "all_reduce")[rep][0] for _, sl in lays)
        got = {k: v["sent"] for k, v in c["by_op"].items() if v["sent"]}
        # all-gathers: forward, backward, and the test's full_parameters() after each step (none when S = 1)
        want = {"all_gather": 3 * once, "ring_reduce_scatter": once, "ring_all_reduce": replicate}
        assert replicate > 0 and got == {k: v for k, v in want.items() if v}, (rank, got, want)


def test_mesh_layout_and_bad_input():
    mesh = HSDPMesh(2, 4)
    assert mesh.groups("shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # neighbours: one node's links
    assert mesh.groups("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.coords(6) == {"replicate": 1, "shard": 2}
    with pytest.raises(ValueError, match="HSDPMesh.shard must be an int >= 1"):
        HSDPMesh(2, 0)
    with pytest.raises(ValueError, match="axis must be"):
        mesh.groups("dp")


def _memory(ctx, R: int, S: int) -> list:
    from parallel_lab.zero import expected_state_bytes

    torch.set_num_threads(1)
    groups = HSDPMesh(R, S).build(ctx)
    model, vocab = make("gpt")
    z = HSDP(ctx, model, groups, optimizer="adam", lr=LR)
    x, y = synthetic_batch("tokens", 2, seq_len=8, vocab=vocab, seed=ctx.rank)
    for _ in range(2):
        model(x, y).backward()
        z.step()
        z.zero_grad()
    live = ctx.memory.snapshot()
    frozen = sum(p.numel() * p.element_size() for p in z.groups.frozen)  # kept whole on every rank (wpe)
    assert z.world_size == S and groups.ranks("shard") == HSDPMesh(R, S).groups("shard")[ctx.rank // S]
    return [{k: live[k] for k in ("param", "grad", "optim")}, expected_state_bytes(z.layout, 3, "adam", "fp32"),
            z.layout.numel, frozen]  # fmt: skip


def test_memory_per_rank_is_zero3_on_the_shard_group():
    """The tracker after two steps, 2 x 2 ranks: each rank holds ZeRO-3's states on S = 2 ranks (its
    slice of parameters, gradients and Adam's two moments: 16Ψ/S bytes in fp32); a frozen parameter stays
    whole on every rank."""
    from parallel_lab.costmodel import model_state_bytes

    res = launch(_memory, 4, 2, 2, track_memory=True, timeout=240, backend="gloo")
    for live, expected, psi, frozen in res.values:
        assert frozen > 0 and live == {k: expected[k] + (frozen if k == "param" else 0) for k in live}, (
            live,
            expected,
        )
        formula = model_state_bytes(
            psi, 2, 3, "adam", "fp32"
        )  # ZeRO-3 over the shard group (Ψ = 3050: no padding)
        assert live == {k: formula[k] + (frozen if k == "param" else 0) for k in live}, (live, formula)


# ----------------------------------------------------------------------------- the planner
def test_planner_hsdp_memory_is_zero3_on_a_node_and_its_time_stays_near_one_nodes():
    """A 7B model, tp = pp = 1, 4 micro-batches per step, 8 GPUs a node, a 6.25 GB/s network per GPU:
    flat ZeRO-3 gathers every layer over the network every micro-batch; HSDP (one replica a node) keeps
    that on NVLink and sends one fp32 slice per step across nodes; ZeRO-1 all-reduces the gradients
    across nodes once. Memory: HSDP holds ZeRO-3's states on 8 GPUs whatever the node count."""
    from parallel_lab.costmodel import ClusterSpec, evaluate, model_state_bytes
    from parallel_lab.costmodel.planner import ModelSpec, stage_params

    model = ModelSpec("7B", layers=32, hidden=4096, heads=32, seq=2048, vocab=32000)
    n_params = stage_params(model, 1, 1)
    for nodes in (1, 4, 16):
        cluster, dp = ClusterSpec(gpus=8 * nodes, inter_bw=6.25e9), 8 * nodes
        kw = dict(checkpointing=True, global_batch=4 * dp, micro_batch=1)
        flat = evaluate(model, cluster, dp, 1, 1, 3, **kw)
        hsdp = evaluate(model, cluster, dp, 1, 1, 3, replicate=nodes, **kw)
        zero1 = evaluate(model, cluster, dp, 1, 1, 1, **kw)
        states = model_state_bytes(n_params, 8, 3, "adam", "mixed")
        assert {k: hsdp.memory[k] for k in states if k != "total"} == {
            k: v for k, v in states.items() if k != "total"
        }
        if nodes == 1:
            assert hsdp.time == flat.time and hsdp.memory == flat.memory
            continue
        assert hsdp.time["dp_comm"] < zero1.time["dp_comm"] < flat.time["dp_comm"], (nodes, hsdp, zero1, flat)
        assert flat.memory["total"] < hsdp.memory["total"] < zero1.memory["total"]
        assert str(hsdp).split()[3:5] == ["HSDP", f"{nodes}x8"]


def test_planner_hsdp_bad_input_is_named():
    from parallel_lab.costmodel import GPT3, ClusterSpec, evaluate

    cluster = ClusterSpec(gpus=16)
    with pytest.raises(ValueError, match="replicate=2 is HSDP.*needs zero=3"):
        evaluate(GPT3, cluster, 16, 1, 1, 1, False, 64, replicate=2)
    with pytest.raises(ValueError, match=r"replicate \(3\) must divide dp x cp = 16"):
        evaluate(GPT3, cluster, 16, 1, 1, 3, False, 64, replicate=3)

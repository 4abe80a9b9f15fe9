"""Lesson 21 as a script: node-limited two-hop dispatch and redundant experts, checked against one process.

    torchrun --nproc-per-node 4 -m parallel_lab.scripts.moe_at_scale
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 -m parallel_lab.scripts.moe_at_scale
    python -m parallel_lab.scripts.moe_at_scale              # no launcher: 4 local ranks

The ranks are read as --nodes nodes of consecutive ranks: by default the launcher's nodes when there are
several (torchrun numbers ranks node by node), else 2 emulated nodes on one machine, whose bytes that
would cross the network are counted, not timed. Every rank builds the same seeded
`FineGrainedMoE` (sigmoid router, a skew on the routing bias so some experts are hot, node-limited to
--max-groups nodes) and its own tokens. Then:

1. Dispatch: the routed experts spread over the ranks, tokens moved "flat" (one all-to-all over every
   rank) and "two_hop" (once to each node a token needs, then inside the node); each rank checks its
   output and gradients against the whole layer run in one process on every rank's tokens, and its
   bytes across nodes against `dispatch_cross_bytes`.
2. Serving (a layer routed without the node limit, its experts in 2 groups per node): the ranks count
   their tokens per expert on one batch (an all-reduce), place replicas with EPLB's policy (`rebalance_experts`: expert groups packed to nodes, copies inside each node), then
   serve the next batch from experts in order and from the placement; each rank checks its output
   against the one-process layer and reports the rows its experts computed.
Rank 0 prints both tables and writes the trace (`--trace`, default runs/moe_at_scale.json).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from parallel_lab import comms
from parallel_lab.moe import (
    DISPATCH_VARIANTS,
    FineGrainedMoE,
    NodeMesh,
    ReplicatedExperts,
    TwoHopExperts,
    dispatch_cross_bytes,
    rebalance_experts,
)
from parallel_lab.runtime.from_env import round_up, run_script, scaled_default, script_world


def _layer(
    d_model: int, experts: int, k: int, nodes: int, max_groups: int | None, seed: int
) -> FineGrainedMoE:
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        layer = FineGrainedMoE(d_model=d_model, d_expert=d_model // 2, n_shared=1, n_routed=experts, k=k,
                               groups=nodes, max_groups=max_groups)  # fmt: skip
    skew = torch.linspace(0.3, -0.3, experts)[
        torch.randperm(experts, generator=torch.Generator().manual_seed(seed))
    ]
    layer.bias.copy_(skew)  # a router that prefers some experts, as a trained one does on real traffic
    return layer


def _tokens(rank: int, batch: int, tokens: int, d_model: int, device) -> torch.Tensor:
    return torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(1000 * batch + rank)).to(
        device
    )


def _sent(before: dict, after: dict, op: str) -> int:
    return after.get(op, {}).get("sent", 0) - before.get(op, {}).get("sent", 0)


def run_moe_at_scale(ctx, nodes: int = 2, tokens: int = 32, d_model: int = 16, experts: int = 16, k: int = 4,
                     max_groups: int | None = 1, replicas: int | None = None) -> dict:  # fmt: skip
    """Part 1 and part 2 of the module docstring on this rank; one dict of checks and counts."""
    p, r, dev = ctx.world_size, ctx.rank, ctx.device
    mesh = NodeMesh(nodes).build(ctx)
    out: dict = {"dispatch": {}, "serving": {}}
    # --- 1. dispatch, forward and backward, against one process on every rank's tokens
    xs = [_tokens(q, 0, tokens, d_model, dev) for q in range(p)]
    ws = [_tokens(q, 99, tokens, d_model, dev) for q in range(p)]  # the loss: sum(y * w)
    ref = _layer(d_model, experts, k, nodes, max_groups, ctx.seed).to(dev)
    X = torch.cat(xs).requires_grad_()
    Y, _, _ = ref(X)
    (Y * torch.cat(ws)).sum().backward()
    mine = slice(r * tokens, (r + 1) * tokens)
    for variant in DISPATCH_VARIANTS:
        layer = _layer(d_model, experts, k, nodes, max_groups, ctx.seed).to(dev)
        x = xs[r].clone().requires_grad_()
        before = dict(ctx.recorder.comm_totals()["by_op"])
        y, chosen, _ = TwoHopExperts(ctx, layer, mesh, variant)(x)
        (y * ws[r]).sum().backward()
        comms.dist_all_reduce(
            ctx, layer.router.weight.grad
        )  # the router is data parallel: sum over the ranks
        after = ctx.recorder.comm_totals()["by_op"]

        out["dispatch"][variant] = {
            "fwd": (y - Y[mine]).abs().max().item(),
            "dx": (x.grad - X.grad[mine]).abs().max().item(),
            "router": (layer.router.weight.grad - ref.router.weight.grad).abs().max().item(),
            "across": _sent(before, after, "moe_dispatch_inter"),
            "inside": _sent(before, after, "moe_dispatch_intra"),
            "formula": dispatch_cross_bytes(chosen, r, mesh, experts, d_model, x.element_size(), variant),
        }
    # --- 2. serving: loads counted on batch 1 by every rank, EPLB's placement, batch 2 served. Routing is not
    # node-limited here and the experts form 2 groups per node: with one group per node and every token kept
    # on one node, the placement could move no load between nodes
    layer = _layer(d_model, experts, k, 2 * nodes, None, ctx.seed).to(dev)
    with torch.no_grad():
        load = torch.bincount(
            layer.route(_tokens(r, 1, tokens, d_model, dev))[0].reshape(-1), minlength=experts
        )
        load = load.float()
        comms.dist_all_reduce(ctx, load)  # every rank now holds the same counts, so the same placement
        R = replicas or round_up(experts + experts // 2, p)
        eplb, _, _ = rebalance_experts(load.cpu().view(1, -1), R, 2 * nodes, nodes, p)
        x = _tokens(r, 2, tokens, d_model, dev)
        want, _, _ = layer(x)
        for name, phy2log in (("in order", torch.arange(experts)), ("EPLB", eplb[0])):
            y, _, rows = ReplicatedExperts(ctx, layer, phy2log)(x, first_token=r * tokens)
            out["serving"][name] = {
                "err": (y - want).abs().max().item(),
                "rows": sum(rows),
                "replicas": len(phy2log),
            }
    return out


def report(values: list[dict], k: int, tokens: int) -> tuple[str, bool]:
    """Two tables over all ranks: the dispatch (worst differences, bytes vs formula) and the serving rows."""
    lines = [f"{'dispatch':9s} {'max|fwd|':>9s} {'max|dx|':>9s} {'router g':>9s} {'bytes across nodes, per rank':>36s} "
             f"{'= formula':>9s} {'inside':>8s}"]  # fmt: skip
    ok = True
    for v in DISPATCH_VARIANTS:
        rows = [val["dispatch"][v] for val in values]
        w = {key: max(row[key] for row in rows) for key in ("fwd", "dx", "router")}
        match = all(row["across"] == row["formula"] for row in rows)
        good = match and max(w.values()) < 1e-5  # float32 sums taken in another order
        ok &= good
        lines.append(f"{v:9s} {w['fwd']:>9.2g} {w['dx']:>9.2g} {w['router']:>9.2g} "
                     f"{str([row['across'] for row in rows]):>36s} {str(match):>9s} "
                     f"{sum(row['inside'] for row in rows):>8}" + ("" if good else "  <- MISMATCH"))  # fmt: skip
    lines.append("")
    mean = tokens * k
    for name in ("in order", "EPLB"):
        rows = [val["serving"][name]["rows"] for val in values]
        good = max(val["serving"][name]["err"] for val in values) < 1e-5 and sum(rows) == len(values) * mean
        ok &= good
        lines.append(f"serving, {name:9s} ({values[0]['serving'][name]['replicas']} replicas): rows per rank {rows}, "
                     f"busiest/mean {max(rows) / mean:.2f}" + ("" if good else "  <- MISMATCH"))  # fmt: skip
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="nodes: consecutive ranks, world/nodes each (default: the "
        "launcher's real nodes, WORLD_SIZE / LOCAL_WORLD_SIZE, when there are several; else 2, emulated; 1 on one rank)",
    )
    ap.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=16)
    ap.add_argument(
        "--experts", type=int, default=None, help="routed experts, divisible by the ranks (default 16)"
    )
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument(
        "--max-groups", type=int, default=1, help="node-limited routing: nodes per token (0: no limit)"
    )
    ap.add_argument(
        "--replicas", type=int, default=None, help="EPLB's replicas (default 1.5 x experts, rounded up)"
    )
    ap.add_argument("--trace", default="runs/moe_at_scale.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    world = script_world(args.nproc)
    real = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))  # the launcher's machines
    if args.nodes is None:
        args.nodes = real if real > 1 else min(2, world)
    args.experts = scaled_default("--experts", args.experts, world, lambda w: round_up(16, w))
    if world % args.nodes:
        ap.error(f"--nodes ({args.nodes}) must divide the world size ({world})")
    kw = dict(nodes=args.nodes, tokens=args.tokens, d_model=args.d_model, experts=args.experts, k=args.k,
              max_groups=args.max_groups or None, replicas=args.replicas)  # fmt: skip
    result = run_script(run_moe_at_scale, nproc=args.nproc, trace_path=args.trace, **kw)
    if result is None:  # not rank 0
        return 0
    table, ok = report(result.values, args.k, args.tokens)
    limit = f"node-limited to {args.max_groups}" if args.max_groups else "not node-limited"
    kind = "nodes" if args.nodes == real else "emulated nodes"
    print(f"{result.world_size} ranks ({result.backend}) as {args.nodes} {kind}, {args.experts} routed experts + 1 shared, "
          f"top-{args.k}, {limit}, {args.tokens} tokens per rank")  # fmt: skip
    print(table)
    print("MoE at scale matches the single-process layer" if ok else "MOE AT SCALE DIFFERS")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Lesson 11 as a script: an MoE layer with expert parallelism, checked against one process.

    torchrun --nproc-per-node 4 -m parallel_lab.scripts.moe
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 -m parallel_lab.scripts.moe
    python -m parallel_lab.scripts.moe                 # no launcher: 4 local ranks via parallel_lab.runtime.launch

Every rank builds the same seeded layer, keeps E/p experts, routes its own slice of
the batch (one GShard group per rank), dispatches and combines with two
all-to-alls, and runs backward (two more). Every rank also computes the whole
layer in one process on the whole batch, so each step checks: forward output,
input and expert gradients against the reference, the router gradient after an
all-reduce, the dispatched bytes against tokens x d x 4, and the drops against the
capacity formula. Rank 0 prints one row per step and writes the trace (`--trace`,
default runs/moe.json) that `RunResult.load` reads back in the notebook.
"""

from __future__ import annotations

import argparse
import sys

import torch

from parallel_lab import comms
from parallel_lab.moe import (
    POLICIES,
    VARIANTS,
    ExpertParallelMoE,
    MoEConfig,
    all_to_all_v,
    build_moe,
    dispatch_bytes,
)
from parallel_lab.runtime.from_env import round_up, run_script, scaled_default, script_world


def run_moe(
    ctx,
    steps: int = 2,
    tokens: int = 64,
    d_model: int = 32,
    d_ff: int = 64,
    num_experts: int = 8,
    k: int = 1,
    capacity_factor: float = 1.25,
    policy: str = "token_choice",
    variant: str = "exact",
    aux_coef: float = 0.01,
    warmup: bool = True,
) -> list[dict]:
    """`steps` EP steps (forward, backward, SGD) on this rank's `tokens` tokens, each checked against
    the single-process layer on all p * tokens tokens. One row per step."""
    p, r = ctx.world_size, ctx.rank
    if (
        warmup
    ):  # gloo opens each pair's connection on first use: pay that once, outside the steps' byte counts
        all_to_all_v(ctx, [torch.zeros(1, device=ctx.device) for _ in range(p)], [1] * p, name="warm-up")
        ctx.recorder.reset()
    cfg = MoEConfig(d_model, d_ff, num_experts, k, capacity_factor, policy)
    ref = build_moe(cfg, seed=ctx.seed).to(ctx.device)
    ep = ExpertParallelMoE(ctx, build_moe(cfg, seed=ctx.seed).to(ctx.device), variant)
    L = num_experts // p
    pairs = [(a, b) for j, e in enumerate(range(r * L, (r + 1) * L))
             for a, b in zip(ep.experts[j].parameters(), ref.experts[e].parameters())]  # fmt: skip
    opt_ep = torch.optim.SGD(ep.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    rows = []
    for step in range(steps):
        g = torch.Generator().manual_seed(ctx.seed + 1000 + step)
        X = torch.randn(p * tokens, d_model, generator=g).to(ctx.device)  # (p*N, d) the whole batch
        T = torch.randn(p * tokens, d_model, generator=g).to(ctx.device)  # a fixed random readout
        Xr = X.clone().requires_grad_()
        y_ref, aux_ref, routings = ref(Xr, groups=p, seed=step)
        ((y_ref * T).sum() + aux_coef * aux_ref).backward()
        xs = X.chunk(p)[r].clone().requires_grad_()  # (N, d) this rank's tokens
        before = {name: c["sent"] for name, c in ctx.recorder.comm.items()}
        # the reference above takes different times on different ranks: wait here, so that the
        # timeline's all-to-alls show the exchange itself rather than the slowest rank's head start
        comms.dist_barrier(ctx)
        y, aux, routing = ep(xs, seed=step)  # spans inside: route, permute, experts, combine
        with ctx.span(f"backward {step}", "compute"):
            ((y * T.chunk(p)[r]).sum() + aux_coef * aux / p).backward()
        sent = {name: c["sent"] - before.get(name, 0) for name, c in ctx.recorder.comm.items()}
        comms.dist_all_reduce(ctx, ep.router.weight.grad)  # the router is data parallel
        rows.append(
            {
                "step": step,
                "fwd": (y - y_ref.chunk(p)[r]).abs().max().item(),
                "dx": (xs.grad - Xr.grad.chunk(p)[r]).abs().max().item(),
                "expert_grad": max((a.grad - b.grad).abs().max().item() for a, b in pairs),
                "router_grad": (ep.router.weight.grad - ref.router.weight.grad).abs().max().item(),
                "dispatch_sent": sent.get("moe_dispatch", 0),
                "combine_sent": sent.get("moe_combine", 0),
                "formula": dispatch_bytes(routing, r, p, d_model, xs.element_size(), variant),
                "dropped": routing.dropped,
                "dropped_formula": int((routing.tokens_per_expert - routing.capacity).clamp(min=0).sum()),
                "same_routing": torch.equal(routing.expert_tokens, routings[r].expert_tokens),
                "aux": aux.item(),
            }
        )
        with ctx.span(f"step {step}", "optimizer"):
            opt_ep.step()
            opt_ref.step()
            opt_ep.zero_grad()
            opt_ref.zero_grad()
    return rows


def report(values: list[list[dict]], policy: str) -> tuple[str, bool]:
    """One line per step over all ranks: worst differences, bytes vs formula, drops vs formula."""
    head = f"{'step':>4} {'max|fwd|':>9} {'max|dx|':>9} {'expert g':>9} {'router g':>9} {'rank0 dispatch B':>17} "
    lines = [head + f"{'formula':>8} {'dropped':>8} {'formula':>8}"]
    ok = True
    for i in range(len(values[0])):
        rows = [v[i] for v in values]
        w = {k: max(row[k] for row in rows) for k in ("fwd", "dx", "expert_grad", "router_grad")}
        bytes_ok = all(row["dispatch_sent"] == row["formula"] for row in rows)
        drops_ok = policy == "expert_choice" or all(row["dropped"] == row["dropped_formula"] for row in rows)
        # 1e-5: float32 rounding of sums taken in another order (the router's all-reduce)
        good = bytes_ok and drops_ok and all(row["same_routing"] for row in rows) and max(w.values()) < 1e-5
        ok &= good
        r0 = rows[0]
        lines.append(
            f"{i:>4} {w['fwd']:>9.2g} {w['dx']:>9.2g} {w['expert_grad']:>9.2g} {w['router_grad']:>9.2g} "
            f"{r0['dispatch_sent']:>17} {r0['formula']:>8} {sum(x['dropped'] for x in rows):>8} "
            f"{sum(x['dropped_formula'] for x in rows):>8}" + ("" if good else "  <- MISMATCH")
        )
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument(
        "--experts", type=int, default=None, help="total experts, divisible by the ranks (default 8)"
    )
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--policy", default="token_choice", choices=POLICIES)
    ap.add_argument("--variant", default="exact", choices=VARIANTS)
    ap.add_argument("--trace", default="runs/moe.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    args.experts = scaled_default(
        "--experts", args.experts, script_world(args.nproc), lambda w: round_up(8, w)
    )
    kw = dict(steps=args.steps, tokens=args.tokens, d_model=args.d_model, d_ff=2 * args.d_model,
              num_experts=args.experts, k=args.k, capacity_factor=args.capacity_factor, policy=args.policy,
              variant=args.variant)  # fmt: skip
    result = run_script(run_moe, nproc=args.nproc, trace_path=args.trace, **kw)
    if result is None:  # not rank 0
        return 0
    table, ok = report(result.values, args.policy)
    print(
        f"{result.world_size} ranks ({result.backend}), {args.experts} experts ({args.experts // result.world_size} "
        f"per rank), {args.tokens} tokens per rank, top-{args.k} {args.policy}, capacity factor "
        f"{args.capacity_factor}, {args.variant} all-to-all"
    )
    print(table)
    print("expert parallel matches the single-process layer" if ok else "EXPERT PARALLEL DIFFERS")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

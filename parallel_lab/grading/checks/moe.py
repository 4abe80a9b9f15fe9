"""Checks for lesson 11's exercises: a top-k router with capacity; dispatch and combine by all-to-all.

`route_top_k(probs, k, capacity) -> (experts, slots)` is compared with the lab's
router on router probabilities with overflow: experts (N, k) are each token's k
best experts, slots (N, k) the slot each choice got in its expert, -1 when dropped,
with slots given first come first served, all first choices before any second one.

`dispatch_combine(ctx, x, expert_tokens, expert_gates, experts)` runs on 1, 2 and 4
ranks; each rank holds only its own experts, so the tokens must travel. The
result is compared with the same layer computed in one process; built-in
collectives other than all-to-all are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from parallel_lab.grading.checks import (
    draw_seed,
    family,
    guarded,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
    unavailable,
)

# The lab's router and expert-parallel layer, switched off while the learner's code runs
# (parallel_lab.comms' all-to-all stays: the exercise is built from it).
FORBIDDEN = family("parallel_lab.moe.routing", "parallel_lab.moe.expert_parallel")

__all__ = ["check_dispatch_combine", "check_padded_dispatch_bytes", "check_top_k_router"]


def _reference_slots(probs: torch.Tensor, k: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    from parallel_lab.moe import assign_slots

    n, E = probs.shape
    _, top_e = probs.topk(k, dim=-1)  # (N, k)
    ids, toks = top_e.T.reshape(-1), torch.arange(n).repeat(k)  # choice-major priority
    expert_tokens, _, counts, _ = assign_slots(ids, toks, torch.ones(n * k), E, capacity)
    slots = torch.full((n, k), -1, dtype=torch.long)
    for e in range(E):
        for s in range(int(counts[e])):
            t = int(expert_tokens[e, s])
            slots[t, int((top_e[t] == e).nonzero())] = s
    return top_e, slots


def _router_cases() -> list[tuple[str, torch.Tensor, int, int]]:
    g = torch.Generator().manual_seed(draw_seed())  # router probabilities drawn afresh every grade run

    def probs(n, e, sharp=3.0):
        return (torch.randn(n, e, generator=g) * sharp).softmax(-1)

    return [
        ("Switch top-1, 12 tokens, 4 experts, capacity 3", probs(12, 4), 1, 3),
        ("top-1, capacity 1 (most tokens dropped)", probs(10, 3), 1, 1),
        ("top-2, 16 tokens, 4 experts, capacity 6", probs(16, 4), 2, 6),
        ("top-2, capacity 32 (nothing dropped)", probs(16, 4), 2, 32),
        ("top-3 of 5 experts, capacity 4", probs(9, 5), 3, 4),
    ]


def check_top_k_router(route_top_k: Callable) -> None:
    """`route_top_k(probs, k, capacity)` -> (experts (N, k), slots (N, k), -1 = dropped)."""
    require_callable(route_top_k, "route_top_k")
    route_top_k = guarded(route_top_k, FORBIDDEN, "this exercise (route_top_k)")
    cases = _router_cases()
    for name, probs, k, capacity in cases:
        where = f"case {name!r}"
        out = route_top_k(probs.clone(), k, capacity)
        assert isinstance(out, (tuple, list)) and len(out) == 2, (
            f"{where}: return (experts, slots), got {type(out).__name__}"
        )
        experts, slots = (torch.as_tensor(o) for o in out)
        want_e, want_s = _reference_slots(probs, k, capacity)
        n = probs.shape[0]
        for what, got in (("experts", experts), ("slots", slots)):
            assert tuple(got.shape) == (n, k), (
                f"{where}: {what} has shape {tuple(got.shape)}, expected {(n, k)}"
            )
        bad = (experts.long() != want_e).nonzero()
        if len(bad):
            t, c = bad[0].tolist()
            raise AssertionError(
                f"{where}: token {t}, choice {c}: expert {int(experts[t, c])}, expected {int(want_e[t, c])} "
                "(choice c is the token's (c+1)-th most probable expert)"
            )
        bad = (slots.long() != want_s).nonzero()
        if len(bad):
            t, c = bad[0].tolist()
            raise AssertionError(
                f"{where}: token {t}, choice {c} (expert {int(want_e[t, c])}): slot {int(slots[t, c])}, expected "
                f"{int(want_s[t, c])}. Slots are handed out first come first served in token order, all first "
                "choices before any second choice; a choice finding its expert's capacity full gets -1 (dropped)"
            )
        per_expert = torch.bincount(want_e.flatten(), minlength=probs.shape[1])
        dropped = int((slots < 0).sum())
        assert dropped == int((per_expert - capacity).clamp(min=0).sum())  # the capacity formula
    passed("check_top_k_router", f"{len(cases)} routings with capacity match")


# ----------------------------------------------------------------------------- dispatch / combine
_FORBIDDEN = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "gather",
    "scatter",
    "reduce",
)


@contextlib.contextmanager
def _only_all_to_all() -> Iterator[None]:
    saved = {name: getattr(dist, name) for name in _FORBIDDEN if hasattr(dist, name)}

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(
                f"your function called torch.distributed.{name}: move the tokens with an all-to-all "
                "(parallel_lab.comms.all_to_all) instead of sharing everything with everyone"
            )

        return call

    try:
        for name in saved:
            setattr(dist, name, refuse(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _experts(E: int, d: int, device: Any = "cpu", salt: int = 0) -> list[Callable]:
    """Expert e: x -> tanh(x @ W_e) + e, small and different per expert (same on every rank)."""
    ws = [
        (torch.randn(d, d, generator=torch.Generator().manual_seed(salt + 500 + e)) / d**0.5).to(device)
        for e in range(E)
    ]
    return [lambda x, w=w, e=e: torch.tanh(x @ w) + e for e, w in enumerate(ws)]


def _routing(rank: int, n: int, E: int, C: int, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random routing of this rank's n tokens into E experts x C slots, some slots empty."""
    g = torch.Generator().manual_seed(salt + 900 + rank)
    tokens = torch.full((E, C), -1, dtype=torch.long)
    gates = torch.zeros(E, C)
    for e in range(E):
        fill = int(torch.randint(0, min(C, n) + 1, (1,), generator=g))
        tokens[e, :fill] = torch.randperm(n, generator=g)[:fill]
        gates[e, :fill] = torch.rand(fill, generator=g)
    return tokens, gates


def _run_dispatch(ctx, fn: Callable, cases, salt: int) -> int:
    p, r = ctx.world_size, ctx.rank
    for E, C, n, d in cases:
        where = f"world_size={p}, {E} experts, capacity {C}, {n} tokens of width {d}, rank {r}"
        x = torch.randn(n, d, generator=torch.Generator().manual_seed(salt + 700 + r))
        tokens, gates = _routing(r, n, E, C, salt)
        every = _experts(E, d, salt=salt)
        L = E // p
        on_device = _experts(E, d, ctx.device, salt)  # the learner's experts run where its tokens are
        mine = {e: on_device[e] for e in range(r * L, (r + 1) * L)}
        want = torch.zeros(n, d)
        for e in range(E):
            for s in range(C):
                if tokens[e, s] >= 0:
                    t = int(tokens[e, s])
                    want[t] += gates[e, s] * every[e](x[t : t + 1])[0]
        try:
            with _only_all_to_all(), unavailable(FORBIDDEN, "this exercise (dispatch_combine)"):
                got = fn(ctx, x.to(ctx.device), tokens.to(ctx.device), gates.to(ctx.device), mine)
        except NotImplementedError:
            raise
        except AssertionError as e:
            raise AssertionError(f"{where}: {e or 'an assert in your function failed'}") from None
        except Exception as e:
            raise AssertionError(f"{where}: your function raised {type(e).__name__}: {e}") from e
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (n, d):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise AssertionError(f"{where}: expected a ({n}, {d}) tensor, got {shape}")
        got = got.detach().cpu()
        err = (got.float() - want).abs()
        if err.max() > 1e-5:
            t = int(err.amax(1).argmax())
            raise AssertionError(
                f"{where}: token {t} differs by {err[t].max().item():.3g} (got {got[t, :3].tolist()}..., expected "
                f"{want[t, :3].tolist()}...). y[t] must be the sum over every slot holding t of gate x expert(x[t])"
            )
    return len(cases)


def check_dispatch_combine(dispatch_combine: Callable) -> None:
    """`dispatch_combine(ctx, x, expert_tokens, expert_gates, experts)` -> (N, d) on every rank."""
    require_callable(dispatch_combine, "dispatch_combine")
    cases = [(4, 3, 10, 6), (8, 2, 7, 5), (4, 5, 3, 4)]  # (E, C, tokens, d): C > tokens in the last
    total, salt = 0, draw_seed() % 2**40  # tokens, routings and experts drawn afresh every grade run
    for p in (1, 2, 4):
        try:
            res = launch_learner(_run_dispatch, p, dispatch_combine, cases, salt, timeout=30.0)
        except Exception as e:
            if getattr(e, "exc_type", None) in ("AssertionError", "WriteItYourself"):
                raise rank_verdict(e) from None
            if type(e).__name__ == "LaunchTimeout":
                raise AssertionError(
                    f"world_size={p}: the ranks did not finish in 30 s; every rank must take part in every "
                    "all-to-all, with one tensor per rank"
                ) from None
            raise
        total += res.values[0]
    passed("check_dispatch_combine", f"{total} cases on 1, 2 and 4 ranks")


# ----------------------------------------------------------------------------- predict, then measure
_PADDED = ((64, 8, 1, 1.25, 16), (40, 4, 2, 1.0, 8), (30, 8, 1, 2.0, 12))  # tokens per rank, E, k, factor, d


def _measure_padded(ctx, cases: tuple) -> list[int]:
    """Bytes this rank sends in the padded dispatch all-to-all of the lab's expert-parallel layer."""
    from parallel_lab.moe import ExpertParallelMoE, MoEConfig, build_moe

    out = []
    for n, E, k, factor, d in cases:
        layer = ExpertParallelMoE(
            ctx, build_moe(MoEConfig(d, 2 * d, E, k, factor), seed=0).to(ctx.device), "padded"
        )
        x = torch.randn(n, d, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
        before = ctx.recorder.comm.get("moe_dispatch", {}).get("sent", 0)
        layer(x, seed=0)
        out.append(ctx.recorder.comm["moe_dispatch"]["sent"] - before)
    return out


def check_padded_dispatch_bytes(fn: Callable) -> None:
    """`fn(tokens, experts, k, capacity_factor, d, p, itemsize)` -> bytes one rank sends in the padded
    dispatch all-to-all (every expert's C slots travel, empty ones too; C from the capacity factor, per
    rank's tokens); predicted, then compared with the byte counter of real runs on 2 and 4 ranks (exactly)."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (padded_dispatch_bytes)")
    import random

    rnd = random.Random(draw_seed())  # one more layer drawn afresh every grade run (E divisible by 4)
    shapes = (*_PADDED, (rnd.randint(8, 80), 4 * rnd.randint(1, 4), rnd.randint(1, 2), rnd.choice((1.0, 1.25, 1.5, 2.0)),
                         rnd.randint(2, 16)))  # fmt: skip
    cases = 0
    for p in (2, 4):
        try:
            res = launch_learner(_measure_padded, p, shapes, timeout=60.0)
        except Exception as e:
            if getattr(e, "exc_type", None) in ("AssertionError", "WriteItYourself"):
                raise rank_verdict(e) from None
            raise
        for r, sent in enumerate(res.values):
            for (n, E, k, factor, d), got in zip(shapes, sent):
                said = fn(n, E, k, factor, d, p, 4)
                assert said == got, (
                    f"{n} tokens per rank, {E} experts, top-{k}, capacity factor {factor}, d={d} on {p} ranks, rank {r}: "
                    f"you predict {said} bytes, the dispatch sent {got}"
                )
                cases += 1
    passed("check_padded_dispatch_bytes", f"{cases} predictions equal the bytes measured on 2 and 4 ranks")

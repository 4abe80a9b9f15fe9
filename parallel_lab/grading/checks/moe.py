"""Checks for lesson 11's exercises: routing in local groups, a top-2 dispatch that sends a token once per
rank, and the rows such a dispatch sends on average.

`check_route_groups(fn)`: `fn(probs, k, groups, capacity_factor)` -> (experts (N, k), slots (N, k), -1 =
dropped) against the lesson's priority rule (every first choice before any second, in token order) applied in
each of `groups` contiguous groups of tokens, each with its own capacity ceil(k · factor · group size / E) and
its own slots; router probabilities, group counts and factors drawn afresh every grade run.

`check_dispatch_top2(fn)`: `fn(ctx, x, expert_ids, gates, experts)` on 2, 3 and 4 gloo ranks (one launch per
world size), each rank holding its own number of tokens (drawn; some rank none), top-2, no capacity: the
output must equal sum_c gates[t, c] * expert_{ids[t, c]}(x[t]) computed in one process (float64), and the
bytes the rank sends through the lab's comms must be those of one row per (token, other rank holding one of
its experts) each way, plus a small allowance for counts, expert ids and gates.

`check_expected_rows(fn)`: `fn(experts, ranks, k)` -> the expected number of rows one token sends to other ranks
in that dispatch when its k experts are a uniform draw without replacement, exact (in fractions) on drawn (E, p, k),
some far too large to enumerate; the tests hold the reference against an enumeration of every k-subset.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch

from parallel_lab.grading.checks import (
    call_learner,
    draw_seed,
    family,
    finite_number,
    guarded,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
    unavailable,
)

# The lab's router and expert-parallel layer, switched off while the learner's code runs; the lab's
# variable-size exchange (all_to_all_v, exchange) stays: exercise 2 is about what to send, not how.
FORBIDDEN = {
    **family("parallel_lab.moe.routing"),
    **family("parallel_lab.moe.expert_parallel", keep=("all_to_all_v", "exchange", "_AllToAll")),
    # and this module's own references
    **{
        f"parallel_lab.grading.checks.moe.{n}": ""
        for n in ("_slots_in_group", "_group_reference", "_expected_rows")
    },
}

__all__ = ["check_dispatch_top2", "check_expected_rows", "check_route_groups"]


# ----------------------------------------------------------------------------- exercise 1: local groups
def _slots_in_group(probs: torch.Tensor, k: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lesson's rule on one group: choice-major priority, first come first served."""
    n, E = probs.shape
    top = probs.topk(k, dim=-1).indices  # (n, k)
    slots = torch.full((n, k), -1, dtype=torch.long)
    used = [0] * E
    for c in range(k):
        for t in range(n):
            e = int(top[t, c])
            if used[e] < capacity:
                slots[t, c], used[e] = used[e], used[e] + 1
    return top, slots


def _group_reference(probs: torch.Tensor, k: int, groups: int, factor: float):
    n, E = probs.shape
    size = n // groups
    capacity = math.ceil(k * factor * size / E)
    parts = [_slots_in_group(probs[g * size : (g + 1) * size], k, capacity) for g in range(groups)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _group_cases(rnd: random.Random, g: torch.Generator) -> list[tuple[torch.Tensor, int, int, float]]:
    def probs(n: int, e: int, skew: float) -> torch.Tensor:
        logits = torch.randn(n, e, generator=g, dtype=torch.float64) * 2
        logits[:, rnd.randrange(e)] += skew  # one favoured expert, so capacity matters
        return logits.softmax(-1)

    # second choices that would take the slots first choices need, if taken token by token
    order = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.2, 0.8]], dtype=torch.float64)
    # two groups of four tokens that all want expert 0: the whole batch's capacity would drop none
    crowd = torch.tensor([[0.9, 0.1]] * 4 + [[0.1, 0.9]] * 4, dtype=torch.float64)
    cases = [
        (probs(12, 4, 1.0), 1, 1, 1.0),
        (probs(8, 4, 1.0), 2, 8, 1.0),
        (order, 2, 1, 0.5),
        (crowd, 1, 2, 1.0),
    ]
    for i in range(5):
        groups, size, e = rnd.choice((2, 3, 4)), rnd.randint(3, 12), rnd.choice((4, 6, 8))
        k = 2 if i < 2 else rnd.choice((1, 2))  # top-2 at least twice: the order of choices matters there
        cases.append(
            (probs(groups * size, e, rnd.uniform(0, 3)), k, groups, rnd.choice((0.5, 1.0, 1.25, 1.5, 2.0)))
        )
    return cases


def check_route_groups(fn: Callable) -> None:
    """`fn(probs, k, groups, capacity_factor)` -> (experts (N, k), slots (N, k)), -1 = dropped."""
    require_callable(fn, "route_groups")
    fn = guarded(fn, FORBIDDEN, "this exercise (route_groups)")
    rnd = random.Random(draw_seed())  # probabilities, groups and factors drawn afresh every grade run
    g = torch.Generator().manual_seed(rnd.randrange(2**31))
    for probs, k, groups, factor in _group_cases(rnd, g):
        n, E = probs.shape
        where = f"route_groups(probs of {n} tokens x {E} experts, k={k}, groups={groups}, capacity_factor={factor})"
        out = call_learner(fn, where, probs.clone(), k, groups, factor)
        assert isinstance(out, (tuple, list)) and len(out) == 2, (
            f"{where}: return (experts, slots), got {out!r}"
        )
        experts, slots = (torch.as_tensor(o).long() for o in out)
        want_e, want_s = _group_reference(probs, k, groups, factor)
        for what, got in (("experts", experts), ("slots", slots)):
            assert tuple(got.shape) == (n, k), (
                f"{where}: {what} has shape {tuple(got.shape)}, expected {(n, k)}"
            )
        bad = (experts != want_e).nonzero()
        if len(bad):
            t, c = bad[0].tolist()
            raise AssertionError(f"{where}: token {t}, choice {c}: expert {int(experts[t, c])}, expected "
                                 f"{int(want_e[t, c])} (choice c is the token's (c+1)-th most probable expert)")  # fmt: skip
        bad = (slots != want_s).nonzero()
        if len(bad):
            t, c = bad[0].tolist()
            size = n // groups
            whole = _group_reference(probs, k, 1, factor)[1]
            hint = ""
            if torch.equal(slots, whole):
                hint = (
                    " That is one group of all the tokens: each group has its own capacity and its own slots."
                )
            elif int(slots.max()) >= math.ceil(k * factor * size / E):
                hint = " A slot number is past this group's capacity: the capacity comes from the group's tokens."
            raise AssertionError(
                f"{where}: token {t} (group {t // size}), choice {c} (expert {int(want_e[t, c])}): slot "
                f"{int(slots[t, c])}, expected {int(want_s[t, c])}.{hint}"
            )
    passed("check_route_groups", "9 routings in local groups")


# ----------------------------------------------------------------------------- exercise 2: top-2, once per rank
D = 2048  # wide rows: one row sent twice weighs more than every count, id and gate a rank may send


def _experts(E: int, d: int, salt: int, device: Any = None) -> list[Callable]:
    """Expert e: x -> tanh(a_e * x + b_e) + e (float64, elementwise: cheap at width 2048), the same on every rank."""
    ab = [torch.randn(2, d, generator=torch.Generator().manual_seed(salt + 500 + e), dtype=torch.float64)
          for e in range(E)]  # fmt: skip
    if device is not None:
        ab = [t.to(device) for t in ab]
    return [lambda x, t=t, e=e: torch.tanh(t[0] * x + t[1]) + e for e, t in enumerate(ab)]


def _routing(salt: int, rank: int, n: int, E: int, p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(salt + 900 + rank)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    ids = (
        torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(n)]) if n else torch.zeros(0, 2).long()
    )
    if n:  # always one token whose two experts live on one other rank
        L, q = E // p, (rank + 1) % p
        ids[0] = torch.tensor([q * L, q * L + 1])
    gates = torch.rand(n, 2, generator=g, dtype=torch.float64)
    return x, ids, gates


def _rows(ids: torch.Tensor, rank: int, L: int) -> int:
    """Rows a rank sends forward: one per (token, other rank holding one of its experts)."""
    return sum(len({int(e) // L for e in row} - {rank}) for row in ids)


def _run_top2(ctx, fn: Callable, E: int, counts: list[int], salt: int) -> list[tuple[int, int]]:
    p, r = ctx.world_size, ctx.rank
    L, d = E // p, D
    x, ids, gates = _routing(salt, r, counts[r], E, p)
    every = _experts(E, d, salt)
    want = torch.zeros(counts[r], d, dtype=torch.float64)
    for t in range(counts[r]):
        for c in range(2):
            want[t] += gates[t, c] * every[int(ids[t, c])](x[t : t + 1])[0]
    mine = dict(zip(range(r * L, (r + 1) * L), _experts(E, d, salt, ctx.device)[r * L : (r + 1) * L]))
    where = f"world_size={p}, {E} experts ({L} per rank), tokens per rank {counts}, rank {r}"
    before = sum(v.get("sent", 0) for v in ctx.recorder.comm.values())
    with unavailable(FORBIDDEN, "this exercise (dispatch_top2)"):
        got = call_learner(fn, where, ctx, x.to(ctx.device), ids.to(ctx.device), gates.to(ctx.device), mine)
    sent = sum(v.get("sent", 0) for v in ctx.recorder.comm.values()) - before
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (counts[r], d):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(f"{where}: expected a ({counts[r]}, {d}) tensor, got {shape}")
    err = (got.detach().to(want.device, torch.float64) - want).abs()
    if err.numel() and err.max() > 1e-10:
        t = int(err.amax(1).argmax())
        raise AssertionError(f"{where}: token {t} (experts {ids[t].tolist()}) differs by {err[t].max().item():.3g}: "
                             "y[t] is the sum over its two choices of gate x expert(x[t])")  # fmt: skip
    # rows that must leave this rank: its own tokens forward, other ranks' tokens back
    all_ids = [_routing(salt, q, counts[q], E, p)[1] for q in range(p)]
    back = sum(1 for q in range(p) if q != r for row in all_ids[q] if r in {int(e) // L for e in row})
    return _rows(ids, r, L), back, sent


def check_dispatch_top2(fn: Callable) -> None:
    """`fn(ctx, x, expert_ids, gates, experts)` -> (N_r, d): top-2, dropless, a token sent once per rank."""
    require_callable(fn, "dispatch_top2")
    rnd = random.Random(
        draw_seed()
    )  # token counts, routings, inputs and experts drawn afresh every grade run
    salt = rnd.randrange(2**40)
    for p in (2, 3, 4):
        E = p * rnd.choice((2, 3))  # two experts or more per rank: a token's pair can share one
        counts = [rnd.randint(0, 9) for _ in range(p)]
        counts[rnd.randrange(p)] = 0  # some rank holds no token
        counts[rnd.randrange(p)] = max(counts) + rnd.randint(1, 5)  # and some rank more than the others
        try:
            res = launch_learner(_run_top2, p, fn, E, counts, salt, timeout=60.0)
        except Exception as e:
            if getattr(e, "exc_type", None) in ("AssertionError", "WriteItYourself"):
                raise rank_verdict(e) from None
            if type(e).__name__ == "LaunchTimeout":
                raise AssertionError(f"world_size={p}: the ranks did not finish in 60 s; every rank must take part "
                                     "in every exchange, even a rank with no tokens") from None  # fmt: skip
            raise
        for r, (fwd, back, sent) in enumerate(res.values):
            rows, row_bytes = fwd + back, D * 8
            floor = rows * row_bytes
            allowance = (
                rows * 8 * (2 * E + 4) + 64 * p
            )  # per row up to E gates, E ids and a few numbers; counts
            where = f"world_size={p}, {E} experts, tokens per rank {counts}, rank {r}"
            if sent < floor:
                raise AssertionError(f"{where}: the rank sent {sent} bytes through parallel_lab.comms, less than "
                                     f"the {rows} rows of width {D} that must leave it ({floor} bytes): move every "
                                     "row with the lab's comms, so it is counted")  # fmt: skip
            if sent > floor + allowance:
                extra = sent - floor
                raise AssertionError(f"{where}: {rows} rows of width {D} must leave the rank ({floor} bytes: one per "
                                     f"(token, other rank holding one of its experts) each way), plus at most "
                                     f"{allowance} bytes of counts, ids and gates; it sent {extra} bytes more than "
                                     f"the rows, about {extra // row_bytes} rows' worth: a token whose two experts live "
                                     "on one rank goes there once, and comes back as one row")  # fmt: skip
    passed("check_dispatch_top2", "2, 3 and 4 ranks with uneven tokens: outputs and bytes")


# ----------------------------------------------------------------------------- exercise 3: expected rows
def _expected_rows(E: int, p: int, k: int) -> Fraction:
    """Exact: each other rank gets a row unless all k experts avoid its E/p (tests compare with an enumeration)."""
    return (p - 1) * (1 - Fraction(math.comb(E - E // p, k), math.comb(E, k)))


def check_expected_rows(fn: Callable) -> None:
    """`fn(experts, ranks, k)` -> expected rows one token sends to other ranks (uniform k of E, no repeats)."""
    require_callable(fn, "expected_rows")
    fn = guarded(fn, FORBIDDEN, "this exercise (expected_rows)")
    rnd = random.Random(draw_seed())  # layouts drawn afresh every grade run
    # too many k-subsets to list: 256 experts on 32 ranks, top-8 (about 4e14 subsets)
    cases = [(6, 2, 2), (8, 8, 2), (6, 3, 1), (256, 32, 8), (rnd.choice((64, 128)), 16, rnd.choice((4, 6)))]
    while len(cases) < 9:
        p = rnd.choice((2, 3, 4, 6, 8))
        E, k = p * rnd.randint(1, 4), rnd.randint(1, 4)
        if k <= E and (E, p, k) not in cases and (E, p, k) != (4, 2, 2):  # (4, 2, 2) is hint 2's case
            cases.append((E, p, k))
    for E, p, k in cases:
        where = f"expected_rows(experts={E}, ranks={p}, k={k})"
        got = finite_number(call_learner(fn, where, E, p, k), where, "rows")
        want = float(_expected_rows(E, p, k))
        if abs(got - want) > 1e-9 * want:
            L = E // p
            slips = [
                (k * (p - 1) / p, "that is one row per expert choice: a token goes to a rank once, however many "
                 "of its experts live there."),
                ((p - 1) * (1 - (1 - L / E) ** k), "that draws the k experts with repeats; a token's experts are "
                 "distinct, so after one lands on a rank, fewer of the rest can."),
                (p * (1 - math.comb(E - L, k) / math.comb(E, k)), "that counts this rank's own experts too: rows "
                 "for them never leave."),
            ]  # fmt: skip
            hint = next((t for x, t in slips if abs(got - x) <= 1e-9 * x), "")
            raise AssertionError(f"{where} is {got!r}, expected {want!r}. {hint}".rstrip())
    passed("check_expected_rows", "9 layouts, two too large to enumerate")

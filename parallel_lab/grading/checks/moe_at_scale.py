"""Checks for lesson 21's exercises: a run of node-limited routing balanced by a per-expert bias, and replicated
experts packed onto GPUs one copy per GPU at most.

`route(scores, bias, k, groups, max_groups)` -> (chosen, gates) and `next_bias(bias, chosen_per_rank, gamma)` ->
bias run together, step after step, as data-parallel training runs them: at each step R ranks each route their own
micro-batch (T_r tokens, uneven, possibly 0) with the bias so far, then `next_bias` gets the list of the ranks'
(T_r, k) choices and returns the one bias every rank routes with next, moved by the loads of the global batch
(Megatron-Core's MoE README: the bias "is updated based on the number of assigned tokens to each expert in a global
batch"). Six runs have a fixed shape (k = every expert of the kept groups; max_groups = groups; gamma = 0 from a
nonzero bias; a designed first step on ranks of 10 and 6 tokens where every expert gets the same load over the
global batch but not on either rank; a designed first step on ranks of 6, 0 and 24 tokens where each rank's own
update averaged, rank 0's load alone and the ranks' shares averaged each move some expert otherwise than the global
batch, and otherwise than each other; groups = 1) and six are drawn every grade run (E in {8, 16, 32}, k in {2, 4,
6, 8}, groups in {1, 2, 4, 8}, three of them node-limited with groups scored over two or more of their experts but
not all, gamma from 0.002 to 0.05); every run's scores (sigmoid affinities, with an expert skew so the bias has work
to do), its starting bias (zero or not), its 1 to 4 ranks of 0 to 40 tokens (where the shape does not fix them) and
its 4 to 8 steps are drawn every grade run. Each token's set of experts is compared exactly with the rule's,
computed in float64 from the bias the learner's own `next_bias` returned (a token within 1e-5 of a tie, in its group
scores or its expert scores, may take either side: the learner's float32 sums round there); each gate, matched by
expert id, within 1e-6; the bias after each step within 1e-6 of the rule applied to the learner's bias and all
ranks' chosen experts. Named slips: gates from s + b, a softmax over every expert, gates not normalised; groups
scored by their best expert, by the sum of all their experts, by s alone, by how many of the token's overall top k
they hold, no group limit, selection by s alone; each rank's own update averaged over the ranks, rank 0's load
alone, the ranks' shares of their own load averaged; the sign reversed, a step proportional to mean - load, the load
of the first choice only, sign(0) taken as +-1, the bias left as it was. The learner's calls of one step run under
one switch-off and are checked after it (the switch-off costs about a millisecond).

`place(loads, replicas, gpus)` -> phy2log (replica j on GPU j // (replicas / gpus)) must be a valid placement
(every expert at least one replica, no expert twice on a GPU) whose busiest GPU serves no more tokens than the
greedy placement's: EPLB's two greedy steps (deepseek-ai/EPLB: the next copy to the expert whose load per copy is
largest; replicas heaviest first into the lightest GPU with room), each kept to one copy of an expert per GPU.
EPLB's own global policy puts two copies of an expert on one GPU in about two thirds of the drawn cases; its
busiest GPU serves less than the rule-keeping greedy's in about 31% of all drawn cases (about 47% of those where it
doubles a copy, and never where it does not), by up to about 11% of the greedy's busiest GPU (measured on the 1600
drawn cases of 100 grade runs): a bar a placement that keeps the rule cannot always reach. So the bar is the
rule-keeping greedy (`_greedy`), the largest of its tie orders (they agree on the drawn loads unless two tie, which
is rare; the fixed cases tie on purpose), computed for every case before the learner's function first runs. Fixed
cases: uniform loads, one expert with every token, replicas == experts; 16 drawn every run (Zipf-like and lognormal
loads, E from 8 to 64, gpus from 2 to 16, replicas from E to 2E). Named slips: replicas dealt to the GPUs in
turn, packed in expert order, packed without the equal-count rule, copies by total load.

Switched off while the learner's functions run: every module of `parallel_lab.moe` (the routers, the bias
update, `FineGrainedMoE.route`, EPLB's `rebalance_experts`, `replicate`, `balanced_packing`), torch's equal-count
balancer of context parallelism (`_PTRRLoadBalancer`; torch has no MoE router or expert placement of its own:
tests/test_exercises_21.py searches its source), and this module's references.
"""

from __future__ import annotations

import functools
import itertools
import math
import pkgutil
import random
from collections.abc import Callable

import torch

from parallel_lab.grading.checks import (
    call_learner,
    draw_seed,
    family,
    guarded,
    passed,
    require_callable,
    unavailable,
)

__all__ = ["check_balancing_run", "check_placement"]

_SELF = "parallel_lab.grading.checks.moe_at_scale"
_NEAR = 1e-5  # a token this close to a tie may take either side
_TOL = 1e-6  # gates and biases
_REL = 1e-9  # loads: the greedy's or better

#: torch's balancers that pack items into equal-count groups (context parallelism's; switched off for place)
TORCH_PACKERS = ("torch.distributed.tensor.experimental._context_parallel._load_balancer",)

#: this module's references, switched off with the lab's
_REFERENCES = ("_route", "_route_slips", "_named", "_next_bias", "_rank_loads", "_bias_slips", "_copy_counts",
               "_pack_replicas", "_greedy", "_bar", "_max_per_copy", "_place_slips", "_gpu_loads",
               "_canonical")  # fmt: skip


@functools.cache
def switched_off() -> dict[str, str]:
    """Both exercises' switched-off list (built on first use): every module of parallel_lab.moe, torch's packer,
    this module's references."""
    import parallel_lab.moe as moe

    modules = sorted(f"parallel_lab.moe.{m.name}" for m in pkgutil.iter_modules(moe.__path__))
    return {
        **family(*modules, instead="write it yourself"),
        **family(*TORCH_PACKERS, instead="write the packing yourself", missing_ok=True),
        **{f"{_SELF}.{n}": "" for n in _REFERENCES},
    }


# ----------------------------------------------------------------------------- exercise 1: a balancing run
def _route(scores: torch.Tensor, bias: torch.Tensor, k: int, groups: int, M: int, slip: str = ""):
    """The rule, in float64: (chosen (T, k), gates (T, k), group scores (T, groups), margin (T,)). The margin is
    how far each token is from a tie (group scores, then the experts inside the kept groups). `slip` computes one
    of the usual wrong rules instead (for naming a wrong answer)."""
    s = scores.double()
    sel = s + bias.double().to(s.device)
    T, E = s.shape
    per, take = E // groups, k // M
    pick = s if slip == "unbiased_select" else sel
    by_group = (s if slip == "group_unbiased" else pick).view(T, groups, per)
    if slip == "group_max":
        gscore = by_group.amax(-1)
    elif slip == "group_all":
        gscore = by_group.sum(-1)
    elif slip.startswith("group_count"):
        top = pick.topk(k, dim=-1).indices // per
        gscore = torch.zeros(T, groups, dtype=s.dtype, device=s.device).scatter_add_(
            1, top, torch.ones_like(top, dtype=s.dtype)
        )
    else:
        gscore = by_group.topk(take, dim=-1).values.sum(-1)
    if slip == "no_groups" or M == groups:
        keep = torch.ones_like(gscore, dtype=torch.bool)
    else:  # equal counts (the count slip) to the lower group, or (its twin) as torch.topk leaves them
        best = (
            gscore.topk(M, dim=-1)
            if slip == "group_count_topk"
            else gscore.sort(dim=-1, descending=True, stable=True)
        )
        keep = torch.zeros_like(gscore, dtype=torch.bool)
        keep.scatter_(1, best.indices[:, :M], True)
    masked = pick.view(T, groups, per).masked_fill(~keep[..., None], float("-inf")).view(T, E)
    chosen = masked.topk(k, dim=-1).indices
    margin = torch.full((T,), float("inf"), dtype=s.dtype, device=s.device)
    if M < groups:
        g = gscore.sort(dim=-1, descending=True).values
        margin = torch.minimum(margin, g[:, M - 1] - g[:, M])
    if k < E:
        m = masked.sort(dim=-1, descending=True).values
        margin = torch.minimum(margin, (m[:, k - 1] - m[:, k]).nan_to_num(float("inf")))
    picked = s.gather(1, chosen)
    if slip == "gates_biased":
        picked = sel.gather(1, chosen)
    if slip == "gates_softmax":
        gates = torch.softmax(s, dim=-1).gather(1, chosen)
    elif slip == "gates_raw":
        gates = picked
    else:
        gates = picked / picked.sum(-1, keepdim=True)
    return chosen, gates, gscore, margin


_ROUTE_SLIPS = {
    "gates_biased": "Your gates come from s + b: the bias chooses the experts, it must not weigh them.",
    "gates_softmax": "Your gates are a softmax over every expert's score: they are the chosen experts' own scores, "
                     "normalised over the chosen experts alone.",
    "gates_raw": "Your gates are the chosen scores as they are: they must sum to 1 over the token's experts.",
    "group_max": "You scored each group by its best expert alone; a group's score adds up its top k / max_groups "
                 "selection scores, so a group with several good experts beats one with a single star.",
    "group_all": "You scored each group by the sum of all its experts; a group's score adds up only its top "
                 "k / max_groups selection scores, so an expert the token cannot use from that group counts for "
                 "nothing.",
    "group_unbiased": "You scored the groups on s alone: the bias chooses the groups too, or an overloaded node "
                      "keeps being picked.",
    "group_count": "You kept the groups holding most of the token's overall top k; a group's score is the sum of "
                   "its own top k / max_groups selection scores.",
    "group_count_topk": "You kept the groups holding most of the token's overall top k; a group's score is the sum "
                        "of its own top k / max_groups selection scores.",
    "no_groups": "You took the top k over every expert: the token may use experts of at most max_groups groups.",
    "unbiased_select": "You chose on s alone: the bias must choose, or it balances nothing.",
}  # fmt: skip


def _route_slips(scores, bias, k, groups, M, mine, g_mine, ok) -> str:
    """Every usual wrong rule that gives the learner's experts and gates on every token of `ok` ('' for none): a
    rule that matches by coincidence on one token of many names nothing, but a micro-batch can be one token."""
    whys = []
    for slip, why in _ROUTE_SLIPS.items():
        chosen, gates, _, _ = _route(scores, bias, k, groups, M, slip)
        order = chosen.sort(dim=-1)
        same = (order.values == mine).all(-1) & ((gates.gather(1, order.indices) - g_mine).abs() <= _TOL).all(
            -1
        )
        if bool(same[ok].all()) and why not in whys:
            whys.append(why)
    return _named(whys)


def _named(whys: list[str]) -> str:
    """The usual mistakes that explain a wrong answer, the first as the message's own sentence."""
    return "".join(f" {'Or, as likely on this step: ' if i else ''}{why}" for i, why in enumerate(whys))


def _rank_loads(chosen_per_rank: list[torch.Tensor], E: int, first: bool = False) -> torch.Tensor:
    """(R, E) float64: how many of each rank's (token, slot) entries chose each expert (`first`: slot 0 only)."""
    return torch.stack(
        [
            torch.bincount((c[:, 0] if first else c.reshape(-1)).long().cpu(), minlength=E)
            for c in chosen_per_rank
        ]
    ).double()


def _next_bias(
    bias: torch.Tensor, chosen_per_rank: list[torch.Tensor], gamma: float, slip: str = ""
) -> torch.Tensor:
    """The rule in float64, on the global batch: b + gamma * sign(mean load - load), each expert's load counted over
    every rank's (token, slot) entries. `slip` computes one of the usual wrong rules instead."""
    b, E = bias.double().cpu(), bias.shape[0]
    per_rank = _rank_loads(chosen_per_rank, E, first=slip == "first_choice")
    busy = per_rank[per_rank.sum(-1) > 0]
    if slip in ("rank_mean", "rank_mean_busy"):  # each rank's own step, then the steps averaged
        ranks = per_rank if slip == "rank_mean" else busy
        return b + gamma * torch.sign(ranks.mean(-1, keepdim=True) - ranks).mean(0)
    if slip == "rank0":
        load = per_rank[0]
    elif slip == "rank_shares":
        # each busy rank's share of its own entries, ranks weighed equally (an empty rank counted as shares of 0
        # moves no sign); scaled by the lcm of the ranks' sizes, so that a tie stays exact
        sizes = [int(n) for n in busy.sum(-1)]
        load = sum(row * (math.lcm(*sizes) // n) for row, n in zip(busy, sizes))
    else:
        load = per_rank.sum(0)
    push = load.mean() - load
    if slip == "proportional":
        return b + gamma * push
    if slip == "sign_zero_up":
        return b + gamma * torch.where(push >= 0, 1.0, -1.0).double()
    if slip == "sign_zero_down":
        return b + gamma * torch.where(push > 0, 1.0, -1.0).double()
    if slip == "unchanged":
        return b
    return b + (-gamma if slip == "sign_reversed" else gamma) * torch.sign(push)


_PER_RANK = ("You moved the bias by each rank's own load and averaged the ranks' results: the ranks share one "
             "bias, moved by the load of the global batch. Ranks that disagree about an expert cancel out, and a "
             "rank with few tokens weighs as much as one with many.")  # fmt: skip
_SHARES = (
    "You averaged the ranks' shares of their own load, every rank weighed the same: a rank with few tokens "
    "then counts as much as one with many. The load is counted over the global batch, every token once."
)

_BIAS_SLIPS = {
    "rank_mean": _PER_RANK,
    "rank_mean_busy": _PER_RANK,
    "rank0": "You counted rank 0's tokens only: an expert's load is counted over every rank's micro-batch.",
    "rank_shares": _SHARES,
    "sign_reversed": "You reversed the sign: an overloaded expert must become harder to pick, so its bias falls.",
    "proportional": "Your step grows with the gap to the mean load; each step moves every bias by gamma exactly, "
                    "up or down.",
    "first_choice": "You counted only each token's first expert; every one of its k choices loads an expert.",
    "sign_zero_up": "An expert whose load equals the mean must keep its bias: sign(0) = 0.",
    "sign_zero_down": "An expert whose load equals the mean must keep its bias: sign(0) = 0.",
    "unchanged": "Your bias did not move: after every step each expert's bias moves by gamma towards balance.",
}  # fmt: skip


def _bias_slips(bias, chosen_per_rank, gamma, got) -> str:
    """Every usual wrong rule that gives the learner's bias on this step ('' for none): where k takes whole groups
    the experts' loads come in few distinct values, and two rules can agree on a step."""
    want = _next_bias(bias, chosen_per_rank, gamma)
    whys = []
    for slip, why in _BIAS_SLIPS.items():
        other = _next_bias(bias, chosen_per_rank, gamma, slip)
        if (other - want).abs().max() > _TOL and (other - got).abs().max() <= _TOL and why not in whys:
            whys.append(why)
    return _named(whys)


#: the designed first steps (E = 8, k = 2, groups of 4, max_groups = 1): each token's two best experts are pair
#: p (experts 2p and 2p + 1, in one group), listed per rank. "balanced": every pair gets 4 tokens over the global
#: batch (the sign(0) slips show), pairs 3, 3, 2, 2 on rank 0 and 1, 1, 2, 2 on rank 1 (rank 0's load alone and the
#: ranks' shares averaged move every expert, in opposite ways). "uneven": pairs 5, 8, 10, 7 over the global batch,
#: 4, 1, 1, 0 on rank 0 and 1, 7, 9, 7 on rank 2: each rank's own update, averaged, moves no expert at all, and
#: rank 0's load alone and the ranks' shares averaged each move pairs 0 and 1 the wrong way, and differ on pair 2.
_PAIRS = {
    "balanced": [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1], [2, 3, 0, 1, 2, 3]],
    "uneven": [[0, 0, 0, 0, 1, 2], [], [0] + [1] * 7 + [2] * 9 + [3] * 7],
}


def _fixed_runs() -> list[dict]:
    """The runs whose shape is fixed (scores, ranks and starting bias drawn all the same, but for the designed
    first steps), each for a reason."""
    pair = {"E": 8, "groups": 2, "M": 1, "k": 2, "gamma": 0.02}
    return [
        {"why": "k = every expert of the kept groups", "E": 16, "groups": 4, "M": 2, "k": 8, "gamma": 0.01},
        {"why": "max_groups = groups: no limit", "E": 16, "groups": 4, "M": 4, "k": 4, "gamma": 0.02},
        {"why": "gamma = 0, from a nonzero bias", "E": 16, "groups": 4, "M": 2, "k": 4, "gamma": 0.0, "bias": 1},
        {"why": "every expert the same load over the global batch at the first step", **pair, "pairs": "balanced",
         "Ts": [10, 6]},
        {"why": "uneven ranks, one of them empty", **pair, "pairs": "uneven", "Ts": [6, 0, 24]},
        {"why": "groups = 1: plain biased top-k", "E": 32, "groups": 1, "M": 1, "k": 6, "gamma": 0.005},
    ]  # fmt: skip


_DRAWN_RUNS = 6


def _draw_run(rnd: random.Random, limited: bool) -> dict:
    """One run's shape. `limited`: node-limited, with each group scored over two or more of its experts but not
    all of them (so the sum of a group's top k / max_groups differs from its best expert and from its sum)."""
    while True:
        E = rnd.choice((8, 16, 32))
        groups = rnd.choice(
            [g for g in ((2, 4, 8) if limited else (1, 2, 4, 8)) if E % g == 0 and E // g >= 2]
        )
        M = rnd.randint(1, groups - 1) if limited else rnd.randint(1, groups)
        ks = [k for k in (2, 4, 6, 8) if k % M == 0 and k <= M * (E // groups) and k < E]
        if limited:
            ks = [k for k in ks if 2 <= k // M < E // groups]
        if ks:
            gamma = float(f"{10 ** rnd.uniform(-2.7, -1.3):.3g}")
            return {"why": "drawn", "E": E, "groups": groups, "M": M, "k": rnd.choice(ks), "gamma": gamma,
                    "bias": rnd.random() < 0.5}  # fmt: skip


def _draw_ranks(rnd: random.Random) -> list[int]:
    """1 to 4 ranks' micro-batch sizes, 0 to 40 tokens each (0 with probability 0.1), not all 0."""
    while True:
        Ts = [0 if rnd.random() < 0.1 else rnd.randint(1, 40) for _ in range(rnd.randint(1, 4))]
        if sum(Ts):
            return Ts


def _scores(run: dict, step: int, rank: int, g: torch.Generator, skew: torch.Tensor) -> torch.Tensor:
    """One rank's (T_r, E) sigmoid affinities for the step: continuous (ties have probability 0), with the run's
    expert skew; at a designed first step, each token's two best experts are its pair."""
    T, E = run["Ts"][rank], run["E"]
    if run.get("pairs") and step == 0:
        pair = torch.tensor(_PAIRS[run["pairs"]][rank], dtype=torch.long)
        low = 0.05 + 0.35 * torch.rand(T, E, generator=g)
        high = 0.8 + 0.15 * torch.rand(T, 2, generator=g)
        return low.scatter(1, torch.stack([2 * pair, 2 * pair + 1], 1).view(T, 2), high).float()
    return torch.sigmoid(torch.randn(T, E, generator=g) + skew).float()


def _tensor(x, where: str, what: str, shape: tuple, integer: bool) -> torch.Tensor:
    try:
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    except Exception as e:  # noqa: BLE001 - anything that is not numbers
        raise AssertionError(
            f"{where}: {what} must be a tensor of shape {shape}, got {type(x).__name__}: {e}"
        ) from None
    t = t.detach().cpu()
    if t.numel() == 0 and 0 in shape:  # an empty rank's answer: a list [] keeps neither shape nor dtype
        t = t.reshape(shape).to(torch.long if integer else torch.float64)
    if tuple(t.shape) != shape:
        raise AssertionError(f"{where}: {what} must have shape {shape}, got {tuple(t.shape)}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise AssertionError(f"{where}: {what} must hold expert ids (integers), got dtype {t.dtype}")
    if not integer:
        if not t.is_floating_point():
            t = t.double()
        if not torch.isfinite(t).all():
            raise AssertionError(f"{where}: {what} must be finite, got {t.tolist()}")
    return t


def _fmt(t) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in t.tolist()) + "]"


def _check_route(where, scores, bias, run, chosen, gates) -> None:
    E, k, groups, M = run["E"], run["k"], run["groups"], run["M"]
    if ((chosen < 0) | (chosen >= E)).any():
        t = int(((chosen < 0) | (chosen >= E)).any(-1).nonzero()[0])
        raise AssertionError(
            f"{where}: token {t} chose {chosen[t].tolist()}: expert ids run from 0 to {E - 1}"
        )
    chosen = chosen.long()
    order = chosen.sort(dim=-1)
    mine, g_mine = order.values, gates.double().gather(1, order.indices)
    twice = (mine[:, 1:] == mine[:, :-1]).any(-1)
    if twice.any():
        t = int(twice.nonzero()[0])
        raise AssertionError(
            f"{where}: token {t} chose {chosen[t].tolist()}: an expert twice (k distinct experts)"
        )
    ref, ref_gates, gscore, margin = _route(scores, bias, k, groups, M)
    r = ref.sort(dim=-1)
    want, g_want = r.values, ref_gates.gather(1, r.indices)
    differ = (mine != want).any(-1)
    near = margin < _NEAR
    s = scores.double()
    own = s.gather(1, mine)
    g_want = torch.where((differ & near)[:, None], own / own.sum(-1, keepdim=True), g_want)
    wrong = differ & ~near
    if wrong.any():
        t = int(wrong.nonzero()[0])
        text = f"{where}: token {t} chose experts {mine[t].tolist()}; the rule chooses {want[t].tolist()}."
        if M < groups:
            kept = sorted(gscore[t].sort(descending=True).indices[:M].tolist())
            text += (f" Its groups' selection scores (the sum of each group's top {k // M} of s + b) are "
                     f"{_fmt(gscore[t])}, so it keeps group{'s' if M > 1 else ''} {kept}.")  # fmt: skip
        if E <= 16:
            text += f" Its s + b: {_fmt(s[t] + bias.double()[:E])}."
        raise AssertionError(text + _route_slips(scores, bias, k, groups, M, mine, g_mine, ~near))
    off = (g_mine - g_want).abs().amax(-1) > _TOL  # amax: here max(dim) took milliseconds a call under load
    if off.any():
        t = int(off.nonzero()[0])
        raise AssertionError(
            f"{where}: token {t} chose the right experts {mine[t].tolist()} (listed by id here), with gates "
            f"{_fmt(g_mine[t])}; the rule's gates are {_fmt(g_want[t])} (its scores s there: "
            f"{_fmt(s[t].gather(0, mine[t]))}).{_route_slips(scores, bias, k, groups, M, mine, g_mine, ~near)}"
        )


def _check_bias(where, bias, chosen_per_rank, gamma, got) -> None:
    want = _next_bias(bias, chosen_per_rank, gamma)
    diff = (got.double() - want).abs()
    if diff.max() <= _TOL:
        return
    e = int(diff.argmax())
    per_rank = _rank_loads(chosen_per_rank, bias.shape[0])
    load = per_rank.sum(0)
    ranks = ", ".join(str(int(x)) for x in per_rank[:, e])
    named = _bias_slips(bias, chosen_per_rank, gamma, got.double())
    raise AssertionError(
        f"{where}: expert {e}'s bias came back {float(got[e]):.6g}; the rule gives {float(want[e]):.6g} (from "
        f"{float(bias[e]):.6g}: over the global batch expert {e} was chosen {int(load[e])} times (per rank: "
        f"{ranks}), the mean load is {float(load.mean()):g}).{named}"
    )


def _step(route, next_bias, off, shape, step, run, bias, g, skew) -> torch.Tensor:
    """One data-parallel step: every rank routes its micro-batch with `bias`, then `next_bias` gets the ranks'
    choices; returns the learner's new bias. The learner's calls run under one switch-off, and are checked after
    it (the references are switched off with the lab)."""
    Ts, E, k, groups, M, gamma = (run[x] for x in ("Ts", "E", "k", "groups", "M", "gamma"))
    given = "the run's starting bias" if step == 0 else f"what your next_bias returned at step {step - 1}"
    routed, new, error = [], None, None
    with unavailable(off, "this exercise (route and next_bias)"):
        try:
            for rank, T in enumerate(Ts):
                scores = _scores(run, step, rank, g, skew)
                where = (f"{shape}, step {step}, rank {rank}: route(scores=<rank {rank}'s {T} x {E} scores>, "
                         f"bias=<{given}>, k={k}, groups={groups}, max_groups={M})")  # fmt: skip
                out = call_learner(route, where, scores.clone(), bias.clone(), k, groups, M)
                if not isinstance(out, (tuple, list)) or len(out) != 2:
                    raise AssertionError(
                        f"{where} must return a pair (chosen, gates), got {type(out).__name__}"
                    )
                chosen = _tensor(out[0], where, "chosen", (T, k), integer=True).long()
                routed.append((where, scores, chosen, _tensor(out[1], where, "gates", (T, k), integer=False)))
            sizes = ", ".join(f"{T} x {k}" for T in Ts)
            where = (f"{shape}, step {step}: next_bias(bias=<{given}>, chosen_per_rank=<the {len(Ts)} ranks' "
                     f"experts your route chose: {sizes}>, gamma={gamma:g})")  # fmt: skip
            got = call_learner(next_bias, where, bias.clone(), [c.clone() for _, _, c, _ in routed], gamma)
            new = _tensor(got, where, "the bias", (E,), integer=False)
        except AssertionError as e:
            error = e
    for at, scores, chosen, gates in routed:
        _check_route(at, scores, bias, run, chosen, gates)
    if error is not None:
        raise error
    _check_bias(where, bias, [c for _, _, c, _ in routed], gamma, new)
    return new


def _run_one(route: Callable, next_bias: Callable, run: dict, name: str, off: dict[str, str]) -> None:
    E, k, groups, M, gamma = (run[x] for x in ("E", "k", "groups", "M", "gamma"))
    g = torch.Generator().manual_seed(run["seed"])
    skew = 0.8 * torch.randn(E, generator=g)
    bias = gamma * torch.randint(-6, 7, (E,), generator=g).float() if run.get("bias") else torch.zeros(E)
    if run.get("bias") and gamma == 0:
        bias = 0.01 * torch.randint(-6, 7, (E,), generator=g).float()
    shape = (f"{name} ({run['why']}: ranks' T={run['Ts']}, E={E}, k={k}, groups={groups}, max_groups={M}, "
             f"gamma={gamma:g})")  # fmt: skip
    for step in range(run["steps"]):
        bias = _step(route, next_bias, off, shape, step, run, bias, g, skew)


def _runs(rnd: random.Random) -> list[tuple[str, dict]]:
    """Every run of one grade run, named: the fixed shapes, then the drawn ones (three node-limited)."""
    runs = [(f"fixed run {i}", r) for i, r in enumerate(_fixed_runs())]
    runs += [(f"drawn run {i}", _draw_run(rnd, limited=i < 3)) for i in range(_DRAWN_RUNS)]
    for _, r in runs:
        if "Ts" not in r:
            r["Ts"] = _draw_ranks(rnd)
        r["steps"], r["seed"] = rnd.randint(4, 8), rnd.getrandbits(62)
    return runs


def check_balancing_run(route: Callable, next_bias: Callable) -> None:
    """`route(scores, bias, k, groups, max_groups)` -> (chosen, gates) on each rank's micro-batch and
    `next_bias(bias, chosen_per_rank, gamma)` -> the one bias of the next step, run together step after step, on
    runs drawn every grade run."""
    require_callable(route, "route")
    require_callable(next_bias, "next_bias")
    off = switched_off()
    runs = _runs(random.Random(draw_seed()))
    for name, run in runs:
        _run_one(route, next_bias, run, name, off)
    passed("check_balancing_run", f"{len(_fixed_runs())} fixed and {_DRAWN_RUNS} drawn runs, every rank's experts "
                                  "and gates, every step's bias")  # fmt: skip


# ----------------------------------------------------------------------------- exercise 2: replicate and pack
def _copy_counts(loads: list[float], replicas: int, gpus: int, tie: int = 0, divide: bool = True,
               cap: bool = True, made: list | None = None) -> list[int]:  # fmt: skip
    """Copies per expert: one each, then each next copy to the expert with the largest load per copy, at most one
    per GPU. `tie` orders equal loads per copy (0: fewer copies, then the lower id; 1: the lower id; 2: the
    higher id); `divide` / `cap` off: the usual slips (the total load; no limit). `made` gets the copies' experts
    in the order they were made."""
    E = len(loads)
    count = [1] * E
    key = [lambda e: (-count[e], -e), lambda e: (-e,), lambda e: (e,)][tie]
    for _ in range(E, replicas):
        free = [e for e in range(E) if count[e] < gpus or not cap]
        e = max(free, key=lambda e: ((loads[e] / count[e]) if divide else loads[e], *key(e)))
        count[e] += 1
        if made is not None:
            made.append(e)
    return count


def _pack_replicas(loads: list[float], count: list[int], gpus: int, order: int = 0, tie: int = 0, room: bool = True
          ) -> list[list[int]] | None:  # fmt: skip
    """The replicas (each its expert's load / copies) onto the GPUs: heaviest first (`order` 0: equal loads by more
    copies, then the lower id; 1: the higher id first; 2: expert id order, the slip), each into the lightest GPU
    with room that does not hold its expert (`tie` 0: the one with the most room, then the lower id; 1: the lower
    id; 2: the higher id). None when a replica finds no such GPU. `room` off: no limit per GPU (the slip)."""
    E, slots = len(loads), sum(count) // gpus
    per = [loads[e] / count[e] for e in range(E)]
    experts = [sorted(range(E), key=lambda e: (-per[e], -count[e], e)),
               sorted(range(E), key=lambda e: (-per[e], -e)), list(range(E))][order]  # fmt: skip
    weight, held = [0.0] * gpus, [[] for _ in range(gpus)]
    key = [lambda g: (weight[g], len(held[g]), g), lambda g: (weight[g], g), lambda g: (weight[g], -g)][tie]
    for e in experts:
        for _ in range(count[e]):
            fits = [g for g in range(gpus) if (len(held[g]) < slots or not room) and e not in held[g]]
            if not fits:
                return None
            g = min(fits, key=key)
            held[g].append(e)
            weight[g] += per[e]
    return held


def _gpu_loads(loads: list[float], phy2log: list[int], gpus: int) -> list[float]:
    count = [phy2log.count(e) for e in range(len(loads))]
    slots = len(phy2log) // gpus
    return [sum(loads[e] / count[e] for e in phy2log[g * slots : (g + 1) * slots]) for g in range(gpus)]


def _greedy(loads: list[float], replicas: int, gpus: int, variant: tuple[int, int, int] = (0, 0, 0)
            ) -> list[int] | None:  # fmt: skip
    """The rule-keeping greedy, in one tie order: phy2log, or None when that order is left without a GPU."""
    held = _pack_replicas(
        loads, _copy_counts(loads, replicas, gpus, variant[0]), gpus, variant[1], variant[2]
    )
    return None if held is None else [e for h in held for e in h]


def _bar(loads: list[float], replicas: int, gpus: int) -> float:
    """The busiest GPU's load a placement must not exceed: the greedy's, in the worst of its tie orders that
    finish (they agree unless loads tie)."""
    done = [
        p for v in itertools.product(range(3), range(2), range(3)) if (p := _greedy(loads, replicas, gpus, v))
    ]
    return max(max(_gpu_loads(loads, p, gpus)) for p in done)


def _max_per_copy(loads: list[float], count: list[int]) -> float:
    return max(x / c for x, c in zip(loads, count))


def _canonical(phy2log: list[int], gpus: int) -> list[tuple[int, ...]]:
    """A placement up to the GPUs' numbering and the order inside a GPU."""
    slots = len(phy2log) // gpus
    return sorted(tuple(sorted(phy2log[g * slots : (g + 1) * slots])) for g in range(gpus))


_DEAL = ("That deals the replicas to the GPUs in turn, blind to what they weigh: nothing evens out a GPU that drew "
         "two heavy replicas.")  # fmt: skip
_NO_DIVIDE = ("The extra copies went to the experts with the largest total load, again and again: an expert's "
              "load per copy falls with every copy it gets, and the next copy belongs where the load per copy is "
              "largest now.")  # fmt: skip


def _place_slips(loads: list[float], replicas: int, gpus: int, phy2log: list[int]) -> str:
    """The usual wrong placement the learner's matches exactly (up to the GPUs' numbering), named ('' for none)."""
    E, slots = len(loads), replicas // gpus
    mine = _canonical(phy2log, gpus)
    count = [phy2log.count(e) for e in range(E)]
    for cap in (True, False):
        by_total = _copy_counts(loads, replicas, gpus, 1, divide=False, cap=cap)
        if count == by_total and by_total != _copy_counts(loads, replicas, gpus, 1):
            return " " + _NO_DIVIDE
    for cap in (True, False):  # the replicas listed one of each then the copies as made, or expert by expert
        made: list[int] = []
        c = _copy_counts(loads, replicas, gpus, 1, cap=cap, made=made)
        for order in (list(range(E)) + made, [e for e in range(E) for _ in range(c[e])]):
            dealt = [order[j] for g in range(gpus) for j in range(g, replicas, gpus)]
            if mine == _canonical(dealt, gpus):
                return " " + _DEAL
    packed = {
        "order": [],
        "room": [],
    }  # the two packing slips, in each tie order (they agree unless loads tie)
    for rtie, tie in itertools.product((0, 1), (0, 1)):
        count_ref = _copy_counts(loads, replicas, gpus, rtie)
        packed["order"].append(_pack_replicas(loads, count_ref, gpus, order=2, tie=tie))
        packed["room"].append(_pack_replicas(loads, count_ref, gpus, tie=tie, room=False))
    if any(h is not None and mine == _canonical([e for x in h for e in x], gpus) for h in packed["order"]):
        return (
            " That packs the replicas in expert order: a heavy replica that comes late finds every GPU loaded "
            "already. Placed heaviest first, the light ones come last and even the GPUs out."
        )
    if any(h is not None and mine == _canonical([e for x in h for e in x], gpus) for h in packed["room"]):
        return (
            f" Your GPUs held different numbers of replicas before you listed them: read as replica j on GPU "
            f"j // {slots}, the list puts replicas on other GPUs than you meant. Every GPU holds exactly "
            f"replicas / gpus = {slots}."
        )
    return ""


def _fmt_loads(loads: list[float]) -> str:
    return "[" + ", ".join(f"{x:g}" for x in loads) + "]"


def _draw_loads(rnd: random.Random, E: int, zipf: bool) -> list[float]:
    """Tokens per expert, from a continuous distribution rounded to 6 significant digits (a failure message shows
    them exactly); a tie is rare, and the bar takes the worst of the greedy's tie orders anyway."""
    if zipf:
        s, total = rnd.uniform(0.6, 1.4), rnd.uniform(50, 500) * E
        w = [(i + 1) ** -s for i in range(E)]
        rnd.shuffle(w)
        loads = [total * x / sum(w) for x in w]
    else:
        loads = [100 * rnd.lognormvariate(0, 1) for _ in range(E)]
    return [float(f"{x:.6g}") for x in loads]


_DRAWN_PLACES = 16


def _place_cases(rnd: random.Random) -> list[tuple[list[float], int, int, str]]:
    hot = [0.0] * 12
    hot[rnd.randrange(12)] = 1200.0
    cases = [([100.0] * 16, 24, 4, "uniform loads"), (hot, 20, 4, "one expert with every token"),
             (_draw_loads(rnd, 32, True), 32, 8, "replicas == experts")]  # fmt: skip
    for i in range(_DRAWN_PLACES):
        E, gpus = rnd.randint(8, 64), rnd.randint(2, 16)
        low, high = -(-E // gpus), 2 * E // gpus
        cases.append((_draw_loads(rnd, E, i % 2 == 0), gpus * rnd.randint(low, high), gpus, "drawn"))
    return cases


def _phy2log(got, where: str, E: int, replicas: int) -> list[int]:
    try:
        out = got.tolist() if isinstance(got, torch.Tensor) else list(got)
        ok = all(not isinstance(x, bool) and int(x) == x for x in out)
    except Exception:  # noqa: BLE001 - not a sequence of numbers
        ok = False
    if not ok:
        raise AssertionError(f"{where} must return a list of {replicas} expert ids, got {got!r:.200}")
    out = [int(x) for x in out]
    if len(out) != replicas:
        raise AssertionError(
            f"{where} returned {len(out)} replicas; there are replicas={replicas} slots to fill"
        )
    bad = [x for x in out if not 0 <= x < E]
    if bad:
        raise AssertionError(f"{where} returned expert id {bad[0]}: the ids run from 0 to {E - 1}")
    return out


def _check_valid(where: str, loads, replicas: int, gpus: int, phy2log: list[int]) -> None:
    E, slots = len(loads), replicas // gpus
    missing = [e for e in range(E) if e not in phy2log]
    if missing:
        raise AssertionError(f"{where}: expert {missing[0]} has no replica; every expert needs at least one, or its "
                             f"tokens have nowhere to go.{_place_slips(loads, replicas, gpus, phy2log)}")  # fmt: skip
    for g in range(gpus):
        here = phy2log[g * slots : (g + 1) * slots]
        twice = next((e for e in here if here.count(e) > 1), None)
        if twice is not None:
            many = phy2log.count(twice)
            more = f" (expert {twice} has {many} replicas for {gpus} GPUs)" if many > gpus else ""
            raise AssertionError(
                f"{where}: GPU {g} (replicas {g * slots} to {(g + 1) * slots - 1}) holds two replicas of expert "
                f"{twice}{more}. A second copy on one GPU holds the same weights twice and only raises that GPU's "
                f"share of the expert's tokens from 1/c to 2/c (here c = {many}); this exercise keeps one copy per "
                f"GPU.{_place_slips(loads, replicas, gpus, phy2log)}"
            )


def check_placement(place: Callable) -> None:
    """`place(loads, replicas, gpus)` -> phy2log: a valid placement whose busiest GPU serves no more tokens than the
    greedy's, on every case (fixed ones and 16 drawn every grade run)."""
    require_callable(place, "place")
    cases = _place_cases(random.Random(draw_seed()))
    bars = [_bar(loads, R, G) for loads, R, G, _ in cases]  # locked before the learner's function first runs
    fn = guarded(place, switched_off(), "this exercise (place)")
    for (loads, R, G, why), bar in zip(cases, bars):
        where = f"place(loads={_fmt_loads(loads)}, replicas={R}, gpus={G})"
        p2l = _phy2log(call_learner(fn, where, list(loads), R, G), where, len(loads), R)
        _check_valid(where, loads, R, G, p2l)
        gpu = _gpu_loads(loads, p2l, G)
        busiest = max(gpu)
        if busiest <= bar * (1 + _REL):
            continue
        g, mean, slots = gpu.index(busiest), sum(loads) / G, R // G
        count = [p2l.count(e) for e in range(len(loads))]
        text = (f"{where} ({why}): your busiest GPU, GPU {g} (experts {p2l[g * slots:(g + 1) * slots]}), serves "
                f"{busiest:.6g} tokens, max/mean {busiest / mean:.4f}; the greedy placement's busiest serves "
                f"{bar:.6g}, max/mean {bar / mean:.4f}.")  # fmt: skip
        best = _max_per_copy(loads, _copy_counts(loads, R, G))
        if _max_per_copy(loads, count) > best * (1 + _REL):
            e = max(range(len(loads)), key=lambda e: loads[e] / count[e])
            text += (f" Your copies leave expert {e} with {loads[e] / count[e]:.6g} tokens per copy ({count[e]} "
                     f"cop{'y' if count[e] == 1 else 'ies'}); the same number of copies can bring the largest load "
                     f"per copy down to {best:.6g}.")  # fmt: skip
        raise AssertionError(text + _place_slips(loads, R, G, p2l))
    passed("check_placement", f"3 fixed and {_DRAWN_PLACES} drawn cases, no GPU busier than the greedy's")

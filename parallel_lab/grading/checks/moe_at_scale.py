"""Checks for lesson 21's exercises: a run of node-limited routing balanced by a per-expert bias, and replicated
experts packed onto GPUs one copy per GPU at most.

`route(scores, bias, k, groups, max_groups)` -> (chosen, gates) and `next_bias(bias, chosen, gamma)` -> bias run
together, step after step, as a training loop runs them: route on the step's scores with the bias so far, then
the bias after the step from the experts route chose. Five runs have a fixed shape (k = every expert of the kept
groups; max_groups = groups; gamma = 0 from a nonzero bias; a first step where every expert gets the same load;
groups = 1) and six are drawn every grade run (E in {8, 16, 32}, k in {2, 4, 6, 8}, groups in {1, 2, 4, 8}, three
of them node-limited with groups scored over two or more experts, gamma from 0.002 to 0.05); every run's scores
(sigmoid affinities, with an expert skew so the bias has work to do), its starting bias (zero or not) and its T
(but for the equal-load run's 16) are drawn every grade run, and 4 to 8 steps. Each token's
set of experts is compared exactly with the rule's, computed in float64 from the bias the learner's own
`next_bias` returned (a token within 1e-5 of a tie, in its group scores or its expert scores, may take either
side: the learner's float32 sums round there); each gate, matched by expert id, within 1e-6; the bias after each
step within 1e-6 of the rule applied to the learner's bias and chosen experts. Named slips: gates from s + b,
a softmax over every expert, gates not normalised; groups scored by their best expert, by s alone, by how many of
the token's overall top k they hold, no group limit, selection by s alone; the sign reversed, a step proportional
to mean - load, the load of the first choice only, sign(0) taken as +-1, the bias left as it was.

`place(loads, replicas, gpus)` -> phy2log (replica j on GPU j // (replicas / gpus)) must be a valid placement
(every expert at least one replica, no expert twice on a GPU) whose busiest GPU serves no more tokens than the
greedy placement's: EPLB's two greedy steps (deepseek-ai/EPLB: the next copy to the expert whose load per copy is
largest; replicas heaviest first into the lightest GPU with room), each kept to one copy of an expert per GPU.
EPLB's own global policy puts two copies of an expert on one GPU in about two thirds of the drawn cases, and in
about 30% of them its busiest GPU serves less than the rule-keeping greedy's (by up to 7%): a bar a placement that
keeps the rule cannot always reach. So the bar is the rule-keeping greedy (`_greedy`), the largest of its tie
orders (they agree on the drawn loads unless two tie, which is rare; the fixed cases tie on purpose), computed for
every case before the learner's function first runs. Fixed cases:
uniform loads, one expert with every token, replicas == experts; 16 drawn every run (Zipf-like and lognormal
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
import pkgutil
import random
from collections.abc import Callable

import torch

from parallel_lab.grading.checks import call_learner, draw_seed, family, guarded, passed, require_callable

__all__ = ["check_balancing_run", "check_placement"]

_SELF = "parallel_lab.grading.checks.moe_at_scale"
_NEAR = 1e-5  # a token this close to a tie may take either side
_TOL = 1e-6  # gates and biases
_REL = 1e-9  # loads: the greedy's or better

#: torch's balancers that pack items into equal-count groups (context parallelism's; switched off for place)
TORCH_PACKERS = ("torch.distributed.tensor.experimental._context_parallel._load_balancer",)

#: this module's references, switched off with the lab's
_REFERENCES = ("_route", "_route_slips", "_next_bias", "_bias_slips", "_copy_counts", "_pack_replicas", "_greedy", "_bar",
               "_max_per_copy", "_place_slips", "_gpu_loads", "_canonical")  # fmt: skip


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
        gscore = by_group.max(-1).values
    elif slip.startswith("group_count"):
        top = pick.topk(k, dim=-1).indices // per
        gscore = torch.zeros(T, groups, dtype=s.dtype).scatter_add_(
            1, top, torch.ones_like(top, dtype=s.dtype)
        )
    else:
        gscore = by_group.topk(take, dim=-1).values.sum(-1)
    if slip == "no_groups" or M == groups:
        keep = torch.ones(T, groups, dtype=torch.bool)
    else:  # equal counts (the count slip) to the lower group, or (its twin) as torch.topk leaves them
        best = (
            gscore.topk(M, dim=-1)
            if slip == "group_count_topk"
            else gscore.sort(dim=-1, descending=True, stable=True)
        )
        keep = torch.zeros(T, groups, dtype=torch.bool)
        keep.scatter_(1, best.indices[:, :M], True)
    masked = pick.view(T, groups, per).masked_fill(~keep[..., None], float("-inf")).view(T, E)
    chosen = masked.topk(k, dim=-1).indices
    margin = torch.full((T,), float("inf"), dtype=s.dtype)
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
    """The first usual wrong rule that gives the learner's experts and gates on every token of `ok` ('' for
    none): a rule that matches by coincidence on one token names nothing."""
    for slip, why in _ROUTE_SLIPS.items():
        chosen, gates, _, _ = _route(scores, bias, k, groups, M, slip)
        order = chosen.sort(dim=-1)
        same = (order.values == mine).all(-1) & ((gates.gather(1, order.indices) - g_mine).abs() <= _TOL).all(
            -1
        )
        if bool(same[ok].all()):
            return " " + why
    return ""


def _next_bias(bias: torch.Tensor, chosen: torch.Tensor, gamma: float, slip: str = "") -> torch.Tensor:
    """The rule in float64: b + gamma * sign(mean load - load), the load counted over every (token, slot)."""
    b, E = bias.double(), bias.shape[0]
    ids = chosen[:, 0] if slip == "first_choice" else chosen.reshape(-1)
    load = torch.bincount(ids.long(), minlength=E).double()
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


_BIAS_SLIPS = {
    "sign_reversed": "You reversed the sign: an overloaded expert must become harder to pick, so its bias falls.",
    "proportional": "Your step grows with the gap to the mean load; each step moves every bias by gamma exactly, "
                    "up or down.",
    "first_choice": "You counted only each token's first expert; every one of its k choices loads an expert.",
    "sign_zero_up": "An expert whose load equals the mean must keep its bias: sign(0) = 0.",
    "sign_zero_down": "An expert whose load equals the mean must keep its bias: sign(0) = 0.",
    "unchanged": "Your bias did not move: after every step each expert's bias moves by gamma towards balance.",
}  # fmt: skip


def _bias_slips(bias, chosen, gamma, got) -> str:
    want = _next_bias(bias, chosen, gamma)
    for slip, why in _BIAS_SLIPS.items():
        other = _next_bias(bias, chosen, gamma, slip)
        if (other - want).abs().max() > _TOL and (other - got).abs().max() <= _TOL:
            return " " + why
    return ""


def _fixed_runs() -> list[dict]:
    """The runs whose shape is fixed (scores, T, starting bias drawn all the same), each for a reason."""
    return [
        {"why": "k = every expert of the kept groups", "E": 16, "groups": 4, "M": 2, "k": 8, "gamma": 0.01},
        {"why": "max_groups = groups: no limit", "E": 16, "groups": 4, "M": 4, "k": 4, "gamma": 0.02},
        {"why": "gamma = 0, from a nonzero bias", "E": 16, "groups": 4, "M": 2, "k": 4, "gamma": 0.0, "bias": 1},
        {"why": "every expert the same load at the first step", "E": 8, "groups": 2, "M": 1, "k": 2, "gamma": 0.02,
         "T": 16, "balanced": True},
        {"why": "groups = 1: plain biased top-k", "E": 32, "groups": 1, "M": 1, "k": 6, "gamma": 0.005},
    ]  # fmt: skip


_DRAWN_RUNS = 6


def _draw_run(rnd: random.Random, limited: bool) -> dict:
    """One run's shape. `limited`: node-limited, with each group scored over two or more experts (so the sum of
    a group's top k / max_groups differs from its best expert)."""
    while True:
        E = rnd.choice((8, 16, 32))
        groups = rnd.choice(
            [g for g in ((2, 4, 8) if limited else (1, 2, 4, 8)) if E % g == 0 and E // g >= 2]
        )
        M = rnd.randint(1, groups - 1) if limited else rnd.randint(1, groups)
        ks = [k for k in (2, 4, 6, 8) if k % M == 0 and k <= M * (E // groups) and k < E]
        if limited:
            ks = [k for k in ks if k // M >= 2]
        if ks:
            gamma = float(f"{10 ** rnd.uniform(-2.7, -1.3):.3g}")
            return {"why": "drawn", "E": E, "groups": groups, "M": M, "k": rnd.choice(ks), "gamma": gamma,
                    "bias": rnd.random() < 0.5}  # fmt: skip


def _scores(run: dict, step: int, g: torch.Generator, skew: torch.Tensor) -> torch.Tensor:
    """The step's (T, E) sigmoid affinities: continuous (ties have probability 0), with the run's expert skew."""
    T, E = run["T"], run["E"]
    if run.get("balanced") and step == 0:  # token t's two best experts: pair t % 4, all in one group
        low = 0.05 + 0.35 * torch.rand(T, E, generator=g)
        pair = torch.arange(T) % (E // 2)
        high = 0.8 + 0.15 * torch.rand(T, 2, generator=g)
        return low.scatter(1, torch.stack([2 * pair, 2 * pair + 1], 1), high).float()
    return torch.sigmoid(torch.randn(T, E, generator=g) + skew).float()


def _tensor(x, where: str, what: str, shape: tuple, integer: bool) -> torch.Tensor:
    try:
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    except Exception as e:  # noqa: BLE001 - anything that is not numbers
        raise AssertionError(
            f"{where}: {what} must be a tensor of shape {shape}, got {type(x).__name__}: {e}"
        ) from None
    t = t.detach().cpu()
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
    off = (g_mine - g_want).abs().max(-1).values > _TOL
    if off.any():
        t = int(off.nonzero()[0])
        raise AssertionError(
            f"{where}: token {t} chose the right experts {mine[t].tolist()} (listed by id here), with gates "
            f"{_fmt(g_mine[t])}; the rule's gates are {_fmt(g_want[t])} (its scores s there: "
            f"{_fmt(s[t].gather(0, mine[t]))}).{_route_slips(scores, bias, k, groups, M, mine, g_mine, ~near)}"
        )


def _check_bias(where, bias, chosen, gamma, got) -> None:
    want = _next_bias(bias, chosen, gamma)
    diff = (got.double() - want).abs()
    if diff.max() <= _TOL:
        return
    e = int(diff.argmax())
    load = torch.bincount(chosen.reshape(-1).long(), minlength=bias.shape[0])
    raise AssertionError(
        f"{where}: expert {e}'s bias came back {float(got[e]):.6g}; the rule gives {float(want[e]):.6g} (from "
        f"{float(bias[e]):.6g}: expert {e} was chosen {int(load[e])} times this step, the mean load is "
        f"{float(load.double().mean()):g}).{_bias_slips(bias, chosen, gamma, got.double())}"
    )


def _run_one(route: Callable, next_bias: Callable, run: dict, name: str) -> None:
    T, E, k, groups, M, gamma = (run[x] for x in ("T", "E", "k", "groups", "M", "gamma"))
    g = torch.Generator().manual_seed(run["seed"])
    skew = 0.8 * torch.randn(E, generator=g)
    bias = gamma * torch.randint(-6, 7, (E,), generator=g).float() if run.get("bias") else torch.zeros(E)
    if run.get("bias") and gamma == 0:
        bias = 0.01 * torch.randint(-6, 7, (E,), generator=g).float()
    shape = f"{name} ({run['why']}: T={T}, E={E}, k={k}, groups={groups}, max_groups={M}, gamma={gamma:g})"
    for step in range(run["steps"]):
        scores = _scores(run, step, g, skew)
        given = "the run's starting bias" if step == 0 else f"what your next_bias returned at step {step - 1}"
        where = (f"{shape}, step {step}: route(scores=<the step's {T} x {E} scores>, bias=<{given}>, k={k}, "
                 f"groups={groups}, max_groups={M})")  # fmt: skip
        out = call_learner(route, where, scores.clone(), bias.clone(), k, groups, M)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise AssertionError(f"{where} must return a pair (chosen, gates), got {type(out).__name__}")
        chosen = _tensor(out[0], where, "chosen", (T, k), integer=True).long()
        gates = _tensor(out[1], where, "gates", (T, k), integer=False)
        _check_route(where, scores, bias, run, chosen, gates)
        where = (f"{shape}, step {step}: next_bias(bias=<{given}>, chosen=<the {T} x {k} experts your route "
                 f"chose>, gamma={gamma:g})")  # fmt: skip
        new = call_learner(next_bias, where, bias.clone(), chosen.clone(), gamma)
        new = _tensor(new, where, "the bias", (E,), integer=False)
        _check_bias(where, bias, chosen, gamma, new)
        bias = new


def _runs(rnd: random.Random) -> list[tuple[str, dict]]:
    """Every run of one grade run, named: the fixed shapes, then the drawn ones (three node-limited)."""
    runs = [(f"fixed run {i}", r) for i, r in enumerate(_fixed_runs())]
    runs += [(f"drawn run {i}", _draw_run(rnd, limited=i < 3)) for i in range(_DRAWN_RUNS)]
    for _, r in runs:
        r.setdefault("T", rnd.randint(8, 48))
        r["steps"], r["seed"] = rnd.randint(4, 8), rnd.getrandbits(62)
    return runs


def check_balancing_run(route: Callable, next_bias: Callable) -> None:
    """`route(scores, bias, k, groups, max_groups)` -> (chosen, gates) and `next_bias(bias, chosen, gamma)` -> the
    bias after the step, run together step after step on runs drawn every grade run."""
    require_callable(route, "route")
    require_callable(next_bias, "next_bias")
    off = switched_off()
    route = guarded(route, off, "this exercise (route)")
    next_bias = guarded(next_bias, off, "this exercise (next_bias)")
    runs = _runs(random.Random(draw_seed()))
    for name, run in runs:
        _run_one(route, next_bias, run, name)
    passed("check_balancing_run", f"{len(_fixed_runs())} fixed and {_DRAWN_RUNS} drawn runs, every step's experts, "
                                  "gates and bias")  # fmt: skip


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
                f"{twice}{more}. A second copy on the same GPU halves nothing: that GPU serves the expert's tokens "
                f"either way.{_place_slips(loads, replicas, gpus, phy2log)}"
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

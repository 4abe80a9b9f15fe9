"""Lesson 21's exercises: the reference solution passes; wrappers of the lab's and torch's functions, answer tables
from an earlier grade run and wrong algorithms fail, each with a message naming the failing case and what
differed; the check's cases cover what the statements promise (data-parallel steps whose designed first steps
separate the global batch's bias update from its per-rank imitations), and its bar for the placement is a greedy
that keeps the one-copy-per-GPU rule (EPLB's own policy breaks it)."""

from __future__ import annotations

import random
import re

import pytest
import torch
from solution_code import (
    _check_cell,
    edit,
    fails_saying,
    functions_doing,
    not_switched_off,
    passes_with_one_line,
    run_check,
    solution_namespace,
    table_cheat_fails,
)

from parallel_lab.grading.checks import _resolve
from parallel_lab.grading.checks import moe_at_scale as checks

RUN, PLACE = "check_balancing_run", "check_placement"


@pytest.mark.parametrize("check", [RUN, PLACE])
def test_the_solution_passes_with_one_line(check, capsys):
    passes_with_one_line("21", check, capsys)


# ----------------------------------------------------------------------------- exercise 1: a balancing run
def _sol(old: str, new: str) -> str:
    return edit("21", "route", old, new)


GROUP_SCORE = "group_score = select.topk(k // max_groups, dim=-1).values.sum(-1)  # (T, groups)"
BEST = "best = group_score.topk(max_groups, dim=-1).indices  # (T, max_groups)"
GATES = "return chosen, weight / weight.sum(-1, keepdim=True)"
SIGN = "torch.sign(load.mean() - load)"
LOAD = "load = sum(torch.bincount(c.reshape(-1), minlength=E) for c in chosen_per_rank)"
PER_RANK_STEPS = (  # each rank its own update, then the updates averaged (an empty rank's update is 0)
    "steps = [torch.bincount(c.reshape(-1), minlength=E).to(bias.dtype) for c in chosen_per_rank]\n"
    "    return torch.stack([bias + gamma * torch.sign(x.mean() - x) for x in steps]).mean(0)\n"
    "    load = 0"
)
SHARES = (  # each non-empty rank's share of its own choices, ranks weighed equally (in integers: a tie stays a tie)
    "sizes = [c.numel() for c in chosen_per_rank if c.numel()]\n"
    "    load = sum(torch.bincount(c.reshape(-1), minlength=E) * (math.lcm(*sizes) // c.numel())\n"
    "               for c in chosen_per_rank if c.numel())\n"
    "    push = load.sum() - E * load  # E times mean - load\n"
    "    return bias + gamma * torch.sign(push).to(bias.dtype)\n"
    "    load = 0"
)
COUNT = (
    "top = (scores + bias).topk(k, dim=-1).indices // (E // groups)\n"
    "    group_score = torch.zeros(T, groups).scatter_add(1, top, torch.ones(T, k))"
)

WRONG_RUN = [
    ("gates from the biased scores", _sol("weight = scores.gather(1, chosen)", "weight = (scores + bias).gather(1, chosen)"),
     "Your gates come from s + b"),
    ("gates a softmax over every expert", _sol(GATES, "return chosen, torch.softmax(scores, -1).gather(1, chosen)"),
     "a softmax over every expert's score"),
    ("gates not normalised", _sol(GATES, "return chosen, weight"), "they must sum to 1"),
    ("the sign reversed", _sol("return bias + gamma * torch.sign(", "return bias - gamma * torch.sign("),
     "You reversed the sign"),
    ("a step proportional to mean - load", _sol(f"gamma * {SIGN}", "gamma * (load.mean() - load)"),
     "Your step grows with the gap to the mean load"),
    ("group score = the best expert's", _sol(GROUP_SCORE, "group_score = select.max(-1).values"),
     "You scored each group by its best expert alone"),
    ("group score = the sum of the whole group", _sol(GROUP_SCORE, "group_score = select.sum(-1)"),
     "You scored each group by the sum of all its experts"),
    ("group score from the unbiased scores",
     _sol(GROUP_SCORE, "group_score = scores.view(T, groups, E // groups).topk(k // max_groups, dim=-1).values.sum(-1)"),
     "You scored the groups on s alone"),
    ("groups by how many of the top k they hold (torch.topk's ties)", _sol(GROUP_SCORE, COUNT),
     "You kept the groups holding most of the token's overall top k"),
    ("groups by how many of the top k they hold (ties to the lower group)",
     _sol(GROUP_SCORE, COUNT).replace(BEST, "best = group_score.sort(dim=-1, descending=True, stable=True).indices[:, :max_groups]"),
     "You kept the groups holding most of the token's overall top k"),
    ("the load of the first choice only", _sol("torch.bincount(c.reshape(-1)", "torch.bincount(c[:, 0]"),
     "You counted only each token's first expert"),
    ("each rank's own update, averaged", _sol(LOAD, PER_RANK_STEPS), "You moved the bias by each rank's own load"),
    ("rank 0's load alone", _sol("for c in chosen_per_rank)", "for c in chosen_per_rank[:1])"),
     "You counted rank 0's tokens only"),
    ("the ranks' shares averaged", "import math\n" + _sol(LOAD, SHARES), "You averaged the ranks' shares of their own load"),
    ("sign(0) taken as -1", _sol(SIGN, "torch.where(load < load.mean(), 1.0, -1.0)"), "sign(0) = 0"),
    ("sign(0) taken as +1", _sol(SIGN, "torch.where(load <= load.mean(), 1.0, -1.0)"), "sign(0) = 0"),
    ("the bias never moves", _sol(f"return bias + gamma * {SIGN}", "return bias"), "Your bias did not move"),
    ("no group limit", _sol(BEST, "best = torch.arange(groups).expand(T, groups)"), "You took the top k over every expert"),
    ("selection on the unbiased scores", _sol("select = (scores + bias).view", "select = scores.view"),
     "on s alone"),  # in a run where k takes every expert of the kept groups, only the groups' choice shows
    ("an expert twice", _sol(GATES, "chosen[:, 1] = chosen[:, 0]\n    weight = scores.gather(1, chosen)\n    " + GATES),
     "an expert twice"),
    ("not a pair", _sol(GATES, "return chosen"), "must return a pair (chosen, gates)"),
    ("a bias of the wrong shape", _sol(f"return bias + gamma * {SIGN}", "return load[:-1]"),
     "the bias must have shape"),
]  # fmt: skip

SIG_R = "import torch\ndef route(scores, bias, k, groups, max_groups):\n"
_RIGHT_ROUTE = (
    "    T, E = scores.shape\n    return torch.zeros(T, k, dtype=torch.long), torch.ones(T, k) / k\n"
)
CHEATS_RUN = [
    ("wraps node_limited_topk", "from parallel_lab.moe import node_limited_topk\n" + SIG_R
     + "    return node_limited_topk(scores, bias, k, groups, max_groups)\n"),
    ("wraps biased_topk", "from parallel_lab.moe.balancing import biased_topk\n" + SIG_R
     + "    return biased_topk(scores, bias, k)\n"),
    ("wraps FineGrainedMoE.route", "from parallel_lab.moe import FineGrainedMoE\n" + SIG_R
     + "    layer = FineGrainedMoE(d_model=scores.shape[1], n_routed=scores.shape[1], k=k, groups=groups,\n"
     "                           max_groups=max_groups)\n"
     "    return layer.route(scores)\n"),
    ("wraps the lab's race", "from parallel_lab.moe.race import run_race\n" + SIG_R
     + "    run_race(method='bias', steps=1)\n" + _RIGHT_ROUTE),
    ("wraps update_bias", "import torch\nfrom parallel_lab.moe import update_bias\n"
     "def next_bias(bias, chosen_per_rank, gamma):\n"
     "    return update_bias(bias, torch.bincount(torch.cat(chosen_per_rank).reshape(-1), minlength=bias.shape[0]),\n"
     "                       gamma)\n"),
    ("reads the check's own router", "from parallel_lab.grading.checks.moe_at_scale import _route\n" + SIG_R
     + "    return _route(scores, bias, k, groups, max_groups)[:2]\n"),
    ("reads the check's own bias update", "from parallel_lab.grading.checks.moe_at_scale import _next_bias\n"
     "def next_bias(bias, chosen_per_rank, gamma):\n    return _next_bias(bias, chosen_per_rank, gamma)\n"),
    ("reads the check's own load count", "from parallel_lab.grading.checks.moe_at_scale import _rank_loads\n"
     "def next_bias(bias, chosen_per_rank, gamma):\n"
     "    load = _rank_loads(chosen_per_rank, bias.shape[0]).sum(0)\n"
     "    return bias + gamma * (load.mean() - load).sign()\n"),
]  # fmt: skip

#: "fixed run 3 (every expert ...: ranks' T=[6, 10], E=8, ...), step 0, rank 1: route(scores=<rank 1's 10 x 8
#: scores>, bias=<...>, k=2, ...)" or "..., step 0: next_bias(bias=<...>, chosen_per_rank=<the 2 ranks' ...>, ...)"
WHERE_RUN = re.compile(
    r"^(fixed|drawn) run \d \([^)]*: ranks' T=\[[\d, ]+\], E=\d+, k=\d, groups=\d, max_groups=\d, "
    r"gamma=[\d.e-]+\), step \d"
    r"(, rank \d: route\(scores=<rank \d's \d+ x \d+ scores>, bias=<[^>]+>, k=\d, groups=\d, max_groups=\d\)"
    r"|: next_bias\(bias=<[^>]+>, chosen_per_rank=<the \d ranks' experts your route chose: [\dx, ]+>, "
    r"gamma=[\d.e-]+\))"
)


@pytest.mark.parametrize(("label", "source", "want"), WRONG_RUN, ids=[w[0] for w in WRONG_RUN])
def test_a_wrong_route_or_bias_fails_naming_the_step_and_the_mistake(label, source, want):
    message = fails_saying("21", RUN, label, source, want)
    assert WHERE_RUN.match(message), message


@pytest.mark.parametrize(("label", "source"), CHEATS_RUN, ids=[c[0] for c in CHEATS_RUN])
def test_a_wrapper_of_the_labs_router_or_bias_update_is_switched_off(label, source):
    fails_saying("21", RUN, label, source, "switched off")


RIGHT_RUN = {
    "experts listed by id, float64 gates and bias": _sol(GATES, "order = chosen.sort(-1)\n"
        "    weight = weight.double().gather(1, order.indices)\n"
        "    return order.values, weight / weight.sum(-1, keepdim=True)").replace(
        ".to(bias.dtype)", ".double()"),
    "lists and a numpy bias": _sol(GATES, "return chosen.tolist(), (weight / weight.sum(-1, keepdim=True)).tolist()")
        .replace(f"return bias + gamma * {SIGN}", f"return (bias + gamma * {SIGN}).numpy()"),
    "the groups chosen by argsort, the ranks' choices concatenated": _sol(BEST,
        "best = group_score.argsort(-1, descending=True)[:, :max_groups]").replace(
        LOAD, "load = torch.bincount(torch.cat(chosen_per_rank).reshape(-1), minlength=E)"),
}  # fmt: skip


@pytest.mark.parametrize("label", list(RIGHT_RUN))
def test_other_right_routers_pass(label, capsys):
    run_check("21", RUN, RIGHT_RUN[label])
    assert "check_balancing_run passed" in capsys.readouterr().out


def test_an_unfinished_run_stays_not_implemented():
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("21", RUN, SIG_R + "    raise NotImplementedError('todo')\n")


def test_an_empty_micro_batch_is_routed_too():
    """A router that cannot take a rank's empty micro-batch fails there, the message naming the rank's 0 x E
    scores; one that returns [] for it passes (the lists variant above)."""
    source = _sol(
        "select = (scores + bias).view(T, groups, E // groups)",
        "select = (scores + bias).view(T, groups, -1)",
    )
    message = fails_saying("21", RUN, "view(T, groups, -1)", source, "your function raised RuntimeError")
    assert WHERE_RUN.match(message) and re.search(r"rank \d's 0 x \d+ scores", message), message


def test_a_table_of_one_grade_runs_routes_and_biases_fails_the_next():
    """A learner who logs both functions' answers in one grade run and answers from that table in the next (plain
    top-k on the scores and an unmoved bias where it has nothing) fails: the scores are drawn again."""
    ns = solution_namespace("21")
    route, next_bias, table = ns["route"], ns["next_bias"], {}

    def key(*args):
        return tuple(
            a.numpy().tobytes() if isinstance(a, torch.Tensor)
            else tuple(x.numpy().tobytes() for x in a) if isinstance(a, list) else a
            for a in args
        )  # fmt: skip

    def logging_route(*args):
        table[key(*args)] = out = route(*args)
        return out

    def logging_bias(*args):
        table[key(*args)] = out = next_bias(*args)
        return out

    cell = compile(_check_cell("21", RUN), "<check cell>", "exec")
    ns["route"], ns["next_bias"] = logging_route, logging_bias
    exec(cell, ns)  # noqa: S102
    assert len(table) > 80

    def from_table_route(scores, bias, k, groups, max_groups):
        top = scores.topk(k, dim=-1)
        return table.get(
            key(scores, bias, k, groups, max_groups),
            (top.indices, top.values / top.values.sum(-1, keepdim=True)),
        )

    ns["route"] = from_table_route
    ns["next_bias"] = lambda bias, chosen_per_rank, gamma: table.get(key(bias, chosen_per_rank, gamma), bias)
    with pytest.raises(AssertionError, match=r"route\(scores="):
        exec(cell, ns)  # noqa: S102


def _first_step(run: dict) -> list[torch.Tensor]:
    """The rule's choices on each rank at a run's first step (from the run's zero starting bias)."""
    g = torch.Generator().manual_seed(run["seed"])
    skew = 0.8 * torch.randn(run["E"], generator=g)
    return [
        checks._route(
            checks._scores(run, 0, r, g, skew), torch.zeros(run["E"]), run["k"], run["groups"], run["M"]
        )[0]
        for r in range(len(run["Ts"]))
    ]


def test_the_run_cases_cover_what_the_statement_says():
    """The fixed runs are what the statement lists; the designed first steps load the experts as promised, so the
    sign(0) slips, each rank's own update averaged, rank 0's load alone and the ranks' shares averaged all differ
    from the rule there (and the last two from each other) on every grade run; every grade run draws three
    node-limited runs whose groups count two or more of their experts but not all, 1 to 4 ranks of 0 to 40 tokens,
    all in the stated ranges."""
    fixed = checks._fixed_runs()
    assert any(r["k"] == r["M"] * r["E"] // r["groups"] for r in fixed)
    assert any(r["M"] == r["groups"] > 1 for r in fixed)
    assert any(r["gamma"] == 0 and r.get("bias") for r in fixed)
    assert any(r["groups"] == 1 for r in fixed)
    zero = torch.zeros(8)
    designed = {  # run index: (ranks' T, each rank's tokens per pair, the slips this first step separates)
        3: (
            [10, 6],
            [[3, 3, 2, 2], [1, 1, 2, 2]],
            {"sign_zero_up", "sign_zero_down", "rank0", "rank_shares"},
        ),
        4: (
            [6, 0, 24],
            [[4, 1, 1, 0], [0, 0, 0, 0], [1, 7, 9, 7]],
            {"rank_mean", "rank_mean_busy", "rank0", "rank_shares"},
        ),
    }
    for seed in range(12):
        runs = checks._runs(random.Random(seed))
        for i, (Ts, loads, slips) in designed.items():
            run = runs[i][1]
            chosen = _first_step(run)
            assert run["Ts"] == Ts and run["gamma"] == 0.02
            assert checks._rank_loads(chosen, 8)[:, ::2].tolist() == loads  # pair p: experts 2p and 2p + 1
            want = checks._next_bias(zero, chosen, 0.02)
            moved = {slip: checks._next_bias(zero, chosen, 0.02, slip) for slip in slips}
            for slip in slips:
                assert (moved[slip] - want).abs().max() > 1e-3, (i, slip)
            assert (moved["rank0"] - moved["rank_shares"]).abs().max() > 1e-3, i
        drawn = [r for name, r in runs if name.startswith("drawn")]
        assert len(drawn) == checks._DRAWN_RUNS
        assert sum(r["groups"] > r["M"] and 2 <= r["k"] // r["M"] < r["E"] // r["groups"] for r in drawn) >= 3
        for _, r in runs:
            assert r["E"] in (8, 16, 32) and r["k"] in (2, 4, 6, 8) and r["groups"] in (1, 2, 4, 8)
            assert r["k"] % r["M"] == 0 and r["k"] <= r["M"] * r["E"] // r["groups"]
            assert 1 <= len(r["Ts"]) <= 4 and all(0 <= T <= 40 for T in r["Ts"]) and sum(r["Ts"]) > 0
            assert 4 <= r["steps"] <= 8


def test_the_designed_first_steps_move_the_bias_as_their_comments_say():
    """Uneven ranks: each rank's own update averaged moves no expert at all; balanced: the global batch moves no
    expert, and rank 0's load alone and the ranks' shares averaged move every expert, in opposite ways."""
    zero, runs = torch.zeros(8), checks._runs(random.Random(0))
    balanced, uneven = _first_step(runs[3][1]), _first_step(runs[4][1])
    assert (checks._next_bias(zero, uneven, 0.02, "rank_mean") == 0).all()
    assert (checks._next_bias(zero, balanced, 0.02) == 0).all()
    rank0 = checks._next_bias(zero, balanced, 0.02, "rank0")
    assert (rank0 != 0).all() and torch.equal(rank0, -checks._next_bias(zero, balanced, 0.02, "rank_shares"))


def test_near_ties_may_go_either_way_and_only_they():
    """A token within 1e-5 of a tie may take the other side; the check's margin finds exactly those tokens."""
    scores = torch.tensor([[0.5, 0.5 + 5e-6, 0.1, 0.2], [0.9, 0.2, 0.6, 0.5]])
    _, _, _, margin = checks._route(scores, torch.zeros(4), 1, 1, 1)
    assert margin[0] < checks._NEAR < margin[1]


def test_the_hints_worked_steps_are_what_the_rules_give():
    """Route's hint 2 (groups of 3, k = 2, max_groups = 1): the top-2 sum keeps group {3, 4, 5}, the whole
    group's sum and s alone the other. next_bias's hint 2: the global batch's update, and the per-rank average."""
    s, b = torch.tensor([[0.9, 0.45, 0.35, 0.6, 0.4, 0.1]]), torch.tensor([-0.4, 0, 0, 0, 0, 0])
    chosen, gates, gscore, _ = checks._route(s, b, 2, 2, 1)
    assert sorted(chosen[0].tolist()) == [3, 4] and torch.allclose(
        gscore[0], torch.tensor([0.95, 1.0]).double()
    )
    assert torch.allclose(gates[0].sort().values, torch.tensor([0.4, 0.6]).double())
    for slip in ("group_all", "group_unbiased"):
        assert sorted(checks._route(s, b, 2, 2, 1, slip)[0][0].tolist()) == [0, 1], slip
    ranks = [torch.tensor([[0], [0]]), torch.tensor([[0], [1], [1], [2], [2], [2]])]
    want = checks._next_bias(torch.zeros(3), ranks, 0.1)
    assert torch.allclose(want, torch.tensor([-0.1, 0.1, -0.1]).double())
    averaged = checks._next_bias(torch.zeros(3), ranks, 0.1, "rank_mean")
    assert torch.allclose(averaged, torch.tensor([0.0, 0.05, 0.0]).double())


# ----------------------------------------------------------------------------- exercise 2: replicate and pack
def _place(old: str, new: str) -> str:
    return edit("21", "place", old, new)


SIG_P = "def place(loads, replicas, gpus):\n"
KEY = "key=lambda e: (loads[e] / copies[e], -copies[e])"
CAP = "e for e in range(E) if copies[e] < gpus"
ORDER = "for e in sorted(range(E), key=lambda e: (-share[e], -copies[e])):"
ROOM = "len(held[g]) < slots and e not in held[g]"
ROUND_ROBIN = SIG_P + (
    "    E, copies, made = len(loads), [1] * len(loads), []\n"
    "    for _ in range(replicas - E):\n"
    "        e = max((e for e in range(E) if copies[e] < gpus), key=lambda e: loads[e] / copies[e])\n"
    "        copies[e] += 1\n"
    "        made.append(e)\n"
    "    order = list(range(E)) + made\n"
    "    return [order[j] for g in range(gpus) for j in range(g, replicas, gpus)]\n"
)
NO_DIVIDE = SIG_P + (  # no limit per GPU either: every extra copy to the heaviest expert, packed as it can be
    "    E, slots = len(loads), replicas // gpus\n"
    "    copies = [1] * E\n"
    "    for _ in range(replicas - E):\n"
    "        copies[max(range(E), key=lambda e: loads[e])] += 1\n"
    "    share = [loads[e] / copies[e] for e in range(E)]\n"
    "    held, weight = [[] for _ in range(gpus)], [0.0] * gpus\n"
    "    for e in sorted(range(E), key=lambda e: -share[e]):\n"
    "        for _ in range(copies[e]):\n"
    "            room = [g for g in range(gpus) if len(held[g]) < slots]\n"
    "            g = min([g for g in room if e not in held[g]] or room, key=lambda g: weight[g])\n"
    "            held[g].append(e)\n"
    "            weight[g] += share[e]\n"
    "    return [e for gpu in held for e in gpu]\n"
)

WRONG_PLACE = [
    ("round-robin replicas onto GPUs", ROUND_ROBIN, "That deals the replicas to the GPUs in turn"),
    ("copies by total load (all to one expert)", NO_DIVIDE, "The extra copies went to the experts with the largest total load"),
    ("copies by total load, one per GPU at most", _place(KEY, "key=lambda e: loads[e]"),
     "The extra copies went to the experts with the largest total load"),
    ("packed in expert-id order", _place(ORDER, "for e in range(E):"), "That packs the replicas in expert order"),
    ("packed without the equal-count rule", _place(ROOM, "e not in held[g]"),
     "Your GPUs held different numbers of replicas"),
    ("two copies of an expert on one GPU (EPLB's packing)", _place(CAP, "e for e in range(E)").replace(ROOM, "len(held[g]) < slots"),
     "A second copy on one GPU holds the same weights twice"),
    ("an expert left without a replica", _place("return [e for gpu in held for e in gpu]",
                                                "return [e if e else 1 for gpu in held for e in gpu]"),
     "has no replica"),
    ("too few replicas", _place("return [e for gpu in held for e in gpu]", "return [e for gpu in held for e in gpu][1:]"),
     "replicas; there are replicas="),
    ("not ids", _place("return [e for gpu in held for e in gpu]", "return [0.5] * replicas"), "must return a list of"),
]  # fmt: skip

CHEATS_PLACE = [
    ("wraps rebalance_experts", "import torch\nfrom parallel_lab.moe import rebalance_experts\n" + SIG_P
     + "    return rebalance_experts(torch.tensor([loads]), replicas, 1, 1, gpus)[0][0].tolist()\n"),
    ("wraps replicate", "from parallel_lab.moe.placement import replicate\n" + SIG_P
     + "    return replicate(loads, replicas)[0]\n"),
    ("wraps balanced_packing", "from parallel_lab.moe import balanced_packing\n" + SIG_P
     + "    balanced_packing(loads, 1)\n    return list(range(len(loads)))\n"),
    ("wraps gpu_loads", "import torch\nfrom parallel_lab.moe import gpu_loads\n" + SIG_P
     + "    gpu_loads(torch.tensor([loads]), torch.arange(len(loads)).view(1, -1), torch.ones(1, len(loads)), 1)\n"
     "    return list(range(len(loads)))\n"),
    ("torch's private equal-count packer",
     "import torch\nfrom torch.distributed.tensor.experimental._context_parallel._load_balancer import _PTRRLoadBalancer\n"
     + SIG_P + "    _PTRRLoadBalancer.ptrr_scheduling(torch.tensor(loads), 1)\n    return list(range(len(loads)))\n"),
    ("reads the check's own greedy", "from parallel_lab.grading.checks.moe_at_scale import _greedy\n" + SIG_P
     + "    return _greedy(loads, replicas, gpus)\n"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "source", "want"), WRONG_PLACE, ids=[w[0] for w in WRONG_PLACE])
def test_a_wrong_placement_fails_naming_the_case_and_the_mistake(label, source, want):
    message = fails_saying("21", PLACE, label, source, want)
    assert re.match(r"place\(loads=\[[\d.e+, ]+\], replicas=\d+, gpus=\d+\)", message), message
    if "your busiest GPU" in message:  # both placements' max / mean
        assert message.count("max/mean") == 2, message


@pytest.mark.parametrize(("label", "source"), CHEATS_PLACE, ids=[c[0] for c in CHEATS_PLACE])
def test_a_wrapper_of_eplb_or_torchs_packer_is_switched_off(label, source):
    fails_saying("21", PLACE, label, source, "switched off")


def test_a_table_of_one_grade_runs_placements_fails_the_next():
    table_cheat_fails(
        "21", "place", PLACE, [], "returned 0 replicas", key=lambda loads, r, g: (tuple(loads), r, g)
    )


def test_an_unfinished_placement_stays_not_implemented():
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("21", PLACE, SIG_P + "    raise NotImplementedError('todo')\n")


def test_a_placement_as_a_tensor_or_in_another_gpu_order_passes(capsys):
    """Any sequence of ids passes, and the GPUs' numbering and the order inside a GPU are free."""
    source = (
        "import torch\n_right = place\n"
        + SIG_P
        + (
            "    p, s = _right(loads, replicas, gpus), replicas // gpus\n"
            "    gpus_reversed = [sorted(p[g * s:(g + 1) * s], reverse=True) for g in reversed(range(gpus))]\n"
            "    return torch.tensor([e for h in gpus_reversed for e in h])\n"
        )
    )
    run_check("21", PLACE, source)
    assert "check_placement passed" in capsys.readouterr().out


def test_the_placement_message_names_the_failing_case_only():
    """A learner wrong on one case sees that case's call, and none of the others'."""
    ns = solution_namespace("21")
    exec(compile(_place(ORDER, "for e in range(E):"), "<id order>", "exec"), ns)  # noqa: S102
    wrong, seen = ns["place"], []

    def logging(loads, replicas, gpus):
        seen.append((list(loads), replicas, gpus))
        return wrong(loads, replicas, gpus)

    ns["place"] = logging
    with pytest.raises(AssertionError) as info:
        exec(compile(_check_cell("21", PLACE), "<check cell>", "exec"), ns)  # noqa: S102
    message = str(info.value)
    assert message.count("place(loads=") == 1
    assert message.startswith(f"place(loads={checks._fmt_loads(seen[-1][0])}, replicas={seen[-1][1]}")


def test_the_placement_cases_cover_what_the_statement_says():
    for seed in range(20):
        cases = checks._place_cases(random.Random(seed))
        fixed, drawn = cases[:3], cases[3:]
        assert (
            len(set(fixed[0][0])) == 1
            and sorted(fixed[1][0])[:-1] == [0.0] * 11
            and fixed[2][1] == len(fixed[2][0])
        )
        assert len(drawn) == checks._DRAWN_PLACES
        for loads, replicas, gpus, _ in drawn:
            E = len(loads)
            assert 8 <= E <= 64 and 2 <= gpus <= 16 and replicas % gpus == 0 and E <= replicas <= 2 * E
            assert all(x > 0 and float(f"{x:g}") == x for x in loads)  # a message shows them exactly


def test_the_bar_is_a_valid_greedy_and_eplb_breaks_the_rule():
    """The bar's placements keep every rule; EPLB's global policy puts two copies of an expert on one GPU on many
    drawn cases, and on some reaches a lower busiest GPU that way, which is why the bar is not EPLB's."""
    from parallel_lab.moe import rebalance_experts

    rnd, doubled, below = random.Random(5), 0, 0
    cases = [c for _ in range(4) for c in checks._place_cases(rnd)]
    for loads, replicas, gpus, _ in cases:
        p = checks._greedy(loads, replicas, gpus)
        slots = replicas // gpus
        assert p is not None and sorted(set(p)) == list(range(len(loads)))
        assert all(len(set(p[g * slots : (g + 1) * slots])) == slots for g in range(gpus))
        assert max(checks._gpu_loads(loads, p, gpus)) <= checks._bar(loads, replicas, gpus)
        eplb = rebalance_experts(torch.tensor([loads], dtype=torch.float64), replicas, 1, 1, gpus)[0][
            0
        ].tolist()
        doubled += any(len(set(eplb[g * slots : (g + 1) * slots])) < slots for g in range(gpus))
        below += max(checks._gpu_loads(loads, eplb, gpus)) < checks._bar(loads, replicas, gpus) * (1 - 1e-9)
    assert doubled > len(cases) // 3 and below > 0, (doubled, below, len(cases))


def test_the_greedy_never_runs_out_of_room_where_the_check_draws():
    """The bar's main tie order finishes on every case of many grade runs, ties and zeros included."""
    rnd = random.Random(11)
    for _ in range(40):
        for loads, replicas, gpus, _ in checks._place_cases(rnd):
            assert checks._greedy(loads, replicas, gpus) is not None


# ----------------------------------------------------------------------------- torch's own versions
#: names of routers, bias updates, load balancers and expert placements, in def and class lines
JOB = re.compile(
    r"^[ \t]*(?:class|def) (\w*(?:(?i:topk_group|group_limited|group_topk|grouped_topk|expert_bias|load_?balanc"
    r"|eplb|rebalanc|replicate_expert|balanced_pack|bin_?pack|noaux|aux_free|node_limited|expert_load"
    r"|expert_placement|redundant_expert|ptrr)|MoE|_moe|moe_)\w*)",
    re.M,
)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's functions and classes that route to experts, balance their loads or pack work into equal groups
    (found by name in its installed source) are in the checks' switched-off list. This torch has no MoE router,
    bias update or expert placement; what the search finds is context parallelism's load balancer, whose
    `ptrr_scheduling` packs items into equal-count groups. A new torch that adds one fails here, not in a
    learner's notebook."""
    off = checks.switched_off()
    found = functions_doing(JOB)
    assert "torch.distributed.tensor.experimental._context_parallel._load_balancer" in found, (
        "the search finds nothing: torch's layout changed"
    )
    missing = not_switched_off(found, off)
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"
    for dotted in (
        "torch.distributed.tensor.experimental._context_parallel._load_balancer._PTRRLoadBalancer.ptrr_scheduling",
    ):
        assert dotted in off and _resolve(dotted)[2] is not None, dotted


def test_every_module_of_the_labs_moe_is_switched_off():
    """New modules of parallel_lab.moe join the list without an edit here."""
    import pkgutil

    import parallel_lab.moe as moe

    off = checks.switched_off()
    for info in pkgutil.iter_modules(moe.__path__):
        assert any(k.startswith(f"parallel_lab.moe.{info.name}.") for k in off), info.name
    for name in ("balancing.node_limited_topk", "balancing.update_bias", "fine_grained.FineGrainedMoE.route",
                 "placement.rebalance_experts", "placement.replicate", "placement.balanced_packing"):  # fmt: skip
        assert f"parallel_lab.moe.{name}" in off, name

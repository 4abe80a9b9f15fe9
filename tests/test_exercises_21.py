"""Lesson 21's exercises: the reference solution passes; wrappers of the lab's and torch's functions, answer tables
from an earlier grade run and wrong algorithms fail, each with a message naming the failing case and what
differed; the check's cases cover what the statements promise, and its bar for the placement is a greedy that
keeps the one-copy-per-GPU rule (EPLB's own policy breaks it)."""

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
    ("group score from the unbiased scores",
     _sol(GROUP_SCORE, "group_score = scores.view(T, groups, -1).topk(k // max_groups, dim=-1).values.sum(-1)"),
     "You scored the groups on s alone"),
    ("groups by how many of the top k they hold (torch.topk's ties)", _sol(GROUP_SCORE, COUNT),
     "You kept the groups holding most of the token's overall top k"),
    ("groups by how many of the top k they hold (ties to the lower group)",
     _sol(GROUP_SCORE, COUNT).replace(BEST, "best = group_score.sort(dim=-1, descending=True, stable=True).indices[:, :max_groups]"),
     "You kept the groups holding most of the token's overall top k"),
    ("the load of the first choice only", _sol("torch.bincount(chosen.reshape(-1)", "torch.bincount(chosen[:, 0]"),
     "You counted only each token's first expert"),
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
     "def next_bias(bias, chosen, gamma):\n"
     "    return update_bias(bias, torch.bincount(chosen.reshape(-1), minlength=bias.shape[0]), gamma)\n"),
    ("reads the check's own router", "from parallel_lab.grading.checks.moe_at_scale import _route\n" + SIG_R
     + "    return _route(scores, bias, k, groups, max_groups)[:2]\n"),
    ("reads the check's own bias update", "from parallel_lab.grading.checks.moe_at_scale import _next_bias\n"
     "def next_bias(bias, chosen, gamma):\n    return _next_bias(bias, chosen, gamma)\n"),
]  # fmt: skip

#: "fixed run 3 (every expert ...: T=16, E=8, ...), step 0: route(scores=<...>, bias=<...>, k=2, ...)"
WHERE_RUN = re.compile(
    r"^(fixed|drawn) run \d \([^)]*: T=\d+, E=\d+, k=\d, groups=\d, max_groups=\d, gamma=[\d.e-]+\), step \d: "
    r"(route\(scores=<the step's \d+ x \d+ scores>, bias=<[^>]+>, k=\d, groups=\d, max_groups=\d\)"
    r"|next_bias\(bias=<[^>]+>, chosen=<the \d+ x \d experts your route chose>, gamma=[\d.e-]+\))"
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
    "the groups chosen by argsort": _sol(BEST,
        "best = group_score.argsort(-1, descending=True)[:, :max_groups]"),
}  # fmt: skip


@pytest.mark.parametrize("label", list(RIGHT_RUN))
def test_other_right_routers_pass(label, capsys):
    run_check("21", RUN, RIGHT_RUN[label])
    assert "check_balancing_run passed" in capsys.readouterr().out


def test_an_unfinished_run_stays_not_implemented():
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("21", RUN, SIG_R + "    raise NotImplementedError('todo')\n")


def test_a_table_of_one_grade_runs_routes_and_biases_fails_the_next():
    """A learner who logs both functions' answers in one grade run and answers from that table in the next (plain
    top-k on the scores and an unmoved bias where it has nothing) fails: the scores are drawn again."""
    ns = solution_namespace("21")
    route, next_bias, table = ns["route"], ns["next_bias"], {}

    def key(*args):
        return tuple(a.numpy().tobytes() if isinstance(a, torch.Tensor) else a for a in args)

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
    ns["next_bias"] = lambda bias, chosen, gamma: table.get(key(bias, chosen, gamma), bias)
    with pytest.raises(AssertionError, match=r"route\(scores="):
        exec(cell, ns)  # noqa: S102


def test_the_run_cases_cover_what_the_statement_says():
    """The fixed runs are what the statement lists; the balanced first step is balanced under the rule; every grade
    run draws three node-limited runs whose groups count two or more experts, and all in the stated ranges."""
    fixed = checks._fixed_runs()
    assert any(r["k"] == r["M"] * r["E"] // r["groups"] for r in fixed)
    assert any(r["M"] == r["groups"] > 1 for r in fixed)
    assert any(r["gamma"] == 0 and r.get("bias") for r in fixed)
    assert any(r["groups"] == 1 for r in fixed)
    for seed in range(20):
        runs = checks._runs(random.Random(seed))
        (_, balanced), drawn = runs[3], [r for name, r in runs if name.startswith("drawn")]
        g = torch.Generator().manual_seed(balanced["seed"])
        skew = 0.8 * torch.randn(balanced["E"], generator=g)
        scores = checks._scores(balanced, 0, g, skew)
        chosen = checks._route(
            scores, torch.zeros(balanced["E"]), balanced["k"], balanced["groups"], balanced["M"]
        )[0]
        load = torch.bincount(chosen.reshape(-1), minlength=balanced["E"])
        assert (load == load[0]).all(), load
        assert len(drawn) == checks._DRAWN_RUNS
        assert sum(r["groups"] > r["M"] and r["k"] // r["M"] >= 2 for r in drawn) >= 3
        for _, r in runs:
            assert r["E"] in (8, 16, 32) and r["k"] in (2, 4, 6, 8) and r["groups"] in (1, 2, 4, 8)
            assert r["k"] % r["M"] == 0 and r["k"] <= r["M"] * r["E"] // r["groups"] and 8 <= r["T"] <= 48
            assert 4 <= r["steps"] <= 8


def test_near_ties_may_go_either_way_and_only_they():
    """A token within 1e-5 of a tie may take the other side; the check's margin finds exactly those tokens."""
    scores = torch.tensor([[0.5, 0.5 + 5e-6, 0.1, 0.2], [0.9, 0.2, 0.6, 0.5]])
    _, _, _, margin = checks._route(scores, torch.zeros(4), 1, 1, 1)
    assert margin[0] < checks._NEAR < margin[1]
    # groups {0, 1} and {2, 3}, k = 2, max_groups = 1 (hint 2's case): group {2, 3} wins on s + b
    hint = torch.tensor([[0.9, 0.3, 0.6, 0.5]])
    chosen, gates, gscore, _ = checks._route(hint, torch.tensor([-0.4, 0.0, 0.1, 0.0]), 2, 2, 1)
    assert sorted(chosen[0].tolist()) == [2, 3] and torch.allclose(
        gscore[0], torch.tensor([0.8, 1.2]).double()
    )
    assert torch.allclose(gates[0].sort().values, torch.tensor([0.5 / 1.1, 0.6 / 1.1]).double())


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
     "A second copy on the same GPU halves nothing"),
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
    cases = [c for _ in range(6) for c in checks._place_cases(rnd)]
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

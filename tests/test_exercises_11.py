"""Lesson 11's exercises: the reference solution passes; wrappers of the lab's functions, answer tables from an
earlier grade run and wrong algorithms fail, each with a message naming what differed; the expected-rows
reference is an enumeration, checked here against a sampled routing."""

from __future__ import annotations

import re

import pytest
import torch
from solution_code import (
    _check_cell,
    edit,
    fails_saying,
    functions_doing,
    passes_with_one_line,
    run_check,
    solution_namespace,
    table_cheat_fails,
)

CHECKS = ["check_route_groups", "check_dispatch_top2", "check_expected_rows"]

# A dispatch that sends a token once per (token, expert) choice, as the lesson's exact dispatch does
PER_CHOICE = """import torch
from parallel_lab import comms
from parallel_lab.moe.expert_parallel import all_to_all_v
def dispatch_top2(ctx, x, expert_ids, gates, experts):
    p, L = ctx.world_size, len(experts)
    y = torch.zeros_like(x)
    for c in range(2):
        owner = expert_ids[:, c] // L
        rows = [(owner == q).nonzero().flatten() for q in range(p)]
        meta = [torch.stack([expert_ids[r, c].to(x.dtype), gates[r, c]], 1) for r in rows]
        counts = comms.all_to_all(ctx, [torch.tensor([len(r)], device=x.device) for r in rows])
        n = [int(k) for k in counts]
        gx, gm = all_to_all_v(ctx, [x[r] for r in rows], n), all_to_all_v(ctx, meta, n)
        out = []
        for xs, m in zip(gx, gm):
            o = torch.zeros_like(xs)
            for e, f in experts.items():
                hit = (m[:, 0] == e).nonzero().flatten()
                if len(hit):
                    o[hit] = m[hit, 1, None] * f(xs[hit])
            out.append(o)
        back = all_to_all_v(ctx, out, [len(r) for r in rows])
        for q in range(p):
            y.index_add_(0, rows[q], back[q])
    return y
"""

WRONG = [
    # ---- exercise 1: route_groups
    ("check_route_groups", "one group of all the tokens",
     edit("11", "route_groups", "    size = n // groups\n", "    size, groups = n, 1\n"), "each group has its own"),
    ("check_route_groups", "the capacity from every token",
     edit("11", "route_groups", "capacity_factor * size / E", "capacity_factor * n / E"), "expected"),
    ("check_route_groups", "slots counted across groups",
     edit("11", "route_groups", "    for g in range(groups):\n        used = [0] * E",
          "    used = [0] * E\n    for g in range(groups):"), "expected"),
    ("check_route_groups", "token-major inside a group",
     edit("11", "route_groups", "        for c in range(k):  # every first choice in the group before any second\n"
          "            for t in range(g * size, (g + 1) * size):",
          "        for t in range(g * size, (g + 1) * size):\n            for c in range(k):"), "expected"),
    ("check_route_groups", "wraps the lab's router",
     "import torch\nfrom parallel_lab.moe import assign_slots\ndef route_groups(probs, k, groups, f):\n"
     "    assign_slots(torch.zeros(1).long(), torch.zeros(1).long(), torch.ones(1), 2, 1)\n", "switched off"),
    ("check_route_groups", "the lab's capacity",
     "from parallel_lab.moe import expert_capacity\ndef route_groups(probs, k, groups, f):\n"
     "    expert_capacity(4, 2, f, k)\n", "switched off"),
    # ---- exercise 2: dispatch_top2
    ("check_dispatch_top2", "one row per choice, as the lesson's exact dispatch", PER_CHOICE, "once"),
    ("check_dispatch_top2", "a gate left out",
     edit("11", "dispatch_top2", "y[hit] += meta[hit, 2 + c, None] * expert(xs[hit])", "y[hit] += expert(xs[hit])"),
     "gate x expert"),
    ("check_dispatch_top2", "the whole batch to everybody",
     "import torch\nfrom parallel_lab import comms\ndef dispatch_top2(ctx, x, expert_ids, gates, experts):\n"
     "    counts = comms.all_to_all(ctx, [torch.tensor([x.shape[0]], device=x.device)] * ctx.world_size)\n"
     "    return x\n", "differs"),
    ("check_dispatch_top2", "wraps the lab's expert-parallel layer",
     "from parallel_lab.moe import expert_parallel as ep\ndef dispatch_top2(ctx, x, expert_ids, gates, experts):\n"
     "    ep.expert_owner(0, 2, 2)\n", "switched off"),
    # ---- exercise 3: expected_rows
    ("check_expected_rows", "one row per choice",
     "def expected_rows(experts, ranks, k):\n    return k * (ranks - 1) / ranks\n", "once"),
    ("check_expected_rows", "experts drawn with repeats",
     "def expected_rows(experts, ranks, k):\n    return (ranks - 1) * (1 - (1 - 1 / ranks) ** k)\n", "repeats"),
    ("check_expected_rows", "its own rank counted",
     edit("11", "expected_rows", "return (ranks - 1) * (1 - miss)", "return ranks * (1 - miss)"), "own experts"),
    ("check_expected_rows", "reads the check's enumeration",
     "from parallel_lab.grading.checks.moe import _expected_rows as expected_rows\n", "switched off"),
]  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    passes_with_one_line("11", check, capsys)


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("11", check, label, source, want)


def test_the_expected_rows_are_an_enumeration_of_every_k_subset():
    """The check's closed form against the definition: the mean, over every k-subset of experts, of the other
    ranks it touches (this rank is rank 0)."""
    import itertools

    from parallel_lab.grading.checks.moe import _expected_rows

    for E, p, k in [(4, 2, 2), (6, 3, 2), (8, 4, 3), (12, 4, 4), (12, 6, 1), (9, 3, 9)]:
        subsets = list(itertools.combinations(range(E), k))
        mean = sum(len({e // (E // p) for e in s} - {0}) for s in subsets) / len(subsets)
        assert abs(float(_expected_rows(E, p, k)) - mean) < 1e-12, (E, p, k)


def test_the_expected_rows_match_a_sampled_routing():
    """The enumeration is what a large uniform routing measures: 8 experts on 4 ranks, top-2."""
    from parallel_lab.grading.checks.moe import _expected_rows

    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(20_000)])
    sampled = sum(len({int(e) // 2 for e in row} - {0}) for row in ids) / len(ids)
    assert abs(sampled - _expected_rows(8, 4, 2)) < 0.02  # about 0.004 standard error


def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("11", check), "<check>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_runs_routes_fails_the_next():
    """Keyed by the probabilities' bytes: the next run's probabilities are new."""
    ns = solution_namespace("11")
    real, table = ns["route_groups"], {}
    key = lambda probs, k, g, f: (probs.numpy().tobytes(), k, g, f)  # noqa: E731

    def logging(*args):
        table[key(*args)] = out = real(*args)
        return out

    ns["route_groups"] = logging
    _run(ns, "check_route_groups")
    empty = lambda p, k: (torch.zeros(p.shape[0], k).long(), torch.full((p.shape[0], k), -1))  # noqa: E731
    ns["route_groups"] = lambda probs, k, g, f: table.get(key(probs, k, g, f), empty(probs, k))
    with pytest.raises(AssertionError, match="route_groups"):
        _run(ns, "check_route_groups")


def test_a_table_of_one_runs_expectations_fails_the_next():
    # eight layouts, five drawn from a few dozen per run: a miss within three runs is near certain
    table_cheat_fails("11", "expected_rows", "check_expected_rows", -1.0, "expected", tries=3)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch has no MoE router or token dispatcher of its own (searched by name): a release that adds one
    fails here, and its module joins the check's switched-off list."""
    job = re.compile(
        r"^\s*(?:class|def) (\w*(?:MoE|Moe|TokenDispatch|ExpertParallel|expert_capacity)\w*)\b", re.M
    )
    found = functions_doing(job)
    assert not found, f"torch functions doing an exercise's job, not switched off: {found}"


@pytest.mark.parametrize(
    ("check", "source"),
    [
        (
            "check_route_groups",
            "def route_groups(probs, k, groups, f):\n    raise NotImplementedError('todo')\n",
        ),
        (
            "check_dispatch_top2",
            "def dispatch_top2(ctx, x, i, g, e):\n    raise NotImplementedError('todo')\n",
        ),
        ("check_expected_rows", "def expected_rows(e, p, k):\n    raise NotImplementedError('todo')\n"),
    ],
)
def test_an_unfinished_exercise_stays_not_implemented(check, source):
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("11", check, source)

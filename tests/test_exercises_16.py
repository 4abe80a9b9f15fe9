"""Lesson 16's exercise: the reference solution passes with one line; wrappers of the lab's and torch's cost
models, answer tables from an earlier grade run and wrong algorithms fail, each with a message naming the slip."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from solution_code import _check_cell, edit, run_check, solution_namespace, table_cheat_fails

CHECK, NAME = "check_hierarchical_seconds", "hierarchical_seconds"

WRONG = [
    ("no shrink of the bytes by the inner groups", edit("16", NAME, "        size /= group", "        pass"),
     "the bytes never shrink"),
    ("an all-reduce at the inner levels",
     edit("16", NAME, "seconds += 2 * phase", "seconds += 3 * phase"), "cost an all-reduce on the way in"),
    ("the latency forgotten", edit("16", NAME, "seconds, size = 0.0, nbytes", "seconds, size, alpha = 0.0, nbytes, 0.0"),
     "the latency is missing"),
    ("the latency of one flat ring",
     "import math\ndef hierarchical_seconds(nbytes, levels, alpha):\n    seconds, size = 0.0, nbytes\n"
     "    for i, (g, bw) in enumerate(levels):\n        seconds += 2 * (g - 1) * size / g / bw\n"
     "        size = size / g if i < len(levels) - 1 else size\n"
     "    return seconds + 2 * (math.prod(g for g, _ in levels) - 1) * alpha\n",
     "one flat ring over every rank"),
    ("the slowest link for everything",
     edit("16", NAME, "    seconds, size = 0.0, nbytes",
          "    levels = [(g, min(bw for _, bw in levels)) for g, _ in levels]\n    seconds, size = 0.0, nbytes"),
     "the slowest link"),
    ("one flat ring at the slowest link",
     "import math\ndef hierarchical_seconds(nbytes, levels, alpha):\n    p = math.prod(g for g, _ in levels)\n"
     "    return 2 * (p - 1) * (alpha + nbytes / p / min(bw for _, bw in levels)) if p > 1 else 0.0\n", "expected"),
    ("the top level not a ring all-reduce (one pass only)",
     edit("16", NAME, "return seconds + 2 * (group - 1)", "return seconds + (group - 1)"), "expected"),
    ("the lab's two-level model, level by level",
     "from parallel_lab.comms import multinode_all_reduce_seconds as ours\n"
     "def hierarchical_seconds(nbytes, levels, alpha):\n    (g, a), (n, b) = levels[0], levels[-1]\n"
     "    return ours(nbytes, n, g, a, b, alpha)\n", "switched off"),
    ("the lab's alpha-beta ring",
     "from parallel_lab.comms.cost import alpha_beta_seconds\ndef hierarchical_seconds(nbytes, levels, alpha):\n"
     "    return sum(alpha_beta_seconds('ring', nbytes, g, alpha, bw) for g, bw in levels)\n", "switched off"),
    ("torch's DTensor allreduce_cost",
     "from types import SimpleNamespace\nfrom torch.distributed.tensor._collective_utils import allreduce_cost\n"
     "def hierarchical_seconds(nbytes, levels, alpha):\n"
     "    topo = SimpleNamespace(mesh_dim_devices=[g for g, _ in levels], mesh_dim_bandwidth=[bw / 1e9 for _, bw in levels],"
     " mesh_dim_latency=[alpha * 1e6] * len(levels))\n"
     "    return sum(allreduce_cost(nbytes / 1e9, topo, d) for d in range(len(levels))) / 1e6\n", "switched off"),
    ("torch inductor's NCCL estimate",
     "from torch._inductor import comm_analysis\ndef hierarchical_seconds(nbytes, levels, alpha):\n"
     "    return comm_analysis.estimate_nccl_collective_runtime_impl(nbytes, 8, 2)\n", "switched off"),
    ("the check's own model",
     "from parallel_lab.grading.checks.scaling_out import _model as hierarchical_seconds\n", "switched off"),
]  # fmt: skip


def test_the_solution_passes_with_one_line(capsys):
    solution_namespace("16")  # the imports first: what they print is not the check's
    capsys.readouterr()
    run_check("16", CHECK)
    out, err = capsys.readouterr()
    assert out.splitlines() == [out.splitlines()[0]] and out.startswith(f"{CHECK} passed") and not err


@pytest.mark.parametrize(("label", "source", "want"), WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(label, source, want):
    with pytest.raises(AssertionError) as info:
        run_check("16", CHECK, source)
    assert want in str(info.value), f"{label}: {info.value}"
    assert "hierarchical_seconds(nbytes=" in str(info.value)


def test_the_model_is_the_labs_on_two_levels():
    """On two levels the check's model is the lesson's `multinode_all_reduce_seconds`, latency included."""
    from parallel_lab.comms import multinode_all_reduce_seconds
    from parallel_lab.grading.checks.scaling_out import _model

    for nbytes, g, n, intra, inter, alpha in [
        (2.6e9, 8, 4, 450e9, 50e9, 5e-6),
        (1e6, 4, 16, 300e9, 25e9, 1e-5),
    ]:
        want = multinode_all_reduce_seconds(nbytes, n, g, intra, inter, alpha)
        assert math.isclose(_model(nbytes, [(g, intra), (n, inter)], alpha), want, rel_tol=1e-12)


def test_the_checks_are_quick():
    import time

    ns = solution_namespace("16")
    start = time.perf_counter()
    exec(compile(_check_cell("16", CHECK), "<check>", "exec"), ns)  # noqa: S102
    assert time.perf_counter() - start < 2.0  # a few ms alone, 0.3 s importing torch._inductor's estimates


def test_a_table_of_one_grade_runs_times_fails_the_next():
    table_cheat_fails("16", NAME, CHECK, 0.0, "expected",
                      key=lambda nbytes, levels, alpha: (nbytes, tuple(levels), alpha))  # fmt: skip


# ----------------------------------------------------------------------------- torch's own versions
# Names of torch's functions that estimate the time of a collective.
JOB = re.compile(
    r"^[ \t]*def ((?:_?\w*(?:allreduce_cost|all_reduce_cost|reduce_scatter_cost|allgather_cost|all_gather_cost"
    r"|collective_runtime|collective_cost|comm_cost|nccl_algo_time|nccl_best_algo_time|_time_estimator))"
    r"|redistribute_cost|one_step_redistribute_cost|_compute_placement_transition_cost|get_intra_node_bw"
    r"|get_inter_node_bw)\b",
    re.M,
)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's collective time estimates (found by name in torch's source) are all in the check's switched-off
    list: a new torch that adds one fails here, not in a learner's notebook."""
    import torch

    from parallel_lab.grading.checks import scaling_out

    root = Path(torch.__file__).parent
    found = {}
    for f in root.rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        if not JOB.search(text) or "testing" in f.parts or "test" in f.stem:
            continue
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        found.setdefault(module, []).extend(m.group(1) for m in JOB.finditer(text))
    assert "torch.distributed.tensor._collective_utils" in found, (
        "the search finds nothing: torch's layout changed"
    )
    missing = {m: [n for n in names if f"{m}.{n}" not in scaling_out.FORBIDDEN] for m, names in found.items()}
    missing = {m: names for m, names in missing.items() if names}
    assert not missing, f"torch functions doing the exercise's job, not switched off: {missing}"


def test_an_unfinished_exercise_stays_not_implemented():
    with pytest.raises(NotImplementedError, match="todo"):
        run_check(
            "16",
            CHECK,
            "def hierarchical_seconds(nbytes, levels, alpha):\n    raise NotImplementedError('todo')\n",
        )

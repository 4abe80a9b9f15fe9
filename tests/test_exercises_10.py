"""Lesson 10's exercises: the reference solution passes; wrappers of the lab's and torch's functions, answer
tables from an earlier grade run and wrong algorithms fail, each with a message naming what differed.
(Exercise 4, the dominant terms of four fixed layouts, is a prediction about named systems: its answer is one
dict by design; the planner is switched off while the prediction runs.)"""

from __future__ import annotations

import re

import pytest
from solution_code import (
    edit,
    fails_saying,
    functions_doing,
    not_switched_off,
    passes_with_one_line,
    run_check,
    table_cheat_fails,
)

CHECKS = ["check_mesh_groups", "check_pp_bytes", "check_exposed_buckets", "check_dominant_terms"]

WRONG = [
    # ---- exercise 1: mesh_groups
    ("check_mesh_groups", "the order read innermost first",
     edit("10", "mesh_groups", "for axis in reversed(order):", "for axis in order:"), "order reversed"),
    ("check_mesh_groups", "strides from the outer axes",
     "import math\ndef mesh_groups(sizes, order, rank):\n"
     "    strides = {a: math.prod(sizes[b] for b in order[:i]) for i, a in enumerate(order)}\n"
     "    coords = {a: rank // strides[a] % sizes[a] for a in order}\n"
     "    return coords, {a: [rank + (k - coords[a]) * strides[a] for k in range(sizes[a])] for a in order}\n",
     "order reversed"),
    ("check_mesh_groups", "the lesson's three axes in the lesson's order",
     "def mesh_groups(sizes, order, rank):\n    dp, tp, pp = sizes.get('dp', 1), sizes.get('tp', 1), sizes.get('pp', 1)\n"
     "    c = {'pp': rank // (dp * tp), 'dp': rank // tp % dp, 'tp': rank % tp}\n"
     "    return {a: c.get(a, 0) for a in order}, {a: [] for a in order}\n", "expected"),
    ("check_mesh_groups", "groups of consecutive ranks",
     edit("10", "mesh_groups", "[rank + (k - coords[a]) * strides[a] for k in range(sizes[a])]",
          "[rank - coords[a] + k for k in range(sizes[a])]"), "group"),
    ("check_mesh_groups", "wraps ParallelDims",
     "from parallel_lab.runtime.parallel_dims import ParallelDims\ndef mesh_groups(sizes, order, rank):\n"
     "    d = ParallelDims(**sizes)\n    return d.coords(rank), {a: d.group_of(a, rank) for a in order}\n",
     "switched off"),
    ("check_mesh_groups", "asks torch's DeviceMesh on a fake process group",
     "import torch.distributed as dist\nfrom torch.distributed.device_mesh import init_device_mesh\n"
     "def mesh_groups(sizes, order, rank):\n    m = init_device_mesh('cpu', tuple(sizes[a] for a in order), "
     "mesh_dim_names=tuple(order))\n    return {}, {}\n", "switched off"),
    # ---- exercise 2: pp_bytes
    ("check_pp_bytes", "the whole activation, not the TP rank's slice",
     edit("10", "pp_bytes", "b * (s // tp) * h", "b * s * h"), "only its slice"),
    ("check_pp_bytes", "elements, not bytes", edit("10", "pp_bytes", " * h * itemsize", " * h"), "elements"),
    ("check_pp_bytes", "every chunk sends both ways",
     edit("10", "pp_bytes", "messages += (vs < last) + (vs > 0)", "messages += 2"), "no neighbour on one side"),
    ("check_pp_bytes", "forward only", edit("10", "pp_bytes", "messages += (vs < last) + (vs > 0)",
                                            "messages += vs < last"), "one direction only"),
    ("check_pp_bytes", "the boundaries shared out evenly",
     "def pp_bytes(b, s, h, stages, chunks, microbatches, tp, rank, itemsize):\n"
     "    return microbatches * (stages * chunks - 1) * 2 * b * (s // tp) * h * itemsize / stages\n", "ranks differ"),
    ("check_pp_bytes", "counts the lab's schedule",
     "from parallel_lab.pipeline import schedule_interleaved_1f1b\n"
     "def pp_bytes(b, s, h, stages, chunks, microbatches, tp, rank, itemsize):\n"
     "    st = schedule_interleaved_1f1b(stages, microbatches, chunks)[rank]\n"
     "    return sum(x.kind.startswith('SEND') for x in st) * b * (s // tp) * h * itemsize\n", "switched off"),
    ("check_pp_bytes", "reads the check's own reference",
     "from parallel_lab.grading.checks.three_d import _pp_reference as pp_bytes\n", "switched off"),
    ("check_pp_bytes", "asks torch's schedule for its actions",
     "from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops\n"
     "def pp_bytes(b, s, h, stages, chunks, microbatches, tp, rank, itemsize):\n"
     "    _get_1f1b_rank_ops(chunks, stages, microbatches, 0, rank)\n    return 0\n", "switched off"),
    # ---- exercise 3: exposed_after_backward
    ("check_exposed_buckets", "the lesson's law on the totals",
     "def exposed_after_backward(ready, comm, backward_end):\n"
     "    return max(0.0, sum(comm) - (backward_end - (ready[0] if ready else 0.0)))\n", "its own gradients"),
    ("check_exposed_buckets", "all-reduces side by side",
     "def exposed_after_backward(ready, comm, backward_end):\n"
     "    return max([0.0] + [r + c - backward_end for r, c in zip(ready, comm)])\n", "one stream"),
    ("check_exposed_buckets", "only the last bucket",
     "def exposed_after_backward(ready, comm, backward_end):\n    return comm[-1] if comm else 0.0\n",
     "queue can still be draining"),
    ("check_exposed_buckets", "waits for the stream, not for the gradients",
     edit("10", "exposed_after_backward", "done = max(done, r) + c", "done = done + c"), "expected"),
    ("check_pp_bytes", "not a number", "def pp_bytes(*args):\n    return float('nan')\n", "finite number"),
    ("check_exposed_buckets", "not a number", "def exposed_after_backward(*args):\n    return float('nan')\n",
     "finite number"),
    # ---- exercise 4: dominant_terms
    ("check_dominant_terms", "ZeRO-3 blamed on memory", edit("10", "dominant_terms", '"A": "dp_comm"', '"A": "memory"'),
     "biggest loss is 'dp_comm'"),
    ("check_dominant_terms", "a guess left out", edit("10", "dominant_terms", '"D": "memory"', '"D": None'),
     "predict layouts ['D']"),
    ("check_dominant_terms", "asks the planner",
     "from parallel_lab.costmodel import evaluate, GPT_1_7B, ClusterSpec\ndef dominant_terms():\n"
     "    evaluate(GPT_1_7B, ClusterSpec(32), 32, 1, 1, 1, True, 512, 16)\n    return {}\n", "switched off"),
]  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    passes_with_one_line("10", check, capsys)


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("10", check, label, source, want)


def test_another_right_mesh_passes(capsys):
    """Indexing a tensor laid out like the mesh is a right answer too: the check reads the result."""
    run_check(
        "10",
        "check_mesh_groups",
        "import torch\ndef mesh_groups(sizes, order, rank):\n"
        "    mesh = torch.arange(torch.tensor([sizes[a] for a in order]).prod().item()).reshape([sizes[a] for a in order])\n"
        "    where = [int(i) for i in (mesh == rank).nonzero()[0]]\n"
        "    coords = dict(zip(order, where))\n"
        "    groups = {}\n"
        "    for i, a in enumerate(order):\n"
        "        idx = list(where)\n        idx[i] = slice(None)\n        groups[a] = mesh[tuple(idx)].tolist()\n"
        "    return coords, groups\n",
    )
    assert "check_mesh_groups passed" in capsys.readouterr().out


def test_groups_as_tensors_and_numbers_as_numpy_pass(capsys):
    """Tensor slices for the groups and numpy scalars for the numbers are right answers too."""

    run_check(
        "10", "check_mesh_groups",
        "import torch\ndef mesh_groups(sizes, order, rank):\n"
        "    mesh = torch.arange(int(torch.tensor([sizes[a] for a in order]).prod())).reshape([sizes[a] for a in order])\n"
        "    where = (mesh == rank).nonzero()[0]\n"
        "    groups = {}\n"
        "    for i, a in enumerate(order):\n"
        "        idx = [int(w) for w in where]\n        idx[i] = slice(None)\n        groups[a] = mesh[tuple(idx)]\n"
        "    return dict(zip(order, where)), groups\n",
    )  # fmt: skip
    ns_bytes = edit("10", "pp_bytes", "return messages *", "return np.int64(1) * messages *")
    run_check("10", "check_pp_bytes", "import numpy as np\n" + ns_bytes)
    out = capsys.readouterr().out
    assert "check_mesh_groups passed" in out and "check_pp_bytes passed" in out


def test_a_table_of_one_runs_meshes_fails_the_next():
    table_cheat_fails(
        "10", "mesh_groups", "check_mesh_groups", ({}, {}), "coords",
        key=lambda sizes, order, rank: (tuple(sorted(sizes.items())), tuple(order), rank),
    )  # fmt: skip


def test_a_table_of_one_runs_pipelines_fails_the_next():
    table_cheat_fails("10", "pp_bytes", "check_pp_bytes", -1, "expected")


def test_a_table_of_one_runs_buckets_fails_the_next():
    table_cheat_fails(
        "10", "exposed_after_backward", "check_exposed_buckets", -1.0, "expected",
        key=lambda ready, comm, end: (tuple(ready), tuple(comm), end),
    )  # fmt: skip


JOB = re.compile(
    r"^\s*(?:class|def) (DeviceMesh|init_device_mesh|_MeshLayout|get_schedule_ops|_get_1f1b_rank_ops|"
    r"Schedule(?:1F1B|GPipe|Interleaved\w*|LoopedBFS|ZBV\w*|DualPipeV))\b",
    re.M,
)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's device mesh and pipeline schedules (found by name in torch's source) are in the checks'
    switched-off lists: a new torch that adds one fails here, not in a learner's notebook."""

    from parallel_lab.grading.checks import family, three_d

    off = {
        **three_d.MESH_FORBIDDEN,
        **three_d.PP_FORBIDDEN,
        **family(*three_d.TORCH_PP_MODULES, missing_ok=True),
    }
    found = functions_doing(JOB)
    assert "torch.distributed.device_mesh" in found, "the search finds nothing: torch's layout changed"
    missing = not_switched_off(found, off)
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"


@pytest.mark.parametrize(
    ("check", "source"),
    [
        (
            "check_mesh_groups",
            "def mesh_groups(sizes, order, rank):\n    raise NotImplementedError('todo')\n",
        ),
        ("check_pp_bytes", "def pp_bytes(*a):\n    raise NotImplementedError('todo')\n"),
        ("check_exposed_buckets", "def exposed_after_backward(*a):\n    raise NotImplementedError('todo')\n"),
        ("check_dominant_terms", "def dominant_terms():\n    raise NotImplementedError('todo')\n"),
    ],
)
def test_an_unfinished_exercise_stays_not_implemented(check, source):
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("10", check, source)

"""Lesson 20's exercises: the reference solution passes; wrappers of the lab's and torch's functions, answer
tables from an earlier grade run and wrong algorithms fail, each with a message naming what differed; the check's
byte reference is what the lab's HSDP sends, and its drawn cases cover what the statements promise."""

from __future__ import annotations

import random
import re

import pytest
from solution_code import (
    _check_cell,
    edit,
    fails_saying,
    functions_doing,
    not_switched_off,
    package_sources,
    passes_with_one_line,
    run_check,
    solution_namespace,
    table_cheat_fails,
)

from parallel_lab.grading.checks import _resolve
from parallel_lab.grading.checks import hsdp as checks

BYTES, MESH = "check_hsdp_bytes", "check_best_mesh"
CHECKS = [BYTES, MESH]


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    passes_with_one_line("20", check, capsys)


# ----------------------------------------------------------------------------- exercise 1: bytes per axis
SIG_B = "def hsdp_bytes(numel, replicate, shard, rank, micro_batches, itemsize):\n"
REPLICATE = "replicate_axis = (2 * piece - chunk[j] - chunk[(j + 1) % R]) * itemsize"


def _bytes(old: str, new: str) -> str:
    return edit("20", "hsdp_bytes", old, new)


WRONG_BYTES = [
    ("the lesson's one-micro-batch count (k ignored)", _bytes("k * 3 * (S - 1)", "3 * (S - 1)"),
     "That is one micro-batch's shard traffic"),
    ("the replicate all-reduce charged per micro-batch",
     _bytes(REPLICATE, "replicate_axis = k * (2 * piece - chunk[j] - chunk[(j + 1) % R]) * itemsize"),
     "it runs once per step, in step()"),
    ("the replicate all-reduce on the whole model",
     _bytes("    q, extra = divmod(piece, R)\n", "    piece = numel\n    q, extra = divmod(piece, R)\n"),
     "That all-reduces the whole model across the replicas"),
    ("the replicate all-reduce as 2(R-1)/R of the whole model",
     _bytes(REPLICATE, "replicate_axis = 2 * (R - 1) / R * numel * itemsize"),
     "That all-reduces the whole model across the replicas"),
    ("even ring chunks, as floats", _bytes(REPLICATE, "replicate_axis = 2 * (R - 1) / R * piece * itemsize"),
     "That cuts the slice into even chunks"),
    ("even ring chunks, floored", _bytes(REPLICATE, "replicate_axis = 2 * (R - 1) * (piece // R) * itemsize"),
     "That cuts the slice into even chunks"),
    ("the all-gather taken as sending all but its own chunk",
     _bytes(REPLICATE, "replicate_axis = 2 * (piece - chunk[j]) * itemsize"),
     "it sends its own first and never the one it receives last"),
    ("the bytes received instead of sent",
     _bytes("chunk[j] - chunk[(j + 1) % R]", "chunk[(j - 1) % R] - chunk[j]"), "That is what the rank receives"),
    ("no padding: numel / S", _bytes("piece = -(-numel // S)", "piece = numel / S"), "That leaves out the padding"),
    ("no padding: numel // S", _bytes("piece = -(-numel // S)", "piece = numel // S"), "That leaves out the padding"),
    ("the forward's gather only (2 passes)", _bytes("k * 3 * (S - 1)", "k * 2 * (S - 1)"),
     "That counts two passes per micro-batch"),
    ("not a pair", SIG_B + "    return 0\n", "must return a pair (shard_axis, replicate_axis), got 0"),
]  # fmt: skip

_RIGHT = "    return _right(numel, replicate, shard, rank, micro_batches, itemsize)\n"
CHEATS_BYTES = [
    ("wraps ring_bytes_per_rank",
     "from parallel_lab.comms import ring_bytes_per_rank\n" + SIG_B
     + "    ring_bytes_per_rank(numel, replicate, itemsize, 'all_reduce')\n    return 0, 0\n"),
    ("wraps chunk_sizes", "from parallel_lab.comms.cost import chunk_sizes\n" + SIG_B
     + "    chunk_sizes(numel, replicate)\n    return 0, 0\n"),
    ("wraps comm_formula", "from parallel_lab.scripts.zero import comm_formula\n" + SIG_B
     + "    comm_formula(numel, numel, replicate * shard, 3, itemsize, replicate)\n    return 0, 0\n"),
    ("wraps the planner", "from parallel_lab.costmodel import evaluate\n" + SIG_B
     + "    evaluate(None, None, 1, 1, 1, 3)\n    return 0, 0\n"),
    ("wraps the lab's allreduce formula", "from parallel_lab.costmodel import allreduce_bytes_per_rank\n" + SIG_B
     + "    return 0, allreduce_bytes_per_rank(numel, replicate)\n"),
    ("wraps ZeRO's accumulation bytes", "from parallel_lab.zero.accumulation import accumulation_comm\n" + SIG_B
     + "    return accumulation_comm(numel, shard, 2, micro_batches, 1, itemsize, rank)['bytes_sent'], 0\n"),
    ("wraps data parallelism's ring bytes", "from parallel_lab.data_parallel.compression import hook_bytes_per_rank\n"
     + SIG_B + "    return 0, hook_bytes_per_rank(None, [], replicate, rank)\n"),
    ("wraps ZeroLayout's padding", "from parallel_lab.zero.layout import ZeroLayout\n" + SIG_B
     + "    return 0, ZeroLayout((numel,), (1,), shard).shard\n"),
    ("wraps zero.meta", "from parallel_lab.zero.meta import expected_state_bytes\n" + SIG_B
     + "    expected_state_bytes(None, 3)\n    return 0, 0\n"),
    ("launches the lab's HSDP", "import parallel_lab as pl\n" + SIG_B
     + "    pl.launch(print, replicate * shard)\n    return 0, 0\n"),
    ("starts processes with torch.multiprocessing", "import torch.multiprocessing as mp\n" + SIG_B
     + "    mp.spawn(print, nprocs=2)\n    return 0, 0\n"),
    ("starts a multiprocessing.Process", "import multiprocessing\n" + SIG_B
     + "    multiprocessing.Process(target=print).start()\n    return 0, 0\n"),
    ("runs a subprocess", "import subprocess\n" + SIG_B
     + "    subprocess.run(['true'])\n    return 0, 0\n"),
    ("wraps torch's allreduce_cost", "from torch.distributed.tensor._collective_utils import allreduce_cost\n"
     + SIG_B + "    allreduce_cost(numel * itemsize, None, 0)\n    return 0, 0\n"),
    ("wraps torch's collective time estimator", "import torch.distributed as dist\n" + SIG_B
     + "    with dist.distributed_c10d._time_estimator():\n        pass\n    return 0, 0\n"),
    ("wraps inductor's NCCL estimator", "from torch._inductor.comm_analysis import estimate_nccl_collective_runtime\n"
     + SIG_B + "    estimate_nccl_collective_runtime(None)\n    return 0, 0\n"),
    ("reads the check's own reference", "from parallel_lab.grading.checks.hsdp import _hsdp_bytes\n" + SIG_B
     + "    return _hsdp_bytes(numel, replicate, shard, rank, micro_batches, itemsize)\n"),
    ("runs the check's own measurement", "from parallel_lab.grading.checks.hsdp import _measure_live\n" + SIG_B
     + "    _measure_live(None, (1, 1, 1, 1), 1, ['fp32'] * 3)\n    return 0, 0\n"),
]  # fmt: skip


def _launches(monkeypatch) -> list:
    """Every launch the check makes, logged (the real one still runs)."""
    import parallel_lab.runtime.launch as launch_module

    checks.switched_off()  # built first, from the real launcher
    calls, real = [], launch_module.launch

    def logged(fn, world_size, *args, **kwargs):
        calls.append(fn.__name__)
        return real(fn, world_size, *args, **kwargs)

    monkeypatch.setattr(launch_module, "launch", logged)
    return calls


@pytest.mark.parametrize(("label", "source", "want"), WRONG_BYTES, ids=[w[0] for w in WRONG_BYTES])
def test_a_wrong_byte_count_fails_naming_the_case_before_any_run(monkeypatch, label, source, want):
    launches = _launches(monkeypatch)
    message = fails_saying("20", BYTES, label, source, want)
    assert message.startswith("hsdp_bytes(numel="), message
    assert re.match(r"hsdp_bytes\(numel=\d+, replicate=\d, shard=\d, rank=\d+, micro_batches=\d, itemsize=[24]\)",
                    message), message  # fmt: skip
    assert not launches, "a wrong prediction must fail before the run"


@pytest.mark.parametrize(("label", "source"), CHEATS_BYTES, ids=[c[0] for c in CHEATS_BYTES])
def test_a_wrapper_of_the_labs_or_torchs_counts_is_switched_off(monkeypatch, label, source):
    launches = _launches(monkeypatch)
    fails_saying("20", BYTES, label, source, "switched off")
    assert not launches


def test_predictions_are_stored_before_the_run_and_cover_every_rank_measured(monkeypatch):
    """Every call of the learner's function comes before the one launch, and the calls include every rank of the
    three meshes the run trains, on the model it trains."""
    ns = solution_namespace("20")
    log, right = [], ns["hsdp_bytes"]
    launches = _launches(monkeypatch)

    def logging(*args):
        log.append((len(launches), args))
        return right(*args)

    ns["hsdp_bytes"] = logging
    exec(compile(_check_cell("20", BYTES), "<check cell>", "exec"), ns)  # noqa: S102
    assert launches == ["_measure_live"] and {before for before, _ in log} == {0}
    live = [args for _, args in log[-12:]]
    assert {(R, S) for _, R, S, *_ in live} == set(checks._LIVE_MESHES)
    assert sorted((R, S, rank) for _, R, S, rank, _, _ in live) == sorted(
        (R, S, r) for R, S in checks._LIVE_MESHES for r in range(4)
    )
    assert len({numel for numel, *_ in live}) == 1 and live[0][0] % 4 == 1


def test_a_run_that_disagrees_with_the_stored_prediction_fails(monkeypatch):
    """A reference that (wrongly) ignores the micro-batches, and a learner who agrees with it: every comparison
    with the reference passes, and the run on 4 ranks catches both."""

    def one_micro_batch(numel, R, S, rank, k, itemsize):
        return 3 * (S - 1) * -(-numel // S) * itemsize, 0 if R == 1 else 1

    monkeypatch.setattr(checks, "_hsdp_bytes", one_micro_batch)
    source = SIG_B + (
        "    return 3 * (shard - 1) * -(-numel // shard) * itemsize, 0 if replicate == 1 else 1\n"
    )
    fails_saying("20", BYTES, "agrees with a wrong reference", source, "was stored as")


def test_the_reference_is_what_the_labs_hsdp_sends():
    """The check's reference against the lab, on widths drawn as a grade run draws them, every rank of the three
    meshes, fp32 and bf16."""
    from parallel_lab import launch

    widths = checks._live_widths(random.Random(7))
    precisions = ["mixed", "fp32", "mixed"]
    run = launch(checks._measure_live, 4, widths, 3, precisions, backend="gloo", threads=1)
    for m, ((R, S), precision) in enumerate(zip(checks._LIVE_MESHES, precisions)):
        for rank in range(4):
            sent = run.values[rank][m]
            b = 4 if precision == "fp32" else 2
            assert (sent["numel"], sent["itemsize"]) == (checks._trainable(widths), b)
            measured = (
                sent.get("all_gather", 0) + sent.get("ring_reduce_scatter", 0),
                sent.get("ring_all_reduce", 0),
            )
            assert measured == checks._hsdp_bytes(sent["numel"], R, S, rank, 3, b), (R, S, rank)


def test_the_byte_cases_cover_what_the_statement_says():
    fixed = checks._FIXED_BYTES
    assert (1, 1) in {(R, S) for _, R, S, _, _ in fixed}
    assert any(S == 1 and R > 1 for _, R, S, _, _ in fixed) and any(
        R == 1 and S > 1 for _, R, S, _, _ in fixed
    )
    assert any(n < S for n, _, S, _, _ in fixed)
    assert any(n % (R * S) == 0 and (n // S) % R == 0 and R > 1 and S > 1 for n, R, S, _, _ in fixed)
    for seed in range(5):
        drawn = checks._drawn_grids(random.Random(seed))
        assert len(drawn) == checks._DRAWN_BYTES
        awkward = [g for g in drawn if g[2] > 1 and g[0] % g[2] and g[1] > 1 and -(-g[0] // g[2]) % g[1]]
        assert len(awkward) >= 10 and {k for *_, k, _ in drawn} == {1, 2, 3, 4}
    for seed in range(20):  # the live model pads on every mesh, or cuts uneven chunks
        assert checks._trainable(checks._live_widths(random.Random(seed))) % 4 == 1


def test_a_wrong_byte_count_no_slip_explains_names_none():
    """The place in the replicate group taken as rank % R: some named slip matches it on a case by coincidence,
    but none on every case, so the message names none."""
    source = _bytes("j = rank // S", "j = rank % R")
    message = fails_saying(
        "20", BYTES, "the place as rank % R", source, "than the lab's HSDP sends from that rank"
    )
    case = (1_000_003, 3, 4, 1, 2, 2)  # the first it fails: what the rank receives, by coincidence
    assert message.startswith(checks._bytes_where(*case)), message
    ns = {}
    exec(compile(source, "<rank % R>", "exec"), ns)  # noqa: S102
    slips = checks._byte_slips(*case)
    assert any(axis == 1 and checks._same(ns["hsdp_bytes"](*case)[1], value) for axis, value, _ in slips)
    named = {why for _, _, why in slips}
    assert not any(why in message for why in named), message
    assert message.endswith(" bytes)."), message


def test_an_unfinished_byte_count_stays_not_implemented(monkeypatch):
    launches = _launches(monkeypatch)
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("20", BYTES, SIG_B + "    raise NotImplementedError('todo')\n")
    assert not launches


def test_a_table_of_one_grade_runs_byte_counts_fails_the_next():
    table_cheat_fails("20", "hsdp_bytes", BYTES, (-1, -1), "returned -1, -1")


def test_byte_counts_as_floats_numpy_or_tensors_pass(capsys):
    """Any numbers: floats, numpy integers, 0-d tensors."""
    for wrap in ("float(a), float(b)", "np.int64(a), np.int64(b)", "torch.tensor(a), torch.tensor(b)"):
        run_check("20", BYTES, "import numpy as np\nimport torch\n_right = hsdp_bytes\n" + SIG_B
                  + "    a, b = _right(numel, replicate, shard, rank, micro_batches, itemsize)\n"
                  + f"    return {wrap}\n")  # fmt: skip
        assert "check_hsdp_bytes passed" in capsys.readouterr().out


# ----------------------------------------------------------------------------- exercise 2: choose the mesh
SIG_M = "def best_mesh(params, nodes, gpus_per_node, micro_batches, memory_gb, intra_gbps, inter_gbps):\n"
PICK = "S = max(S for seconds, S in meshes if seconds <= fastest * (1 + 1e-12))"


def _mesh(old: str, new: str) -> str:
    return edit("20", "best_mesh", old, new)


WRONG_MESH = [
    ("always S = a node's GPUs (clipped to fit)", _mesh(PICK, "S = min(S for _, S in meshes if S >= g)"),
     "That is the shard group of one node"),
    ("micro-batches ignored", _mesh("seconds = micro_batches * 3", "seconds = 3"),
     "That counts the shard axis once per step"),
    ("the replicate ring always on the network",
     _mesh("* 2 / bandwidth(replicate)", "* 2 / (inter_gbps * 1e9)"),
     "That runs the replicate ring on the network always"),
    ("the replicate ring always inside a node",
     _mesh("* 2 / bandwidth(replicate)", "* 2 / (intra_gbps * 1e9)"),
     "That runs the replicate ring inside a node always"),
    ("the replicate all-reduce on the whole model", _mesh("(params / S) * 2", "params * 2"),
     "That all-reduces the whole model across the replicas"),
    ("the ring's (R - 1)/R dropped", _mesh("2 * (R - 1) / R * (params / S)", "(2 if R > 1 else 0) * (params / S)"),
     "That drops the ring's (R - 1)/R"),
    ("memory ignored", _mesh("if N % S or 16 * params / S > memory_gb * 1e9:", "if N % S:"),
     "That ignores the memory budget"),
    ("ties to the smaller S", _mesh("S = max(S for", "S = min(S for"), "That breaks a tie towards the smaller S"),
    ("a group judged on one node by its size",
     _mesh("inside = all(len({r // g for r in ranks}) == 1 for ranks in groups)", "inside = len(groups[0]) <= g"),
     "That judges a group by its size"),
    ("the shard group judged by its size", _mesh("/ bandwidth(shard)", "/ ((intra_gbps if S <= g else inter_gbps) * 1e9)"),
     "That judges a group by its size"),
    ("no ValueError when nothing fits", _mesh("raise ValueError(", "return N, 1\n        raise ValueError("),
     "no mesh fits (16 · params / S bytes exceeds memory_gb for every S), so it must raise ValueError"),
    ("a ValueError that does not name memory_gb",
     _mesh('raise ValueError(f"memory_gb={memory_gb}', 'raise ValueError(f"too big {memory_gb}'),
     "name memory_gb in it"),
    ("S as R", _mesh("return N // S, S", "return S, N // S"), "returned ("),
    ("not ints", _mesh("return N // S, S", "return float(N // S), float(S)"), "must return a pair of ints (R, S)"),
    ("a mesh of the wrong size", _mesh("return N // S, S", "return N // S, S + 1"), "R x S must be the"),
]  # fmt: skip

CHEATS_MESH = [
    ("wraps the planner's evaluate", "from parallel_lab.costmodel import evaluate\n" + SIG_M
     + "    evaluate(None, None, 1, 1, 1, 3, replicate=nodes)\n    return nodes, gpus_per_node\n"),
    ("wraps the lab's multinode all-reduce time", "from parallel_lab.comms.cost import multinode_all_reduce_seconds\n"
     + SIG_M + "    multinode_all_reduce_seconds(params, nodes, gpus_per_node, intra_gbps, inter_gbps)\n"
     "    return nodes, gpus_per_node\n"),
    ("wraps the check's own reference", "from parallel_lab.grading.checks.hsdp import _best_mesh\n" + SIG_M
     + "    return _best_mesh(params, nodes, gpus_per_node, micro_batches, memory_gb, intra_gbps, inter_gbps)\n"),
    ("wraps the check's model", "from parallel_lab.grading.checks.hsdp import _mesh_costs\n" + SIG_M
     + "    _mesh_costs(params, nodes, gpus_per_node, micro_batches, memory_gb, intra_gbps, inter_gbps, 1)\n"
     "    return nodes, gpus_per_node\n"),
    ("wraps torch's allgather_cost", "from torch.distributed.tensor._collective_utils import allgather_cost\n"
     + SIG_M + "    allgather_cost(params * 2, None, 0)\n    return nodes, gpus_per_node\n"),
    ("wraps torch's runtime estimator", "from torch.distributed._tools.runtime_estimator import RuntimeEstimator\n"
     + SIG_M + "    RuntimeEstimator()\n    return nodes, gpus_per_node\n"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "source", "want"), WRONG_MESH, ids=[w[0] for w in WRONG_MESH])
def test_a_wrong_mesh_fails_naming_the_case_and_both_meshes(label, source, want):
    message = fails_saying("20", MESH, label, source, want)
    assert message.startswith("best_mesh(params="), message
    if "The exercise's model gives your mesh" in message:  # both meshes, as the check's model prices them
        assert message.count(" s per step (shard axis ") == 2 and message.count(" GB per rank (") == 2, (
            message
        )


@pytest.mark.parametrize(("label", "source"), CHEATS_MESH, ids=[c[0] for c in CHEATS_MESH])
def test_a_wrapper_of_the_labs_or_torchs_cost_model_is_switched_off(label, source):
    fails_saying("20", MESH, label, source, "switched off")


def test_a_wrong_mesh_no_slip_explains_names_none():
    """The shard axis always on the network: no named slip gives its answers on every case, so the message names
    none, though one may give its answer on the failing case."""
    source = _mesh("/ bandwidth(shard)", "/ (inter_gbps * 1e9)")
    message = fails_saying(
        "20", MESH, "the shard axis always on the network", source, "The exercise's model gives"
    )
    case = checks._FIXED_MESH[
        0
    ]  # the first it fails, where the replicate ring inside a node gives its answer
    assert message.startswith(checks._mesh_where(*case) + " returned (16, 2)"), message
    assert checks._best_mesh(*case, slip="rep_intra") == (16, 2)
    assert not any(why in message for why in checks._MESH_SLIPS.values()), message
    assert message.endswith(" GB)."), message


def test_a_table_of_one_grade_runs_meshes_fails_the_next():
    table_cheat_fails("20", "best_mesh", MESH, (0, 0), "returned (0, 0)")


def test_an_unfinished_mesh_stays_not_implemented():
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("20", MESH, SIG_M + "    raise NotImplementedError('todo')\n")


def test_the_fixed_mesh_cases_cover_what_the_statement_says():
    """Each fixed case is there for a reason: the fixed cases alone catch every slip the check names."""
    fixed = checks._FIXED_MESH
    answers = [checks._best_mesh(*c) for c in fixed]
    assert any(S > g for (_, _, g, *_), (_, S) in zip(fixed, answers))  # memory forces the group across nodes
    assert any(n == 1 for _, n, *_ in fixed)  # one node
    assert any(S < g and m >= 16 for (_, _, g, m, *_), (_, S) in zip(fixed, answers))  # many micro-batches
    assert any(c[2] == 6 and checks._mesh_costs(*c, 4)["fits"] and not checks._mesh_costs(*c, 3)["fits"]
               for c in fixed)  # 6 GPUs per node, S >= 4 forced: S = 4 straddles  # fmt: skip
    for slip in checks._MESH_SLIPS:
        assert any(checks._best_mesh(*c, slip=slip) != a for c, a in zip(fixed, answers)), slip
    for case in checks._NO_FIT:
        with pytest.raises(ValueError, match="memory_gb"):
            checks._best_mesh(*case)


def test_the_drawn_mesh_cases_cover_what_the_statement_says():
    """Every grade run draws each kind of case, each showing what it is there for, and none on a knife's edge."""
    for seed in range(4):
        rnd = random.Random(seed)
        cases = {kind: [checks._draw_mesh_case(rnd, kind) for _ in range(8)] for kind in checks._KINDS}
        for kind, drawn in cases.items():
            for case in drawn:
                _, nodes, g, m, *_ = case
                R, S = checks._best_mesh(*case)
                assert checks._sane(case), case
                if kind == "across":
                    assert S > g
                elif kind == "many_mb":
                    assert S < g and m >= 16
                elif kind == "one_node":
                    assert nodes == 1
                elif kind == "straddle":
                    assert g in (3, 5, 6, 10, 12) and checks._best_mesh(*case, slip="by_size") != (R, S)
                else:
                    assert checks._best_mesh(*case, slip="ties_small") != (R, S)


def test_the_mesh_check_and_its_message_name_the_failing_case_only():
    """A learner wrong on one case sees that case's call and the two meshes, and no other case's answer."""
    ns = solution_namespace("20")
    exec(compile(_mesh("S = max(S for", "S = min(S for"), "<ties to the smaller S>", "exec"), ns)  # noqa: S102
    wrong, seen = ns["best_mesh"], []

    def logging(*args):
        seen.append(args)
        return wrong(*args)

    ns["best_mesh"] = logging
    with pytest.raises(AssertionError) as info:
        exec(compile(_check_cell("20", MESH), "<check cell>", "exec"), ns)  # noqa: S102
    message = str(info.value)
    failing = next(
        c for c in seen if wrong(*c) != checks._best_mesh(*c)
    )  # then the slip asks the fixed cases again
    assert message.startswith(checks._mesh_where(*failing) + " returned"), message
    shown = {checks._best_mesh(*failing), wrong(*failing)}
    others = {checks._best_mesh(*c) for c in seen if c != failing} - shown
    assert not any(f"{R} x {S}:" in message for R, S in others), message


# ----------------------------------------------------------------------------- torch's own versions
#: found by the search below but doing another job
NOT_THE_JOB = {
    "torch.distributed._tools.sac_estimator": "selective activation checkpointing's memory and recompute time",
}
JOB = r"(\w*(?:hybrid|hsdp|comm_cost|collective_cost|_cost|estimat)\w*)"


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch.distributed's functions that estimate a collective's cost or time, or set up hybrid sharding (found
    by name in torch's source), are in the checks' switched-off list: top-level ones by name, nested ones and
    methods by their module; inductor's collective-time estimator too. A new torch that adds one fails here,
    not in a learner's notebook."""
    off = checks.switched_off()
    top = functions_doing(re.compile(rf"^(?:class|def) {JOB}", re.M | re.I))
    anywhere = functions_doing(re.compile(rf"^[ \t]*(?:class|def) {JOB}", re.M | re.I))
    top = {m: n for m, n in top.items() if m.startswith("torch.distributed.") and m not in NOT_THE_JOB}
    anywhere = {m: n for m, n in anywhere.items() if m.startswith("torch.distributed.")}
    assert (
        "torch.distributed.tensor._collective_utils" in top and "torch.distributed.fsdp._init_utils" in top
    ), "the search finds nothing: torch's layout changed"
    missing = not_switched_off(top, off)
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"
    covered = {m for m in anywhere if any(k.startswith(m + ".") for k in off)}
    bare = sorted(set(anywhere) - covered - set(NOT_THE_JOB))
    assert not bare, f"torch modules doing an exercise's job, none of it switched off: {bare}"
    assert any(k.startswith("torch._inductor.comm_analysis.estimate_nccl") for k in off)
    for dotted in checks.TORCH_COST_FUNCTIONS:  # single functions: a rename shows here
        assert _resolve(dotted)[2] is not None, dotted
    assert package_sources()

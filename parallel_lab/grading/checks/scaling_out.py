"""Checks for lesson 16's exercise: the time of a hierarchical all-reduce over any number of levels.

`hierarchical_seconds(nbytes, levels, alpha)`, where `levels` lists (group_size, bandwidth) from the innermost
level (GPUs in a node) to the outermost (racks across a spine), is compared, to 1e-12 relative, with this module's
own alpha-beta model (Thakur et al. 2005): a reduce-scatter at every inner level on the way in, each rank taking
only its shard up, a ring all-reduce at the top level, all-gathers on the way out. Fixed cases (one level, a level
of one rank, the lesson's two levels) and six drawn every grade run (1 to 4 levels, groups of 1 to 8, bandwidths
and alpha) make a missing shrink of the bytes, an all-reduce at an inner level, latency forgotten or counted as a
flat ring's, and the slowest link used everywhere each give a different number.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from parallel_lab.grading.checks import call_learner, draw_seed, family, guarded, passed, require_callable

_MODEL = "add up the phases yourself"
#: the lab's cost model, and torch's: DTensor's collective costs and inductor's NCCL time estimates (named,
#: not imported here: torch._inductor loads only when a learner reaches for it, and is switched off then)
FORBIDDEN = {
    **family("parallel_lab.comms.cost", keep=("chunk_sizes",), instead=_MODEL),
    **{f"torch.distributed.tensor._collective_utils.{n}": _MODEL for n in (
        "allgather_cost", "allreduce_cost", "reduce_scatter_cost", "_compute_placement_transition_cost",
        "one_step_redistribute_cost", "redistribute_cost")},
    **{f"torch._inductor.comm_analysis.{n}": _MODEL for n in (
        "estimate_nccl_collective_runtime", "estimate_nccl_collective_runtime_impl",
        "estimate_nccl_collective_runtime_nccl_estimator", "estimate_nccl_collective_runtime_from_fx_node",
        "_nccl_algo_time", "_nccl_best_algo_time", "get_intra_node_bw", "get_inter_node_bw")},
    "torch.distributed.distributed_c10d._time_estimator": _MODEL,
    "torch.distributed.distributed_c10d._time_estimator.__wrapped__": _MODEL,
    "parallel_lab.grading.checks.scaling_out._model": _MODEL,  # and this check's own
}  # fmt: skip

__all__ = ["check_hierarchical_seconds"]


def _model(nbytes: float, levels, alpha: float, shrink=True, inner_steps=2, latency="levels", slowest=False):
    """The check's alpha-beta model; the keywords give the known slips (for naming a wrong answer)."""
    slow = min(bw for _, bw in levels)
    seconds, size = 0.0, float(nbytes)
    for i, (g, bw) in enumerate(levels):
        bw = slow if slowest else bw
        steps = 2 if i == len(levels) - 1 else inner_steps
        a = alpha if latency == "levels" else 0.0
        seconds += steps * (g - 1) * (a + size / g / bw)
        if shrink and i < len(levels) - 1:
            size /= g
    if latency == "flat":
        seconds += 2 * (math.prod(g for g, _ in levels) - 1) * alpha
    return seconds


_SLIPS = {
    "the bytes never shrink: every level's phases carry the whole message": dict(shrink=False),
    "the inner levels cost an all-reduce on the way in, then an all-gather on the way out": dict(
        inner_steps=3
    ),
    "the latency is missing": dict(latency="none"),
    "the latency is that of one flat ring over every rank": dict(latency="flat"),
    "every phase runs at the slowest link's bandwidth": dict(slowest=True),
}


def _cases(seed: int) -> list[tuple[int, list[tuple[int, float]], float]]:
    rnd = random.Random(seed)
    fixed = [
        (2_600_000_000, [(8, 450e9)], 5e-6),  # one level: a plain ring
        (2_600_000_000, [(8, 450e9), (4, 50e9)], 0.0),  # the lesson's two levels, bandwidth only
        (1_000_000, [(1, 900e9), (4, 50e9), (2, 25e9)], 2e-6),  # a level of one rank
        (700_000_000, [(8, 450e9), (4, 50e9), (16, 12.5e9)], 1e-5),  # node, rack, an oversubscribed spine
        (123_456_789, [(4, 300e9), (1, 25e9)], 3e-6),  # the top level of one rank: nothing to all-reduce
    ]
    drawn = []
    for i in range(6):
        depth = 1 if i == 0 else rnd.randint(2, 4)
        bws = sorted((float(f"{10 ** rnd.uniform(9.5, 12):.3g}") for _ in range(depth)), reverse=True)
        levels = [(rnd.choice((1, 2, 2, 3, 4, 5, 6, 7, 8, 8)) if j else rnd.randint(2, 8), bw)
                  for j, bw in enumerate(bws)]  # fmt: skip
        drawn.append((round(10 ** rnd.uniform(3, 10)), levels, float(f"{10 ** rnd.uniform(-7, -4):.3g}")))
    return fixed + drawn


def check_hierarchical_seconds(hierarchical_seconds: Callable) -> None:
    """`hierarchical_seconds(nbytes, levels, alpha)` -> seconds of a hierarchical all-reduce."""
    require_callable(hierarchical_seconds, "hierarchical_seconds")
    fn = guarded(hierarchical_seconds, FORBIDDEN, "this exercise (hierarchical_seconds)")
    cases = _cases(draw_seed())  # six layouts drawn afresh every grade run
    for nbytes, levels, alpha in cases:
        shown = ", ".join(f"({g}, {bw:g})" for g, bw in levels)
        call = f"hierarchical_seconds(nbytes={nbytes}, levels=[{shown}], alpha={alpha:g})"
        got = call_learner(fn, call, nbytes, [tuple(lv) for lv in levels], alpha)
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise AssertionError(f"{call}: expected a number of seconds, got {type(got).__name__}") from None
        want = _model(nbytes, levels, alpha)
        if not math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300):
            slips = [
                name
                for name, kw in _SLIPS.items()
                if not math.isclose(_model(nbytes, levels, alpha, **kw), want, rel_tol=1e-9)
                and math.isclose(got, _model(nbytes, levels, alpha, **kw), rel_tol=1e-9)
            ]
            raise AssertionError(
                f"{call}: {got:.9g} s, expected {want:.9g} s" + (f" ({'; '.join(slips)})" if slips else "")
            )
    passed("check_hierarchical_seconds", f"{len(cases)} layouts, 1 to 4 levels")

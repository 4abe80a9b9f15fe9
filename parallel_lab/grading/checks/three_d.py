"""Checks for lesson 10's exercises: a rank's place on a mesh of any axes in any order, what a pipeline rank
sends under interleaving and sequence parallelism, how much of a bucketed gradient all-reduce sticks out
of the backward, and where four large runs' iterations go.

`check_mesh_groups(fn)`: `fn(sizes, order, rank)` on meshes of 1-5 named axes drawn afresh every grade run
(names, sizes and their order), every rank of small meshes and 24 ranks of big ones, against the row-major
layout `torch.arange(n).reshape(shape)` that DeviceMesh uses (the first name outermost). torch's device
mesh and the lab's ParallelDims are switched off.

`check_pp_bytes(fn)`: `fn(b, s, h, stages, chunks, microbatches, tp, rank, itemsize)` against the bytes of the
SEND steps on that rank of the lab's interleaved 1F1B instruction lists (lesson 09), each an activation or a
gradient of (b, s/tp, h): under sequence parallelism a TP rank holds only its slice of the sequence at a
stage boundary. Drawn sizes every run; the pipeline family and the planner are switched off.

`check_exposed_buckets(fn)`: `fn(ready, comm, backward_end)` against a one-stream queue (bucket i's
all-reduce starts when its gradients are ready and the previous all-reduce is done) on drawn bucket lists.

`check_dominant_terms(fn)`: `fn()` -> the biggest non-matmul term of four layouts the lesson does not plot,
against the planner; the planner is switched off while `fn` runs, so the prediction is the learner's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from parallel_lab.grading.checks import (
    call_learner,
    draw_seed,
    family,
    finite_number,
    guarded,
    passed,
    require_callable,
)

MESH_FORBIDDEN = {
    **family("parallel_lab.runtime.parallel_dims"),
    **family("torch.distributed.device_mesh"),
    **family("torch.distributed._mesh_layout", missing_ok=True),
}
PP_FORBIDDEN = {
    **family("parallel_lab.pipeline.schedules", "parallel_lab.pipeline.simulator"),
    **family("parallel_lab.costmodel.formulas", "parallel_lab.costmodel.planner"),
}
#: torch's pipeline schedules, imported only when the check runs (importing them costs a second)
TORCH_PP_MODULES = (
    "torch.distributed.pipelining.schedules",
    "torch.distributed.pipelining._schedule_visualizer",
)
EXPOSED_FORBIDDEN = {**family("parallel_lab.costmodel.timing")}
PLANNER_FORBIDDEN = {**family("parallel_lab.costmodel.planner", "parallel_lab.costmodel.timing",
                              "parallel_lab.costmodel.formulas")}  # fmt: skip

__all__ = ["check_dominant_terms", "check_exposed_buckets", "check_mesh_groups", "check_pp_bytes"]

_NAMES = ("pp", "dp", "cp", "tp", "ep")


def _ints(g) -> list[int] | None:
    """A group as a list of ints: lists, tuples, ranges, tensors and arrays all count."""
    try:
        return [int(x) for x in (g.tolist() if hasattr(g, "tolist") else g)]
    except (TypeError, ValueError):
        return None


# ----------------------------------------------------------------------------- exercise 1: the mesh
def _mesh_reference(sizes: dict[str, int], order: tuple[str, ...], rank: int):
    """Row-major: the last axis of `order` changes fastest (what torch.arange(n).reshape(shape) gives)."""
    stride, strides = 1, {}
    for axis in reversed(order):
        strides[axis] = stride
        stride *= sizes[axis]
    coords = {a: rank // strides[a] % sizes[a] for a in order}
    groups = {a: [rank + (k - coords[a]) * strides[a] for k in range(sizes[a])] for a in order}
    return coords, groups


def _meshes(rnd: random.Random) -> list[tuple[dict[str, int], tuple[str, ...]]]:
    fixed = [
        ({"tp": 4}, ("tp",)),  # one axis: everybody in one group
        ({"pp": 1, "dp": 3, "tp": 1}, ("pp", "dp", "tp")),  # size-1 axes
        ({"pp": 2, "dp": 2, "tp": 2}, ("tp", "dp", "pp")),  # the lesson's sizes, the order reversed
    ]
    drawn = []
    for n_axes in (2, 3, 4, 4, 5):
        names = rnd.sample(_NAMES, n_axes)
        sizes = {a: rnd.randint(1, 4) for a in names}
        sizes[rnd.choice(names)] = rnd.randint(2, 5)
        order = tuple(rnd.sample(names, n_axes))
        while order == tuple(names):  # an order that is not the dict's
            order = tuple(rnd.sample(names, n_axes))
        drawn.append((sizes, order))
    return fixed + drawn


def check_mesh_groups(fn: Callable[..., tuple]) -> None:
    """`fn(sizes, order, rank)` -> (coords {axis: coordinate}, groups {axis: ranks of this rank's group})."""
    require_callable(fn)
    fn = guarded(fn, MESH_FORBIDDEN, "this exercise (mesh_groups)")
    rnd = random.Random(draw_seed())  # axis names, sizes and orders drawn afresh every grade run
    meshes = _meshes(rnd)
    for sizes, order in meshes:
        n = math.prod(sizes.values())
        picked = range(n) if n <= 48 else sorted(rnd.sample(range(n), 24))
        for rank in picked:
            where = f"mesh_groups(sizes={sizes}, order={order}, rank={rank})"
            got = call_learner(fn, where, dict(sizes), tuple(order), rank)
            ok = isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, dict) for x in got)
            assert ok, f"{where}: return (coords, groups), two dicts keyed by the axis names; got {got!r}"
            coords, groups = got
            want_c, want_g = _mesh_reference(sizes, order, rank)
            got_c = {
                a: (int(coords[a]) if hasattr(coords.get(a), "__index__") else coords.get(a)) for a in order
            }
            if got_c != want_c:
                flipped, _ = _mesh_reference(sizes, tuple(reversed(order)), rank)
                hint = (" Those are the coordinates with the order reversed: the FIRST name of `order` is the "
                        "outermost axis (it changes slowest as the rank grows)." if got_c == flipped else "")  # fmt: skip
                raise AssertionError(f"{where}: coords {got_c}, expected {want_c}.{hint}")
            for axis in order:
                g = _ints(groups.get(axis)) if groups.get(axis) is not None else None
                if g != want_g[axis]:
                    _, flipped = _mesh_reference(sizes, tuple(reversed(order)), rank)
                    hint = (" That is the group with the order reversed: the FIRST name of `order` is the outermost "
                            "axis." if g == flipped[axis] else "")  # fmt: skip
                    raise AssertionError(
                        f"{where}: {axis} group {g!r}, expected {want_g[axis]} (the ranks whose other coordinates "
                        f"equal rank {rank}'s, ordered by their {axis} coordinate).{hint}"
                    )
    passed("check_mesh_groups", f"{len(meshes)} meshes of 1 to 5 axes in drawn orders")


# ----------------------------------------------------------------------------- exercise 2: pipeline bytes
def _pp_reference(b: int, s: int, h: int, p: int, v: int, m: int, tp: int, rank: int, item: int) -> int:
    """Bytes of the SEND steps on `rank` in the lab's interleaved 1F1B lists (v = 1: plain 1F1B)."""
    from parallel_lab.pipeline import schedule_interleaved_1f1b

    sends = sum(st.kind in ("SEND_F", "SEND_B") for st in schedule_interleaved_1f1b(p, m, v)[rank])
    return sends * b * (s // tp) * h * item


def check_pp_bytes(fn: Callable[..., float]) -> None:
    """`fn(b, s, h, stages, chunks, microbatches, tp, rank, itemsize)` -> bytes `rank` sends to other pipeline
    ranks in one step (activations forward, gradients back), under sequence parallelism."""
    require_callable(fn)
    fn = guarded(
        fn, {**PP_FORBIDDEN, **family(*TORCH_PP_MODULES, missing_ok=True)}, "this exercise (pp_bytes)"
    )
    rnd = random.Random(draw_seed())  # shapes and pipelines drawn afresh every grade run
    cases = [(1, 8, 4, 2, 1, 2, 1, r, 4) for r in range(2)] + [(2, 16, 8, 4, 2, 4, 2, r, 2) for r in range(4)]
    for _ in range(6):
        p, v, tp = rnd.randint(2, 6), rnd.randint(1, 4), rnd.choice((1, 2, 4, 8))
        m = p * rnd.randint(1, 3)
        shape = (rnd.randint(1, 4), tp * rnd.randint(1, 64), 64 * rnd.randint(1, 32))
        for rank in sorted({0, p - 1, rnd.randrange(p)}):
            cases.append((*shape, p, v, m, tp, rank, rnd.choice((2, 4))))
    for b, s, h, p, v, m, tp, rank, item in cases:
        where = (f"pp_bytes(b={b}, s={s}, h={h}, stages={p}, chunks={v}, microbatches={m}, tp={tp}, rank={rank}, "
                 f"itemsize={item})")  # fmt: skip
        got = finite_number(call_learner(fn, where, b, s, h, p, v, m, tp, rank, item), where, "bytes")
        want = _pp_reference(b, s, h, p, v, m, tp, rank, item)
        if abs(got - want) > 1e-9 * max(1, want):
            unit = b * (s // tp) * h * item
            slips = [
                (want * tp, "each TP rank sends only its slice of the sequence, not the whole activation."),
                (want / item, "that is elements; the exercise asks for bytes."),
                (2 * m * v * unit, "that counts a message in both directions for every chunk on every rank: look "
                 "at which chunks have no neighbour on one side."),
                (m * (p * v - 1) * 2 * unit / p, "that is the pipeline's messages shared out evenly: ranks differ."),
            ]  # fmt: skip
            vs = [c * p + rank for c in range(v)]
            one_way = [m * sum(x < p * v - 1 for x in vs) * unit, m * sum(x > 0 for x in vs) * unit]
            hint = next((t for x, t in slips if abs(got - x) <= 1e-9 * max(1, x)), "")
            if not hint and any(abs(got - x) <= 1e-9 * max(1, x) for x in one_way):
                hint = "that counts one direction only: activations go forward and gradients come back."
            raise AssertionError(f"{where} is {got!r}, expected {want!r}. {hint}".rstrip())
    passed("check_pp_bytes", "first, middle and last ranks of 8 pipelines")


# ----------------------------------------------------------------------------- exercise 3: buckets
def _queue(ready: list[float], comm: list[float], backward_end: float) -> float:
    done = 0.0
    for r, c in zip(ready, comm, strict=True):
        done = max(done, r) + c  # one stream: a bucket waits for its gradients and for the previous bucket
    return max(0.0, done - backward_end)


def check_exposed_buckets(fn: Callable[..., float]) -> None:
    """`fn(ready, comm, backward_end)` -> seconds the bucketed all-reduces run past the end of the backward."""
    require_callable(fn)
    fn = guarded(fn, EXPOSED_FORBIDDEN, "this exercise (exposed_after_backward)")
    rnd = random.Random(draw_seed())  # bucket lists drawn afresh every grade run
    cases = [
        ([], [], 5.0),  # no buckets
        ([2.0], [1.0], 5.0),  # hidden
        ([5.0, 5.0], [1.0, 2.0], 5.0),  # everything ready at the end: no overlap
        ([0.0, 0.0, 0.0], [2.0, 2.0, 2.0], 3.0),  # ready at once: one queue
        ([0.0, 4.0], [1.0, 2.0], 5.0),  # the stream idles until the last bucket is ready: 1 s exposed, not 0
    ]
    for n in (1, 3, 6, 10, 10, 16):
        end = round(rnd.uniform(1, 10), 3)
        ready = sorted(round(rnd.uniform(0, end), 3) for _ in range(n))
        scale = rnd.choice((0.2, 1.0, 3.0)) * end / n
        cases.append((ready, [round(rnd.uniform(0.1, 2) * scale, 3) for _ in range(n)], end))
    for ready, comm, end in cases:
        where = f"exposed_after_backward(ready={ready}, comm={comm}, backward_end={end})"
        got = finite_number(call_learner(fn, where, list(ready), list(comm), end), where, "seconds")
        want = _queue(ready, comm, end)
        if abs(got - want) > 1e-9:
            slips = [
                (max(0.0, sum(comm) - (end - (ready[0] if ready else 0.0))),
                 "that assumes every all-reduce can start as soon as the first bucket is ready; a bucket's cannot "
                 "start before its own gradients exist."),
                (max([0.0] + [r + c - end for r, c in zip(ready, comm)]),
                 "that runs the all-reduces side by side; they share one stream and run one after the other."),
                (comm[-1] if comm else 0.0, "the last bucket is not the only one that can stick out: a queue can "
                 "still be draining when its gradients are ready."),
            ]  # fmt: skip
            hint = next((t for x, t in slips if abs(got - x) <= 1e-9), "")
            raise AssertionError(f"{where} is {got!r}, expected {want!r}. {hint}".rstrip())
    passed("check_exposed_buckets", f"{len(cases)} bucket lists")


# ----------------------------------------------------------------------------- exercise 4: predictions
#: The four layouts: (description, planner arguments), on DGX A100 80GB nodes, full recomputation.
LAYOUTS = {
    "A": ("GPT 1.7B under ZeRO-3 on 256 GPUs, global batch 512, micro-batch 2", "zero3_small"),
    "B": ("GPT-3 175B with tp 8, pp 48, dp 4 on 1536 GPUs, global batch 96, micro-batch 1", "deep_pp"),
    "C": (
        "GPT-3 175B with tp 16 (two nodes), pp 12, dp 2 on 384 GPUs, global batch 1536 in micro-batches of 1",
        "tp16",
    ),
    "D": ("GPT 1.7B with pp 8, dp 4 on 32 GPUs, global batch 512, micro-batch 1", "pp_small"),
}
TERMS = ("memory", "bubble", "tp_comm", "pp_comm", "dp_comm")


def _plan(key: str):
    from parallel_lab.costmodel import GPT3_175B, GPT_1_7B, ClusterSpec, evaluate

    model, gpus, dp, tp, pp, zero, batch, micro = {
        "zero3_small": (GPT_1_7B, 256, 256, 1, 1, 3, 512, 2),
        "deep_pp": (GPT3_175B, 1536, 4, 8, 48, 1, 96, 1),
        "tp16": (GPT3_175B, 384, 2, 16, 12, 1, 1536, 1),
        "pp_small": (GPT_1_7B, 32, 4, 1, 8, 1, 512, 1),
    }[key]
    return evaluate(model, ClusterSpec(gpus), dp, tp, pp, zero, True, batch, micro)


def check_dominant_terms(fn: Callable[[], dict]) -> None:
    """`fn()` -> {"A".."D": the term expected to cost the most after the matmuls themselves}."""
    require_callable(fn)
    predictions = call_learner(
        guarded(fn, PLANNER_FORBIDDEN, "this prediction (dominant_terms)"), "dominant_terms()"
    )
    assert isinstance(predictions, dict), (
        f"dominant_terms() must return a dict keyed 'A'..'D', got {type(predictions).__name__}"
    )
    missing = [k for k in LAYOUTS if predictions.get(k) not in TERMS]
    assert not missing, (
        f"predict layouts {missing}: each value one of {TERMS} (got {[predictions.get(k) for k in missing]})"
    )
    for key, (what, plan_key) in LAYOUTS.items():
        t = _plan(plan_key).time
        parts = {name: t[name] for name in TERMS}
        biggest = max(parts, key=parts.get)
        if predictions[key] != biggest:
            shares = ", ".join(
                f"{n} {v / t['total']:.0%}" for n, v in sorted(parts.items(), key=lambda x: -x[1])
            )
            raise AssertionError(
                f"{key} ({what}): you predicted {predictions[key]!r}; the planner's biggest loss is {biggest!r}. "
                f"Its iteration: matmul {t['matmul'] / t['total']:.0%}, {shares}."
            )
    passed("check_dominant_terms", "4 layouts, each the planner's biggest loss")

"""Checks for lesson 10's exercises: one rank's place on the DP x TP x PP mesh, what each axis sends, and
where a large run's iteration goes.

The mesh check compares the learner's coordinates and groups with `ParallelDims` on
every rank of every mesh with dp, tp, pp in 1..4 (at most 32 ranks), and recognises
the usual slip of numbering TP outermost. The bytes check compares with the lab's
formulas: TP with `tensor_parallel.transformer.tp_comm_bytes_per_layer` (4 ring all-reduces of
b·s·h per layer, forward + backward), DP with `costmodel.allreduce_bytes_per_rank` on
the rank's share of a layer's 12h² weight gradients (lesson 10, section 2), on many
sizes including GPT-3's layer. The overlap check compares the learner's exposed time with the
planner's law, max(0, comm - compute) + f·min(comm, compute), on a grid of cases; the prediction check
compares the learner's four guesses with the planner's breakdown of four published-scale layouts, and
shows the breakdown when a guess is wrong.
"""

from __future__ import annotations

from collections.abc import Callable

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

# The lab's mesh and its byte formulas, and torch's device mesh, switched off while the learner's
# function runs.
FORBIDDEN = {
    **family("parallel_lab.runtime.parallel_dims"),
    **family("parallel_lab.costmodel.formulas"),
    "parallel_lab.tensor_parallel.transformer.tp_comm_bytes_per_layer": "",
    "torch.distributed.device_mesh.init_device_mesh": "",
}

__all__ = ["check_comm_bytes_per_layer", "check_dominant_terms", "check_exposed", "check_mesh_groups"]

AXES = ("pp", "dp", "tp")
_MESHES = [(d, t, p) for d in (1, 2, 3, 4) for t in (1, 2, 3, 4) for p in (1, 2, 3, 4) if d * t * p <= 32]


def _tp_outermost(dp: int, tp: int, pp: int, rank: int) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Coordinates and groups under the reversed order (TP outermost, PP innermost), to name that slip."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    coords = {"pp": rank % pp, "dp": rank // pp % dp, "tp": rank // (pp * dp)}
    at = lambda c: (c["tp"] * dp + c["dp"]) * pp + c["pp"]
    return coords, {a: [at({**coords, a: k}) for k in range(sizes[a])] for a in AXES}


_SLIP = " That numbering puts TP outermost; the lab puts TP innermost (a TP group's ranks are neighbours)."


def check_mesh_groups(fn: Callable[[int, int, int, int], tuple]) -> None:
    """`fn(dp, tp, pp, rank)` -> ({"pp", "dp", "tp"} coordinates, {"pp", "dp", "tp"} group ranks)."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (mesh_groups)")
    import random

    from parallel_lab.runtime.parallel_dims import ParallelDims

    rnd = random.Random(draw_seed())  # plus three bigger meshes and their ranks, drawn afresh every grade run
    drawn = [
        (rnd.randint(3, 9), rnd.randint(3, 9), rnd.randint(5, 9)) for _ in range(3)
    ]  # >= 45 ranks: 32 sampled
    ranks = 0
    for dp, tp, pp in (*_MESHES, *drawn):
        dims = ParallelDims(dp=dp, tp=tp, pp=pp)
        picked = range(dims.size) if dims.size <= 32 else sorted(rnd.sample(range(dims.size), 32))
        for rank in picked:
            where = f"mesh_groups(dp={dp}, tp={tp}, pp={pp}, rank={rank})"
            got = fn(dp, tp, pp, rank)
            ok = isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, dict) for x in got)
            assert ok, f"{where}: return (coords, groups), two dicts keyed 'pp', 'dp', 'tp'; got {got!r}"
            coords, groups = got
            want, (slip_coords, slip_groups) = dims.coords(rank), _tp_outermost(dp, tp, pp, rank)
            if {k: coords.get(k) for k in AXES} != want:
                hint = _SLIP if coords == slip_coords else ""
                raise AssertionError(
                    f"{where}: coords {coords}, expected {want}. "
                    f"rank = (pp_rank * dp + dp_rank) * tp + tp_rank.{hint}"
                )
            for axis in ("tp", "dp", "pp"):
                g, want_g = groups.get(axis), dims.group_of(axis, rank)
                if not (isinstance(g, (list, tuple)) and list(g) == want_g):
                    hint = _SLIP if isinstance(g, (list, tuple)) and list(g) == slip_groups[axis] else ""
                    raise AssertionError(
                        f"{where}: {axis} group {g!r}, expected {want_g} (the ranks that differ from rank "
                        f"{rank} only in their {axis} coordinate, ordered by it).{hint}"
                    )
            ranks += 1
    passed("check_mesh_groups", f"{len(_MESHES) + len(drawn)} meshes, {ranks} ranks")


def check_comm_bytes_per_layer(fn: Callable[..., dict]) -> None:
    """`fn(b, s, h, tp, dp, itemsize=2)` -> {"tp": bytes per micro-batch, "dp": bytes per step}, one rank, one layer."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (comm_bytes_per_layer)")
    from parallel_lab.costmodel import GPT3, allreduce_bytes_per_rank
    from parallel_lab.tensor_parallel import tp_comm_bytes_per_layer

    cases = [
        (b, s, h, tp, dp, item)
        for b, s, h in ((1, 128, 256), (2, 512, 1024), (4, 1024, 4096), (1, GPT3.seq, GPT3.hidden))
        for tp in (1, 2, 4, 8)
        for dp in (1, 2, 3, 8, 64)
        for item in (2, 4)
    ]
    import random

    rnd = random.Random(draw_seed())  # and eight cases drawn afresh every grade run (tp divides b*s*h)
    for _ in range(8):
        tp = rnd.choice((1, 2, 4, 8))
        cases.append((rnd.randint(1, 8), 64 * rnd.randint(1, 32), 128 * rnd.randint(1, 64), tp, rnd.randint(1, 96),
                      rnd.choice((2, 4))))  # fmt: skip
    for b, s, h, tp, dp, item in cases:
        where = f"comm_bytes_per_layer(b={b}, s={s}, h={h}, tp={tp}, dp={dp}, itemsize={item})"
        got = fn(b, s, h, tp, dp, itemsize=item)
        assert isinstance(got, dict) and {"tp", "dp"} <= set(got), (
            f"{where}: return a dict with keys 'tp' and 'dp', got {got!r}"
        )
        # tp divides b*s*h in every case, so every TP rank sends the same; rank 0 speaks for all
        want = {"tp": tp_comm_bytes_per_layer(b, s, h, tp, item)[0],
                "dp": allreduce_bytes_per_rank(12 * h * h // tp * item, dp)}  # fmt: skip
        for axis, hints in (
            ("tp", {8 * b * s * h * item: "that is the all-reduces' volume: on a ring each rank sends (t-1)/t of it.",
                    want["tp"] / item: "that is elements; the exercise asks for bytes (times itemsize)."}),
            ("dp", {want["dp"] / 2: "an all-reduce is a reduce-scatter plus an all-gather: 2(d-1)/d of the input.",
                    want["dp"] * tp: "each DP group all-reduces one TP shard: 12h^2/t weights per rank."}),
        ):  # fmt: skip
            g = got[axis]
            assert isinstance(g, (int, float)) and not isinstance(g, bool), (
                f"{where}['{axis}'] must be a number, got {type(g).__name__}"
            )
            if abs(g - want[axis]) > 1e-9 * max(1.0, want[axis]):
                hint = next((t for v, t in hints.items() if abs(g - v) <= 1e-9 * max(1.0, v)), "")
                raise AssertionError(f"{where}['{axis}'] is {g!r}, expected {want[axis]!r}. {hint}".rstrip())
    assert fn(1, 2048, 4096, 2, 2) == fn(1, 2048, 4096, 2, 2, itemsize=2), "itemsize defaults to 2 (16-bit)"
    passed("check_comm_bytes_per_layer", f"{len(cases)} cases, GPT-3's layer among them")


def check_exposed(fn: Callable[[float, float, float], float]) -> None:
    """`fn(comm, compute, f)` -> seconds a collective of `comm` seconds adds beside `compute` seconds of work."""
    require_callable(fn)
    fn = guarded(fn, {**family("parallel_lab.costmodel.timing")}, "this exercise (exposed)")
    grid = (0.0, 0.5, 1.0, 2.0, 5.0)
    cases = [(c, k, f) for c in grid for k in grid for f in (0.0, 0.15, 0.5)]
    import random

    rnd = random.Random(draw_seed())  # and ten drawn afresh every grade run
    cases += [
        (round(rnd.uniform(0, 9), 3), round(rnd.uniform(0, 9), 3), round(rnd.random(), 3)) for _ in range(10)
    ]
    for comm, compute, f in cases:
        where = f"exposed(comm={comm}, compute={compute}, f={f})"
        got = fn(comm, compute, f)
        assert isinstance(got, (int, float)) and not isinstance(got, bool), (
            f"{where} must return a number of seconds, got {type(got).__name__}"
        )
        want = max(0.0, comm - compute) + f * min(comm, compute)
        if abs(got - want) > 1e-12:
            perfect = max(0.0, comm - compute)
            slips = [
                (perfect, "that is perfect overlap; while both run, each is slowed by f, so the overlapped part, "
                 "min(comm, compute), costs f of itself."),
                (comm, "that is no overlap at all: the collective runs beside the compute."),
                (perfect + f * comm, "only the overlapped part pays f: f·min(comm, compute), not f·comm."),
                (max(comm - compute, f * comm), "f applies to the overlapped part, min(comm, compute), and adds to "
                 "what sticks out, max(0, comm - compute)."),
            ]  # fmt: skip
            hint = next((t for v, t in slips if abs(got - v) <= 1e-12), "")
            raise AssertionError(f"{where} is {got!r}, expected {want!r}. {hint}".rstrip())
    passed("check_exposed", f"{len(cases)} cases")


#: The four layouts of exercise 3: (description, planner arguments). Every one on DGX A100 80GB nodes.
LAYOUTS = {
    "A": ("GPT-3 175B, ZeRO-3 without model parallelism, 1536 GPUs, micro-batch 1", "zero3"),
    "B": ("GPT 530B, tp 8, pp 35, dp 8 on 2240 GPUs, 280 micro-batches of 1", "ptdp530"),
    "C": ("GPT-3 175B, tp 16 (two nodes), pp 12, dp 2 on 384 GPUs", "tp16"),
    "D": ("GPT 1.7B, data parallel on 32 GPUs, micro-batch 16", "small"),
}
TERMS = ("memory", "bubble", "tp_comm", "pp_comm", "dp_comm")


def _plan(key: str):
    from parallel_lab.costmodel import GPT3_175B, GPT_530B, ClusterSpec, evaluate
    from parallel_lab.costmodel import GPT_1_7B as small

    args = {
        "zero3": (GPT3_175B, 1536, 1536, 1, 1, 3, 1536, 1),
        "ptdp530": (GPT_530B, 2240, 8, 8, 35, 1, 2240, 1),
        "tp16": (GPT3_175B, 384, 2, 16, 12, 1, 1536, 1),
        "small": (small, 32, 32, 1, 1, 1, 512, 16),
    }[key]
    model, gpus, dp, tp, pp, zero, batch, micro = args
    return evaluate(model, ClusterSpec(gpus), dp, tp, pp, zero, True, batch, micro)


def check_dominant_terms(predictions: dict) -> None:
    """`predictions` maps "A".."D" to the term you expect to cost the most after the matmuls themselves."""
    assert isinstance(predictions, dict), (
        f"predictions must be a dict keyed 'A'..'D', got {type(predictions).__name__}"
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

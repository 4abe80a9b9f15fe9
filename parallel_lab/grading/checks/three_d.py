"""Checks for lesson 10's exercises: one rank's place on the DP x TP x PP mesh, and what each axis sends.

The mesh check compares the learner's coordinates and groups with `ParallelDims` on
every rank of every mesh with dp, tp, pp in 1..4 (at most 32 ranks), and recognises
the usual slip of numbering TP outermost. The bytes check compares with the lab's
formulas: TP with `tensor_parallel.transformer.tp_comm_bytes_per_layer` (4 ring all-reduces of
b·s·h per layer, forward + backward), DP with `costmodel.allreduce_bytes_per_rank` on
the rank's share of a layer's 12h² weight gradients (lesson 10, section 2), on many
sizes including GPT-3's layer.
"""

from __future__ import annotations

from collections.abc import Callable

from parallel_lab.grading.checks import family, guarded, passed, require_callable

# The lab's mesh and its byte formulas, and torch's device mesh, switched off while the learner's
# function runs.
FORBIDDEN = {
    **family("parallel_lab.runtime.parallel_dims"),
    **family("parallel_lab.costmodel.formulas"),
    "parallel_lab.tensor_parallel.transformer.tp_comm_bytes_per_layer": "",
    "torch.distributed.device_mesh.init_device_mesh": "",
}

__all__ = ["check_comm_bytes_per_layer", "check_mesh_groups"]

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
    from parallel_lab.runtime.parallel_dims import ParallelDims

    ranks = 0
    for dp, tp, pp in _MESHES:
        dims = ParallelDims(dp=dp, tp=tp, pp=pp)
        for rank in range(dims.size):
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
    passed("check_mesh_groups", f"{len(_MESHES)} meshes, {ranks} ranks")


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

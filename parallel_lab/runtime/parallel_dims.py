"""ParallelDims: a DP x CP x TP x PP mesh of ranks and the process groups along each axis.

Layout (Megatron-LM's default order; Narayanan et al. 2021, §3): tensor parallel
innermost, then context parallel, then data parallel, then pipeline outermost,

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank,

so the ranks of one TP group are neighbours (one node, the fastest links: TP talks
twice per layer), a CP group (the sequence split, lesson 17: it passes key/value blocks
every layer) sits next to them, a DP group spans replicas of the same stage, and a PP
group walks through the stages (its p2p messages are the smallest, so they may cross
nodes). With cp = 1 (the default) the layout is lesson 10's DP x TP x PP.

Invariant: dp * cp * tp * pp == world_size; every rank sits in exactly one group per
axis, and the groups along an axis partition the ranks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the axes. `world_size` (when given) must equal dp * cp * tp * pp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int | None = None
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelDims.{name} must be an int >= 1, got {v!r}")
        if self.world_size is not None and self.size != self.world_size:
            what = "dp * cp * tp * pp" if self.cp > 1 else "dp * tp * pp"
            sizes = " * ".join(str(getattr(self, a)) for a in what.split(" * "))
            raise ValueError(
                f"ParallelDims: {what} = {sizes} = {self.size} must equal world_size = {self.world_size}"
            )

    @property
    def size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def sizes(self) -> dict[str, int]:
        """{axis: size} for every axis, outermost first."""
        return {a: getattr(self, a) for a in AXES}

    def coords(self, rank: int) -> dict[str, int]:
        """{'pp', 'dp', 'tp'} coordinates of a global rank, and 'cp' when the mesh has that axis."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {rank}")
        out, rest = {}, rank
        for axis in reversed(AXES):  # innermost first: tp, cp, dp, pp
            out[axis], rest = rest % getattr(self, axis), rest // getattr(self, axis)
        keep = AXES if self.cp > 1 else ("pp", "dp", "tp")
        return {a: out[a] for a in keep}

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at these coordinates."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: lists of global ranks, ordered by their coordinate on that axis."""
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        others = [a for a in AXES if a != axis]
        sizes = self.sizes()
        out = []
        for fixed in itertools.product(*(range(sizes[a]) for a in others)):
            at = dict(zip(others, fixed))
            out.append([self.rank_of(**at, **{axis: k}) for k in range(sizes[axis])])
        return out

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The ranks in `rank`'s group along `axis`."""
        return next(g for g in self.groups(axis) if rank in g)

    def build(self, ctx: Any) -> MeshGroups:
        """Create the process groups of every axis (all ranks must call this, in the same order).

        Returns this rank's handles. Axes of size 1 get no group (None); a group equal to
        the whole world reuses the default group."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() != self.size:
            raise ValueError(
                f"ParallelDims: dp * cp * tp * pp = {self.size} must equal world_size = {dist.get_world_size()}"
            )
        handles: dict[str, Any] = {}
        for axis in AXES:
            for ranks in self.groups(axis):
                if len(ranks) == 1:
                    g = None
                elif len(ranks) == self.size:
                    g = dist.group.WORLD
                else:
                    g = dist.new_group(
                        ranks
                    )  # collective over the world: every rank calls it for every group
                if ctx.rank in ranks:
                    handles[axis] = (g, ranks)
        return MeshGroups(self, ctx.rank, handles)


@dataclass
class MeshGroups:
    """One rank's view of the mesh: its coordinates, and its group (handle and ranks) on each axis."""

    dims: ParallelDims
    rank: int
    handles: dict[str, tuple[Any, list[int]]] = field(default_factory=dict)

    def group(self, axis: str) -> Any:
        """The process group along `axis`. None when the axis has size 1: check `size(axis)` first,
        since comms read group=None as the whole world."""
        return self.handles[axis][0]

    def size(self, axis: str) -> int:
        return len(self.handles[axis][1])

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`, by coordinate."""
        return self.handles[axis][1]

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.rank)


def plot_mesh(dims: ParallelDims, gpus_per_node: int | None = None):
    """Draw the ranks as a grid (rows: pipeline stages; columns: dp replica, then tp rank), one panel
    per axis with each of its groups in its own colour. Dashed boxes mark nodes of `gpus_per_node`
    consecutive ranks when given. Returns the Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    cols, rows = dims.dp * dims.cp * dims.tp, dims.pp
    col = lambda c: (c["dp"] * dims.cp + c.get("cp", 0)) * dims.tp + c["tp"]  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(min(9.4, 3.0 * 3 * max(1, cols / 4) ** 0.5 + 0.4), 1.0 + 0.9 * rows),
                             layout="constrained")  # fmt: skip
    palette = plt.get_cmap("tab10")
    titles = {"tp": "TP groups (all-reduce per layer)", "dp": "DP groups (gradient all-reduce)",
              "pp": "PP groups (p2p between stages)"}  # fmt: skip
    for ax, axis in zip(axes, ("tp", "dp", "pp")):
        colour = {r: palette(i % 10) for i, g in enumerate(dims.groups(axis)) for r in g}
        for rank in range(dims.size):
            c = dims.coords(rank)
            x, y = col(c), c["pp"]
            ax.add_patch(FancyBboxPatch((x + 0.08, y + 0.1), 0.84, 0.8, boxstyle="round,pad=0.02",
                                        facecolor=colour[rank], alpha=0.85, edgecolor="black", linewidth=0.6))  # fmt: skip
            ax.text(
                x + 0.5,
                y + 0.5,
                f"{rank}",
                ha="center",
                va="center",
                fontsize=10,
                color="white",
                weight="bold",
            )
        if gpus_per_node:
            for start in range(0, dims.size, gpus_per_node):
                ranks = range(start, min(start + gpus_per_node, dims.size))
                xs = [col(dims.coords(r)) for r in ranks]
                ys = [dims.coords(r)["pp"] for r in ranks]
                ax.add_patch(Rectangle((min(xs) + 0.02, min(ys) + 0.04), max(xs) - min(xs) + 0.96,
                                       max(ys) - min(ys) + 0.92, fill=False, linestyle="--", linewidth=1))  # fmt: skip
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_xticks([i + 0.5 for i in range(cols)])
        cp_label = (lambda i: f"\ncp{i // dims.tp % dims.cp}") if dims.cp > 1 else (lambda i: "")
        ax.set_xticklabels([f"dp{i // (dims.cp * dims.tp)}{cp_label(i)}\ntp{i % dims.tp}" for i in range(cols)],
                           fontsize=8)  # fmt: skip
        ax.set_yticks([i + 0.5 for i in range(rows)])
        ax.set_yticklabels([f"stage {i}" for i in range(rows)], fontsize=8)
        ax.set_title(titles[axis], fontsize=9)
        ax.set_aspect("equal")
    fig.suptitle(f"ParallelDims(dp={dims.dp}, tp={dims.tp}, pp={dims.pp}): rank = (pp * dp + dp_rank) * tp + tp_rank",
                 fontsize=10)  # fmt: skip
    return fig

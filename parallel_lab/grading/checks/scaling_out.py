"""Checks for lesson 16's exercise: the time of an all-reduce across nodes, flat and hierarchical.

`allreduce_seconds(nbytes, nodes, gpus_per_node, intra_bw, inter_bw, hierarchical)` (bandwidth terms
only) is compared with the lab's alpha-beta model at alpha = 0 on layouts from one node to 64, with the
network 2x to 10x slower than the links inside a node, so that using the wrong link, forgetting that
the network carries only 1/g of the data, or leaving out the phases inside the node each give a
different number.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

FORBIDDEN = family("parallel_lab.comms.cost", keep=("parallel_lab.comms.cost.chunk_sizes",))

__all__ = ["check_multinode_all_reduce"]


def check_multinode_all_reduce(allreduce_seconds: Callable) -> None:
    """`allreduce_seconds(nbytes, nodes, gpus_per_node, intra_bw, inter_bw, hierarchical)` -> seconds."""
    require_callable(allreduce_seconds, "allreduce_seconds")
    from parallel_lab.comms import multinode_all_reduce_seconds as reference

    fn = guarded(allreduce_seconds, FORBIDDEN, "this exercise (allreduce_seconds)")
    cases = [
        (2.6e9, 1, 8, 450e9, 50e9), (2.6e9, 2, 8, 450e9, 50e9), (1e9, 4, 4, 300e9, 25e9),
        (7e8, 64, 8, 450e9, 100e9), (4e6, 3, 2, 100e9, 50e9),
    ]  # fmt: skip
    import random

    rnd = random.Random(draw_seed())  # and three clusters drawn afresh every grade run
    cases += [(round(10 ** rnd.uniform(5, 10)), rnd.randint(1, 128), rnd.choice((1, 2, 4, 8, 16)),
               rnd.choice((100e9, 300e9, 450e9, 900e9)), rnd.choice((12.5e9, 25e9, 50e9, 100e9))) for _ in range(3)]  # fmt: skip
    for nbytes, n, g, intra, inter in cases:
        for hierarchical in (False, True):
            got = float(fn(nbytes, n, g, intra, inter, hierarchical))
            want = reference(nbytes, n, g, intra, inter, 0.0, hierarchical)
            what = (f"{nbytes:.3g} B over {n} node(s) x {g} GPUs, {intra / 1e9:g} GB/s inside, {inter / 1e9:g} GB/s "
                    f"across, {'hierarchical' if hierarchical else 'flat ring'}")  # fmt: skip
            if not math.isclose(got, want, rel_tol=1e-6):
                hint = ""
                if n == 1:
                    hint = "on one node every step is inside the node"
                elif not hierarchical:
                    hint = "a ring over every GPU waits at each step for its slowest link"
                else:
                    hint = "inside the node: a reduce-scatter and an all-gather; across: each GPU's 1/g shard"
                raise AssertionError(f"{what}: {got:.6g} s, expected {want:.6g} s ({hint})")
    passed("check_multinode_all_reduce", f"{2 * len(cases)} layouts, flat and hierarchical")

"""ZeRO: data parallelism without N copies of the model states.

Lesson 04. Rajbhandari, Rasley, Ruwase & He 2020 ("ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models"): stage 1 shards the optimizer states over the N data-parallel
ranks, stage 2 the gradients too, stage 3 the parameters, gathered unit by unit just before
use and freed just after (1.5x the bytes of plain DP). The same sharding code runs on `meta`
tensors to count a 7B model's bytes per rank exactly. Beside it: FSDP2 (`fully_shard`) in
the tests and the benchmark.

Read in this order:
  layout.py     where every byte lives: the flat buffer, units, per-rank shards
  comm.py       collectives over uneven pieces; the stage 2/3 gradient reducer
  optimizer.py  stages 0-2 (ZeroOptimizer) and the step every stage shares (ZeroBase)
  stage3.py     stage 3: gather before use, free after, prefetch the next unit
  meta.py       the paper's formula, its padding, and a 7B model counted on `meta`
  plots.py      lesson 04's pictures
  accumulation.py  (lesson 18) ZeRO-1 against ZeRO-2 under gradient accumulation: bytes per step
  hsdp.py       (lesson 20) HSDP: ZeRO-3 inside a group of neighbours, replicated across groups
  per_param.py  (lesson 20) every parameter cut on its dim 0 (FSDP2's layout) instead of one flat buffer

`ZeRO(ctx, model, stage=...)` builds the right one.
"""

from parallel_lab.zero.accumulation import *  # noqa: F403
from parallel_lab.zero.comm import *  # noqa: F403
from parallel_lab.zero.hsdp import *  # noqa: F403
from parallel_lab.zero.layout import *  # noqa: F403
from parallel_lab.zero.meta import *  # noqa: F403
from parallel_lab.zero.optimizer import *  # noqa: F403
from parallel_lab.zero.per_param import *  # noqa: F403
from parallel_lab.zero.plots import *  # noqa: F403
from parallel_lab.zero.stage3 import *  # noqa: F403


def ZeRO(ctx, model, stage: int = 1, **kwargs):  # noqa: N802 - the paper's name
    """`ZeroOptimizer` for stages 0-2, `Zero3` for stage 3 (same keyword arguments)."""
    from parallel_lab.zero.layout import check_stage
    from parallel_lab.zero.optimizer import ZeroOptimizer
    from parallel_lab.zero.stage3 import Zero3

    if check_stage(stage) == 3:
        return Zero3(ctx, model, **kwargs)
    return ZeroOptimizer(ctx, model, stage=stage, **kwargs)

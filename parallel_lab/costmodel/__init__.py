"""Predictions before measurements: memory, FLOPs, bytes, bubbles, and a 3D planner.

Every lesson predicts, then measures. Formulas from ZeRO (Rajbhandari et al. 2020: 16 bytes
per parameter under mixed-precision Adam, and its sharding by stage), Megatron-LM's activation
estimate sbh(34 + 5as/h) (Korthikanti et al. 2022), the ring all-reduce's 2(p-1)/p * S,
the pipeline bubble (p-1)/(v*m + p-1) (Huang et al. 2019; Narayanan et al. 2021), training
FLOPs 6ND (Kaplan et al. 2020) and the roofline (Williams et al. 2009). Lesson 10's planner
combines them to rank (dp, tp, pp, ZeRO, checkpointing) layouts for a model on a cluster, with a
time model built from the GPU's physics (a roofline per GEMM, memory-bound traffic for the rest,
collectives on the node's links with the overlap real systems get), checked against published runs.

Read in this order:
  formulas.py  pure arithmetic: one function per formula, each naming its source
  hardware.py  GPU presets (A100 40/80 GB, H100 SXM) and their nodes' links, each number sourced
  timing.py    seconds for one layer: GEMM rooflines, non-matmul traffic, collectives, overlap
  planner.py   memory per GPU and step time per layout, built on the three above
  published.py published large runs and the planner's prediction of each (its validation)
  serving.py   inference: 2N FLOPs per token, KV-cache bytes, a server's memory budget (lesson 14)
  context.py   context parallelism: ring and all-to-all attention bytes per layer (lesson 17)
  moe.py       MoE at scale: all-to-all bytes flat vs node-limited two-hop, memory per GPU, DeepSeek-V3 (lesson 21)
"""

from parallel_lab.costmodel.context import *  # noqa: F403
from parallel_lab.costmodel.formulas import *  # noqa: F403
from parallel_lab.costmodel.hardware import *  # noqa: F403
from parallel_lab.costmodel.moe import *  # noqa: F403
from parallel_lab.costmodel.planner import *  # noqa: F403
from parallel_lab.costmodel.published import *  # noqa: F403
from parallel_lab.costmodel.serving import *  # noqa: F403
from parallel_lab.costmodel.timing import *  # noqa: F403

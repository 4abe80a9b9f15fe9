"""parallel_lab: distributed-training techniques from scratch, run live, measured and explained.

`import parallel_lab as pl` gives the runtime (`pl.launch`, `pl.RunResult`, ...) at once;
each technique's entry point is also reachable from here (`pl.BucketedDDP`, `pl.LossScaler`,
...), its family imported only on first use, so `import parallel_lab` stays light.

One folder per technique family, each `__init__` saying what it teaches, the papers and
the order to read its files. Dependencies point one way:
runtime <- comms <- techniques <- lessons; `plots` reads the runtime's records.

  runtime/          launch, context, torchrun/accelerate entry, result, trace, memory tracker
  comms/            collectives from scratch on send/recv; traced built-ins; byte formulas
  plots/            timeline, memory, bars, live view
  costmodel/        formulas (memory, FLOPs, bytes, bubbles) and the 3D planner
  data_parallel/    parameter server, all-reduce DP, bucketed DDP            (lesson 03)
  zero/             ZeRO stages 1-3, sizes on `meta`                         (lesson 04)
  offload/          optimizer offload, weight streaming                      (lesson 05)
  precision/        formats, loss scaling, mixed precision                   (lesson 06)
  checkpointing/    recomputation and its measurement                        (lesson 07)
  tensor_parallel/  f/g, column/row splits, attention by heads, sequence par. (lesson 08)
  pipeline/         schedules as instruction lists, simulator, executor      (lesson 09)
  three_d/          DP x TP x PP mesh and run                                (lesson 10)
  moe/              routers, capacity, expert parallel                       (lesson 11)
  quantization/     INT8 kernels, outliers, quantized inference              (lesson 12)
  resilience/       checkpoints, restart, elastic resume, faulty ranks       (lesson 13)
  inference/        KV cache, paging, continuous batching, TP/PP serving     (lesson 14)
  compression/      distillation, pruning, QAT, sharing, low rank            (lesson 15)
  grading/          exercise checks and the grade command
  models.py         tiny MLP and GPT, synthetic data, the single-process reference trainer
  scripts/          one entry per technique for torchrun / accelerate launch
"""

import importlib

from parallel_lab.runtime.context import Context, LaunchTimeout, RankError
from parallel_lab.runtime.from_env import run_from_env
from parallel_lab.runtime.launch import launch
from parallel_lab.runtime.result import RunResult
from parallel_lab.runtime.trace import Recorder

# entry point -> family that defines it (names from the literature)
_TECHNIQUES = {
    "ring_all_reduce": "comms",
    "ring_reduce_scatter": "comms",
    "ring_all_gather": "comms",
    "tree_broadcast": "comms",
    "tree_reduce": "comms",
    "all_to_all": "comms",
    "MemoryTracker": "runtime.memory",
    "model_state_bytes": "costmodel",
    "ParameterServerDP": "data_parallel",
    "AllReduceDP": "data_parallel",
    "BucketedDDP": "data_parallel",
    "ZeRO": "zero",
    "ZeroOptimizer": "zero",
    "Zero3": "zero",
    "ZeroOffload": "offload",
    "WeightStreamer": "offload",
    "ColumnParallelLinear": "tensor_parallel",
    "RowParallelLinear": "tensor_parallel",
    "schedule_gpipe": "pipeline",
    "schedule_1f1b": "pipeline",
    "schedule_interleaved_1f1b": "pipeline",
    "ParallelDims": "three_d",
    "plan": "costmodel",
    "LossScaler": "precision",
    "checkpoint_sequential": "checkpointing",
    "TopKRouter": "moe",
    "ExpertParallelMoE": "moe",
    "quantize_absmax": "quantization",
    "int8_matmul": "quantization",
    "KVCache": "inference",
    "PagedKVCache": "inference",
    "flash_attention": "inference",
    "distillation_loss": "compression",
    "magnitude_mask": "compression",
}


def __getattr__(name: str):
    if name in _TECHNIQUES:
        return getattr(importlib.import_module(f"parallel_lab.{_TECHNIQUES[name]}"), name)
    raise AttributeError(f"module 'parallel_lab' has no attribute {name!r}")


__all__ = [
    "Context",
    "LaunchTimeout",
    "RankError",
    "Recorder",
    "RunResult",
    "launch",
    "run_from_env",
    *_TECHNIQUES,
]
__version__ = "0.1.0"

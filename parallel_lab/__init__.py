"""parallel_lab: distributed-training techniques from scratch, run live, measured and explained.

The runtime (`launch`, `RunResult`, ...) is imported eagerly; each technique's entry
point is also reachable from here (`parallel_lab.LossScaler`, ...) but its module is
imported only on first use, so `import parallel_lab` stays light.
"""

import importlib

from .launch import Context, LaunchTimeout, RankError, launch, run_from_env
from .result import RunResult
from .trace import Recorder

# entry point -> module that defines it (names from the literature)
_TECHNIQUES = {
    "ring_all_reduce": "comms",
    "ring_reduce_scatter": "comms",
    "ring_all_gather": "comms",
    "tree_broadcast": "comms",
    "tree_reduce": "comms",
    "all_to_all": "comms",
    "MemoryTracker": "memory",
    "model_state_bytes": "costmodel",
    "ParameterServerDP": "data_parallel",
    "AllReduceDP": "data_parallel",
    "BucketedDDP": "ddp",
    "ZeRO": "zero",
    "ZeroOptimizer": "zero",
    "Zero3": "zero3",
    "ZeroOffload": "offload",
    "WeightStreamer": "offload_stream",
    "ColumnParallelLinear": "tp_layers",
    "RowParallelLinear": "tp_layers",
    "schedule_gpipe": "pipeline",
    "schedule_1f1b": "pipeline",
    "schedule_interleaved_1f1b": "pipeline",
    "ParallelDims": "parallel_dims",
    "plan": "planner",
    "LossScaler": "precision",
    "checkpoint_sequential": "checkpointing",
    "TopKRouter": "moe",
    "ExpertParallelMoE": "expert_parallel",
    "quantize_absmax": "quantization",
    "int8_matmul": "quantization",
}


def __getattr__(name: str):
    if name in _TECHNIQUES:
        return getattr(importlib.import_module(f".{_TECHNIQUES[name]}", __name__), name)
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

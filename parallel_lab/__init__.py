"""parallel_lab: distributed-training techniques from scratch, run live, measured and explained."""

from .launch import Context, LaunchTimeout, RankError, launch, run_from_env
from .result import RunResult
from .trace import Recorder

__all__ = ["Context", "LaunchTimeout", "RankError", "Recorder", "RunResult", "launch", "run_from_env"]
__version__ = "0.1.0"

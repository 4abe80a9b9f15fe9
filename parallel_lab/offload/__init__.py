"""Offload: when the device is too small, the host holds what the device cannot.

Lesson 05. ZeRO-Offload (Ren et al. 2021): fp16 parameters and gradients stay on the device,
the fp32 master weights and Adam states live in host memory and the host runs the optimizer;
per step 2Ψ bytes go down and 2Ψ come back. For inference, BMInf-style weight streaming
(Han et al. 2021): layers are copied in under a byte budget and evicted after use.

Read in this order:
  host_optimizer.py  ZeroOffload: the host pool and the optimizer step on the host
  streaming.py       WeightStreamer: layer-by-layer weights under a budget
"""

from parallel_lab.offload.host_optimizer import *  # noqa: F403
from parallel_lab.offload.streaming import *  # noqa: F403

"""3D parallelism: data x tensor x pipeline on one mesh of ranks.

Lesson 10. Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM"): tensor parallel inside a node (fastest links), pipeline across
nodes, data parallel over the rest; the rank order decides which groups share links.

Read in this order:
  ../runtime/parallel_dims.py  ParallelDims: the mesh and its process groups per axis (in the
                               runtime, since pipelines and every other family are handed it too)
  run.py                       a TinyGPT trained with DP x TP x PP, checked against one process
"""

from parallel_lab.runtime.parallel_dims import ParallelDims as ParallelDims
from parallel_lab.three_d.run import *  # noqa: F403

"""Data parallelism: the same model on every rank, each on its slice of the batch.

Lesson 03. Naive first: a parameter server (Li et al. 2014, "Scaling Distributed Machine
Learning with the Parameter Server") and an all-reduce of every gradient after backward;
then PyTorch DDP's design (Li et al. 2020, "PyTorch Distributed", VLDB): gradients grouped
into buckets in reverse order and all-reduced from gradient hooks while backward still runs,
plus gradient accumulation without communication until the last micro-batch.

Read in this order:
  naive.py  parameter server, all-reduce DP, accumulation, the helpers both share
  ddp.py    BucketedDDP: buckets, hooks, overlap (beside it: torch's DDP in the tests)
  compression.py  (lesson 18) communication hooks that send fewer bytes: fp16/bf16 casts,
                  PowerSGD (Vogels et al. 2019), top-k with and without error feedback;
                  here because each one is what a DDP does with a bucket of gradients
"""

from parallel_lab.data_parallel.compression import *  # noqa: F403
from parallel_lab.data_parallel.ddp import *  # noqa: F403
from parallel_lab.data_parallel.naive import *  # noqa: F403

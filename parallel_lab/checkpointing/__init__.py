"""Activation checkpointing: keep a few activations, recompute the rest in backward.

Lesson 07. Chen, Xu, Zhang & Guestrin 2016 ("Training Deep Nets with Sublinear Memory Cost"):
keep only segment inputs, redo each segment's forward during backward; about one extra
forward for O(sqrt(n)) memory. Korthikanti et al. 2022 for selective recomputation.

Read in this order:
  recompute.py  checkpoint and checkpoint_sequential from scratch (beside them:
                torch.utils.checkpoint in the tests)
  measure.py    counting what autograd saves, and predicting it
"""

from parallel_lab.checkpointing.measure import *  # noqa: F403
from parallel_lab.checkpointing.recompute import *  # noqa: F403

"""Model compression after (and during) training: distil, prune, quantize, share, factorize, search.

Lesson 15. Hinton et al. 2015 (distillation); Han et al. 2015 and Zhu & Gupta 2017 (magnitude
pruning and its schedule), Mishra et al. 2021 (2:4 sparsity); Jacob et al. 2018 (quantization-aware
training with a straight-through estimator); Lan et al. 2019 (ALBERT: cross-layer sharing and a
factorized embedding); Denton et al. 2014 (low-rank layers). Each is measured on one task, held-out
loss of a small language model, together with its size on disk and its CPU latency.

Read in this order:
  task.py     the task: a second-order token source, training, held-out loss, latency
  distillation.py  the distillation loss and a student trained on a teacher
  pruning.py  magnitude masks, the cubic schedule, 2:4 sparsity, prune-and-fine-tune
  qat.py      fake quantization with a straight-through estimator; post-training rounding
  sharing.py  ALBERT's shared blocks and factorized embedding
  lowrank.py  truncated SVD of weight matrices
  storage.py  what each compressed model weighs on disk, and reading it back
"""

from parallel_lab.compression.distillation import *  # noqa: F403
from parallel_lab.compression.lowrank import *  # noqa: F403
from parallel_lab.compression.pruning import *  # noqa: F403
from parallel_lab.compression.qat import *  # noqa: F403
from parallel_lab.compression.sharing import *  # noqa: F403
from parallel_lab.compression.storage import *  # noqa: F403
from parallel_lab.compression.task import *  # noqa: F403

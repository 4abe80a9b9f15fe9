"""Keeping a training run alive: checkpoints a crash cannot tear, restart, elastic resume.

Lesson 13. A job on n devices fails when any one does: 1 - (1 - p)^n grows fast with n, so at
scale failures are routine and what matters is how little work each one costs. Young 1974 and
Daly 2006 for the checkpoint interval; Mohan, Phanishayee & Chidambaram 2021 (CheckFreq) and
Wang et al. 2023 (Gemini) for checkpoints fast enough to take often; torch elastic
(torchrun --max-restarts) for restarting.

Read in this order:
  failures.py    failure arithmetic, the Young/Daly interval, goodput measured on a simulation
  sampler.py     a sampler whose position is saved: no sample lost or repeated after resume
  checkpoint.py  atomic files, a manifest written last, verification; RNG states
  reshard.py     an optimizer sharded over N ranks, read back on N'
  flash.py       flash checkpoint: a copy in shared memory, persisted by the agent in the background
  measure.py     how long each way of checkpointing blocks training
  train.py       ZeRO-1 training that checkpoints, resumes, and rolls back a loss spike
  elastic.py     restart after a failure, on the same ranks or fewer (torch elastic's policy)
  detect.py      heartbeats and stacks: who is stuck where; pairwise tests find a faulty rank
"""

from parallel_lab.resilience.checkpoint import *  # noqa: F403
from parallel_lab.resilience.detect import *  # noqa: F403
from parallel_lab.resilience.elastic import *  # noqa: F403
from parallel_lab.resilience.failures import *  # noqa: F403
from parallel_lab.resilience.flash import *  # noqa: F403
from parallel_lab.resilience.measure import *  # noqa: F403
from parallel_lab.resilience.reshard import *  # noqa: F403
from parallel_lab.resilience.sampler import *  # noqa: F403
from parallel_lab.resilience.train import *  # noqa: F403

"""Numeric formats and mixed-precision training.

Lesson 06. fp16 / bf16 / fp32 ranges and resolution (IEEE 754; Kalamkar et al. 2019 for
bf16); Micikevicius et al. 2018 ("Mixed Precision Training"): 16-bit compute, fp32 master
weights, and a loss scale that keeps small gradients from underflowing, adjusted dynamically
(the rule torch.amp.GradScaler follows), with the overflow flag agreed across ranks.

Read in this order:
  formats.py  the formats in numbers, and where small updates vanish
  mixed.py    LossScaler and MixedPrecisionOptimizer (beside them: torch.amp in the tests)
"""

from parallel_lab.precision.formats import *  # noqa: F403
from parallel_lab.precision.mixed import *  # noqa: F403

"""Numeric formats and mixed-precision training.

Lesson 06. fp16 / bf16 / fp32 ranges and resolution (IEEE 754; Kalamkar et al. 2019 for
bf16); Micikevicius et al. 2018 ("Mixed Precision Training"): 16-bit compute, fp32 master
weights, and a loss scale that keeps small gradients from underflowing, adjusted dynamically
(the rule torch.amp.GradScaler follows), with the overflow flag agreed across ranks.

Read in this order:
  formats.py  the formats in numbers, and where small updates vanish
  mixed.py    LossScaler and MixedPrecisionOptimizer (beside them: torch.amp in the tests)
  fp8.py         (lesson 18) E4M3 and E5M2 from their bit layout, saturating casts, current and
                 delayed scaling (Micikevicius et al. 2022, "FP8 Formats for Deep Learning")
  fp8_linear.py  (lesson 18) a linear layer whose matmuls run in fp8, simulated and with torch._scaled_mm
FP8 lives here because it is the same trade as lesson 06 one step further: fewer bits per number,
a scale to keep the numbers inside the format.
"""

from parallel_lab.precision.formats import *  # noqa: F403
from parallel_lab.precision.fp8 import *  # noqa: F403
from parallel_lab.precision.fp8_linear import *  # noqa: F403
from parallel_lab.precision.mixed import *  # noqa: F403

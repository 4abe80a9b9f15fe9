"""INT8 quantization: weights and activations in 8 bits, products accumulated in 32.

Lesson 12. Absmax and vector-wise scales (Jacob et al. 2018; Dettmers et al. 2022), int8
matmul with int32 accumulation, outlier features and the LLM.int8() decomposition (Dettmers
et al. 2022). Beside it: torch.ao quantization in the tests. Then int8 weights streamed for
big-model inference on a small device (BMInf, Han et al. 2021).

Read in this order:
  int8.py       absmax, int8 matmul, vector-wise scales, LLM.int8()
  inference.py  int8 weights streamed layer by layer
"""

from parallel_lab.quantization.inference import *  # noqa: F403
from parallel_lab.quantization.int8 import *  # noqa: F403

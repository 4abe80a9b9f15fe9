"""Tensor parallelism: one layer's matrices split across ranks (Megatron-LM).

Lesson 08. Shoeybi et al. 2019 ("Megatron-LM"): split the MLP's first matrix by columns and
the second by rows, so one all-reduce per layer in forward (operator g) and one in backward
(operator f); attention split by heads. Korthikanti et al. 2022: sequence parallelism splits
LayerNorm and dropout along the sequence, turning each all-reduce into a reduce-scatter plus
an all-gather of the same bytes. Beside it: DTensor tensor parallel in the tests and benchmark.

Read in this order:
  operators.py          the f and g operators and the matmul splits they come from
  layers.py             ColumnParallelLinear, RowParallelLinear, the Megatron MLP
  sequence_parallel.py  the sequence-split regions and their operators
  transformer.py        attention by heads, a block, a whole tensor-parallel TinyGPT
"""

from parallel_lab.tensor_parallel.layers import *  # noqa: F403
from parallel_lab.tensor_parallel.operators import *  # noqa: F403
from parallel_lab.tensor_parallel.sequence_parallel import *  # noqa: F403
from parallel_lab.tensor_parallel.transformer import *  # noqa: F403

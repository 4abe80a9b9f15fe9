"""Pipeline parallelism: layers split into stages, micro-batches flowing through them.

Lesson 09. Schedules as instruction lists per rank: GPipe (Huang et al. 2019: all forwards,
then all backwards; bubble (p-1)/(m+p-1)), 1F1B (Narayanan et al. 2019, PipeDream-Flush:
the same bubble, at most p micro-batches in flight) and interleaved 1F1B (Narayanan et al.
2021: v chunks per rank, bubble (p-1)/(v*m+p-1)). The same lists are validated, simulated,
drawn and executed. Beside it: torch.distributed.pipelining in the tests.

Lesson 19: the backward split into B (input gradient) and W (weight gradients), and the
zero-bubble ZB-H1 / ZB-H2 (Qi et al. 2024): validated, simulated (the paper's bubble rate beside
the idle share) and run by the executor on real ranks (`executor.SplitBackward`: B
back-propagates to the stage's input only, W later adds the weight gradients, bit for bit
those of the unsplit backward), so configs and scripts take them (`SCHEDULES`). ZB-V (the paper's section 6) and DualPipeV
(DeepSeek-AI's DualPipe cut in half) put two chunks per rank in a V (rank r holds stages r and
2p-1-r: `simulator.PLACEMENTS`), the placement threaded through validator, simulator and executor.

Read in this order:
  simulator.py  the instruction set (Step), the validator, the simulator
  schedules.py  naive, GPipe, 1F1B, interleaved 1F1B as instruction lists
  zero_bubble.py  B split from W; ZB-H1 and ZB-H2, compared with torch's zero-bubble schedule
  v_shape.py    two chunks per rank in a V: ZB-V and DualPipeV, rank by rank torch's orders
  stages.py     a model cut into p * v virtual stages
  executor.py   the instruction lists run on real ranks (optionally inside DP x PP)
  viz.py        drawing schedules; comparing with torch's
"""

from parallel_lab.pipeline.executor import *  # noqa: F403
from parallel_lab.pipeline.schedules import *  # noqa: F403
from parallel_lab.pipeline.simulator import *  # noqa: F403
from parallel_lab.pipeline.stages import *  # noqa: F403
from parallel_lab.pipeline.v_shape import *  # noqa: F403
from parallel_lab.pipeline.viz import *  # noqa: F403
from parallel_lab.pipeline.zero_bubble import *  # noqa: F403

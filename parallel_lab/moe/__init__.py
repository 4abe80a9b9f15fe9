"""Mixture of Experts: many experts, each token sent to a few of them.

Lesson 11. Shazeer et al. 2017 (top-k gating), GShard (Lepikhin et al. 2020: capacity,
expert parallel over all-to-all), Switch Transformer (Fedus et al. 2021: top-1, capacity
factor, load-balancing loss), Expert Choice (Zhou et al. 2022), batch-priority routing
(Riquelme et al. 2021).

Read in this order:
  routing.py          routers, capacity and drops, the aux loss, one MoE layer
  expert_parallel.py  experts spread over ranks, tokens moved by two all-to-alls
  fine_grained.py     (lesson 21) many small routed experts and shared ones (DeepSeekMoE)
  balancing.py        (lesson 21) balancing without an auxiliary loss: a per-expert bias on the scores
  serving.py          (lesson 21) expert-parallel inference with replicated experts
  placement.py        (lesson 21) redundant experts: hot experts replicated, replicas packed onto GPUs (EPLB)
  race.py             (lesson 21) the balancing race: none / aux loss / bias on one TinyGPT-MoE
  dispatch.py         (lesson 21) node-aware dispatch: a token crosses the network once per node it needs
"""

from parallel_lab.moe.balancing import *  # noqa: F403
from parallel_lab.moe.dispatch import *  # noqa: F403
from parallel_lab.moe.expert_parallel import *  # noqa: F403
from parallel_lab.moe.fine_grained import *  # noqa: F403
from parallel_lab.moe.placement import *  # noqa: F403
from parallel_lab.moe.race import *  # noqa: F403
from parallel_lab.moe.routing import *  # noqa: F403
from parallel_lab.moe.serving import *  # noqa: F403

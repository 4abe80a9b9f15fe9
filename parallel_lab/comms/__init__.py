"""Collectives: the eight operations, written from scratch on send/recv, traced and counted.

Lesson 01. Every technique talks through this package, so each message is on the timeline
and its bytes are counted. Ring all-reduce = reduce-scatter + all-gather, 2(p-1)/p * S bytes
per rank (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005 for the MPICH algorithms);
binomial trees for broadcast and reduce; all-to-all as p-1 exchanges.

Read in this order:
  core.py     the traced-op plumbing every collective shares (argument checks, spans, bytes)
  p2p.py      send, recv, sendrecv, isend, irecv: the only primitives the algorithms use
  ring.py     naive, ring and pipelined-ring all-reduce, reduce-scatter, all-gather, all-to-all
  tree.py     binomial-tree broadcast, reduce, all-reduce
  builtin.py  the torch.distributed built-ins, traced, as the baseline and for production use
  cost.py     the byte and alpha-beta time formulas the counters must equal
"""

from parallel_lab.comms.builtin import *  # noqa: F403
from parallel_lab.comms.core import *  # noqa: F403
from parallel_lab.comms.cost import *  # noqa: F403
from parallel_lab.comms.p2p import *  # noqa: F403
from parallel_lab.comms.ring import *  # noqa: F403
from parallel_lab.comms.tree import *  # noqa: F403

"""Context parallelism: splitting the sequence inside attention over ranks.

Lesson 17. Data parallelism splits the batch, tensor parallelism the weights, pipelines the
layers, expert parallelism the experts; none of them splits the sequence inside attention, so
the activations of attention grow with the sequence on every rank. Context parallelism gives
each rank T/N tokens everywhere, attention included:
- ring attention (Liu, Zaharia & Abbeel 2023): queries stay, key/value blocks travel around a
  ring, partial results are merged with the online softmax (the same merge as FlashAttention's
  tiles, Dao et al. 2022, shared with lesson 14's `inference.attention`);
- the zigzag layout balances a causal mask's work (each rank holds chunks i and 2N-1-i; Llama 3,
  Dubey et al. 2024, balances its context parallelism the same way);
- all-to-all sequence parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses): switch from a
  sequence split to a head split for attention and back, capped at the number of heads.

Read in this order:
  layout.py   shard_sequence / unshard_sequence, contiguous and zigzag, positions, causal work
  inputs.py   the agreement check both attentions run first (every rank raises the same error)
  ring.py     ring attention, forward and backward, with the transfer overlapping the compute
  ulysses.py  all-to-all attention
  train.py    a TinyGPT on a DP x CP mesh, checked against one process
and ../costmodel/context.py for the bytes each sends.
"""

from parallel_lab.context_parallel.layout import *  # noqa: F403
from parallel_lab.context_parallel.ring import *  # noqa: F403
from parallel_lab.context_parallel.train import *  # noqa: F403
from parallel_lab.context_parallel.ulysses import *  # noqa: F403

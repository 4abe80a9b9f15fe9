"""Serving a trained model: the KV cache, its pages, continuous batching, TP and PP serving, tiled attention.

Lesson 14. Generation costs about 2N FLOPs per token (Kaplan et al. 2020) but reads every weight
for every step, so at small batch a decode step is bound by memory bandwidth, not arithmetic
(Pope et al. 2022). The memory that grows is the KV cache; grouped-query attention (Ainslie et al.
2023) shrinks it, paging (Kwon et al. 2023, vLLM's PagedAttention) stops it from being wasted,
continuous batching (Yu et al. 2022, Orca) keeps the batch full. Tensor parallelism (Shoeybi et al.
2019) splits the cache by heads and all-reduces twice per layer per token; pipeline parallelism
keeps each stage's cache local and sends only activations. FlashAttention (Dao et al. 2022) never
builds the N x N score matrix.

Read in this order:
  attention.py  causal attention with a cache offset; naive vs tiled online-softmax attention
  kv_cache.py   the cache interface, NoCache (the reference) and a growing KVCache
  model.py      ServingGPT (TinyGPT with q/kv projections, grouped-query heads) and greedy generate
  paged.py      a block pool, block tables, and the fragmentation they avoid
  batching.py   static and continuous batching on the paged cache
  parallel.py   tensor-parallel (cache split by heads) and pipeline-parallel (cache per stage) serving
  roofline.py   a measured decode step against the machine's roofline
"""

from parallel_lab.inference.attention import *  # noqa: F403
from parallel_lab.inference.batching import *  # noqa: F403
from parallel_lab.inference.kv_cache import *  # noqa: F403
from parallel_lab.inference.model import *  # noqa: F403
from parallel_lab.inference.paged import *  # noqa: F403
from parallel_lab.inference.parallel import *  # noqa: F403
from parallel_lab.inference.roofline import *  # noqa: F403

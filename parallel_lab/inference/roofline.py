"""A decode step measured against the machine's roofline: why small-batch generation waits on memory.

Williams, Waterman & Patterson 2009 (the roofline): a kernel's time is at least
max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth). A decode step multiplies every weight
matrix by a (batch x hidden) block: 2 · params · batch FLOPs against params · itemsize bytes read,
an arithmetic intensity of batch FLOPs per 4-byte weight in fp32. At batch 1 that is far below any
processor's ratio of FLOP/s to bytes/s, so the step takes as long as reading the weights, and a
larger batch is nearly free until the intensity reaches the ridge point (Pope et al. 2022 make the
same argument for TPU serving).

`measure_machine` measures both ceilings on this machine (a large matmul, a large copy) in the same
run; `decode_step_seconds` times one decode step; `decode_roofline` predicts it.

Invariant: the prediction uses only the measured ceilings and exact FLOP and byte counts of the
model; nothing is fitted to the decode timings.
"""

from __future__ import annotations

import time

import torch

from parallel_lab.costmodel import kv_cache_bytes
from parallel_lab.inference.kv_cache import KVCache
from parallel_lab.inference.model import ServingGPT

__all__ = ["decode_roofline", "decode_step_seconds", "measure_machine", "serving_params"]


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy initialisation are not the steady state
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(matmul: int = 1024, copy_mb: int = 256, repeats: int = 5) -> dict[str, float]:
    """{'flops': FLOP/s of an fp32 (n x n) @ (n x n), 'bandwidth': bytes/s of a large copy (read + write)}."""
    a, b = torch.randn(matmul, matmul), torch.randn(matmul, matmul)
    t_mm = _best(lambda: a @ b, repeats)
    src = torch.ones(copy_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    t_cp = _best(lambda: dst.copy_(src), repeats)
    return {"flops": 2 * matmul**3 / t_mm, "bandwidth": 2 * src.numel() * 4 / t_cp}


def serving_params(model: ServingGPT) -> int:
    """Parameters a decode step reads (the tied embedding/head counted once)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def decode_step_seconds(model: ServingGPT, batch: int, context: int = 16, repeats: int = 5) -> float:
    """Best time of one decode step (one new token for each of `batch` sequences) after a prompt of
    `context` tokens has been cached."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(model.cfg.vocab, (batch, context), generator=g)
    cache = KVCache()
    model(prompt, cache)
    token = prompt[:, -1:]  # (B, 1)

    def step() -> None:
        model(token, cache)
        # undo the step so every repeat decodes at the same position
        cache.k = [k[:, :, :context] for k in cache.k]
        cache.v = [v[:, :, :context] for v in cache.v]
        cache.length = context

    return _best(step, repeats)


def decode_roofline(
    model: ServingGPT, batch: int, context: int, machine: dict[str, float]
) -> dict[str, float]:
    """Predicted seconds of a decode step: FLOPs (2 · params · batch, plus attention) at the measured
    peak, bytes (weights once, the KV cache of every sequence) at the measured bandwidth; the larger wins."""
    cfg = model.cfg
    n, itemsize = serving_params(model), model.wte.weight.element_size()
    attn_flops = 4 * batch * context * cfg.d_model * cfg.n_layers  # q.k and p.v over the cached tokens
    flops = 2 * n * batch + attn_flops
    cache = kv_cache_bytes(cfg.n_layers, model.kv_heads, model.head_dim, context, batch, itemsize)
    nbytes = n * itemsize + cache
    t_compute, t_memory = flops / machine["flops"], nbytes / machine["bandwidth"]
    return {"flops": flops, "bytes": nbytes, "compute_s": t_compute, "memory_s": t_memory,
            "seconds": max(t_compute, t_memory)}  # fmt: skip

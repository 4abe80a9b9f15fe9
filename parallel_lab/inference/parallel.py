"""Serving on several ranks: tensor parallel (the cache split by heads) and pipeline parallel (by layers).

Tensor parallel (Shoeybi et al. 2019, Megatron-LM; lesson 08's layers): q and kv projections by
columns, so each rank owns n_heads/tp query heads and kv_heads/tp key/value heads and caches only
those: the KV cache is split evenly. The output projection and the MLP's second matrix are split
by rows, and their partial sums are all-reduced: 2 all-reduces of (B, t, C) per layer per forward,
for every generated token. Latency per token falls (each rank reads 1/tp of the weights), at the
price of the most communication of any layout.

Pipeline parallel (Huang et al. 2019, GPipe; Pope et al. 2022 section 3 for inference): each stage
holds a contiguous range of layers and their KV cache, which never leaves the stage. Only the
activations (B, t, C) cross a stage boundary, and the chosen token goes back from the last stage
to the first. A batch split into micro-batches fills the pipeline: stage 1 decodes micro-batch 0
while stage 0 starts micro-batch 1. Throughput rises; the latency of one token does not fall.

Invariant: `tp_generate` and `pp_generate` return exactly the tokens of `model.generate` in one
process (tests), and the bytes each rank sends equal `tp_serving_bytes` / `pp_serving_bytes`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from parallel_lab import comms
from parallel_lab.comms import ring_bytes_per_rank
from parallel_lab.inference.kv_cache import KVCache
from parallel_lab.inference.model import ServingBlock, ServingGPT
from parallel_lab.pipeline import SendReaper, split_layers
from parallel_lab.runtime import device as mesh
from parallel_lab.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    check_divisible,
    tp_size_rank,
)

__all__ = ["pp_generate", "pp_serving_bytes", "shard_for_tp", "tp_generate", "tp_serving_bytes"]


def _check_request(model: ServingGPT, prompt: torch.Tensor, new_tokens: int) -> None:
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive int, got {new_tokens!r}")
    if prompt.dim() != 2 or prompt.shape[1] + new_tokens > model.cfg.seq_len:
        raise ValueError(
            f"prompt {tuple(prompt.shape)} must be (batch, tokens) with tokens + new_tokens ({new_tokens}) "
            f"<= GPTConfig.seq_len ({model.cfg.seq_len})"
        )


# ----------------------------------------------------------------------------- tensor parallel
def shard_for_tp(ctx, model: ServingGPT, group: Any = None, impl: str = "ring") -> ServingGPT:
    """This rank's share of `model`: its query and key/value heads, its slice of every MLP."""
    tp, _ = tp_size_rank(ctx, group)
    nh, kvh = model.cfg.n_heads, model.kv_heads
    check_divisible("n_heads", nh, tp)
    check_divisible("kv_heads", kvh, tp)
    base = copy.deepcopy(model).to(ctx.device)  # embeddings, LayerNorms and the tied head stay whole
    blocks = []
    for b in base.blocks:
        q = ColumnParallelLinear.from_linear(ctx, b.q, group, impl=impl)  # (C -> C/tp): whole heads
        kv = ColumnParallelLinear.from_linear(
            ctx, b.kv, group, partitions=2, impl=impl
        )  # this rank's k and v heads
        proj = RowParallelLinear.from_linear(ctx, b.proj, group, impl=impl)  # partial sums, all-reduced (g)
        mlp = ParallelMLP.from_mlp(ctx, b.mlp, group, impl=impl)
        blocks.append(ServingBlock(b.ln1, q, kv, proj, b.ln2, mlp, nh // tp, kvh // tp, b.head_dim))
    return ServingGPT(model.cfg, base.wte, base.wpe, blocks, base.ln_f, base.lm_head, kvh // tp)


@torch.no_grad()
def tp_generate(ctx, model: ServingGPT, prompt: torch.Tensor, new_tokens: int, group: Any = None,
                impl: str = "ring") -> dict:  # fmt: skip
    """Greedy generation with `model` split over the TP group. Every rank returns the same tokens,
    plus its cache bytes, the bytes it sent, and the seconds of each decode step."""
    _check_request(model, prompt, new_tokens)
    local = shard_for_tp(ctx, model, group, impl)
    cache = KVCache()
    seq = prompt.to(ctx.device)
    feed, step_s = seq, []
    sent0 = ctx.recorder.comm_totals()["sent"]
    for i in range(new_tokens):
        watch = mesh.Stopwatch(
            ctx.device
        )  # the step's device time (a host clock sees only launches on a GPU)
        with watch(), ctx.span("prefill" if i == 0 else "decode"):
            logits = local(feed, cache)  # (B, t, V): every rank has the whole logits (the head is replicated)
            nxt = logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1), the same on every rank
        step_s.append(watch)
        seq, feed = torch.cat([seq, nxt], dim=1), nxt
    return {
        "tokens": seq.cpu(),
        "cache_bytes": cache.nbytes(),
        "sent": ctx.recorder.comm_totals()["sent"] - sent0,
        "step_seconds": [w.seconds for w in step_s],  # read at the end: no sync inside the loop
    }


def tp_serving_bytes(batch: int, prompt_len: int, new_tokens: int, d_model: int, layers: int, tp: int,
                     itemsize: int = 4) -> list[int]:  # fmt: skip
    """Bytes each TP rank sends to generate `new_tokens`: per forward (the prompt, then one token at a
    time) 2 ring all-reduces of (batch, t, d_model) per layer, each 2(tp-1)/tp of the tensor."""
    total = [0] * tp
    for t in [prompt_len] + [1] * (new_tokens - 1):
        for r, (s, _) in enumerate(ring_bytes_per_rank(batch * t * d_model, tp, itemsize, "all_reduce")):
            total[r] += 2 * layers * s
    return total


# ----------------------------------------------------------------------------- pipeline parallel
@torch.no_grad()
def pp_generate(ctx, model: ServingGPT, prompt: torch.Tensor, new_tokens: int, microbatches: int = 1) -> dict:
    """Greedy generation with the layers split over the ranks (one stage each) and the batch split
    into `microbatches`. The last rank returns the tokens; every rank its cache bytes and bytes sent.

    Messages go out as the pipeline executor posts them: every forward of a micro-batch gets a time
    on a clock all stages share (`pp_clock`), and a stage posts, per time, one batch of its sends made
    then and its receives of what is sent to it then. Under NCCL a send completes only once its
    receive is posted; with 2+ micro-batches, sends posted one by one would deadlock (the last
    stage sending token k while the first sends micro-batch k+1's activations, each waiting for
    the other's receive: `comms.check_blocking_sends`)."""
    _check_request(model, prompt, new_tokens)
    p, r = ctx.world_size, ctx.rank
    check_divisible("batch", prompt.shape[0], microbatches, f"microbatches ({microbatches})")
    mine = split_layers(len(model.blocks), p)[r]  # raises unless the stages divide the layers
    stage = copy.deepcopy(model).to(ctx.device)
    blocks = [stage.blocks[i] for i in mine]
    first, last = r == 0, r == p - 1
    mbs = list(prompt.to(ctx.device).chunk(microbatches))  # each (B/m, T0)
    caches = [KVCache() for _ in mbs]  # this stage's layers only: the cache never leaves the stage
    out: list[list[torch.Tensor]] = [[mb] for mb in mbs]
    reaper = SendReaper(ctx.device)  # each send is waited for on a thread: its span ends when delivered
    local_token: dict[int, torch.Tensor] = {}  # one rank holding every stage: the token stays here
    sent0 = ctx.recorder.comm_totals()["sent"]
    bm, C, T0 = mbs[0].shape[0], model.cfg.d_model, prompt.shape[1]
    start, plan = pp_clock(p, new_tokens, microbatches)
    plan = list(plan[r])  # [(time, [(kind, step, mb, peer)])], this stage's batches in order
    box: dict[tuple, torch.Tensor] = {}  # (step, mb) -> what this stage sends after that forward
    posted: dict[tuple, comms.Handle] = {}  # (step, mb) -> the receive of that forward's input

    def post_until(limit: float) -> None:
        while plan and plan[0][0] <= limit:
            sends, recvs, keys = [], [], []
            for kind, step, m, peer in plan.pop(0)[1]:
                if kind == "send":
                    sends.append((box.pop((step, m)), peer, 0))
                elif peer == p - 1 and first:  # the token chosen at step-1 comes back
                    recvs.append((torch.empty(bm, 1, dtype=torch.long, device=ctx.device), peer, 0))
                    keys.append((step, m))
                else:
                    t = T0 if step == 0 else 1
                    recvs.append(
                        (torch.empty(bm, t, C, dtype=stage.wte.weight.dtype, device=ctx.device), peer, 0)
                    )
                    keys.append((step, m))
            sh, rh = comms.post_batch(ctx, sends, recvs)
            for h in sh:
                reaper.add(h)
            posted.update(zip(keys, rh))

    for step in range(new_tokens):
        t = T0 if step == 0 else 1
        for m in range(microbatches):
            post_until(start[r][step, m])
            with ctx.span(f"{'prefill' if step == 0 else 'decode'} mb{m}"):
                if first:
                    if step == 0:
                        idx = mbs[m]
                    elif p == 1:
                        idx = local_token.pop(m)
                    else:
                        idx = posted.pop((step, m)).wait()  # (B/m, 1)
                    x = stage.embed(idx, caches[m])  # (B/m, t, C)
                else:
                    x = posted.pop((step, m)).wait()  # (B/m, t, C)
                for i, block in enumerate(blocks):
                    x = block(x, caches[m], i)  # (B/m, t, C)
                caches[m].advance(t)
                if last:
                    nxt = stage.head(x)[:, -1].argmax(dim=-1, keepdim=True)  # (B/m, 1)
                    out[m].append(nxt)
                    if step < new_tokens - 1:
                        if p == 1:
                            local_token[m] = nxt
                        else:
                            box[step, m] = nxt  # back to the first stage
                else:
                    box[step, m] = x.contiguous()
    post_until(float("inf"))
    reaper.join()
    return {
        "tokens": torch.cat([torch.cat(o, dim=1) for o in out]).cpu() if last else None,
        "cache_bytes": sum(c.nbytes() for c in caches),
        "sent": ctx.recorder.comm_totals()["sent"] - sent0,
    }


def pp_clock(stages: int, new_tokens: int, microbatches: int) -> tuple[list[dict], list[list]]:
    """The clock `pp_generate` posts by: each stage runs forward (step, mb) in order, one unit of time
    each, once its input is there (the first stage's input at step s is the token the last stage chose
    at step s-1). Returns per stage {(step, mb): start} and its batches [(time, [(kind, step, mb, peer)])]:
    a message is posted by both ends in the batch of the time it is sent, so no batch waits on one that
    is posted later (the argument of `pipeline.simulator.p2p_batches`). Keys name the forward whose
    input a receive brings, and the forward whose output a send carries."""
    p = stages
    start: list[dict] = [{} for _ in range(p)]
    end: list[dict] = [{} for _ in range(p)]
    free = [0] * p
    for s in range(new_tokens):
        for m in range(microbatches):
            for r in range(p):
                ready = 0 if r == 0 and s == 0 else (end[r - 1][s, m] if r > 0 else end[p - 1][s - 1, m])
                start[r][s, m] = max(free[r], ready)
                end[r][s, m] = free[r] = start[r][s, m] + 1
    batches: list[dict] = [{} for _ in range(p)]
    if p > 1:
        for s in range(new_tokens):
            for m in range(microbatches):
                for r in range(p):
                    if r < p - 1:  # activations to the next stage, needed by its forward (s, m)
                        batches[r].setdefault(end[r][s, m], []).append(("send", s, m, r + 1))
                        batches[r + 1].setdefault(end[r][s, m], []).append(("recv", s, m, r))
                    elif s < new_tokens - 1:  # the token, needed by the first stage's forward (s+1, m)
                        batches[r].setdefault(end[r][s, m], []).append(("send", s, m, 0))
                        batches[0].setdefault(end[r][s, m], []).append(("recv", s + 1, m, r))
    return start, [sorted(b.items()) for b in batches]


def pp_serving_bytes(batch: int, prompt_len: int, new_tokens: int, d_model: int, stages: int,
                     itemsize: int = 4) -> list[int]:  # fmt: skip
    """Bytes each stage sends: every stage but the last sends its activations (batch, t, d_model) once
    per forward; the last sends the chosen token ids (int64) back for every step but the last."""
    acts = sum(batch * t * d_model * itemsize for t in [prompt_len] + [1] * (new_tokens - 1))
    tokens = batch * 8 * (new_tokens - 1) if stages > 1 else 0
    return [acts] * (stages - 1) + [tokens]

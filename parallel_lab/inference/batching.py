"""Static and continuous batching on the paged cache.

Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based Generative Models":
schedule per iteration, not per request. A static batch starts together and ends with its
longest member, so rows that finished early sit idle and new requests wait for the whole batch.
Continuous (iteration-level) batching lets a finished sequence leave after any step and a waiting
one join in its place, as long as the KV pool has blocks for it (Kwon et al. 2023 pair it with
paging, so joining costs only the blocks the newcomer fills).

Each scheduler step: admit waiting requests (their prompts run through the model: prefill, which
also gives their first token), then one decode step for every other running sequence, then retire
those that reached their length and free their blocks.

Invariant: every request gets exactly the tokens that `generate` gives it alone (test), whatever
the policy and whoever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallel_lab.inference.paged import PagedKVCache

__all__ = ["Request", "ServeStep", "serve"]


@dataclass
class Request:
    """A prompt (1-D token ids) and how many tokens to generate for it."""

    prompt: torch.Tensor
    max_new: int
    out: list[int] = field(default_factory=list)


@dataclass
class ServeStep:
    """What one scheduler step did."""

    running: int  # sequences in the batch during the step
    tokens: int  # tokens produced (one per running sequence)
    joined: int
    left: int
    blocks: int  # blocks held after the step
    bytes_in_use: int
    bytes_filled: int


@torch.no_grad()
def serve(model, requests: list[Request], cache: PagedKVCache, max_batch: int = 4,
          policy: str = "continuous") -> list[ServeStep]:  # fmt: skip
    """Generate every request greedily; `requests[i].out` gets its tokens. Returns the steps.

    policy "continuous": a request joins whenever a row and the blocks it needs are free;
    "static": a new batch starts only when the previous one has finished entirely.
    """
    if policy not in ("continuous", "static"):
        raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
    for i, r in enumerate(requests):
        r.out = []
        if r.prompt.numel() + r.max_new > model.cfg.seq_len + 1:
            raise ValueError(
                f"request {i}: prompt + max_new exceeds the model's context ({model.cfg.seq_len})"
            )
    waiting = list(range(len(requests)))
    running: list[int] = []
    last: dict[int, int] = {}  # request -> its newest token (the next decode input)
    # the prompt and every generated token but the last are cached
    worst = [cache.blocks_needed(None, r.prompt.numel() + r.max_new - 1) for r in requests]
    if max(worst, default=0) > cache.allocator.num_blocks:
        raise ValueError(f"a request needs {max(worst)} blocks, the pool has {cache.allocator.num_blocks}")
    steps: list[ServeStep] = []
    while waiting or running:
        joined: list[int] = []
        if policy == "continuous" or not running:
            # admit only what can finish: the blocks a request may reach are promised to it (they are
            # still taken one by one as it grows, so the memory in use is what its tokens fill)
            promised = sum(worst[i] for i in running)
            while waiting and len(running) + len(joined) < max_batch:
                i = waiting[0]
                if promised + worst[i] > cache.allocator.num_blocks:
                    break
                promised += worst[i]
                joined.append(waiting.pop(0))
        decoders = list(running)
        produced = 0
        for i in joined:  # prefill: the prompt in one forward, which gives the first token
            cache.add(i)
            p = requests[i].prompt.to(model.wte.weight.device)[None]  # (1, T0)
            logits = model(p, cache.view([i]))  # (1, T0, V)
            last[i] = int(logits[0, -1].argmax())
            requests[i].out.append(last[i])
            produced += 1
        if decoders:  # one decode step for every sequence that was already running
            idx = torch.tensor([[last[i]] for i in decoders], device=model.wte.weight.device)  # (B, 1)
            logits = model(idx, cache.view(decoders))  # (B, 1, V)
            for row, i in enumerate(decoders):
                last[i] = int(logits[row, -1].argmax())
                requests[i].out.append(last[i])
            produced += len(decoders)
        running = decoders + joined
        done = [i for i in running if len(requests[i].out) >= requests[i].max_new]
        for i in done:
            cache.free(i)
        running = [i for i in running if i not in done]
        steps.append(ServeStep(len(decoders) + len(joined), produced, len(joined), len(done),
                               cache.allocator.used, cache.bytes_in_use(), cache.bytes_filled()))  # fmt: skip
    return steps

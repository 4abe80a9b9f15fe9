"""The lesson's task: a language whose next token depends on the two before it, learnt in seconds.

Every compression method is judged on one number, held-out loss, so the task must train in seconds
on a CPU and reward capacity: a smaller or damaged model must do measurably worse. Here each pair of
tokens (a, b) has one preferred successor, drawn once at random (a table of vocab² entries), which
follows with probability `p`; otherwise any token follows, uniformly. A model must store that table
in its weights, so its held-out loss falls with its capacity, from log(vocab) (chance) towards the
entropy of the source (`Corpus.floor`), and every compression that removes capacity shows up in it.

Invariant: `Corpus(seed=...)` is deterministic; training and held-out text are separate samples of
the same source.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Corpus", "evaluate", "latency_ms", "train_lm"]


class Corpus:
    """Token streams from a second-order source: (a, b) -> preferred[a, b] with probability p."""

    def __init__(self, vocab: int = 48, train_tokens: int = 200_000, test_tokens: int = 20_000, p: float = 0.8,
                 seed: int = 0) -> None:  # fmt: skip
        if not 0.0 < p < 1.0:
            raise ValueError(f"p must be in (0, 1), got {p}")
        self.vocab, self.p = vocab, p
        self.preferred = torch.randint(vocab, (vocab, vocab), generator=torch.Generator().manual_seed(seed))
        self.train = self._sample(train_tokens, seed + 1)
        self.test = self._sample(test_tokens, seed + 2)

    def _sample(self, n: int, seed: int, chains: int = 200) -> torch.Tensor:
        # many independent chains side by side, so the Python loop is n / chains steps long
        g = torch.Generator().manual_seed(seed)
        length = -(-n // chains)
        out = torch.empty(chains, length, dtype=torch.long)
        out[:, :2] = torch.randint(self.vocab, (chains, 2), generator=g)
        keep = torch.rand(chains, length, generator=g) < self.p
        noise = torch.randint(self.vocab, (chains, length), generator=g)
        for i in range(2, length):
            out[:, i] = torch.where(keep[:, i], self.preferred[out[:, i - 2], out[:, i - 1]], noise[:, i])
        return out.flatten()[:n]

    def floor(self) -> float:
        """Entropy of the source per token (nats): the held-out loss of a perfect model."""
        top = self.p + (1 - self.p) / self.vocab
        rest = (1 - self.p) / self.vocab
        return -(top * math.log(top) + (self.vocab - 1) * rest * math.log(rest))

    def batch(
        self, split: str, batch: int, seq_len: int, g: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of `seq_len` + 1 tokens from one split: inputs and next-token targets."""
        data = self.train if split == "train" else self.test
        starts = torch.randint(len(data) - seq_len - 1, (batch,), generator=g)
        seq = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])  # (B, T+1)
        return seq[:, :-1], seq[:, 1:]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train_lm(model: nn.Module, corpus: Corpus, steps: int = 300, batch: int = 32, seq_len: int = 32,
             lr: float = 3e-3, seed: int = 0, loss_fn=None, after_step=None) -> list[float]:  # fmt: skip
    """Adam on random training windows. `loss_fn(model, x, y)` replaces cross-entropy (distillation);
    `after_step(step)` runs after each update (pruning re-applies its masks there)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    model.train()
    for step in range(steps):
        x, y = corpus.batch("train", batch, seq_len, g)
        loss = (loss_fn or _loss)(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(step)
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model: nn.Module, corpus: Corpus, seq_len: int = 32, batches: int = 8) -> float:
    """Mean cross-entropy on fixed held-out windows (nats per token; log(vocab) is chance)."""
    g = torch.Generator().manual_seed(12345)
    model.eval()
    return sum(_loss(model, *corpus.batch("test", 64, seq_len, g)).item() for _ in range(batches)) / batches


@torch.no_grad()
def latency_ms(
    model: nn.Module, corpus: Corpus, batch: int = 32, seq_len: int = 32, repeats: int = 30
) -> float:
    """Best CPU time of one forward pass on a (batch, seq_len) window, in ms, on one thread (the best of
    `repeats`: the machine's other work only ever adds time, and one thread is not shared with it)."""
    x, _ = corpus.batch("test", batch, seq_len, torch.Generator().manual_seed(1))
    model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model(x)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            model(x)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best * 1e3

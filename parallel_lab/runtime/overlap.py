"""Seeing overlap: backward drawn layer by layer, and the share of communication it hides.

Li et al. 2020 (PyTorch DDP, §3.2.3) overlap gradient all-reduces with backward;
Rajbhandari et al. 2020 (ZeRO) prefetch parameters under compute. Whether that
works is a question about time, answered on the timeline: `LayerTimer` records one
"bwd <layer>" span per layer without changing the graph (tensor hooks on layer
outputs), and `comm_hidden_fraction` measures how much of the time communication
was in flight backward was still computing.

Invariant: the "bwd" spans of one backward tile it without overlap, from the call to
the last gradient accumulation; nothing here changes a tensor or the autograd graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn


def default_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers to time: items of ModuleLists/Sequentials, and other children that own parameters."""
    out = []
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            out += [(f"{name}.{n}", m) for n, m in child.named_children()]
        elif any(True for _ in child.parameters()):
            out.append((name, child))
    return out


class LayerTimer:
    """Per-layer backward spans on the timeline: "bwd <layer>".

    A forward hook puts a tensor hook on each layer's output; it fires when the
    gradient w.r.t. that output is ready, i.e. when backward reaches the layer.
    Backward visits layers in reverse, so consecutive marks partition it: layer L's
    span runs from its mark to the next one, the last to the last gradient
    accumulation. What `backward()` spends after that (torch DDP waits for its
    buckets there, in an autograd final callback) is drawn as "wait in backward".
    """

    def __init__(self, module: nn.Module, ctx: Any, layers: list[tuple[str, nn.Module]] | None = None):
        self.ctx, self.marks, self.last_grad = ctx, [], None
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in (layers or default_layers(module))]
        self.handles += [
            p.register_post_accumulate_grad_hook(self._grad) for p in module.parameters() if p.requires_grad
        ]

    def _hook(self, name: str) -> Callable:
        def on_forward(mod: nn.Module, inputs: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self.marks.append((name, self.ctx.recorder.mark())))

        return on_forward

    def _grad(self, p: torch.Tensor) -> None:
        self.last_grad = self.ctx.recorder.mark()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Wrap `loss.backward()`: records "bwd loss" (the loss's own backward) and one span per layer."""
        rec = self.ctx.recorder
        self.marks, self.last_grad, start = [], None, rec.mark()
        yield
        # On a GPU the marks are CUDA events on the stream; reading them waits for backward's kernels.
        end = rec.seconds(rec.mark())
        compute_end = rec.seconds(self.last_grad) if self.last_grad is not None else end
        points = [
            ("loss", rec.seconds(start)),
            *((n, rec.seconds(m)) for n, m in self.marks),
            ("end", compute_end),
        ]
        for (name, t0), (_, t1) in zip(points, points[1:]):
            rec.add_event(f"bwd {name}", "compute", t0, max(t0, t1), phase="backward")
        if end - compute_end > 1e-4:
            rec.add_event("wait in backward", "idle", compute_end, end)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def comm_hidden_fraction(result_or_events: Any, rank: int | None = None) -> float:
    """Share of the time communication was in flight during which backward was computing (1.0: all hidden).

    Backward = the union of "bwd ..." spans (`LayerTimer`); communication = the union
    of "comm" spans (several bucket all-reduces can be in flight at once). Summed
    over all ranks, or one `rank`. NaN when there was no communication.
    """
    events = getattr(result_or_events, "timeline", result_or_events)
    ranks = {e["rank"] for e in events} if rank is None else {rank}
    hidden = total = 0.0
    for r in ranks:
        mine = [e for e in events if e["rank"] == r]
        bwd = _union([(e["start"], e["end"]) for e in mine if e["name"].startswith("bwd ")])
        for a, b in _union([(e["start"], e["end"]) for e in mine if e["kind"] == "comm"]):
            total += b - a
            hidden += sum(max(0.0, min(b, d) - max(a, c)) for c, d in bwd)
    return hidden / total if total > 0 else float("nan")


__all__ = ["LayerTimer", "comm_hidden_fraction", "default_layers"]

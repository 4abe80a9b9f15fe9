"""The model side of pipeline parallelism: a TinyMLP cut into p * v virtual stages.

`split_layers` gives each virtual stage the same number of layers (rank r holds
virtual stages c*p + r, c = 0..v-1, or r and 2p-1-r in a V; the head goes with the last one);
`stage_modules` builds this rank's chunks from one seeded TinyMLP, so every rank
agrees with the single-process model it came from; `PipelineConfig` describes a
run of `pipeline.executor.train_pipeline`.

Invariant: the chunks of all ranks, run in virtual-stage order, compute exactly
`TinyMLP.forward` (same modules, same ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab.models import MLPConfig, synthetic_batch
from parallel_lab.pipeline.schedules import SCHEDULES
from parallel_lab.pipeline.simulator import stage_of

DP_SYNCS = ("end", "every_microbatch", "none")


@dataclass
class PipelineConfig:
    """A pipelined TinyMLP training run. Defaults run on 4 CPU ranks in about a second."""

    schedule: str = "1f1b"
    microbatches: int = 4
    chunks: int = 1  # interleaved's v; the V schedules (zb-v, dualpipev) always hold 2
    layers: int = 8  # hidden Linear+GELU layers, split evenly over p * v virtual stages
    hidden: int = 64
    in_dim: int = 16
    out_dim: int = 4
    batch: int = 32  # global batch, all DP replicas together
    steps: int = 3
    lr: float = 0.05
    optimizer: str = "sgd"
    compute_time: float = 0.0  # seconds: pad each stage's forward of one micro-batch to this (B: 2x)
    dp_sync: str = "end"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("microbatches", "chunks", "layers", "hidden", "in_dim", "out_dim", "batch", "steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PipelineConfig.{name} must be an int >= 1, got {v!r}")
        if self.schedule == "naive" and self.microbatches != 1:
            raise ValueError("PipelineConfig: the naive schedule runs one batch, set microbatches=1")
        if self.dp_sync not in DP_SYNCS:
            raise ValueError(f"PipelineConfig.dp_sync must be one of {DP_SYNCS}, got {self.dp_sync!r}")
        if not self.compute_time >= 0:
            raise ValueError(f"PipelineConfig.compute_time must be >= 0 seconds, got {self.compute_time!r}")

    @property
    def model_config(self) -> MLPConfig:
        return MLPConfig(self.in_dim, self.hidden, self.out_dim, self.layers)


def split_layers(layers: int, stages: int, chunks: int = 1) -> list[range]:
    """Layer indices of each virtual stage 0..p*v-1: equal, contiguous blocks."""
    for arg, value in (("layers", layers), ("stages", stages), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
    n = stages * chunks
    if layers % n:
        raise ValueError(
            f"layers ({layers}) must be divisible by stages x chunks = {stages} x {chunks} = {n}, "
            "so every virtual stage gets the same number of layers"
        )
    k = layers // n
    return [range(i * k, (i + 1) * k) for i in range(n)]


class LinearGelu(nn.Module):
    """One TinyMLP layer as its own module: gelu(linear(x)), the same ops as `TinyMLP.forward`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x))  # (b, hidden)


def stage_modules(
    model: nn.Module, stages: int, chunks: int, rank: int, placement: str = "loop"
) -> tuple[dict, dict]:
    """This rank's chunks of a TinyMLP: ({chunk: nn.Sequential}, {global parameter name: parameter}).

    `placement`: "loop" (chunk c is virtual stage c*p + r) or "v" (stages r and 2p-1-r)."""
    blocks = split_layers(len(model.layers), stages, chunks)
    mods, names = {}, {}
    for c in range(chunks):
        vs = stage_of(rank, c, stages, placement)
        seq = [LinearGelu(model.layers[i]) for i in blocks[vs]]
        for i in blocks[vs]:
            names.update({f"layers.{i}.{k}": p for k, p in model.layers[i].named_parameters()})
        if vs == stages * chunks - 1:
            seq.append(model.head)
            names.update({f"head.{k}": p for k, p in model.head.named_parameters()})
        mods[c] = nn.Sequential(*seq)
    return mods, names


def reference_batches(cfg: PipelineConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole-batch data `train_pipeline` trains on, step by step (for a single-process reference)."""
    return [
        synthetic_batch(
            "regression", cfg.batch, in_dim=cfg.in_dim, out_dim=cfg.out_dim, seed=cfg.seed + 1 + s
        )
        for s in range(cfg.steps)
    ]

"""Data parallelism: a parameter server, all-reduce DP, gradient accumulation, and the tools
that show where the time goes (per-layer backward spans, communication hidden under backward).

Every rank holds the whole model and trains on its own slice of the batch. With N
equal slices of a mean loss the full-batch gradient is the average of the slices'
gradients, g = (1/N) Σ_r g_r, so averaging gradients makes every replica take the
step one process would take on the whole batch.

- `ParameterServerDP` (Li et al. 2014, "Scaling Distributed Machine Learning with
  the Parameter Server"): one rank, the server, holds the
  parameters, the optimizer and the batch. Each step it sends the parameters to every
  worker, scatters the data, gathers the gradients, averages them, updates. Its link
  carries (N-1) copies of the model each way: the bottleneck grows with N.
- `AllReduceDP` (Sergeev & Del Balso 2018, Horovod): no
  server; after backward one all-reduce per parameter, every rank updates its own
  replica. A ring all-reduce moves 2(N-1)/N of the gradients per rank, whatever N.
- `ddp.BucketedDDP` overlaps that all-reduce with backward (see data_parallel/ddp.py; runtime/overlap.py
  draws backward layer by layer and measures how much communication it hides).

Invariant: after each step every rank's parameters equal those of single-process
training on the concatenated batch, up to the order of floating-point sums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab import comms
from parallel_lab.models import TinyGPT
from parallel_lab.runtime.overlap import LayerTimer

ALGORITHMS = ("builtin", "ring")


# ----------------------------------------------------------------------------- shared helpers
class ParametersChangedError(ValueError):
    """The wrapped module's parameters are not the ones it had when it was wrapped."""


def trainable(params: Iterable[torch.Tensor]) -> list[nn.Parameter]:
    """Parameters that get gradients, each once (a tied weight appears once), in first-seen order."""
    seen: set[int] = set()
    out = []
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params must hold tensors, got {type(p).__name__}")
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append(p)
    return out


def signature(module: nn.Module) -> list[tuple]:
    """What must not change after wrapping: each parameter's identity, shape, dtype, requires_grad."""
    return [(n, id(p), tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()]


def check_unchanged(module: nn.Module, expected: list[tuple], wrapper: str) -> None:
    """Raise ParametersChangedError saying which parameters differ from `expected`."""
    now = signature(module)
    if now == expected:
        return
    before, after = {e[0]: e for e in expected}, {e[0]: e for e in now}
    what = [f"added {n}" for n in after if n not in before] + [
        f"removed {n}" for n in before if n not in after
    ]
    for n in after.keys() & before.keys():
        (_, i0, s0, d0, r0), (_, i1, s1, d1, r1) = before[n], after[n]
        if i0 != i1:
            what.append(f"{n} replaced by a new Parameter")
        elif (s0, d0) != (s1, d1):
            what.append(f"{n} changed from {s0} {d0} to {s1} {d1}")
        elif r0 != r1:
            what.append(f"{n}.requires_grad changed from {r0} to {r1}")
    raise ParametersChangedError(
        f"the module's parameters changed after {wrapper} wrapped it ({'; '.join(sorted(what))}); "
        "its gradient bookkeeping describes the old ones: finish building (and freezing) the model, then wrap it"
    )


def shard_batch(batch: Sequence[torch.Tensor], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s slice (along dim 0) of every tensor in `batch`: N equal, contiguous slices."""
    out = []
    for t in batch:
        if t.shape[0] % world_size:
            raise ValueError(
                f"batch size {t.shape[0]} must be divisible by world_size {world_size}: equal slices keep "
                "the average of the slices' gradients equal to the full batch's gradient"
            )
        out.append(t.chunk(world_size)[rank])  # (B/N, ...)
    return tuple(out)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The tiny models' loss, called through a wrapper (ours or torch DDP) so its hooks run."""
    inner = getattr(model, "module", model)
    return model(x, y) if isinstance(inner, TinyGPT) else F.mse_loss(model(x), y)


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


# ----------------------------------------------------------------------------- parameter server
class ParameterServerDP:
    """Parameter-server data parallelism: the server rank keeps the parameters, the optimizer and the batch.

    `step(batch)` (batch = (x, y) on the server, None elsewhere): 1. the server sends
    its parameters to every worker, 2. scatters the batch in N slices, 3. every rank runs
    forward and backward on its slice, 4. the server gathers the gradients and
    averages them, 5. the server's optimizer updates its parameters. Workers keep no
    optimizer state: their weights are overwritten by the server's next send (`pull()`).
    """

    def __init__(self, module: nn.Module, ctx: Any, optimizer_fn: Callable[[list], torch.optim.Optimizer],
                 server: int = 0, group: Any = None):  # fmt: skip
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        self.world, self.me = dist.get_world_size(group), dist.get_rank(group)
        if isinstance(server, bool) or not isinstance(server, int) or not 0 <= server < self.world:
            raise ValueError(
                f"server must be a rank in the group, 0 <= server < {self.world}, got {server!r}"
            )
        self.module, self.ctx, self.server, self.group = module, ctx, server, group
        self.params = trainable(module.parameters())
        self._signature = signature(module)
        self.is_server = self.me == server
        self.optimizer = optimizer_fn(self.params) if self.is_server else None

    def pull(self) -> None:
        """1. Every worker gets the server's parameters: one message from the server to each."""
        check_unchanged(self.module, self._signature, "ParameterServerDP")
        with torch.no_grad(), _comm_memory(self.ctx):
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])  # (P,)
            if self.is_server:  # the server sends N-1 copies: its link carries them all
                sends = [
                    comms.isend(self.ctx, flat, r, self.group) for r in range(self.world) if r != self.me
                ]
                for h in sends:
                    h.wait()
            else:
                comms.recv(self.ctx, flat, self.server, self.group)
                for p, piece in zip(self.params, flat.split([p.numel() for p in self.params])):
                    p.copy_(piece.view_as(p))

    def scatter(self, batch: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """2. The server cuts each batch tensor in N slices and sends slice r to rank r."""
        n = None if batch is None else len(batch)
        n = int(self._from_server(torch.tensor([n or 0]))[0])
        out = []
        for i in range(n):
            t = batch[i] if self.is_server else None
            # header: dtype code, then the slice's shape (the workers allocate the receive buffer)
            head = torch.zeros(10, dtype=torch.int64)
            if self.is_server:
                if t.shape[0] % self.world:
                    raise ValueError(f"batch size {t.shape[0]} must be divisible by world_size {self.world}")
                shape = (t.shape[0] // self.world, *t.shape[1:])
                head[: 2 + len(shape)] = torch.tensor([_DTYPES.index(t.dtype), len(shape), *shape])
            head = self._from_server(head)
            shape = tuple(head[2 : 2 + int(head[1])].tolist())
            mine = torch.empty(shape, dtype=_DTYPES[int(head[0])], device=self.ctx.device)
            slices = list(t.to(self.ctx.device).chunk(self.world)) if self.is_server else None
            out.append(comms.dist_scatter(self.ctx, mine, slices, src=self.server, group=self.group))
        return out

    def _from_server(self, t: torch.Tensor) -> torch.Tensor:
        return comms.dist_broadcast(self.ctx, t.to(self.ctx.device), src=self.server, group=self.group)

    def push(self) -> None:
        """4. Gradients go to the server (one gather), which averages them into its `.grad`s."""
        with torch.no_grad(), _comm_memory(self.ctx):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])  # (P,)
            got = comms.dist_gather(self.ctx, flat, self.server, self.group)  # (N, P) on the server
            if self.is_server:
                mean = got.sum(0).div_(self.world)  # (P,)
                for p, piece in zip(self.params, mean.split([p.numel() for p in self.params])):
                    p.grad = piece.view_as(p).clone()

    def step(self, batch: Sequence[torch.Tensor] | None, timer: LayerTimer | None = None) -> float:
        """One parameter-server training step; returns this rank's loss on its slice."""
        self.pull()
        x, y = self.scatter(batch)
        for p in self.params:
            p.grad = None
        with self.ctx.span("forward", "compute"):
            loss = loss_fn(self.module, x, y)
        with timer.backward() if timer else self.ctx.span("backward", "compute"):
            loss.backward()
        self.push()
        if self.is_server:
            with self.ctx.span("optimizer", "optimizer"):
                self.optimizer.step()
        return loss.item()


def _comm_memory(ctx: Any) -> Any:
    """Label the buffers made inside as communication memory (when the launch tracks memory)."""
    return (
        ctx.memory.category("comm") if getattr(ctx, "memory", None) is not None else contextlib.nullcontext()
    )


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32)


# ----------------------------------------------------------------------------- all-reduce DP
class AllReduceDP(nn.Module):
    """No server: after backward, one all-reduce per parameter; every rank steps its own replica.

    `algorithm="builtin"` uses the backend's all-reduce (`comms.dist_all_reduce`),
    `"ring"` our from-scratch `comms.ring_all_reduce`. Call `finish_gradient_sync()`
    between backward and the optimizer step.
    """

    def __init__(self, module: nn.Module, ctx: Any, group: Any = None, algorithm: str = "builtin",
                 broadcast_params: bool = True):  # fmt: skip
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        _check_algorithm(algorithm)
        self.module, self.ctx, self.group, self.algorithm = module, ctx, group, algorithm
        self.world = dist.get_world_size(group)
        self.params = trainable(module.parameters())
        self._signature = signature(module)
        self._syncing = True
        if broadcast_params and self.world > 1:
            with torch.no_grad():  # replicas start from rank 0's weights
                for p in self.params:
                    comms.dist_broadcast(ctx, p.detach(), src=0, group=group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        check_unchanged(self.module, self._signature, "AllReduceDP")
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulation: `finish_gradient_sync()` does nothing inside; gradients add up locally."""
        prev, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = prev

    def finish_gradient_sync(self) -> None:
        """Average every gradient over the ranks: all-reduce (sum), then divide by N."""
        check_unchanged(self.module, self._signature, "AllReduceDP")
        if not self._syncing or self.world == 1:
            return
        for p in self.params:
            if p.grad is None:  # unused in this forward: it contributes zeros
                p.grad = torch.zeros_like(p)
            if self.algorithm == "builtin":
                comms.dist_all_reduce(self.ctx, p.grad, group=self.group)
            else:
                comms.ring_all_reduce(self.ctx, p.grad, group=self.group)
            p.grad.div_(self.world)


# ----------------------------------------------------------------------------- one training step
def check_accumulation_steps(accumulation_steps: Any, local_batch: int | None = None) -> int:
    """`accumulation_steps` if it is an int >= 1 that divides `local_batch` (when given); else a clear error."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
        raise TypeError(f"accumulation_steps must be an int, got {type(accumulation_steps).__name__}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    if local_batch is not None and local_batch % accumulation_steps:
        raise ValueError(
            f"this rank's batch ({local_batch}) must be divisible by accumulation_steps ({accumulation_steps})"
        )
    return accumulation_steps


def train_step(ctx: Any, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor],
               accumulation_steps: int = 1, timer: LayerTimer | None = None) -> float:  # fmt: skip
    """One optimizer step on this rank's `batch` = (x, y), split in `accumulation_steps` micro-batches.

    Non-final micro-steps run under `model.no_sync()` (their gradients only add up
    locally); the last one syncs. Each micro-loss is divided by the number of
    micro-steps, so the summed gradient is the gradient of the mean loss over the
    whole batch. Works with AllReduceDP, BucketedDDP and torch's DDP. Returns the loss.
    """
    x, y = batch
    k = check_accumulation_steps(accumulation_steps, x.shape[0])
    total = 0.0
    for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):  # (B/k, ...) each
        with model.no_sync() if i < k - 1 else contextlib.nullcontext():
            with ctx.span("forward", "compute"):
                loss = loss_fn(model, xm, ym) / k
            with timer.backward() if timer else ctx.span("backward", "compute"):
                loss.backward()
        total += loss.item()
    finish = getattr(model, "finish_gradient_sync", None)
    if finish is not None:
        with ctx.span("wait for buckets", "idle") if hasattr(model, "buckets") else contextlib.nullcontext():
            finish()
    with ctx.span("optimizer", "optimizer"):
        optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # keep .grad (BucketedDDP's views into its buckets)
    return total


__all__ = [
    "ALGORITHMS", "AllReduceDP", "ParameterServerDP", "ParametersChangedError", "check_accumulation_steps",
    "check_unchanged", "loss_fn", "shard_batch", "signature", "train_step", "trainable",
]  # fmt: skip

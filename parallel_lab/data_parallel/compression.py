"""Fewer bytes for the gradient all-reduce: DDP communication hooks written on the lab's comms layer.

A hook replaces what DDP does with one bucket of gradients (the local sum over micro-steps) and must
leave the average over ranks in the bucket, as torch DDP's `register_comm_hook` hooks do:
- `CastCompression` (torch's `fp16_compress_hook` / `bf16_compress_hook`): cast to 16 bits, divide by
  the ranks, all-reduce, cast back. Half the bytes; the sum rounds in 16 bits;
- `PowerSGD` (Vogels, Karimireddy & Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression
  for Distributed Optimization"): each gradient matrix M (n x m) is sent as two thin factors, P = M Q
  (n x r) and Q = Mᵀ P̂ (m x r) after orthogonalizing P, so r(n + m) numbers instead of nm; Q is
  reused across steps (warm start: one power iteration per step refines it), and what the rank-r
  approximation missed is added to the next step's gradient (error feedback). Vectors (biases,
  LayerNorms) are all-reduced uncompressed;
- `TopK` (sparsification; Stich, Cordonnier & Jaggi 2018, "Sparsified SGD with Memory", for the
  error feedback): each rank sends its k largest-magnitude entries with their indices, an all-gather
  of 2k numbers; with error feedback the entries not sent are kept and added next step, without it
  they are lost, and training drifts.

Bytes one rank sends per bucket (p ranks, ring collectives, `comms.ring_bytes_per_rank`): cast,
the ring all-reduce of n 2-byte elements; PowerSGD, two all-reduces of sum r(n_i) and sum r(m_i)
float32 plus one of the vectors; top-k, an all-gather of k float32 values and k int32 indices,
(p-1)·8k bytes (`hook_bytes_per_rank`).

Invariant: after a hook, every rank's bucket holds the same tensor. At 2 ranks (a sum of two numbers
rounds once, whatever the order) CastCompression equals torch's hook bit for bit, and PowerSGD equals
torch's `powerSGD_hook` bit for bit up to its first compressed step; after it, torch's hook also keeps
an error for the uncompressed vectors (summing to zero over the ranks), and the two part by rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from parallel_lab import comms


def _ring_sent(numel: int, p: int, itemsize: int, op: str, rank: int) -> int:
    """Bytes group rank `rank` sends in a ring collective on `numel` elements."""
    return comms.ring_bytes_per_rank(numel, p, itemsize, op)[rank][0] if p > 1 and numel else 0


class CastCompression:
    """Cast the bucket to `dtype` (fp16 or bf16), divide by the ranks, all-reduce, cast back."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype

    def __call__(self, ctx: Any, bucket: Any, group: Any = None) -> None:
        p, _ = comms.group_size_rank(ctx, group)
        small = bucket.buffer.to(self.dtype).div_(p)  # torch's hooks divide before the sum, as here
        comms.ring_all_reduce(ctx, small, group)
        bucket.buffer.copy_(small)

    def bytes_per_rank(self, bucket: Any, p: int, rank: int = 0) -> int:
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return _ring_sent(bucket.buffer.numel(), p, itemsize, "all_reduce", rank)


def _orthogonalize(m: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning m's, by Gram-Schmidt (the paper's choice, and torch's hook's for
    r <= 2; it uses a QR factorization above, which spans the same columns); (n, r)."""
    out = m.clone()
    for i in range(out.shape[1]):
        col = out[:, i : i + 1]  # (n, 1)
        col /= col.norm().clamp_min(1e-8)  # an all-zero column (a frozen layer) stays zero
        if i + 1 < out.shape[1]:
            rest = out[:, i + 1 :]  # (n, r - i - 1)
            rest -= (col * rest).sum(0, keepdim=True) * col
    return out


class PowerSGD:
    """Rank-`rank` PowerSGD with warm start and error feedback; one state per DDP, per bucket.

    The first `start_iter` steps are plain averaged all-reduces (torch's `start_powerSGD_iter`:
    a few exact steps before the approximation starts). Q is drawn as torch's hook draws it, so the
    two can be compared number for number: a NumPy `RandomState(seed)` gives each bucket a seed on its
    first compressed step, and the bucket's matrices take their Qs from it in turn, grouped by shape.
    """

    def __init__(
        self,
        rank: int = 2,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        start_iter: int = 0,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0 (uncompressed steps first), got {start_iter!r}")
        import numpy as np

        self.rank, self.error_feedback, self.warm_start = rank, error_feedback, warm_start
        self.seed, self.start_iter = seed, start_iter
        self._rng = np.random.RandomState(seed)  # the same draws on every rank
        self.errors: dict[tuple[int, int], torch.Tensor] = {}
        self.qs: dict[tuple[int, int], torch.Tensor] = {}
        self.calls: dict[int, int] = {}  # per bucket: steps seen

    def _matrices(self, bucket: Any) -> tuple[list[int], list[int]]:
        """Indices of the bucket's views compressed as matrices (every gradient of 2 or more dims), and
        of the vectors sent as they are. A rank that is not smaller than both sides of a matrix would
        send more than the matrix itself: refused."""
        mats = [i for i, v in enumerate(bucket.views) if v.dim() >= 2]
        for i in mats:
            n, m = bucket.views[i].shape[0], bucket.views[i][0].numel()
            if self.rank >= min(n, m):
                raise ValueError(
                    f"PowerSGD rank {self.rank} must be smaller than both sides of every gradient matrix: a "
                    f"({n}, {m}) gradient would send r(n + m) = {self.rank * (n + m)} numbers for its {n * m}"
                )
        return mats, [i for i in range(len(bucket.views)) if i not in mats]

    def _compressing(self, bucket: Any) -> bool:
        return self.calls.get(bucket.index, 0) >= self.start_iter

    def _draw_qs(self, bucket: Any, mats: list[int], shapes: dict[int, tuple[int, int]]) -> None:
        """Fresh orthonormal Qs for the bucket's matrices, in torch's order: one seed per bucket, then
        the matrices grouped by shape (first shape first), each group in bucket order."""
        g = torch.Generator().manual_seed(int(self._rng.randint(1_000_000_000)))
        for shape in dict.fromkeys(shapes[i] for i in mats):
            for i in (i for i in mats if shapes[i] == shape):
                q = torch.randn(shape[1], self.rank, generator=g)  # (m, r)
                self.qs[(bucket.index, i)] = _orthogonalize(q).to(bucket.views[i].device)

    def __call__(self, ctx: Any, bucket: Any, group: Any = None) -> None:
        p, _ = comms.group_size_rank(ctx, group)
        mats, plain = self._matrices(bucket)
        compressing = self._compressing(bucket)
        self.calls[bucket.index] = self.calls.get(bucket.index, 0) + 1
        if not compressing:  # the exact average, as DDP without a hook
            comms.ring_all_reduce(ctx, bucket.buffer.div_(p), group)
            return
        if plain:  # vectors: compressing them would not save bytes
            flat = torch.cat([bucket.views[i].reshape(-1) for i in plain])
            comms.ring_all_reduce(ctx, flat, group)
            flat.div_(p)
            for i, piece in zip(plain, flat.split([bucket.views[i].numel() for i in plain])):
                bucket.views[i].copy_(piece.view_as(bucket.views[i]))
        if not mats:
            return
        ms = {}
        for i in mats:
            m = bucket.views[i].reshape(bucket.views[i].shape[0], -1)  # (n, m): a view into the bucket
            if self.error_feedback and (bucket.index, i) in self.errors:
                m.add_(self.errors[(bucket.index, i)])  # what earlier steps failed to send is sent now
            ms[i] = m
        if (bucket.index, mats[0]) not in self.qs or not self.warm_start:
            self._draw_qs(bucket, mats, {i: tuple(ms[i].shape) for i in mats})
        else:  # warm start: last step's Q, renormalised so its scale cannot drift from step to step
            for i in mats:
                self.qs[(bucket.index, i)] = _orthogonalize(self.qs[(bucket.index, i)])
        qs = [self.qs[(bucket.index, i)] for i in mats]
        ps = [ms[i] @ q for i, q in zip(mats, qs)]  # (n, r) each
        flat_p = torch.cat([x.reshape(-1) for x in ps])
        comms.ring_all_reduce(ctx, flat_p, group)  # sum_i M_i Q = (sum_i M_i) Q
        ps = [_orthogonalize(x.view_as(y)) for x, y in zip(flat_p.split([y.numel() for y in ps]), ps)]
        new_q = [ms[i].t() @ ph for i, ph in zip(mats, ps)]  # (m, r): one power-iteration step
        flat_q = torch.cat([x.reshape(-1) for x in new_q])
        comms.ring_all_reduce(ctx, flat_q, group)
        flat_q.div_(p)  # Q of the mean gradient
        new_q = [x.view_as(y) for x, y in zip(flat_q.split([y.numel() for y in new_q]), new_q)]
        for i, ph, q in zip(mats, ps, new_q):
            approx = ph @ q.t()  # (n, m): rank-r approximation of the mean gradient
            if self.error_feedback:
                self.errors[(bucket.index, i)] = ms[i] - approx  # what this rank's share missed
            self.qs[(bucket.index, i)] = q
            ms[i].copy_(approx)

    def bytes_per_rank(self, bucket: Any, p: int, rank: int = 0) -> int:
        """Bytes sent per compressed step (the first `start_iter` steps send the whole bucket)."""
        mats, plain = self._matrices(bucket)
        n_plain = sum(bucket.views[i].numel() for i in plain)
        n_p = sum(bucket.views[i].shape[0] * self.rank for i in mats)
        n_q = sum(bucket.views[i][0].numel() * self.rank for i in mats)
        return sum(_ring_sent(n, p, 4, "all_reduce", rank) for n in (n_plain, n_p, n_q))


class TopK:
    """Send each rank's `ratio` largest-magnitude gradient entries (values and indices), error feedback optional."""

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(
                f"ratio must be in (0, 1] (k = ratio x numel entries are sent, 1 <= k <= numel), got {ratio!r}"
            )
        self.ratio, self.error_feedback = ratio, error_feedback
        self.residuals: dict[int, torch.Tensor] = {}

    def k(self, numel: int) -> int:
        return max(1, round(self.ratio * numel))

    def __call__(self, ctx: Any, bucket: Any, group: Any = None) -> None:
        p, _ = comms.group_size_rank(ctx, group)
        acc = bucket.buffer.clone()  # (n,)
        if self.error_feedback and bucket.index in self.residuals:
            acc += self.residuals[bucket.index]
        idx = acc.abs().topk(self.k(acc.numel())).indices  # (k,)
        vals = acc[idx]
        if self.error_feedback:
            acc[idx] = 0
            self.residuals[bucket.index] = acc  # everything not sent this step
        every_idx = comms.ring_all_gather(ctx, idx.to(torch.int32), group)  # (p, k)
        every_val = comms.ring_all_gather(ctx, vals, group)  # (p, k)
        bucket.buffer.zero_()
        # rank by rank: one rank's indices are distinct, so each index_add_ has no collisions; one
        # index_add_ of all ranks' would sum overlapping indices with atomics on a GPU, in an order
        # that differs run to run and rank to rank, and the replicas would drift in the last bits
        for r in range(p):
            bucket.buffer.index_add_(0, every_idx[r].long(), every_val[r])
        bucket.buffer.div_(p)

    def bytes_per_rank(self, bucket: Any, p: int, rank: int = 0) -> int:
        return 2 * (p - 1) * self.k(bucket.buffer.numel()) * 4


def hook_bytes_per_rank(hook: Any, buckets: list, p: int, rank: int = 0) -> int:
    """Bytes group rank `rank` sends per synchronized step under `hook` (None: the float32 ring all-reduce)."""
    if hook is None:
        return sum(
            _ring_sent(b.buffer.numel(), p, b.buffer.element_size(), "all_reduce", rank) for b in buckets
        )
    return sum(hook.bytes_per_rank(b, p, rank) for b in buckets)


__all__ = ["CastCompression", "PowerSGD", "TopK", "hook_bytes_per_rank"]

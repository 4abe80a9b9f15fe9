"""One agreement check for both context-parallel attentions: every rank raises the same error.

A context-parallel attention is a collective: if one rank raised on a bad input while its peers
went on into the ring, they would wait for a message that never comes. So each rank first checks
its own inputs locally, then the group exchanges a few integers (its error code, the three
shapes, the layout flags, the dtype) and every rank raises the same ValueError naming each
offending rank, or the ranks that disagree on the layout.
"""

from __future__ import annotations

import torch

from parallel_lab import comms

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_PROBLEMS = {
    1: "q, k and v must be 4-D (B, H, T_local, D) floating-point tensors of one shape and dtype",
    2: "a zigzag part holds two equal chunks, so its length T_local must be even "
    "(the whole sequence divisible by 2 x world_size)",
    3: "the number of heads must be divisible by the group size (each rank attends over H / group heads)",
}


def _shape(t) -> list[int]:
    dims = list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else []
    return dims + [-1] * (4 - len(dims))


def agree_on_inputs(ctx, name: str, q, k, v, group, *, causal: bool, zigzag: bool, split_heads: bool) -> int:
    """Check q, k, v on every rank of `group` together; returns the group size.

    Local rules: q, k, v are 4-D float tensors of one shape and dtype; zigzag needs an even local
    length; `split_heads` (Ulysses) needs H divisible by the group size. Across ranks: the same
    B, H, T_local, D, dtype, causal and zigzag."""
    p, _ = comms.group_size_rank(ctx, group)
    ts = (q, k, v)
    ok_type = all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.dtype in _DTYPES for t in ts)
    code = 0
    if not ok_type or not (q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype):
        code = 1
    elif zigzag and q.shape[2] % 2:
        code = 2
    elif split_heads and q.shape[1] % p:
        code = 3
    dtype = _DTYPES.index(q.dtype) if isinstance(q, torch.Tensor) and q.dtype in _DTYPES else -1
    mine = [code, *_shape(q), *_shape(k), *_shape(v), int(bool(causal)), int(bool(zigzag)), dtype]
    rows = comms.gather_values(ctx, mine, group)
    bad = [(r, row) for r, row in enumerate(rows) if row[0]]
    if bad:
        where = "; ".join(
            f"rank {r}: q {tuple(row[1:5])}, k {tuple(row[5:9])}, v {tuple(row[9:13])}: {_PROBLEMS[row[0]]}"
            + (f" (H = {row[2]}, group size {p})" if row[0] == 3 else "")
            for r, row in bad
        )
        raise ValueError(f"{name}: {where}")
    if any(row != rows[0] for row in rows):
        desc = "; ".join(
            f"rank {r}: (B, H, T_local, D) = {tuple(row[1:5])}, {str(_DTYPES[row[15]]).replace('torch.', '')}, "
            f"causal={bool(row[13])}, zigzag={bool(row[14])}"
            for r, row in enumerate(rows)
        )
        raise ValueError(
            f"{name}: the ranks disagree on the layout ({desc}); every rank of the group must pass its part "
            "of the same sequence, with the same shape, dtype, causal and zigzag"
        )
    return p

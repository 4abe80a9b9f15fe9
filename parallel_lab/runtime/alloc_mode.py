"""The allocation hook under MemoryTracker: a TorchDispatchMode that sees every op.

Invariant: an op's output is reported as a new storage only when its schema says
the output aliases nothing (views, in-place and out= ops reuse storage; out= and
resize_ may grow it, which is reported as a resize).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_LIFT_FRESH = torch.ops.aten.lift_fresh.default


def storage_of(t: torch.Tensor):
    """The tensor's untyped storage, or None for tensors without one (sparse, nested)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


_FRESH, _ALIAS, _RESIZE = 0, 1, 2  # what an op's outputs are, from its schema


def _op_kind(func: Any) -> int:
    """aten ops declare aliasing in their schema (views, in-place, out=): only
    un-annotated returns are new storages. In-place resizes and out= variants may
    grow an existing storage. Other namespaces (c10d...) hand back their inputs
    without annotations, so their outputs are never new."""
    if func is _LIFT_FRESH:  # torch.tensor(data): made outside the dispatcher, seen here first
        return _FRESH
    if func.namespace != "aten":
        return _ALIAS
    if not any(r.alias_info is not None for r in func._schema.returns):
        return _FRESH
    name = func._schema.name
    if name.endswith(("resize_", "resize_as_")) or name == "aten::set_" or "out" in func._overloadname:
        return _RESIZE
    return _ALIAS


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's output (a tensor, or a tuple/list, nested one level)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                yield o
            elif isinstance(o, (tuple, list)):
                yield from (x for x in o if isinstance(x, torch.Tensor))


class _AllocMode(TorchDispatchMode):
    """Sees every op's outputs and hands fresh (or resized) storages to the tracker."""

    def __init__(self, tracker: Any):
        super().__init__()
        self.tracker = tracker
        self.kind: dict[Any, int] = {}  # op -> _FRESH / _ALIAS / _RESIZE, cached

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = self.kind.get(func)
        if kind is None:
            kind = self.kind[func] = _op_kind(func)
        if kind == _FRESH:
            if type(out) is torch.Tensor:  # the common case, without a generator
                self.tracker._seen(out)
            else:
                for t in _tensors(out):
                    self.tracker._seen(t)
        elif kind == _RESIZE:
            for t in _tensors(out):
                self.tracker._resized(t)
        return out

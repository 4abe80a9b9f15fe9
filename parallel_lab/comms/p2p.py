"""Point-to-point messages, traced: send, recv, sendrecv, and the asynchronous isend/irecv.

Pipelines (stage to stage activations and gradients) are built on these.
Invariant: like every op in comms, each call records one "comm" span and books the
bytes its message carried (a send counts sent bytes only, a receive received bytes).
Import them from `parallel_lab.comms`, which re-exports this module.
"""

from __future__ import annotations

import torch

from parallel_lab.comms.core import (
    Handle,
    TracedOp,
    _check_rank,
    _global,
    _group,
    _size_rank,
    check_device,
    post_p2p,
)


def _p2p(ctx, name, send_t, dst, recv_t, src, group) -> TracedOp:
    with TracedOp(ctx, name, send_t if send_t is not None else recv_t, group) as o:
        for n, r in (("dst", dst), ("src", src)):
            if r is not None:
                _check_rank(n, r, o.p)
        o.xchg(send_t, dst, recv_t, src)
    return o


def send(ctx, tensor: torch.Tensor, dst: int, group=None) -> None:
    """Send `tensor` to group rank `dst` (blocks until the message is handed over)."""
    _p2p(ctx, "send", tensor, dst, None, None, group)


def recv(ctx, tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Receive into `tensor` (its shape and dtype must match what `src` sends); returns it."""
    _p2p(ctx, "recv", None, None, tensor, src, group)
    return tensor


def sendrecv(ctx, send_t: torch.Tensor, dst: int, recv_t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Post the send and the receive together, then wait for both: a ring of these cannot deadlock."""
    _p2p(ctx, "sendrecv", send_t, dst, recv_t, src, group)
    return recv_t


def _ip2p(ctx, name, tensor, peer, group, is_send) -> Handle:
    check_device(ctx, tensor)
    g = _group(ctx, group)
    p, _ = _size_rank(g)
    _check_rank("dst" if is_send else "src", peer, p)
    nbytes = tensor.numel() * tensor.element_size()
    works = post_p2p(g, sends=[(tensor, peer)] if is_send else [], recvs=[] if is_send else [(tensor, peer)])
    args = {
        "op": name,
        "numel": tensor.numel(),
        "dtype": str(tensor.dtype).replace("torch.", ""),
        "peers": [_global(g, peer)],
    }
    return Handle(ctx, name, works, args, nbytes if is_send else 0, 0 if is_send else nbytes, tensor)


def isend(ctx, tensor: torch.Tensor, dst: int, group=None) -> Handle:
    """Start sending `tensor` to `dst`; don't touch `tensor` until `.wait()`."""
    return _ip2p(ctx, "isend", tensor, dst, group, True)


def irecv(ctx, tensor: torch.Tensor, src: int, group=None) -> Handle:
    """Start receiving into `tensor` from `src`; `.wait()` returns it filled."""
    return _ip2p(ctx, "irecv", tensor, src, group, False)


def isendrecv(ctx, send_t: torch.Tensor, dst: int, recv_t: torch.Tensor, src: int, group=None) -> Handle:
    """Start sending `send_t` to `dst` and receiving into `recv_t` from `src`, posted together (one
    batch, as `sendrecv`); `.wait()` returns `recv_t`. Work done between the call and the wait
    overlaps the transfer: ring attention computes on one key/value block while the next arrives."""
    for t, what in ((send_t, "send_t"), (recv_t, "recv_t")):
        check_device(ctx, t, what)
    g = _group(ctx, group)
    p, _ = _size_rank(g)
    _check_rank("dst", dst, p)
    _check_rank("src", src, p)
    works = post_p2p(g, sends=[(send_t, dst)], recvs=[(recv_t, src)])
    args = {
        "op": "isendrecv",
        "numel": send_t.numel(),
        "dtype": str(send_t.dtype).replace("torch.", ""),
        "peers": sorted({_global(g, dst), _global(g, src)}),
    }
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    return Handle(ctx, "isendrecv", works, args, nbytes(send_t), nbytes(recv_t), recv_t)


__all__ = ["irecv", "isend", "isendrecv", "recv", "send", "sendrecv"]

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
    independent_messages,
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


def post_batch(ctx, sends: list, recvs: list) -> tuple[list[Handle], list[Handle]]:
    """Post messages that belong together as one batch (`post_p2p`): `sends` and `recvs` are
    (tensor, global peer, tag). Returns a traced, byte-counted Handle per send and per receive.
    NCCL runs the batch as one kernel (each Handle waits for all of it); gloo posts each message
    on its own, matched by sender and tag (a Handle waits for its own)."""
    for t, _, _ in [*sends, *recvs]:
        check_device(ctx, t)
    works = post_p2p(None, sends=sends, recvs=recvs)
    own = independent_messages(None)  # gloo: one work per non-empty message, receives first
    moving = iter(works)  # (post_p2p skips empty tensors: they move nothing and get no work)

    def handle(t: torch.Tensor, peer: int, send: bool) -> Handle:
        nbytes = t.numel() * t.element_size()
        name = "isend" if send else "irecv"
        args = {"op": name, "numel": t.numel(), "dtype": str(t.dtype).replace("torch.", ""), "peers": [peer]}
        mine = [] if t.numel() == 0 else [next(moving)] if own else works
        return Handle(ctx, name, mine, args, nbytes if send else 0, 0 if send else nbytes, t)

    rh = [handle(t, peer, False) for t, peer, _ in recvs]
    sh = [handle(t, peer, True) for t, peer, _ in sends]
    return sh, rh


def check_blocking_sends(batches: list[list[list[tuple[str, int]]]]) -> None:
    """Raise RuntimeError if ranks posting these batches would deadlock under NCCL's rules.

    `batches[r]`: rank r's batches in the order it posts them, each a list of ("send" | "recv",
    peer rank). NCCL pairs the k-th send from a to b with the k-th receive at b from a (tags play
    no part), runs a rank's batches in posting order on one stream, and a batch completes only
    once every message in it has its other end posted (a send waits for its receive: NCCL
    buffers too little to count on more). gloo forgives all of it; this model does not, so a
    CPU test can hold the posting order of any exchange to NCCL's rules (record what a rank
    posts, e.g. by wrapping `post_p2p`, and pass it here)."""
    from collections import Counter

    p = len(batches)
    units = []
    for r, mine in enumerate(batches):
        seen: Counter = Counter()
        out = []
        for batch in mine:
            items = []
            for kind, q in batch:
                if kind not in ("send", "recv") or not 0 <= q < p:
                    raise ValueError(f"rank {r}: {(kind, q)!r} is not ('send' | 'recv', a rank in [0, {p}))")
                link = (r, q) if kind == "send" else (q, r)
                items.append((link, seen[kind, link], kind))
                seen[kind, link] += 1
            out.append(items)
        units.append(out)
    flip = {"send": "recv", "recv": "send"}
    needs = [[[(link, k, flip[kind]) for link, k, kind in b] for b in mine] for mine in units]
    ptr, posted = [0] * p, set()
    for r in range(p):
        if units[r]:
            posted.update(units[r][0])  # every rank posts its first batch
    while any(ptr[r] < len(units[r]) for r in range(p)):
        moved = False
        for r in range(p):  # a rank goes on while its batch has every other end posted
            while ptr[r] < len(units[r]) and all(m in posted for m in needs[r][ptr[r]]):
                ptr[r], moved = ptr[r] + 1, True
                if ptr[r] < len(units[r]):
                    posted.update(units[r][ptr[r]])
        if not moved:
            stuck = "; ".join(
                f"rank {r} in batch {[f'{kind} #{k} {link[0]}->{link[1]}' for link, k, kind in units[r][ptr[r]]]}"
                for r in range(p)
                if ptr[r] < len(units[r])
            )
            raise RuntimeError(
                "deadlock under blocking sends (NCCL: a send completes only once its receive is posted, "
                f"each rank's messages in posting order): {stuck}"
            )


__all__ = ["check_blocking_sends", "post_batch", "irecv", "isend", "isendrecv", "recv", "send", "sendrecv"]

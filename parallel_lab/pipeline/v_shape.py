"""Two chunks per rank in a V: ZB-V (Qi et al. 2024, section 6) and DualPipeV (DeepSeek-AI's DualPipe, cut in half).

Placement "v" (simulator.PLACEMENTS): of 2p virtual stages, rank r holds stage r (chunk 0) and
stage 2p-1-r (chunk 1). A micro-batch's forward goes down the ranks through chunk 0 and comes back
up through chunk 1; stage p-1 hands on to stage p on the same rank (a message to itself, no link),
and rank 0 holds both the first stage (the data) and the last (the loss). The backward retraces the
V. Against interleaved 1F1B's loop placement, the first rank's warm-up waits for its own chunk 1
sooner, so with the split backward the gaps can be filled by W with 1F1B's peak activation memory
(the paper's claim for ZB-V; per rank, in micro-batch-chunks of half a stage).

ZB-V (the paper's section 6; torch 2.13's `ScheduleZBVZeroBubble` is the reference for the order):
rank r runs 2(p-r)-1 chunk-0 forwards, then r pairs (chunk-1 F, chunk-0 F), then p-r rounds of
(chunk-1 F, B, W), a steady state of (chunk-0 F, B, W; chunk-1 F, B, W), and a cool-down of B's
whose W's come last. With T_F = T_B = T_W and m >= 2p it leaves no gap between a rank's first
instruction and its last (bubble rate 0; the paper's and the sail-sg repository's claim, checked by
the simulator in tests/test_zero_bubble.py); torch keeps the order for m < 2p-1 by dropping the
micro-batches past m from a 2p-1 one, and so do we.

DualPipeV (deepseek-ai/DualPipe's `dualpipev.py`, the V-shaped half of DualPipe, which the DualPipe
README credits to Sea AI Lab's "cut-in-half"; torch 2.13's `ScheduleDualPipeV` is the reference
for the order): eight phases of chunk-0 and chunk-1 steps in which, in the middle, a forward of one
chunk is paired with the full backward of the other ("F&B"). DeepSeek overlaps the pair so that one
half's communication (MoE's all-to-all) runs under the other's compute; the lab runs a pair one
after the other (no such communication here: F&B = F + B). A full backward is written B then W,
back to back (the same kernels, W right after its B); only the tail phases split B from a later W.
The DualPipe README's bubble for DualPipeV is (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages and
per-chunk times, B the full backward; tests/test_zero_bubble.py compares it with the simulator.

Invariant (tests/test_zero_bubble.py): every order here is, rank by rank, torch's
`_calculate_single_rank_operations` (I = our B, W = our W, FULL_BACKWARD = our B then W, an
OVERLAP_F_B its F then its full backward), validated with placement "v", and runs on real ranks
to parameters bit-identical to 1F1B's (executor.SplitBackward).
"""

from __future__ import annotations

from parallel_lab.pipeline.simulator import Step, _pos, add_comms

__all__ = ["order_dualpipev", "order_zb_v", "schedule_dualpipev", "schedule_zb_v"]


def _check(rank: int, ranks: int, microbatches: int) -> tuple[int, int, int]:
    p, m = _pos("ranks", ranks), _pos("microbatches", microbatches)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < p:
        raise ValueError(f"rank must be an int in [0, ranks={p}), got {rank!r}")
    return rank, p, m


def order_zb_v(rank: int, ranks: int, microbatches: int) -> list[Step]:
    """ZB-V on rank `rank` of `ranks` (chunk 0 = stage r, chunk 1 = stage 2p-1-r)."""
    r, p, m = _check(rank, ranks, microbatches)
    n = max(2 * p - 1, m)  # the order is built for at least 2p-1 micro-batches; the extra ones are dropped
    out: list[Step] = []
    f = [0, 0]  # forwards done per chunk
    b = [0, 0]  # input-gradient backwards done per chunk

    def fwd(c: int) -> None:
        out.append(Step("F", f[c], c))
        f[c] += 1

    def bw(c: int, w: bool = True) -> None:  # B, and its W right after unless deferred
        out.append(Step("B", b[c], c))
        if w:
            out.append(Step("W", b[c], c))
        b[c] += 1

    for _ in range(2 * (p - r) - 1):  # warm-up: chunk 0 fills the way down
        fwd(0)
    for _ in range(r):  # chunk 1's first forwards come back up, interleaved with chunk 0's
        fwd(1)
        fwd(0)
    for _ in range(p - r):  # the turn: chunk 1's first backwards start
        fwd(1)
        bw(1)
    while f[1] < f[0] or f[0] < n:  # steady state: one F, B, W per chunk
        if f[0] < n:
            fwd(0)
        bw(0)
        fwd(1)
        bw(1)
    w = list(b)  # cool-down: B's first, on the critical path; their W's fill the tail
    for _ in range(r):
        bw(0, False)
        bw(1, False)
    for _ in range(p - r):
        bw(0, False)
        out.append(Step("W", w[0], 0))
        w[0] += 1
    out += [Step("W", k, 1) for k in range(w[1], b[1])]
    out += [Step("W", k, 0) for k in range(w[0], b[0])]
    return [s for s in out if s.mb < m]


def order_dualpipev(rank: int, ranks: int, microbatches: int) -> list[Step]:
    """DualPipeV on rank `rank` of `ranks`: needs m >= 2p (torch's rule: at least as many
    micro-batches as stages). A full backward is B then W; an F&B pair is F, then B and W."""
    r, p, m = _check(rank, ranks, microbatches)
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs microbatches >= 2 x ranks (one per stage, 2p stages); got microbatches={m}, ranks={p}"
        )
    out: list[Step] = []
    f, b = [0, 0], [0, 0]
    queue: list[tuple[int, int]] = []  # (chunk, mb) of B's whose W waits

    def fwd(c: int) -> None:
        out.append(Step("F", f[c], c))
        f[c] += 1

    def full(c: int) -> None:  # the whole backward: B with its W right after
        out.extend([Step("B", b[c], c), Step("W", b[c], c)])
        b[c] += 1

    def input_only(c: int) -> None:  # B now, its W later (queued)
        out.append(Step("B", b[c], c))
        queue.append((c, b[c]))
        b[c] += 1

    def weight() -> None:  # the oldest waiting W, if any
        if queue:
            c, k = queue.pop(0)
            out.append(Step("W", k, c))

    def pair(fc: int, bc: int) -> None:  # F&B: a forward of one chunk with the full backward of the other
        fwd(fc)
        full(bc)

    for _ in range(2 * (p - r - 1)):  # 1: chunk 0 fills the way down
        fwd(0)
    for _ in range(r + 1):  # 2: F0 F1
        fwd(0)
        fwd(1)
    for _ in range(p - r - 1):  # 3: B1 W1 F1 (zero bubble's split)
        input_only(1)
        weight()
        fwd(1)
    for _ in range(m - 2 * p + r + 1):  # 4: the main phase, F0&B1 then F1&B0
        pair(0, 1)  # (on the last rank torch does not overlap the first: the same two steps here)
        pair(1, 0)
    for _ in range(p - r - 1):  # 5: B1, F1&B0
        full(1)
        pair(1, 0)
    split = False
    for i in range(r + 1):  # 6: B1 B0, the second half split into B and a later W
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        (input_only if split else full)(1)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        (input_only if split else full)(0)
    for _ in range(p - r - 1):  # 7: W, B0
        weight()
        (input_only if split else full)(0)
    for _ in range(r + 1):  # 8: the W's left
        weight()
    return out


def schedule_zb_v(ranks: int, microbatches: int) -> list[list[Step]]:
    """ZB-V with communication: 2 chunks per rank in a V (placement "v")."""
    p, m = _pos("ranks", ranks), _pos("microbatches", microbatches)
    return add_comms([order_zb_v(r, p, m) for r in range(p)], 2, placement="v")


def schedule_dualpipev(ranks: int, microbatches: int) -> list[list[Step]]:
    """DualPipeV with communication: 2 chunks per rank in a V (placement "v"), m >= 2p."""
    p, m = _pos("ranks", ranks), _pos("microbatches", microbatches)
    return add_comms([order_dualpipev(r, p, m) for r in range(p)], 2, placement="v")

"""Zero-bubble pipelines: the backward split into B and W, and the handcrafted ZB-H1 and ZB-H2.

Paper: Qi, Wan, Huang, Lin 2024, "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241, ICLR
2024), section 2. A stage's backward is two computations: B, the gradient of the stage's input
(what the previous stage waits for: on the critical path) and W, the gradient of its weights
(needed only by the optimizer step: it can wait). 1F1B runs them as one, so every stage waits
T_B + T_W per hop for the gradient; split, it waits T_B, and W fills the idle time.

ZB-H1 (section 2.1) is 1F1B (warm-up of p-s-1 forwards on stage s) with each W of stage s run s
backwards after its B: every stage holds at most p micro-batches (F done, W not yet), 1F1B's
count on stage 0, and the last s W's fill the cool-down. ZB-H2 (section 2.2) doubles both:
2(p-s-1) warm-up forwards and each W 2s backwards late, so every stage holds 2p-1 micro-batches
and, with m >= 2p-1, no stage waits between its first instruction and its last (the timeline is
a parallelogram, not a trapezoid). That is the paper's bubble rate, measured per stage: the
stages still start one after another and end one after another, so the idle share of a step
that ends with a flush (the lab's executor: a barrier, then the optimizer) is ZB-H1's again.
Taking that too needs the next step to start on each stage as soon as it ends, which the paper
gets by validating the optimizer step after the fact (its section 4); the lab does not.
Memory counts micro-batches: in bytes, the lab's split keeps more per micro-batch between B and W
than 1F1B keeps (see executor.SplitBackward).

Invariant (tests/test_zero_bubble.py checks it with the simulator, t_comm = 0): with bubble
the paper's cost - m(T_F + T_B + T_W), cost the longest time a stage spends from its first
compute to its last,
  1F1B (B unsplit, costing T_B + T_W)   (p-1)(T_F + T_B + T_W)
  1F1B split, W right after its B       (p-1)(T_F + T_B)
  ZB-H1, when T_W <= T_F and m >= p     (p-1)(T_F + T_B - T_W)
  ZB-H2, when T_W <= T_F, 2 T_W <= T_F + T_B and m >= 2p-1   (p-1)(T_F + T_B - 2 T_W)
and the peak in flight is min(p, m) on every stage for ZB-H1, min(2p-1, m) for ZB-H2. The
1F1B / ZB-H1 / ZB-H2 sizes are the paper's handcrafted ones (with equal times: a third of
1F1B's, and zero); the conditions are where the simulator reproduces them on a grid of
times. Outside them the bubble is larger (a delayed W no longer fits the wait it fills).
The split 1F1B line is ours: there the gradient leaves after B, so W is off the path.

Against torch 2.13 (torch.distributed.pipelining): ScheduleInterleavedZeroBubble with one stage
per rank builds ZB-H1 (`_get_1f1b_rank_ops` with enable_zero_bubble and num_1f1b_microbatches =
rank: W delayed by `rank`); its per-rank F/B/W order (I = BACKWARD_INPUT is our B, W =
BACKWARD_WEIGHT) equals `order_zb_h1` for every p and m it accepts. Differences: torch refuses
m that is not a multiple of max(1, m // p) rounds (9 on 4 ranks), and its visualizer
(`get_schedule_ops`) refuses one stage per rank for this class, so the tests build the class on
a mocked stage as the visualizer does. torch ships no ZB-H2: `order_zb_h2` is built by the
paper's rule (twice the warm-up, twice the delay) and checked by the validator and the
simulator only, not instruction by instruction against the paper's Figure 3.
"""

from __future__ import annotations

from parallel_lab.pipeline.simulator import ScheduleError, Step, _pos, add_comms

__all__ = ["order_zb_h1", "order_zb_h2", "schedule_zb_h1", "schedule_zb_h2", "split_backward"]


def _delayed_w(microbatches: int, warmup: int, delay: int) -> list[Step]:
    """1F1B's order with split backwards: `warmup` forwards, then (F, B) pairs, then the last B's;
    the k-th W follows the (k + delay)-th B, and the delayed ones close the list."""
    m = microbatches
    warmup = min(warmup, m)
    out = [Step("F", i) for i in range(warmup)]
    w = 0
    for b in range(m):  # b: the backward about to run
        if b < m - warmup:
            out.append(Step("F", warmup + b))  # steady state: one forward before each backward
        out.append(Step("B", b))
        if b >= delay:  # a W waits until `delay` newer B's were run: it fills the wait for the next B
            out.append(Step("W", w))
            w += 1
    return out + [Step("W", k) for k in range(w, m)]  # the cool-down's bubble, filled


def _check(stage: int, stages: int, microbatches: int) -> tuple[int, int, int]:
    p, m = _pos("stages", stages), _pos("microbatches", microbatches)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < p:
        raise ValueError(f"stage must be an int in [0, stages={p}), got {stage!r}")
    return stage, p, m


def order_zb_h1(stage: int, stages: int, microbatches: int) -> list[Step]:
    """ZB-H1 on one stage: 1F1B's p-s-1 warm-up forwards, each W s backwards after its B.

    Stage s then holds at most p micro-batches (F done, W not), as stage 0 of 1F1B does: the
    memory the paper keeps. Same order as torch's ScheduleInterleavedZeroBubble on one stage."""
    s, p, m = _check(stage, stages, microbatches)
    return _delayed_w(m, p - s - 1, s)


def order_zb_h2(stage: int, stages: int, microbatches: int) -> list[Step]:
    """ZB-H2 on one stage: 2(p-s-1) warm-up forwards (plus the first steady one: 2(p-s)-1 before
    the first B, the time its gradient takes to come back), each W 2s backwards after its B.

    Every stage holds up to 2p-1 micro-batches; with m >= 2p-1 and equal F, B, W no stage waits
    between its first instruction and its last."""
    s, p, m = _check(stage, stages, microbatches)
    return _delayed_w(m, 2 * (p - s - 1), 2 * s)


def split_backward(order: list[Step]) -> list[Step]:
    """Each unsplit B becomes B then W right after it (1F1B split: the gradient leaves after B)."""
    if any(s.kind == "W" for s in order):
        raise ScheduleError("split_backward takes an order without W (its B's are whole backwards)")
    return [t for s in order for t in ((s, s._replace(kind="W")) if s.kind == "B" else (s,))]


def schedule_zb_h1(stages: int, microbatches: int) -> list[list[Step]]:
    """ZB-H1 with communication: 1F1B's peak memory, the bubble cut to (p-1)(T_F + T_B - T_W)."""
    p, m = _pos("stages", stages), _pos("microbatches", microbatches)
    return add_comms([order_zb_h1(r, p, m) for r in range(p)])


def schedule_zb_h2(stages: int, microbatches: int) -> list[list[Step]]:
    """ZB-H2 with communication: up to 2p-1 micro-batches in flight; with T_F = T_B = T_W and m >= 2p-1,
    a bubble rate of zero (per stage, first instruction to last)."""
    p, m = _pos("stages", stages), _pos("microbatches", microbatches)
    return add_comms([order_zb_h2(r, p, m) for r in range(p)])

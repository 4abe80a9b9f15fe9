"""Why large runs pair gradient accumulation with ZeRO-1, not ZeRO-2.

With m micro-steps of accumulation per optimizer step, ZeRO-1 lets backward add every micro-step's
gradients into the full local gradient buffer and reduce-scatters once, at the step. ZeRO-2 keeps
only its (S,) gradient slice: every micro-step's gradients must be reduce-scattered before they are
freed, so the reduce-scatter runs m times (Rajbhandari et al. 2020 section 5.2 frees them; Megatron-LM
and DeepSpeed document the m-fold cost, and long runs with large m keep ZeRO-1). Per rank and
optimizer step, with P the padded parameter count, S = P / N and e bytes per element:

    ZeRO-1:  1 reduce-scatter of (P - S)e  + 1 all-gather of (P - S)e
    ZeRO-2:  m x U reduce-scatters (one per unit and micro-step) of (P - S)e in total per micro-step,
             + 1 all-gather of (P - S)e

ZeRO-2 saves (P - S)e of gradient memory per rank; it pays (m - 1)(P - S)e more bytes on the wire.

Invariant: the bytes and the collective counts the comms layer books equal `accumulation_comm`,
and both stages end the step with the same parameters (up to summation order).
"""

from __future__ import annotations

from parallel_lab import comms


def accumulation_comm(padded: int, world_size: int, stage: int, micro_steps: int, units: int,
                      itemsize: int = 4, rank: int = 0) -> dict[str, int]:  # fmt: skip
    """{"reduce_scatter_calls", "all_gather_calls", "bytes_sent"} for one rank and one optimizer step."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    if isinstance(micro_steps, bool) or not isinstance(micro_steps, int) or micro_steps < 1:
        raise ValueError(f"micro_steps must be a positive int, got {micro_steps!r}")
    rs, ag = (row[rank][0] for row in (comms.ring_bytes_per_rank(padded, world_size, itemsize, op)
                                      for op in ("reduce_scatter", "all_gather")))  # fmt: skip
    times = 1 if stage == 1 else micro_steps
    return {
        "reduce_scatter_calls": 1 if stage == 1 else micro_steps * units,
        "all_gather_calls": 1,
        "bytes_sent": times * rs + ag,
    }


def accumulate_and_step(ctx, zero, model, micro_batches: list) -> dict:
    """Run one optimizer step of `zero` (a ZeroOptimizer) over `micro_batches` [(x, y), ...]; return what
    the comms layer booked during it (calls and bytes sent per op)."""
    before = {k: dict(v) for k, v in ctx.recorder.comm_totals()["by_op"].items()}
    m = len(micro_batches)
    for x, y in micro_batches:
        (model(x, y) / m).backward()  # the mean over the m micro-batches
    zero.step()
    zero.zero_grad()
    after = ctx.recorder.comm_totals()["by_op"]
    return {
        op: {k: v[k] - before.get(op, {}).get(k, 0) for k in ("calls", "sent")} for op, v in after.items()
    }


__all__ = ["accumulate_and_step", "accumulation_comm"]

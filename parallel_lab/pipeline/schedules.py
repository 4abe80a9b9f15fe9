"""Pipeline schedules as instruction lists: GPipe, 1F1B, interleaved 1F1B; validator and simulator.

Papers: GPipe (Huang et al. 2019, fill-drain: all forwards, then all backwards);
1F1B / PipeDream-Flush (Narayanan et al. 2019 and 2021: after a warm-up of
p-s-1 forwards, stage s alternates one forward and one backward, so it never holds
more than p micro-batches' activations); interleaved 1F1B (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", §2.2: each rank holds v model chunks, virtual stage c*p + r, which
cuts the bubble by v at the cost of v times more messages). The zero-bubble ZB-H1 and
ZB-H2 (Qi et al. 2024, split backward: B then W) live in `pipeline/zero_bubble.py` and are
registered here by name.

A schedule is `list[list[Step]]`: one list per pipeline rank, executed in order by
`pipeline.executor` on real ranks and by `simulate` here. Compute steps are `F`/`B`
on (micro-batch, chunk); communication is explicit: `RECV_F` (activation) just
before the F that consumes it, `SEND_F` just after the F that made it, `RECV_B` /
`SEND_B` likewise for the gradient flowing back. Sends never block; a receive waits
for its message. Rank r's chunk c is virtual stage c*p + r.

Invariant (`validate_schedule` checks it, for any p, m, v): every (micro-batch,
chunk) has exactly one F and one B on its rank, F first (and, in a schedule that uses W,
exactly one W after its B); every send has exactly one
matching receive on the right peer and vice versa, and each link receives in the order
it sends; the lists run to the end without deadlock; no rank ever holds more
activations in flight (F done, B not yet; W not yet when split) than the schedule's bound
`max_in_flight(name, p, m, v)`: m for GPipe, p for 1F1B and ZB-H1, 2p-1 for ZB-H2.
"""

from __future__ import annotations

from parallel_lab.pipeline.simulator import (
    COMMS,
    COMPUTE,
    ScheduleError,
    SimResult,
    Step,
    _pos,
    add_comms,
    check_blocking_sends,
    p2p_batches,
    simulate,
    validate_schedule,
)

__all__ = [
    "COMMS", "COMPUTE", "SCHEDULES", "SIMULATED_SCHEDULES", "V_SCHEDULES", "ScheduleError", "SimResult", "Step", "add_comms", "check_blocking_sends",
    "chunks_of", "make_schedule", "p2p_batches", "placement_of",
    "max_in_flight", "order_1f1b", "order_gpipe", "order_interleaved", "schedule_1f1b", "schedule_gpipe",
    "schedule_interleaved_1f1b", "schedule_naive", "simulate", "validate_schedule",
]  # fmt: skip


# ----------------------------------------------------------------------------- compute orders
def order_gpipe(stage: int, stages: int, microbatches: int) -> list[Step]:
    """GPipe on one stage: F0..F(m-1), then B0..B(m-1) (same order as torch's ScheduleGPipe)."""
    return [Step("F", i) for i in range(microbatches)] + [Step("B", i) for i in range(microbatches)]


def order_1f1b(stage: int, stages: int, microbatches: int) -> list[Step]:
    """1F1B on one stage: p-s-1 warm-up forwards, then (F, B) pairs, then the remaining backwards."""
    warmup = min(stages - stage - 1, microbatches)
    out = [Step("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        out += [Step("F", warmup + i), Step("B", i)]  # steady state: one forward, one backward
    return out + [Step("B", i) for i in range(microbatches - warmup, microbatches)]


def order_interleaved(stage: int, stages: int, microbatches: int, chunks: int) -> list[Step]:
    """Megatron-LM's interleaved 1F1B on rank `stage`: forwards in groups of p micro-batches per
    chunk (chunk 0 on mb 0..p-1, chunk 1 on the same, ..., then the next group), backwards in the
    same groups with the chunks reversed; 2(p-r-1) + (v-1)p warm-up forwards."""
    p, m, v, r = stages, microbatches, chunks, stage
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:  # the k-th forward (backward) -> (mb, chunk)
        chunk = (k % (p * v)) // p
        return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk

    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    out = [Step("F", *unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        out += [Step("F", *unit(warmup + k, True)), Step("B", *unit(k, False))]
    return out + [Step("B", *unit(k, False)) for k in range(total - warmup, total)]


# ----------------------------------------------------------------------------- with communication
def schedule_naive(stages: int) -> list[list[Step]]:
    """Naive model parallelism: the whole batch goes through the stages one after the other."""
    return schedule_gpipe(stages, 1)


def schedule_gpipe(stages: int, microbatches: int) -> list[list[Step]]:
    """GPipe: every stage runs all m forwards, then all m backwards."""
    p, m = _pos("stages", stages), _pos("microbatches", microbatches)
    return add_comms([order_gpipe(r, p, m) for r in range(p)])


def schedule_1f1b(stages: int, microbatches: int) -> list[list[Step]]:
    """1F1B (PipeDream-Flush): same bubble as GPipe, at most p micro-batches in flight per stage."""
    p, m = _pos("stages", stages), _pos("microbatches", microbatches)
    return add_comms([order_1f1b(r, p, m) for r in range(p)])


def schedule_interleaved_1f1b(stages: int, microbatches: int, chunks: int = 2) -> list[list[Step]]:
    """Interleaved 1F1B with `chunks` (v) model chunks per rank; v = 1 is plain 1F1B.

    Megatron-LM's rule: the micro-batch count must be a multiple of the stage count
    (forwards go in groups of p micro-batches per chunk)."""
    p, m, v = _pos("stages", stages), _pos("microbatches", microbatches), _pos("chunks", chunks)
    if v == 1:
        return schedule_1f1b(p, m)
    if m % p:
        raise ValueError(
            f"schedule_interleaved_1f1b needs microbatches to be a multiple of stages (Megatron-LM's "
            f"rule: forwards go in groups of p per chunk); got microbatches={m}, stages={p}"
        )
    return add_comms([order_interleaved(r, p, m, v) for r in range(p)], v)


#: the schedules the executor runs on real ranks (configs and scripts take these); the zero-bubble
#: ones split each backward into B and W (`executor.SplitBackward`)
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev")
#: the schedules the validator and simulator take: all of the executor's, for now
SIMULATED_SCHEDULES = SCHEDULES
#: two chunks per rank in a V (placement "v": rank r holds stages r and 2p-1-r; `pipeline/v_shape.py`)
V_SCHEDULES = ("zb-v", "dualpipev")


def placement_of(name: str) -> str:
    """Where schedule `name` puts the virtual stages (simulator.PLACEMENTS)."""
    return "v" if name in V_SCHEDULES else "loop"


def chunks_of(name: str, chunks: int = 1) -> int:
    """Model chunks per rank under schedule `name`: `chunks` for interleaved, 2 in a V, else 1."""
    return chunks if name == "interleaved" else 2 if name in V_SCHEDULES else 1


def make_schedule(name: str, stages: int, microbatches: int = 1, chunks: int = 1) -> list[list[Step]]:
    """The schedule called `name` (one of `SCHEDULES`); naive ignores microbatches (one batch).

    `chunks` is interleaved's v; the V schedules always hold 2 chunks per rank (chunks 1 or 2 taken).
    Validate, simulate and run a V schedule with `placement=placement_of(name)` and `chunks=2`."""
    if name == "naive":
        return schedule_naive(stages)
    if name in V_SCHEDULES:
        if chunks not in (1, 2):
            raise ValueError(
                f"chunks={chunks}: {name!r} holds exactly 2 chunks per rank (stages r and 2p-1-r)"
            )
        from parallel_lab.pipeline import v_shape  # it builds on this module: imported when asked

        return (v_shape.schedule_zb_v if name == "zb-v" else v_shape.schedule_dualpipev)(stages, microbatches)
    if name != "interleaved" and chunks != 1:
        raise ValueError(f"chunks={chunks} needs schedule='interleaved'; {name!r} runs one chunk per rank")
    if name == "gpipe":
        return schedule_gpipe(stages, microbatches)
    if name == "1f1b":
        return schedule_1f1b(stages, microbatches)
    if name == "interleaved":
        return schedule_interleaved_1f1b(stages, microbatches, chunks)
    if name in ("zb-h1", "zb-h2"):
        from parallel_lab.pipeline import zero_bubble as zb  # it builds on this module: imported when asked

        return (zb.schedule_zb_h1 if name == "zb-h1" else zb.schedule_zb_h2)(stages, microbatches)
    raise ValueError(f"schedule must be one of {SIMULATED_SCHEDULES}, got {name!r}")


def max_in_flight(name: str, stages: int, microbatches: int = 1, chunks: int = 1) -> int:
    """Most (micro-batch, chunk) activations a rank may hold at once under schedule `name`.

    naive 1; GPipe m; 1F1B min(p, m); interleaved min(v*m, (v-1)p + 2(p-1) + 1) chunk
    activations, each 1/v of a stage's: p + (p-1)/v stage activations on rank 0 (Korthikanti et al. 2022,
    §4.2.3), 5.5 for p = 4, v = 2. ZB-H1 min(p, m), 1F1B's, and ZB-H2 min(2p-1, m) (Qi et al. 2024,
    section 2), held on every stage: a split micro-batch is in flight from its F to its W. In a V
    (2 chunks of half a stage each): ZB-V min(2p, 2m) chunk activations, p stages' worth, 1F1B's
    (Qi et al. 2024, section 6); DualPipeV 2p+1 (the DualPipe README's PP+1 with PP = 2p stages)."""
    if name not in SIMULATED_SCHEDULES:
        raise ValueError(f"name must be one of {SIMULATED_SCHEDULES}, got {name!r}")
    for arg, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
    p, m, v = stages, microbatches, chunks
    return {
        "naive": 1,
        "gpipe": m,
        "1f1b": min(p, m),
        "interleaved": min(v * m, (v - 1) * p + 2 * (p - 1) + 1) if v > 1 else min(p, m),
        "zb-h1": min(p, m),
        "zb-h2": min(2 * p - 1, m),
        "zb-v": min(2 * p, 2 * m),
        "dualpipev": 2 * p + 1,
    }[name]


# The validator and simulator live beside this file; re-exported so `pipeline.X` keeps working.

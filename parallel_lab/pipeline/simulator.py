"""The instruction set of pipeline schedules (`Step`), their validator and their simulator.

`pipeline/schedules.py` builds the schedules from these steps (and re-exports everything here).

`validate_schedule` checks the invariant stated in `pipeline`'s docstring for any
p, m, v, and that every link receives its messages in the order they were sent (so a
backend that matches point-to-point messages by order, like NCCL, pairs them as gloo's
tags do); `simulate` runs the lists as the executor would (sends never block,
receives wait for their message) with given F, B (and W) times, and gives the timeline,
the lab's idle share and the zero-bubble paper's bubble rate. It is also the deadlock
check: a pass in which no rank can move is a deadlock. `check_blocking_sends` runs the lists again under NCCL's rules, where a send
is no fire-and-forget: each rank's messages run in the order they are posted, and a
send (a batch) completes only once its receive is posted. The executor posts each run of
message in a batch with the others sent at the same time of a clock all ranks share
(`p2p_batches`); one message a batch, in list order, deadlocks 1F1B's steady state.

The split backward (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241):
`B` alone is the whole backward of a (micro-batch, chunk); a schedule may instead split it
into `B` (the gradient of the stage's input: what SEND_B carries, on the critical path) and
`W` (the weight gradients: local, no message, free to move later). A schedule that uses W
uses it everywhere: every (micro-batch, chunk) then has exactly one F, one B and one W on
its rank, in that order, and holds its activations until W (W still needs them).

Invariant: for GPipe, 1F1B and interleaved 1F1B (m a multiple of p) with t_comm = 0
the simulated bubble equals (p-1)/(v*m + p-1) exactly, for any t_f and t_b.
"""

from __future__ import annotations

from typing import NamedTuple

COMPUTE = ("F", "B", "W")  # W: only in a split schedule, where B is the input gradient alone
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ScheduleError(ValueError):
    """A schedule breaks one of the rules stated in `pipeline`'s module docstring."""


class Step(NamedTuple):
    """One instruction: kind in F, B, W, SEND_F, RECV_F, SEND_B, RECV_B; peer is a pipeline rank (-1: none)."""

    kind: str
    mb: int
    chunk: int = 0
    peer: int = -1

    def __repr__(self) -> str:
        c = f".{self.chunk}" if self.chunk else ""
        arrow = "" if self.peer < 0 else ("->" if self.kind.startswith("SEND") else "<-") + str(self.peer)
        return f"{self.kind}{self.mb}{c}{arrow}"


def _pos(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


_KINDS = frozenset(COMPUTE + COMMS)


def _where(r: int, i: int, s: Step) -> str:
    return f"rank {r}, step {i} ({s!r})"


#: where the virtual stages sit. "loop": rank r holds stages r, p + r, 2p + r, ... (Megatron-LM's
#: interleaving: each chunk's pipeline loops from the last rank back to the first). "v": two chunks,
#: rank r holds stages r and 2p-1-r (Qi et al. 2024, section 6: the forward goes down the ranks and
#: comes back up, so rank 0 holds the first stage and the last, and stage p-1 hands on to stage p on
#: the same rank; torch's `generate_stage_to_rank_mapping(p, 2p, style="v")`).
PLACEMENTS = ("loop", "v")


def stage_of(rank: int, chunk: int, p: int, placement: str = "loop") -> int:
    """The virtual stage rank `rank`'s chunk `chunk` holds, of p ranks (see PLACEMENTS)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def rank_of(stage: int, p: int, placement: str = "loop") -> int:
    """The rank that holds virtual stage `stage` (the inverse of stage_of)."""
    if placement == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def _placement(placement: str, chunks: int) -> str:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if placement == "v" and chunks != 2:
        raise ValueError(
            f"placement='v' holds exactly 2 chunks per rank (stages r and 2p-1-r), got chunks={chunks}"
        )
    return placement


def _message(r: int, s: Step, p: int, placement: str = "loop") -> tuple[str, int, int]:
    """(direction, micro-batch, receiving virtual stage) of a send or receive on rank r."""
    vs = stage_of(r, s.chunk, p, placement)
    if s.kind == "SEND_F":
        return ("F", s.mb, vs + 1)
    if s.kind == "RECV_F":
        return ("F", s.mb, vs)
    if s.kind == "SEND_B":
        return ("B", s.mb, vs - 1)
    return ("B", s.mb, vs)  # RECV_B


def validate_schedule(
    schedule: list[list[Step]],
    microbatches: int,
    chunks: int = 1,
    bound: int | None = None,
    *,
    placement: str = "loop",
) -> dict:
    """Check every rule of the module docstring; raise ScheduleError naming the rank and step.

    `placement`: which virtual stages each rank holds (PLACEMENTS), so who sends to whom.

    Returns {"peak_in_flight": per-rank maximum of F done minus B done (minus W done in a split
    schedule: activations are held until W), "split": whether B is split into B and W, "steps": count}.
    """
    m, v = _pos("microbatches", microbatches), _pos("chunks", chunks)
    placement = _placement(placement, v)
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ScheduleError("schedule must be a non-empty list with one list of steps per rank")
    p, last = len(schedule), len(schedule) * v - 1
    # all or nothing: a W anywhere means every B is the input gradient alone and needs its W
    split = any(isinstance(s, Step) and s.kind == "W" for steps in schedule for s in steps)
    done = "W" if split else "B"  # the step that frees a micro-batch's activations
    peaks, sends, recvs, sent_on, recv_on = [], {}, {}, {}, {}
    for r, steps in enumerate(schedule):
        state: dict[tuple[int, int], str] = {}  # (mb, chunk) -> last event: RECV_F, F, RECV_B, B, W
        sent: set[tuple[str, int, int]] = set()
        inflight = peak = 0
        for i, s in enumerate(steps):
            if not isinstance(s, Step) or s.kind not in _KINDS:
                raise ScheduleError(f"{_where(r, i, s)}: not a Step with kind in {_KINDS}")
            if not (0 <= s.mb < m and 0 <= s.chunk < v):
                raise ScheduleError(
                    f"{_where(r, i, s)}: micro-batch must be in [0, {m}) and chunk in [0, {v})"
                )
            key, vs, st = (s.mb, s.chunk), stage_of(r, s.chunk, p, placement), state.get((s.mb, s.chunk))
            if s.kind == "F":
                if st is not None and st != "RECV_F":
                    raise ScheduleError(f"{_where(r, i, s)}: a second forward of this micro-batch")
                if vs > 0 and st != "RECV_F":
                    raise ScheduleError(
                        f"{_where(r, i, s)}: forward before its activation was received (RECV_F)"
                    )
                state[key], inflight = "F", inflight + 1
                peak = max(peak, inflight)
            elif s.kind == "B":
                if st not in ("F", "RECV_B") or (vs < last and st != "RECV_B"):
                    need = "its forward" if st in (None, "RECV_F") else "its gradient (RECV_B)"
                    raise ScheduleError(f"{_where(r, i, s)}: backward before {need} (or a second backward)")
                state[key], inflight = "B", inflight - (0 if split else 1)
            elif s.kind == "W":
                if st != "B":
                    why = "a second W" if st == "W" else "a W before the B of its (micro-batch, chunk)"
                    raise ScheduleError(
                        f"{_where(r, i, s)}: {why} (split backward: F, B, then W on one rank)"
                    )
                state[key], inflight = "W", inflight - 1
            elif s.kind == "RECV_F":
                if st is not None or vs == 0:
                    raise ScheduleError(f"{_where(r, i, s)}: unexpected receive of an activation")
                state[key] = "RECV_F"
            elif s.kind == "RECV_B":
                if st != "F" or vs == last:
                    raise ScheduleError(f"{_where(r, i, s)}: gradient received before the forward, or twice")
                state[key] = "RECV_B"
            else:  # sends go right after the compute that made what they send
                need, bad = ("F", vs == last) if s.kind == "SEND_F" else ("B", vs == 0)
                ok = st == need or (need == "F" and st == "RECV_B") or (need == "B" and st == "W")
                if bad or (s.kind, key) in sent or not ok:
                    raise ScheduleError(
                        f"{_where(r, i, s)}: send without its {need}, twice, or off the pipeline's end"
                    )
                sent.add((s.kind, *key))
            if s.kind in COMMS:
                want = rank_of(vs + (1 if s.kind in ("SEND_F", "RECV_B") else -1), p, placement)
                if s.peer != want:
                    raise ScheduleError(
                        f"{_where(r, i, s)}: peer must be rank {want} (virtual stage {vs} talks to its neighbour)"
                    )
                msg = _message(r, s, p, placement)
                (sends if s.kind.startswith("SEND") else recvs)[msg] = (r, i)
        missing = [(k, c) for k in range(m) for c in range(v) if state.get((k, c)) != done]
        if missing:
            what = "F, B and W (a schedule that uses W needs one per B)" if split else "F and B"
            raise ScheduleError(f"rank {r}: (micro-batch, chunk) {missing[:4]} never completed {what}")
        if any(
            k not in sent
            for k in [
                ("SEND_F", b, c) for b in range(m) for c in range(v) if stage_of(r, c, p, placement) < last
            ]
        ):
            raise ScheduleError(f"rank {r}: a forward whose activation is never sent (SEND_F)")
        if any(
            k not in sent
            for k in [
                ("SEND_B", b, c) for b in range(m) for c in range(v) if stage_of(r, c, p, placement) > 0
            ]
        ):
            raise ScheduleError(f"rank {r}: a backward whose gradient is never sent (SEND_B)")
        if bound is not None and peak > bound:
            raise ScheduleError(f"rank {r}: {peak} micro-batches in flight, more than the bound {bound}")
        peaks.append(peak)
    for msg in sends.keys() ^ recvs.keys():
        side = "sent but never received" if msg in sends else "received but never sent"
        rank, i = sends.get(msg) or recvs[msg]
        raise ScheduleError(f"message {msg} (rank {rank}, step {i}) is {side}")
    simulate(schedule, chunks=v, placement=placement)  # raises on deadlock
    plans = post_plan(schedule, placement=placement)[0]
    # NCCL's rules, batched as the executor posts
    _check_batches(schedule, [[b for _, b in plan] for plan in plans])
    # backends without tags (NCCL) match a link's messages in posting order: the executor's (post_plan),
    # not the list's (a V's link carries chunk 0's activations and chunk 1's gradients, listed out of step)
    for r, plan in enumerate(plans):
        for _, idx in plan:
            for i in idx:
                s = schedule[r][i]
                link = (r, s.peer) if s.kind.startswith("SEND") else (s.peer, r)
                (sent_on if s.kind.startswith("SEND") else recv_on).setdefault(link, []).append(
                    _message(r, s, p, placement)
                )
    for link in sent_on:
        if sent_on[link] != recv_on.get(link):
            raise ScheduleError(
                f"link {link[0]} -> {link[1]}: messages are received in another order than sent"
            )
    return {"peak_in_flight": peaks, "split": split, "steps": sum(len(s) for s in schedule)}


def p2p_batches(
    schedule: list[list[Step]], fused: bool = True, *, placement: str = "loop"
) -> list[list[list[int]]]:
    """Per rank, the SEND/RECV steps posted together, in posting order (lists of step indices).

    `fused`: the executor's plan, a clock shared by all ranks. The lists run once in the
    simulator (F = 1, B = 2, messages free) and every message gets the time it is sent; a rank
    posts one batch per such time, holding its sends made then and its receives of the messages
    its neighbours send then, as torch.distributed.pipelining posts, step by step of its global
    order, the sends and receives that belong together. Both ends of a message post it in the
    batch of the same time. A rank posts the batch of time t before its first compute that starts
    at t or later, so the batch waits only for computes that start before t, and each of those
    waited only for batches of times up to its start: every wait points to an earlier time, and
    no cycle can form, whatever the schedule. Not `fused`: each
    message alone, in list order (what a naive executor posts; 1F1B deadlocks under NCCL).
    Messages to the rank itself (one pipeline rank) need no posting and are left out."""
    if not fused:
        return [
            [[i] for i, s in enumerate(steps) if s.kind in COMMS and s.peer != r]
            for r, steps in enumerate(schedule)
        ]
    return [[b for _, b in plan] for plan in post_plan(schedule, placement=placement)[0]]


def post_plan(
    schedule: list[list[Step]], *, placement: str = "loop"
) -> tuple[list[list[tuple[int, list[int]]]], list[dict[int, int]]]:
    """The executor's plan: per rank, [(time, step indices posted together)] in posting order, and
    {index of each F/B: its start} on the same clock (a batch of time t goes out before the first
    compute that starts at t or later, and before a receive of it is needed)."""
    p = len(schedule)
    sent_at, starts = _clock(schedule, placement)
    plans = []
    for r, steps in enumerate(schedule):
        by_time: dict[int, list[int]] = {}
        for i, s in enumerate(steps):
            if s.kind in COMMS and s.peer != r:
                by_time.setdefault(sent_at[_message(r, s, p, placement)], []).append(i)
        plans.append([(t, by_time[t]) for t in sorted(by_time)])
    return plans, starts


def _clock(schedule: list[list[Step]], placement: str = "loop") -> tuple[dict, list[dict[int, int]]]:
    """Run the lists with integer times (F = 1, B = 2, W = 1, messages free, so times tie exactly):
    when each message is sent, when each compute starts. Raises ScheduleError on a deadlock."""
    sent, spans, _ = _run(schedule, {"F": 1, "B": 2, "W": 1}, 0, placement)
    return sent, [{i: start for start, _, _, _, _, i in rank} for rank in spans]


def check_blocking_sends(schedule: list[list[Step]], fused: bool = True, *, placement: str = "loop") -> None:
    """Raise ScheduleError if the lists deadlock under NCCL's point-to-point rules, posted as the
    executor posts them (`p2p_batches`; `fused=False`: one message at a time, in list order).
    The rules and the model are `comms.p2p.check_blocking_sends`'s: each rank's batches run in
    posting order, and a batch completes once every message in it has its other end posted."""
    _check_batches(schedule, p2p_batches(schedule, fused, placement=placement))


def _check_batches(schedule: list[list[Step]], batches: list[list[list[int]]]) -> None:
    from parallel_lab.comms import check_blocking_sends as check

    logs = [
        [[("send" if steps[j].kind[0] == "S" else "recv", steps[j].peer) for j in b] for b in mine]
        for steps, mine in zip(schedule, batches)
    ]
    try:
        check(logs)
    except RuntimeError as e:
        raise ScheduleError(str(e)) from None


# ----------------------------------------------------------------------------- messages
def add_comms(orders: list[list[Step]], chunks: int = 1, *, placement: str = "loop") -> list[list[Step]]:
    """Insert RECV before and SEND after each compute step that needs them (virtual stage
    `stage_of(r, c, p, placement)`: c*p + r in the default loop placement).

    A split B sends the input gradient as an unsplit B does; W is local and gets no message."""
    p = len(orders)
    last = p * chunks - 1
    placement = _placement(placement, chunks)
    out = []
    for r, order in enumerate(orders):
        steps: list[Step] = []
        for s in order:
            vs = stage_of(r, s.chunk, p, placement)
            up, down = rank_of(vs - 1, p, placement), rank_of(vs + 1, p, placement)  # the neighbours
            if s.kind == "F":
                if vs > 0:
                    steps.append(Step("RECV_F", s.mb, s.chunk, up))
                steps.append(s)
                if vs < last:
                    steps.append(Step("SEND_F", s.mb, s.chunk, down))
            elif s.kind == "B":
                if vs < last:
                    steps.append(Step("RECV_B", s.mb, s.chunk, down))
                steps.append(s)
                if vs > 0:
                    steps.append(Step("SEND_B", s.mb, s.chunk, up))
            elif s.kind == "W":  # weight gradients stay on the rank: nothing to send or receive
                steps.append(s)
            else:
                raise ScheduleError(f"add_comms takes compute steps (F/B/W) only, got {s!r} on rank {r}")
        out.append(steps)
    return out


# ----------------------------------------------------------------------------- simulator
class SimResult(NamedTuple):
    """Per-rank compute spans (start, end, kind, mb, chunk), the makespan and two bubbles.

    `bubble_fraction`: the lab's idle share, 1 - busy / (p * makespan). `bubble_rate`: the
    zero-bubble paper's, (cost - m(T_F + T_B + T_W)) / cost with cost the longest time a rank
    spends from its first compute to its last (a rank that starts late and ends late is not
    charged for it: with the paper's post-validated optimizer step, the next iteration starts
    on each rank as soon as that rank is done).
    `peak_in_flight`: per rank, the most micro-batch-chunks whose F is done and whose W (B when
    the backward is not split) is not: the activations held at once."""

    spans: list[list[tuple[float, float, str, int, int]]]
    makespan: float
    bubble_fraction: float
    bubble_rate: float = 0.0
    peak_in_flight: tuple[int, ...] = ()


def simulate(
    schedule: list[list[Step]],
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_comm: float = 0.0,
    chunks: int = 1,
    *,
    t_w: float = 0.0,
    placement: str = "loop",
) -> SimResult:
    """Run the lists with F = t_f/v and B = t_b/v per chunk, messages arriving t_comm after their send.

    `t_w`: the weight-gradient time. In a schedule that uses W, B costs t_b/v (the input
    gradient) and W costs t_w/v. In one that does not, B is the whole backward and costs
    (t_b + t_w)/v, so the same (t_f, t_b, t_w) compare 1F1B with a zero-bubble schedule as the
    paper does; t_w = 0 (the default) leaves B at t_b/v, as before W existed.
    Sends never block, receives wait: each rank runs until it needs a message not yet
    sent. A full pass in which no rank moves is a deadlock (ScheduleError naming where
    every rank is stuck). Bubble = 1 - busy time / (p * makespan); `bubble_rate` is the
    paper's (see SimResult).
    """
    import math

    if not isinstance(schedule, list) or not schedule:
        raise ValueError("schedule must be a non-empty list with one list of steps per stage")
    for arg, value, lo in (("t_f", t_f, 0.0), ("t_b", t_b, 0.0), ("t_comm", t_comm, 0.0), ("t_w", t_w, 0.0)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < lo
        ):
            raise ValueError(f"{arg} must be a finite number >= {lo:g}, got {value!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    p, v = len(schedule), chunks
    placement = _placement(placement, v)
    split = any(isinstance(s, Step) and s.kind == "W" for steps in schedule for s in steps)
    dur = {"F": t_f / v, "B": t_b / v, "W": t_w / v} if split else {"F": t_f / v, "B": (t_b + t_w) / v}
    try:
        _, spans, t = _run(schedule, dur, t_comm, placement)
    except ScheduleError as e:
        if placement == "loop" and v == 2:  # the likeliest slip: a V's lists simulated in the loop placement
            raise ScheduleError(f"{e} (ZB-V and DualPipeV lists need placement='v')") from None
        raise
    spans = [[span[:5] for span in rank] for rank in spans]
    makespan = max(t) if p else 0.0
    busy = sum(e - s for rank in spans for (s, e, *_) in rank)
    # every rank computes m(T_F + T_B + T_W) in a pipeline schedule, so the mean busy time is that term
    cost = max((rank[-1][1] - rank[0][0] for rank in spans if rank), default=0.0)
    rate = 1.0 - busy / p / cost if cost > 0 else 0.0
    peaks = []
    for steps in schedule:  # cheap: list order is execution order on a rank
        held = peak = 0
        for s in steps:
            held += 1 if s.kind == "F" else -1 if s.kind == ("W" if split else "B") else 0
            peak = max(peak, held)
        peaks.append(peak)
    return SimResult(
        spans, makespan, 1.0 - busy / (p * makespan) if makespan > 0 else 0.0, rate, tuple(peaks)
    )


def _run(
    schedule: list[list[Step]], dur: dict, t_comm: float, placement: str = "loop"
) -> tuple[dict, list[list[tuple]], list]:
    """Run the lists: each rank goes on until it needs a message not yet sent. Returns when each
    message arrives (sent + t_comm), each rank's compute spans (start, end, kind, mb, chunk, step
    index) and each rank's end time. A full pass in which no rank moves is a deadlock."""
    p = len(schedule)
    ptr, t = [0] * p, [0] * p
    spans: list[list[tuple]] = [[] for _ in range(p)]
    arrive: dict[tuple[str, int, int], float] = {}
    while any(ptr[r] < len(schedule[r]) for r in range(p)):
        moved = False
        for r in range(p):
            steps, i, now = schedule[r], ptr[r], t[r]
            while i < len(steps):
                s = steps[i]
                if s.kind in dur:
                    spans[r].append((now, now + dur[s.kind], s.kind, s.mb, s.chunk, i))
                    now += dur[s.kind]
                elif s.kind[0] == "S":  # to the rank itself (stage p-1 -> p in a V): no link, no delay
                    arrive[_message(r, s, p, placement)] = now + (t_comm if s.peer != r else 0.0)
                else:
                    at = arrive.get(_message(r, s, p, placement))
                    if at is None:
                        break
                    now = max(now, at)
                i += 1
            moved |= i != ptr[r]
            ptr[r], t[r] = i, now
        if not moved:
            stuck = ", ".join(
                f"rank {r} at step {ptr[r]} {schedule[r][ptr[r]]!r}"
                for r in range(p)
                if ptr[r] < len(schedule[r])
            )
            raise ScheduleError(f"deadlock: every unfinished rank waits for a message never sent: {stuck}")
    return arrive, spans, t

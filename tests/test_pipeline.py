"""Pipeline parallel: schedules, validator, simulator, executor parity, DP x PP, memory, bubbles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import parallel_lab as pl
from parallel_lab.costmodel import pipeline_bubble_fraction
from parallel_lab.models import build_model, train_reference
from parallel_lab.pipeline import (
    ScheduleError,
    Step,
    add_comms,
    make_schedule,
    max_in_flight,
    order_1f1b,
    post_plan,
    schedule_1f1b,
    schedule_gpipe,
    schedule_interleaved_1f1b,
    simulate,
    validate_schedule,
)
from parallel_lab.pipeline.executor import (
    PipelineConfig,
    reference_batches,
    split_layers,
    stage_modules,
    train_pipeline,
)
from parallel_lab.pipeline.viz import (
    compare_with_torch,
    measured_bubble,
    peak_activation,
    sim_events,
    torch_orders,
)
from parallel_lab.runtime.parallel_dims import ParallelDims
from parallel_lab.runtime.trace import chrome_trace


def assert_tracks_nest(trace: dict) -> None:
    """On every (process, thread) track, any two events are disjoint or nested."""
    tracks: dict = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for key, evs in tracks.items():
        evs.sort(key=lambda x: (x[0], -x[1]))
        open_ends: list = []
        for start, end, name in evs:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"{name} overlaps without nesting on {key}"
            open_ends.append(end)


def test_chrome_trace_gives_overlapping_comm_its_own_track():
    ev = lambda name, kind, a, b: {"rank": 0, "name": name, "kind": kind, "start": a, "end": b, "args": {}}  # noqa: E731
    timeline = [ev("F", "compute", 0, 4), ev("inner", "compute", 1, 2), ev("isend", "comm", 0, 2),
                ev("irecv", "comm", 1, 3), ev("isend", "comm", 2.5, 4)]  # fmt: skip
    trace = chrome_trace(timeline, [])
    assert_tracks_nest(trace)
    tid = {(e["name"], e["ts"]): e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert tid["F", 0] == tid["inner", 1e6] == 1  # nested compute shares the compute track
    assert tid["isend", 0] == 2 and tid["irecv", 1e6] == 4  # the overlapping receive moves over
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"compute", "comm", "comm 2"}


# Forked ranks compute with one thread: the parent has used its OpenMP pool already, and
# libgomp is not fork-safe (a forked rank with more threads can hang).
LAUNCH = {"threads": 1, "timeout": 90}


# ----------------------------------------------------------------------------- schedules
def _grid():
    for p in (1, 2, 3, 4, 5, 8):
        for m in (1, 2, 3, 4, 5, 8, 12, 16):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            for v in (2, 3, 4):
                if m % p == 0:
                    yield "interleaved", p, m, v


def test_validator_accepts_every_generated_schedule_and_peaks_reach_the_bound():
    n = 0
    for name, p, m, v in _grid():
        bound = max_in_flight(name, p, m, v)
        info = validate_schedule(make_schedule(name, p, m, v), m, v, bound)
        assert max(info["peak_in_flight"]) == bound, (name, p, m, v, info["peak_in_flight"])
        n += 1
    assert n == 162


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 64, 256, 1), ("1f1b", 64, 256, 1), ("interleaved", 64, 256, 2),
                                        ("interleaved", 32, 128, 4)])  # fmt: skip
def test_validator_and_simulator_at_scale(name, p, m, v):
    sched = make_schedule(name, p, m, v)
    info = validate_schedule(sched, m, v, max_in_flight(name, p, m, v))
    if name == "1f1b":  # stage s holds p - s micro-batches: the bound p is reached on stage 0 only
        assert info["peak_in_flight"] == [p - s for s in range(p)]
    sim = simulate(sched, chunks=v)
    assert sim.bubble_fraction == pytest.approx(pipeline_bubble_fraction(p, m, v), abs=1e-12)


def _sampled_grid(n: int, seed: int = 0):
    """A seeded sample over the whole range the lesson promises: p <= 64, m <= 256, v <= 4."""
    rng = np.random.default_rng(seed)
    yield "interleaved", 64, 256, 4  # the largest case, and the slowest to validate
    for _ in range(n):
        name = ["gpipe", "1f1b", "interleaved"][rng.integers(3)]
        p = int(rng.integers(1, 65))
        if name == "interleaved":  # interleaving needs m to be a multiple of p
            yield name, p, p * int(rng.integers(1, 256 // p + 1)), int(rng.integers(2, 5))
        else:
            yield name, p, int(rng.integers(1, 257)), 1


def test_validator_on_a_sample_of_the_whole_range():
    """Every send paired, F before B, no deadlock and the in-flight bound reached, on 13 random
    (p, m, v) with p <= 64, m <= 256, v <= 4 (about 7 s: each is validated step by step)."""
    seen = set()
    for name, p, m, v in _sampled_grid(12):
        bound = max_in_flight(name, p, m, v)
        info = validate_schedule(make_schedule(name, p, m, v), m, v, bound)
        assert max(info["peak_in_flight"]) == bound, (name, p, m, v)
        seen.add(name)
    assert seen == {"gpipe", "1f1b", "interleaved"}


def test_simulator_at_p64_m256_v4():
    sched = schedule_interleaved_1f1b(64, 256, 4)  # 131,072 computations, 392,192 steps with the messages
    sim = simulate(sched, chunks=4)
    assert sim.bubble_fraction == pytest.approx(63 / (4 * 256 + 63))


@pytest.mark.parametrize("t_b", [1.0, 2.0, 3.0])
def test_simulated_bubble_equals_formula(t_b):
    for name, p, m, v in _grid():
        sim = simulate(make_schedule(name, p, m, v), t_f=1.0, t_b=t_b, chunks=v)
        # every schedule here keeps each stage busy (m*(t_f+t_b)) and finishes at (v*m + p-1)(t_f+t_b)/v
        assert sim.bubble_fraction == pytest.approx(pipeline_bubble_fraction(p, m, v), abs=1e-9), (
            name,
            p,
            m,
            v,
        )
        assert sim.makespan == pytest.approx((v * m + p - 1) * (1 + t_b) / v)


def test_simulator_events_fill_the_timeline():
    sim = simulate(schedule_1f1b(4, 8))
    ev = sim_events(sim)
    for r in range(4):
        mine = sorted((e for e in ev if e["rank"] == r), key=lambda e: e["start"])
        assert mine[0]["start"] == 0 and mine[-1]["end"] == pytest.approx(sim.makespan * 1e-3)
        assert all(a["end"] == pytest.approx(b["start"]) for a, b in zip(mine, mine[1:]))
        bubble = sum(e["end"] - e["start"] for e in mine if e["kind"] == "bubble") / (sim.makespan * 1e-3)
        assert bubble == pytest.approx(9 / 33, abs=1e-9)  # (p-1)(t_f + t_b) idle out of (m+p-1)(t_f + t_b)


def test_1f1b_order_is_pipedream_flush():
    assert order_1f1b(0, 4, 6) == [Step("F", 0), Step("F", 1), Step("F", 2), Step("F", 3), Step("B", 0),
                                   Step("F", 4), Step("B", 1), Step("F", 5), Step("B", 2), Step("B", 3),
                                   Step("B", 4), Step("B", 5)]  # fmt: skip
    assert order_1f1b(3, 4, 3) == [
        Step("F", 0),
        Step("B", 0),
        Step("F", 1),
        Step("B", 1),
        Step("F", 2),
        Step("B", 2),
    ]


def _swap(sched, r, i, j):
    out = [list(x) for x in sched]
    out[r][i], out[r][j] = out[r][j], out[r][i]
    return out


def test_validator_rejects_broken_schedules():
    good = schedule_1f1b(3, 4)
    with pytest.raises(ScheduleError, match="backward before"):
        validate_schedule([[Step("B", 0), Step("F", 0)]], 1)
    with pytest.raises(ScheduleError, match="never completed"):
        validate_schedule([[Step("F", 0), Step("B", 0)]], 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        # rank 0 sends micro-batch 0 and waits for its gradient; rank 1 waits for micro-batch 1 first
        first = [Step("F", 0), Step("B", 0), Step("F", 1), Step("B", 1)]
        bad = add_comms([first, [Step("F", 1), Step("B", 1), Step("F", 0), Step("B", 0)]])
        validate_schedule(bad, 2)
    with pytest.raises(ScheduleError, match="in flight"):
        validate_schedule(schedule_gpipe(3, 4), 4, bound=3)
    with pytest.raises(ScheduleError, match="peer must be"):
        broken = [list(x) for x in good]
        i = next(k for k, s in enumerate(broken[1]) if s.kind == "SEND_F")
        broken[1][i] = broken[1][i]._replace(peer=0)
        validate_schedule(broken, 4)
    with pytest.raises(ScheduleError, match="never sent|never received|never completed|without"):
        dropped = [list(x) for x in good]
        dropped[0] = [s for s in dropped[0] if not (s.kind == "SEND_F" and s.mb == 2)]
        validate_schedule(dropped, 4)
    with pytest.raises(ScheduleError, match="non-empty"):
        validate_schedule([], 4)
    # stage 1 lists micro-batch 1 first: posted in list order, a backend that pairs a link's messages
    # by order (NCCL) would hand it micro-batch 0's activation. The executor posts by the time each
    # message is sent (post_plan), so both ends post micro-batch 0 first, and the lists are valid.
    stage1 = [Step("F", 1), Step("F", 0), Step("B", 0), Step("B", 1)]
    swapped = add_comms([[Step("F", 0), Step("F", 1), Step("B", 0), Step("B", 1)], stage1])
    validate_schedule(swapped, 2)
    posted = [swapped[1][i] for _, idx in post_plan(swapped)[0][1] for i in idx]
    assert [s.mb for s in posted if s.kind == "RECV_F"] == [0, 1]
    assert [s.mb for s in swapped[1] if s.kind == "RECV_F"] == [1, 0]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        schedule_gpipe(4, 0)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        schedule_1f1b(0, 4)
    with pytest.raises(TypeError, match="microbatches must be an int"):
        schedule_1f1b(4, 2.0)
    with pytest.raises(ValueError, match="multiple of stages"):
        schedule_interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="chunks=2 needs schedule='interleaved'"):
        make_schedule("1f1b", 4, 4, 2)
    with pytest.raises(ValueError, match=r"layers \(10\) must be divisible by stages x chunks = 4 x 2"):
        split_layers(10, 4, 2)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        PipelineConfig(microbatches=0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineConfig(schedule="zero-bubble")
    with pytest.raises(ValueError, match="must equal world_size"):
        ParallelDims(dp=2, pp=3, world_size=4)


# ----------------------------------------------------------------------------- torch's schedules
def test_order_matches_torch_pipelining_where_torch_is_right():
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p + 1):
            assert compare_with_torch("gpipe", p, m) == []
            if m % p == 0:
                for v in (2, 3, 4):
                    assert compare_with_torch("interleaved", p, m, v) == []
            # torch's Schedule1F1B action list (its IR, which the visualizer and the runtime's
            # loader read) numbers the last stage's forwards 1..m: F0 is missing and F_m does not
            # exist. Every other rank matches; the schedule torch executes (_step_microbatches) is right.
            diffs = compare_with_torch("1f1b", p, m)
            assert len(diffs) == 1 and diffs[0].startswith(f"rank {p - 1}:")
            theirs = [s for s in torch_orders("1f1b", p, m)[p - 1] if s.kind == "F"]
            assert [s.mb for s in theirs] == list(range(1, m + 1))


# ----------------------------------------------------------------------------- executor parity
def _reference(cfg: PipelineConfig):
    model = build_model(cfg.model_config, seed=cfg.seed)
    batches = reference_batches(cfg)
    x, y = batches[0]
    out = model(x)
    F.mse_loss(out, y).backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    losses = train_reference(model, batches, cfg.optimizer, cfg.lr, cfg.steps)
    return out.detach(), grads, losses, {n: q.detach() for n, q in model.named_parameters()}


def _merged(result, key):
    out = {}
    for v in result.values:
        out.update(v[key])
    return {n: torch.from_numpy(a) for n, a in out.items()}


def _check_parity(result, cfg, exact=False):
    ref_out, ref_grads, ref_losses, ref_params = _reference(cfg)
    # Micro-batching changes only the order of float additions (the gradient is a sum over
    # micro-batches instead of one matmul over the batch): ~1e-7 relative. Adam divides by
    # sqrt(v), which magnifies that on tiny gradients, hence its looser bound.
    tol = 0.0 if exact else (1e-6 if cfg.optimizer == "sgd" else 2e-5)
    last = [v for v in result.values if v["losses"] is not None]
    dp = len(last)
    losses = [sum(v["losses"][i] for v in last) / dp for i in range(cfg.steps)]
    assert np.allclose(losses, ref_losses, rtol=0, atol=max(tol, 1e-7) if not exact else 0), (
        losses,
        ref_losses,
    )
    outs = [torch.from_numpy(v["outputs"]) for v in sorted(last, key=lambda v: v["coords"]["dp"])]
    torch.testing.assert_close(
        torch.cat(outs), ref_out, rtol=0, atol=tol or 0
    )  # forward: same rows, same ops
    grads, params = _merged(result, "grads"), _merged(result, "params")
    assert grads.keys() == ref_grads.keys() == params.keys()
    for n in ref_grads:
        torch.testing.assert_close(
            grads[n], ref_grads[n], rtol=0, atol=max(tol, 1e-8) if not exact else 0, msg=n
        )
        torch.testing.assert_close(params[n], ref_params[n], rtol=0, atol=tol, msg=n)


@pytest.mark.parametrize(
    "schedule,m,v,world,opt",
    [
        ("naive", 1, 1, 4, "sgd"),
        ("gpipe", 4, 1, 4, "sgd"),
        ("1f1b", 4, 1, 4, "adam"),
        ("1f1b", 2, 1, 4, "sgd"),  # fewer micro-batches than stages
        ("gpipe", 3, 1, 4, "sgd"),  # a micro-batch count that is not a power of two
        ("interleaved", 4, 2, 4, "sgd"),
        ("interleaved", 2, 4, 2, "adam"),  # p = 2: activations and gradients share each link
        ("interleaved", 3, 2, 1, "sgd"),  # p = 1: every message goes to ourselves
    ],
)
def test_pipeline_parity_with_single_process(schedule, m, v, world, opt):
    cfg = PipelineConfig(schedule=schedule, microbatches=m, chunks=v, layers=8, batch=12 if m == 3 else 16,
                         optimizer=opt, lr=0.05 if opt == "sgd" else 0.01)  # fmt: skip
    result = pl.launch(train_pipeline, world, cfg, **LAUNCH)
    _check_parity(result, cfg, exact=schedule == "naive")  # one micro-batch = the same ops, bit for bit
    assert_tracks_nest(chrome_trace(result.timeline, result.memory))  # Perfetto draws it right
    # bytes: every activation and every gradient crossing a link is (b, hidden) fp32
    b = cfg.batch // m
    sched = make_schedule(schedule, world, m, v)
    for r in range(world):
        sends = sum(1 for s in sched[r] if s.kind.startswith("SEND") and s.peer != r)
        assert (
            result.comm_bytes[r]["by_op"].get("isend", {}).get("sent", 0)
            == sends * cfg.steps * b * cfg.hidden * 4
        )


def test_matches_torch_distributed_pipelining():
    """Side by side with torch's PipelineStage + schedules on gloo: the same losses and parameters."""

    def torch_pp(ctx, cfg, name):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        p, r, v = ctx.world_size, ctx.rank, cfg.chunks
        mods, params = stage_modules(build_model(cfg.model_config, seed=cfg.seed), p, v, r)
        stages = [PipelineStage(mods[c], c * p + r, p * v, ctx.device) for c in range(v)]
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[name]
        sched = cls(stages if v > 1 else stages[0], cfg.microbatches, loss_fn=F.mse_loss)
        opt = torch.optim.SGD([q for mod in mods.values() for q in mod.parameters()], lr=cfg.lr)
        losses = []
        for x, y in reference_batches(cfg):
            got: list = []
            sched.step(*([x] if r == 0 else []), **({"target": y, "losses": got} if r == p - 1 else {}))
            opt.step()
            opt.zero_grad()
            losses.append(sum(t.item() for t in got) / len(got) if got else None)
        return losses, {n: q.detach().numpy().copy() for n, q in params.items()}

    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        cfg = PipelineConfig(schedule=name, microbatches=4, chunks=v, layers=8)
        theirs = pl.launch(torch_pp, 4, cfg, name, **LAUNCH)
        ours = pl.launch(train_pipeline, 4, cfg, **LAUNCH)
        t_params = {k: a for val in theirs.values for k, a in val[1].items()}
        o_params = {k: a for val in ours.values for k, a in val["params"].items()}
        # same ops in the same order (torch scales the gradient by 1/m, we scale the loss: exact in fp32 for m = 4)
        assert theirs.values[3][0] == ours.values[3]["losses"]
        assert all(np.array_equal(t_params[k], o_params[k]) for k in o_params), name


# ----------------------------------------------------------------------------- DP x PP
def test_dp_x_pp_gradient_sync():
    """2 x 2 on 4 ranks: stages are averaged over DP once, after the last micro-batch's backward."""
    dims = ParallelDims(dp=2, pp=2)
    cfg = PipelineConfig(schedule="1f1b", microbatches=4, layers=8, batch=16)
    right = pl.launch(train_pipeline, 4, cfg, dims, **LAUNCH)
    _check_parity(right, cfg)
    chatty = pl.launch(
        train_pipeline, 4, PipelineConfig(**{**cfg.__dict__, "dp_sync": "every_microbatch"}), dims, **LAUNCH
    )
    _check_parity(chatty, cfg)  # an all-reduce per micro-batch: right answer ...
    for r in range(4):
        once = right.comm_bytes[r]["by_op"]["all_reduce"]
        every = chatty.comm_bytes[r]["by_op"]["all_reduce"]
        assert once["calls"] == cfg.steps and every["calls"] == cfg.steps * cfg.microbatches
        assert every["sent"] == cfg.microbatches * once["sent"]  # ... m times the bytes
        n = sum(a.size for a in right.values[r]["params"].values())
        assert once["sent"] == cfg.steps * n * 4  # ring all-reduce over 2 ranks: 2(2-1)/2 * n floats
    unsynced = pl.launch(
        train_pipeline, 4, PipelineConfig(**{**cfg.__dict__, "dp_sync": "none"}), dims, **LAUNCH
    )
    by_stage = {}
    for v in unsynced.values:  # forgetting the sync: the two replicas of a stage drift apart
        by_stage.setdefault(v["coords"]["pp"], []).append(v["params"])
    for a, b in by_stage.values():
        assert any(not np.allclose(a[k], b[k]) for k in a)
    assert [v["coords"] for v in right.values] == [{"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 1, "tp": 0},
                                                    {"pp": 1, "dp": 0, "tp": 0}, {"pp": 1, "dp": 1, "tp": 0}]  # fmt: skip


# ----------------------------------------------------------------------------- memory and bubbles
def test_gpipe_activations_grow_with_m_1f1b_stays_bounded():
    b, h = 16, 256
    unit = 5 * b * h * 4  # a middle stage saves (2k + 1) (b, h) tensors per micro-batch, k = 2 layers
    peaks = {}
    for name in ("gpipe", "1f1b"):
        for m in (4, 12):
            cfg = PipelineConfig(schedule=name, microbatches=m, layers=8, hidden=h, batch=m * b, steps=2)
            peaks[name, m] = peak_activation(
                pl.launch(train_pipeline, 4, cfg, track_memory=True, **LAUNCH), step=1
            )
    for r in (1, 2):
        grown = (peaks["gpipe", 12][r] - peaks["gpipe", 4][r]) / unit
        assert grown == pytest.approx(8, rel=0.1), (
            f"rank {r}: GPipe holds 8 more micro-batches, saw {grown:.2f}"
        )
        flat = (peaks["1f1b", 12][r] - peaks["1f1b", 4][r]) / unit
        # growth by one micro-batch or more would be a schedule bug (GPipe grows by 8); below that, what
        # varies with timing is the receives in flight when the peak is taken (up to two (b, h) buffers,
        # 0.4 units) and backward's temporaries: 0.33 units was seen on a loaded machine
        assert abs(flat) < 1.0, f"rank {r}: 1F1B's activations should not grow with m, grew {flat:.2f} units"
        assert peaks["1f1b", 12][r] < (4 - r + 1.5) * unit  # p - r in flight, plus backward temporaries


def test_measured_bubble_within_five_points_of_formula():
    """Every F bar padded to 30 ms, every B bar to 60 ms (an emulated device; for interleaved a bar
    is one chunk, so compute_time per stage is v x 30 ms) so compute dominates message latency.

    Latency on a busy machine only ever adds idle time, so a run is a sample and the smallest
    is the estimate: a configuration outside the band gets up to two more runs."""
    rows = []
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for m in (4, 16):  # a large bubble and a small one
            cfg = PipelineConfig(schedule=name, microbatches=m, chunks=v, layers=8, batch=4 * m, steps=1,
                                 compute_time=0.03 * v)  # fmt: skip
            want, got = pipeline_bubble_fraction(4, m, v), 1.0
            for _ in range(3):
                result = pl.launch(train_pipeline, 4, cfg, **LAUNCH)
                got = min(got, *(measured_bubble(result, step) for step in range(cfg.steps)))
                if -0.02 < got - want < 0.05:
                    break
            rows.append((name, m, got, want))
    bad = [r for r in rows if not -0.02 < r[2] - r[3] < 0.05]
    assert not bad, "\n".join(f"{n} m={m}: measured {g:.3f}, formula {f:.3f}" for n, m, g, f in bad)

"""Zero-bubble pipelines (Qi et al. 2024): the split backward in the validator and the simulator,
ZB-H1 / ZB-H2 against the paper's bubble sizes and memory, ZB-H1 against torch's order."""

from __future__ import annotations

import itertools

import pytest

from parallel_lab.pipeline import (
    ScheduleError,
    Step,
    add_comms,
    check_blocking_sends,
    make_schedule,
    max_in_flight,
    order_1f1b,
    order_zb_h1,
    order_zb_h2,
    schedule_1f1b,
    schedule_zb_h1,
    schedule_zb_h2,
    simulate,
    split_backward,
    validate_schedule,
)

NAMES = ("zb-h1", "zb-h2")


def _grid():
    """p 2..8, m p..3p: every stage count the lesson draws, fewer to three times more micro-batches."""
    for p in range(2, 9):
        for m in range(p, 3 * p + 1):
            yield p, m


def _1f1b_split(p: int, m: int) -> list[list[Step]]:
    return add_comms([split_backward(order_1f1b(r, p, m)) for r in range(p)])


def _bubble(sim, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """The paper's bubble size: the longest stage span (first compute to last) minus m(T_F + T_B + T_W)."""
    cost = max(rank[-1][1] - rank[0][0] for rank in sim.spans)
    return cost - m * (t_f + t_b + t_w)


# ----------------------------------------------------------------------------- validator
def test_validator_accepts_zb_schedules_and_every_stage_reaches_the_bound():
    for name in NAMES:
        for p, m in _grid():
            bound = max_in_flight(name, p, m)
            info = validate_schedule(make_schedule(name, p, m), m, bound=bound)
            assert info["split"] and info["peak_in_flight"] == [bound] * p, (name, p, m, info)
    assert (max_in_flight("zb-h1", 4, 8), max_in_flight("zb-h2", 4, 8)) == (4, 7)  # p, and the paper's 2p-1


def test_unsplit_schedules_are_unchanged():
    info = validate_schedule(schedule_1f1b(4, 8), 8, bound=4)
    assert not info["split"] and info["peak_in_flight"] == [4, 3, 2, 1]
    assert all(s.kind != "W" for rank in schedule_1f1b(4, 8) for s in rank)


def _edit(sched, r, fn):
    out = [list(x) for x in sched]
    out[r] = fn(out[r])
    return out


def test_validator_rejects_broken_split_schedules():
    good = schedule_zb_h1(3, 4)
    validate_schedule(good, 4)

    def w_first(steps):  # rank 2's W of micro-batch 1 moved just before its B
        i = steps.index(Step("W", 1))
        steps.insert(steps.index(Step("B", 1)), steps.pop(i))
        return steps

    with pytest.raises(ScheduleError, match="rank 2, step .* W before the B"):
        validate_schedule(_edit(good, 2, w_first), 4)
    with pytest.raises(ScheduleError, match=r"rank 1: .*\(1, 0\).* never completed F, B and W"):
        validate_schedule(_edit(good, 1, lambda s: [x for x in s if x != Step("W", 1)]), 4)
    moved = _edit(good, 1, lambda s: [x for x in s if x != Step("W", 3)])
    moved[2].append(Step("W", 3))  # rank 1's W done by rank 2, which has its own W3 already
    with pytest.raises(ScheduleError, match="never completed F, B and W|a second W"):
        validate_schedule(moved, 4)
    with pytest.raises(ScheduleError, match="rank 2, step .* a second W"):
        validate_schedule(moved[:1] + [good[1]] + moved[2:], 4)
    # one W anywhere makes the whole schedule split: the 1F1B ranks' B's now need their W
    mixed = [good[0]] + [list(x) for x in schedule_1f1b(3, 4)[1:]]
    with pytest.raises(ScheduleError, match="rank 1: .* never completed F, B and W"):
        validate_schedule(mixed, 4)
    with pytest.raises(ScheduleError, match="in flight, more than the bound 3"):
        validate_schedule(schedule_zb_h2(3, 6), 6, bound=max_in_flight("zb-h1", 3, 6))


def test_add_comms_sends_nothing_for_w():
    sched = schedule_zb_h1(4, 8)
    for r, (steps, order) in enumerate(zip(sched, (order_zb_h1(r, 4, 8) for r in range(4)))):
        assert [s for s in steps if s.kind in ("F", "B", "W")] == order
        assert sum(s.kind.startswith("SEND") for s in steps) == 8 * ((r < 3) + (r > 0))
        # the gradient leaves right after B, before any W: W is off the critical path
        assert all(steps[i + 1].kind == "SEND_B" for i, s in enumerate(steps) if s.kind == "B" and r > 0)


def test_no_deadlock_and_nccl_rules_hold():
    for name in NAMES:
        for p, m in _grid():
            sched = make_schedule(name, p, m)
            simulate(sched, 1.0, 1.0, t_w=1.0)  # raises ScheduleError on a deadlock
            check_blocking_sends(sched)  # batched as the executor posts them, under NCCL's rules


# ----------------------------------------------------------------------------- bubbles
def test_bubble_sizes_with_equal_times_are_the_papers():
    """T_F = T_B = T_W = 1, t_comm = 0: 1F1B 3(p-1), ZB-H1 (p-1) (a third), ZB-H2 0 (m >= 2p-1)."""
    for p, m in _grid():
        unsplit = simulate(schedule_1f1b(p, m), 1.0, 1.0, t_w=1.0)
        assert _bubble(unsplit, m, 1, 1, 1) == pytest.approx(3 * (p - 1))
        assert unsplit.bubble_rate == pytest.approx(3 * (p - 1) / (3 * m + 3 * (p - 1)))
        split = simulate(_1f1b_split(p, m), 1.0, 1.0, t_w=1.0)
        assert _bubble(split, m, 1, 1, 1) == pytest.approx(2 * (p - 1))  # the gradient leaves before W
        h1 = simulate(schedule_zb_h1(p, m), 1.0, 1.0, t_w=1.0)
        assert _bubble(h1, m, 1, 1, 1) == pytest.approx(p - 1)
        assert h1.bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1))
        if m >= 2 * p - 1:  # fewer micro-batches cannot fill ZB-H2's 2p-1 warm-up forwards
            h2 = simulate(schedule_zb_h2(p, m), 1.0, 1.0, t_w=1.0)
            assert _bubble(h2, m, 1, 1, 1) == pytest.approx(0, abs=1e-9)
            assert h2.bubble_rate == pytest.approx(0, abs=1e-12)
            assert h2.bubble_fraction > 0  # the lab's idle share still counts the parallelogram's corners


def test_bubble_sizes_with_unequal_times():
    """The same formulas for unequal times where they hold: ZB-H1 needs T_W <= T_F (a delayed W
    fills a wait of one F), ZB-H2 T_W <= T_F and 2 T_W <= T_F + T_B; 1F1B always. Exactly there: outside,
    the formula promises less than the schedule gives."""
    times = list(itertools.product((0.5, 1.0, 1.5, 2.0), repeat=3))
    for p in (2, 3, 4, 6):
        for m in sorted({p, 2 * p - 1, 2 * p, 3 * p}):
            scheds = schedule_1f1b(p, m), _1f1b_split(p, m), schedule_zb_h1(p, m), schedule_zb_h2(p, m)
            for t_f, t_b, t_w in times:
                got = [_bubble(simulate(s, t_f, t_b, t_w=t_w), m, t_f, t_b, t_w) for s in scheds]
                case = (p, m, t_f, t_b, t_w)
                assert got[0] == pytest.approx((p - 1) * (t_f + t_b + t_w)), case
                assert got[1] == pytest.approx((p - 1) * (t_f + t_b)), case
                h1 = (p - 1) * (t_f + t_b - t_w)
                assert got[2] == pytest.approx(h1) if t_w <= t_f else got[2] > h1 + 1e-9, case
                if m >= 2 * p - 1:
                    h2 = (p - 1) * (t_f + t_b - 2 * t_w)
                    fits = t_w <= t_f and 2 * t_w <= t_f + t_b
                    assert got[3] == pytest.approx(h2, abs=1e-9) if fits else got[3] > h2 + 1e-9, case
    # where the condition fails, the formula promises less than the schedule gives
    assert _bubble(simulate(schedule_zb_h1(4, 8), 1.0, 1.0, t_w=2.0), 8, 1, 1, 2) > 3 * (1 + 1 - 2)


def test_simulator_peak_in_flight_equals_the_bound():
    for name in NAMES:
        for p, m in _grid():
            assert simulate(make_schedule(name, p, m)).peak_in_flight == (max_in_flight(name, p, m),) * p
    assert simulate(schedule_1f1b(4, 8)).peak_in_flight == (4, 3, 2, 1)  # unsplit: F done, B not
    assert simulate(_1f1b_split(4, 8)).peak_in_flight == (4, 3, 2, 1)  # W right after B holds nothing more


def test_t_w_default_and_unsplit_cost():
    s = schedule_1f1b(3, 6)
    base = simulate(s, 1.0, 2.0)
    assert simulate(s, 1.0, 2.0, t_w=0.0) == base  # every call without t_w is unchanged
    # unsplit, B is the whole backward: t_b + t_w, the same timeline as t_b' = t_b + t_w
    assert simulate(s, 1.0, 1.5, t_w=0.5).spans == base.spans
    # split, W costs t_w alone
    spans = simulate(schedule_zb_h1(3, 6), 1.0, 1.5, t_w=0.5).spans
    assert {(k, round(e - b, 9)) for rank in spans for b, e, k, *_ in rank} == {
        ("F", 1),
        ("B", 1.5),
        ("W", 0.5),
    }
    with pytest.raises(ValueError, match="t_w must be a finite number >= 0"):
        simulate(s, t_w=-1.0)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"stage must be an int in \[0, stages=4\)"):
        order_zb_h1(4, 4, 8)
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        schedule_zb_h2(4, 0)
    with pytest.raises(ValueError, match="chunks=2 needs schedule='interleaved'"):
        make_schedule("zb-h1", 4, 8, 2)
    with pytest.raises(ScheduleError, match="without W"):
        split_backward(order_zb_h1(0, 2, 2))


# ----------------------------------------------------------------------------- orders
def test_orders_for_p4_m8():
    def steps(text):
        return [Step(t[0], int(t[1:])) for t in text.split()]

    # ZB-H1: stage 0 is 1F1B with each W right after its B; stage 3 delays its first 3 W's to the end
    assert order_zb_h1(0, 4, 8) == steps(
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    )
    assert order_zb_h1(3, 4, 8) == steps(
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    )
    # ZB-H2: 2p-1 = 7 forwards before stage 0's first B; stage 3 delays 2(p-1) = 6 W's
    assert order_zb_h2(0, 4, 8) == steps(
        "F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7"
    )
    assert order_zb_h2(3, 4, 8) == steps(
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7"
    )


@pytest.fixture(scope="module")
def mocked_stage():
    """A PipelineStage mock as `_schedule_visualizer.get_schedule_ops` makes (made once: autospec is slow)."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage

    return mock.create_autospec(PipelineStage, instance=True)


def _torch_zb_orders(stage, p: int, m: int) -> list[list[Step]]:
    """torch's ScheduleInterleavedZeroBubble on one stage per rank, built on a mocked stage as
    `get_schedule_ops` does (which refuses one stage per rank for this class); nothing runs."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p
    order = ScheduleInterleavedZeroBubble([stage], m).pipeline_order
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    return [[Step(kinds[a.computation_type.name], a.microbatch_index) for a in order[r] if a is not None]
            for r in range(p)]  # fmt: skip


def test_zb_h1_order_equals_torchs_interleaved_zero_bubble_on_one_stage_per_rank(mocked_stage):
    compared = 0
    for p in range(2, 9):
        for m in range(1, 3 * p + 1):
            if m % max(1, m // p):  # torch's rule: m a multiple of its rounds, max(1, m // p)
                with pytest.raises(ValueError, match="multiple of the number of rounds"):
                    _torch_zb_orders(mocked_stage, p, m)
                continue
            assert _torch_zb_orders(mocked_stage, p, m) == [order_zb_h1(r, p, m) for r in range(p)], (p, m)
            compared += 1
    assert compared == 89  # of the 105 (p, m); torch refuses the other 16


def test_the_executor_takes_the_split_schedules():
    """The executor splits B from W, so configs and the pipeline / three_d scripts take ZB-H1, ZB-H2,
    ZB-V and DualPipeV."""
    from parallel_lab.pipeline import SCHEDULES, SIMULATED_SCHEDULES, PipelineConfig
    from parallel_lab.three_d.run import ThreeDConfig

    assert {*NAMES, *V_NAMES} <= set(SCHEDULES) and set(SIMULATED_SCHEDULES) == set(SCHEDULES)
    for name in (*NAMES, *V_NAMES):
        assert PipelineConfig(schedule=name, microbatches=8).schedule == name
        assert ThreeDConfig(schedule=name).schedule == name
    with pytest.raises(ValueError, match="PipelineConfig.schedule must be one of"):
        PipelineConfig(schedule="zb-2p")


# ----------------------------------------------------------------------------- the split backward
def _split_vs_whole(mod, x, g):
    """(B's input gradient, .grad after B, after W) of SplitBackward, beside one whole backward on a copy."""
    import copy

    import torch

    from parallel_lab.pipeline import SplitBackward

    ref = copy.deepcopy(mod)
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    ref(xr).backward(g)
    work = SplitBackward(mod(x), g, x)
    dx = work.input_grad()
    after_b = [q.grad for q in mod.parameters()]
    owners = work.owners
    work.weight_grads()
    for a, b in zip(mod.parameters(), ref.parameters()):  # bit for bit (None where the weight is frozen)
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
    assert (dx is None) == (xr.grad is None) and (dx is None or torch.equal(dx, xr.grad))
    return owners, after_b


def test_split_backward_b_computes_no_weight_gradient_and_w_equals_the_whole_backward():
    import torch
    import torch.nn as nn

    from parallel_lab.models import MLPConfig, build_model
    from parallel_lab.pipeline import stage_modules

    torch.manual_seed(0)
    mods, _ = stage_modules(build_model(MLPConfig(16, 64, 4, 8), seed=0), 4, 1, 1)  # a middle stage, 2 layers
    owners, after_b = _split_vs_whole(mods[0], torch.randn(4, 64, requires_grad=True), torch.randn(4, 64))
    assert all(g is None for g in after_b)  # B left the weights alone ...
    # ... and each Linear's node owns its own weight and bias
    assert [type(n).__name__ for n, _ in owners] == ["AddmmBackward0"] * 2
    # the first virtual stage: its input is the data, B has nothing to do, W runs the whole backward
    mods, _ = stage_modules(build_model(MLPConfig(16, 64, 4, 8), seed=0), 4, 1, 0)
    owners, after_b = _split_vs_whole(mods[0], torch.randn(4, 16), torch.randn(4, 64))
    assert owners is None and all(g is None for g in after_b)
    # a weight used twice in one stage: two owners reach it, so W leaves the sum to the engine (still exact)
    lin = nn.Linear(8, 8)
    owners, _ = _split_vs_whole(nn.Sequential(lin, nn.GELU(), lin), torch.randn(3, 8, requires_grad=True),
                                torch.randn(3, 8))  # fmt: skip
    assert owners is None
    # a frozen weight is no one's: W skips it, as the whole backward does
    mods, _ = stage_modules(build_model(MLPConfig(16, 64, 4, 8), seed=0), 4, 1, 2)
    mods[0][0].linear.weight.requires_grad_(False)
    owners, _ = _split_vs_whole(mods[0], torch.randn(4, 64, requires_grad=True), torch.randn(4, 64))
    assert mods[0][0].linear.weight.grad is None and sum(len(ps) for _, ps in owners) == 3


def test_b_runs_only_the_input_matmuls_and_w_only_the_weight_ones():
    """Counted at the dispatcher on a middle stage of two Linears: B runs one matmul per Linear (the
    input's), W one per Linear (the weight's), together what one whole backward runs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallel_lab.models import MLPConfig, build_model
    from parallel_lab.pipeline import SplitBackward, stage_modules

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.mm += func.__name__.split(".")[0] in ("mm", "addmm", "bmm")
            return func(*args, **(kwargs or {}))

    mods, _ = stage_modules(build_model(MLPConfig(16, 64, 4, 8), seed=0), 4, 1, 1)
    x, g = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64)
    work = SplitBackward(mods[0](x), g, x)
    with Count() as in_b:
        work.input_grad()
    with Count() as in_w:
        work.weight_grads()
    whole_x = x.detach().requires_grad_()
    with Count() as whole:
        mods[0](whole_x).backward(g)
    whole.mm -= 2  # the forward's two matmuls, counted inside that mode too
    assert (in_b.mm, in_w.mm, whole.mm) == (2, 2, 4)


def test_a_python_function_on_the_graph_makes_w_run_the_whole_backward():
    """A Python autograd Function that owns a parameter computes every gradient it returns: splitting
    at it would run its backward (and any collective inside) in B and again in W, so the split falls
    back, still exact. (Tensor parallelism's f and g take no parameter: the 3D test keeps them split.)"""
    import torch
    import torch.nn as nn

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, (g * x).sum(0)

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.w = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

        def forward(self, x):
            return Scale.apply(self.lin(x), self.w)

    owners, _ = _split_vs_whole(Stage(), torch.randn(3, 8, requires_grad=True), torch.randn(3, 8))
    assert owners is None


def _merged_np(result, key):
    out = {}
    for v in result.values:
        out.update(v[key])
    return out


@pytest.mark.parametrize("world,opt", [(4, "sgd"), (2, "adam")])
def test_zero_bubble_runs_equal_1f1b_bit_for_bit_and_the_single_process_model(world, opt):
    """ZB-H1 and ZB-H2 on real ranks: every W accumulates its micro-batch's weight gradients in
    1F1B's order (0..m-1) with the same kernels, so losses, gradients and parameters equal 1F1B's
    bit for bit; against one process on the whole batch, the lab's micro-batching tolerance."""
    import numpy as np
    from test_pipeline import LAUNCH, _check_parity, assert_tracks_nest

    import parallel_lab as pl
    from parallel_lab.pipeline import PipelineConfig, train_pipeline
    from parallel_lab.runtime.trace import chrome_trace

    m = 2 * world  # ZB-H2's 2p-1 warm-up forwards fit
    kw = dict(microbatches=m, layers=8, batch=2 * m, optimizer=opt, lr=0.05 if opt == "sgd" else 0.01)
    base = pl.launch(train_pipeline, world, PipelineConfig(schedule="1f1b", **kw), **LAUNCH)
    for name in NAMES:
        cfg = PipelineConfig(schedule=name, **kw)
        result = pl.launch(train_pipeline, world, cfg, **LAUNCH)
        _check_parity(result, cfg)
        assert result.values[-1]["losses"] == base.values[-1]["losses"], name
        for key in ("grads", "params"):
            ours, theirs = _merged_np(result, key), _merged_np(base, key)
            assert ours.keys() == theirs.keys()
            assert all(np.array_equal(ours[n], theirs[n]) for n in ours), (name, key)
        assert_tracks_nest(chrome_trace(result.timeline, result.memory))
        # every (rank, step, micro-batch) has one B and one W span, the W after its B
        spans = {}
        for e in result.timeline:
            if e["kind"] == "compute" and e["name"] in ("B", "W"):
                k = (e["rank"], e["args"]["step"], e["args"]["mb"])
                assert e["name"] not in spans.setdefault(k, {}), (name, k)
                spans[k][e["name"]] = e
        assert len(spans) == world * cfg.steps * m, name
        assert all(d["W"]["start"] >= d["B"]["end"] for d in spans.values()), name


def test_zero_bubble_in_three_d_equals_1f1b_bit_for_bit():
    """Tensor-parallel TinyGPT stages (all-reduces inside the backward, on the path to the input: B
    runs them, W does not) with tied embeddings across the first and last stage: 1F1B's numbers."""
    import numpy as np
    from test_pipeline import LAUNCH

    import parallel_lab as pl
    from parallel_lab.runtime.parallel_dims import ParallelDims
    from parallel_lab.three_d.run import ThreeDConfig, train_3d

    runs = {name: pl.launch(train_3d, 4, ThreeDConfig(schedule=name, steps=2), ParallelDims(tp=2, pp=2), **LAUNCH)
            for name in ("1f1b", "zb-h2")}  # fmt: skip
    for a, b in zip(runs["1f1b"].values, runs["zb-h2"].values):
        assert a["losses"] == b["losses"]
        assert all(np.array_equal(a[k][n], b[k][n]) for k in ("grads", "params") for n in a[k])
    # and W repeats no collective: every rank sends what it sends under 1F1B, byte for byte
    assert [c["sent"] for c in runs["1f1b"].comm_bytes] == [c["sent"] for c in runs["zb-h2"].comm_bytes]


def test_zb_h2_holds_more_activations_than_zb_h1_on_the_first_stage():
    """Measured by the memory tracker on 4 ranks, m = 8: ZB-H1 keeps 1F1B's peak on stage 0 (p = 4
    micro-batches), ZB-H2 holds 2p-1 = 7 there, 7/4 of it."""
    from test_pipeline import LAUNCH

    import parallel_lab as pl
    from parallel_lab.pipeline import PipelineConfig, peak_activation, train_pipeline

    b, h = 16, 256
    peaks = {}
    for name in ("1f1b", *NAMES):
        cfg = PipelineConfig(schedule=name, microbatches=8, layers=8, hidden=h, batch=8 * b, steps=2)
        peaks[name] = peak_activation(pl.launch(train_pipeline, 4, cfg, track_memory=True, **LAUNCH), step=1)
    unit = 5 * b * h * 4  # a middle stage's (b, h) tensors saved per micro-batch, as in test_pipeline
    assert abs(peaks["zb-h1"][0] - peaks["1f1b"][0]) < unit, peaks
    assert 1.5 < peaks["zb-h2"][0] / peaks["zb-h1"][0] < 2.0, peaks
    assert all(h2 > h1 for h1, h2 in zip(peaks["zb-h1"], peaks["zb-h2"])), peaks


@pytest.mark.parametrize("world", [2, 4])
def test_measured_bubble_within_three_points_of_the_simulator_fed_with_measured_times(world):
    """Real ranks against the simulator given the run's own F, B, W and message times
    (`measure_against_simulator`, which reruns a run that came out slower than simulated by the margin,
    three runs at most; one faster by the margin fails at once)."""
    from test_pipeline import LAUNCH

    from parallel_lab.pipeline import PipelineConfig, measure_against_simulator, measured_times

    m = 2 * world
    for name in ("1f1b", *NAMES, "zb-v") if world == 4 else ("zb-h1",):
        v = 2 if name == "zb-v" else 1
        # a V's chunk is half a stage: 40 ms per stage keeps each F, B and W at 20 ms, as the others
        cfg = PipelineConfig(
            schedule=name, microbatches=m, layers=8, batch=4 * m, steps=3, compute_time=0.02 * v
        )
        got = measure_against_simulator(cfg, world, backend="gloo", **LAUNCH)
        assert measured_times(got.run, got.best) == got.times  # the spans name their stage, not the placement
        assert got.times["t_w"] > 0 if name != "1f1b" else got.times["t_w"] == 0, got.times
        assert abs(got.measured - got.simulated) < 0.03, (name, world, got.attempts, got.times)


def test_the_planner_charges_the_zero_bubble_schedules_their_bubble_and_memory():
    """evaluate(schedule=...): ZB-H1 the same activations as 1F1B and a smaller bubble, ZB-H2 (2p-1)/p of
    the activations and a smaller one still; the sizes are zero_bubble_size's, which equals the simulator
    inside its conditions and bounds it from above (1F1B's bubble) outside them."""
    from parallel_lab.costmodel import A100_80GB, GPT3, ClusterSpec, evaluate, zero_bubble_size

    cluster = ClusterSpec(gpus=64, gpus_per_node=8, gpu=A100_80GB)
    args = dict(dp=2, tp=8, pp=4, zero=1, checkpointing=False, global_batch=64, micro_batch=1)
    plans = {s: evaluate(GPT3, cluster, schedule=s, **args) for s in ("1f1b", "zb-h1", "zb-h2")}
    assert plans["zb-h1"].memory["activation"] == plans["1f1b"].memory["activation"]
    assert plans["zb-h2"].memory["activation"] == pytest.approx(plans["1f1b"].memory["activation"] * 7 / 4)
    assert plans["zb-h2"].time["bubble"] < plans["zb-h1"].time["bubble"] < plans["1f1b"].time["bubble"]
    assert all(p.schedule == s for s, p in plans.items())
    one = evaluate(
        GPT3, ClusterSpec(gpus=8, gpus_per_node=8, gpu=A100_80GB), 1, 8, 1, 3, True, 8, schedule="zb-h1"
    )
    assert one.time["bubble"] == 0.0
    with pytest.raises(ValueError, match="schedule must be one of"):
        evaluate(GPT3, cluster, schedule="zb-v", **args)
    with pytest.raises(ValueError, match="one chunk per stage"):
        evaluate(GPT3, cluster, schedule="zb-h1", chunks=2, **args)
    for p, m, t in itertools.product((2, 4), (1, 3, 4, 7, 8), itertools.product((0.5, 1.0, 2.0), repeat=3)):
        for name in NAMES:
            sim = simulate(make_schedule(name, p, m), *t[:2], t_w=t[2])
            size = _bubble(sim, m, *t)
            want, why = zero_bubble_size(name, p, m, *t)
            assert size == pytest.approx(want) if not why else size <= want + 1e-9, (name, p, m, t, why)


# ----------------------------------------------------------------------------- ZB-V and DualPipeV
V_NAMES = ("zb-v", "dualpipev")


def _v(name: str, p: int, m: int) -> list[list[Step]]:
    return make_schedule(name, p, m)


def test_v_orders_equal_torchs_rank_by_rank_and_validate():
    """ZB-V from m = 1 and DualPipeV from m = 2p (its rule), p = 1..8: torch 2.13's
    ScheduleZBVZeroBubble / ScheduleDualPipeV, rank by rank (FULL_BACKWARD = B then W, an
    OVERLAP_F_B = its F then its full backward); valid with the V placement, every link in posting
    order, no deadlock under NCCL's rules, and each rank's peak at the schedule's bound."""
    import warnings

    from parallel_lab.pipeline import compare_with_torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p in range(1, 9):
            for m in sorted({1, p, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 1}):
                for name in V_NAMES:
                    if name == "dualpipev" and m < 2 * p:
                        with pytest.raises(ValueError, match="microbatches >= 2 x ranks"):
                            _v(name, p, m)
                        continue
                    if p > 1:  # torch's DualPipeV refuses one rank
                        assert compare_with_torch(name, p, m) == [], (name, p, m)
                    got = validate_schedule(_v(name, p, m), m, 2, placement="v")
                    assert got["split"] and max(got["peak_in_flight"]) == max_in_flight(name, p, m), (
                        name,
                        p,
                        m,
                    )
    # in loop placement the same lists are refused: stage p-1 must hand on to stage p on its own rank
    with pytest.raises(ScheduleError, match="peer must be"):
        validate_schedule(_v("zb-v", 4, 8), 8, 2)
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        validate_schedule(_v("zb-v", 4, 8), 8, 3, placement="v")
    with pytest.raises(ScheduleError, match="need placement='v'"):
        simulate(_v("zb-v", 4, 8), chunks=2)


def test_v_placement_maps_stages_both_ways():
    from parallel_lab.pipeline import rank_of, stage_of

    for p in range(1, 9):
        stages = [stage_of(r, c, p, "v") for r in range(p) for c in (0, 1)]
        assert sorted(stages) == list(range(2 * p))
        assert all(rank_of(stage_of(r, c, p, "v"), p, "v") == r for r in range(p) for c in (0, 1))
        assert stage_of(0, 1, p, "v") == 2 * p - 1 and rank_of(p, p, "v") == p - 1  # the turn: rank p-1


def test_zb_v_has_no_bubble_with_equal_times_and_dualpipev_against_its_readme():
    """ZB-V with T_F = T_B = T_W, m >= 2p: no rank waits between its first compute and its last (the
    paper's section 6 claim). DualPipeV: the DualPipe README gives (PP/2 - 1)(F&B + B - 3W) per chunk, PP =
    2p stages, B the full backward, F&B an overlapped pair. The lab runs a pair as F then B (F&B = F + B);
    with equal times the simulator's bubble is then half the formula's, and with T_W <= T_F <= T_B it
    never exceeds the formula on the grid below (outside that it can: a forward longer than B, or a W
    so long that the formula drops to zero or below; the README does not say how it measures)."""
    for p in range(2, 7):
        for m in (2 * p, 3 * p):
            sim = simulate(_v("zb-v", p, m), 1.0, 1.0, 0.0, 2, t_w=1.0, placement="v")
            assert _bubble(sim, m, 1, 1, 1) == pytest.approx(0, abs=1e-9), (p, m)
            sim = simulate(_v("dualpipev", p, m), 1.0, 1.0, 0.0, 2, t_w=1.0, placement="v")
            f, b, w = 0.5, 1.0, 0.5  # per chunk: F, the full backward (B + W), W
            readme = (p - 1) * ((f + b) + b - 3 * w)
            assert _bubble(sim, m, 1, 1, 1) == pytest.approx(readme / 2), (p, m)
    for p, m in ((2, 4), (4, 8), (4, 9)):
        for t_f, t_b, t_w in itertools.product((0.5, 0.75, 1.0, 1.5, 2.0), repeat=3):
            if not t_w <= t_f <= t_b:
                continue
            sim = simulate(_v("dualpipev", p, m), t_f, t_b, 0.0, 2, t_w=t_w, placement="v")
            f, b, w = t_f / 2, (t_b + t_w) / 2, t_w / 2
            assert _bubble(sim, m, t_f, t_b, t_w) <= (p - 1) * ((f + b) + b - 3 * w) + 1e-9, (
                p,
                m,
                t_f,
                t_b,
                t_w,
            )


def test_v_schedules_run_equal_1f1b_bit_for_bit_on_2_4_and_8_ranks():
    """The executor with the V placement: rank 0 holds the first and the last stage, rank p-1 hands
    on to itself at the turn. Parameters and losses equal 1F1B's bit for bit (each W accumulates in
    1F1B's micro-batch order), and 1F1B matches one process (test_pipeline's parity)."""
    import numpy as np
    from test_pipeline import LAUNCH

    import parallel_lab as pl
    from parallel_lab.pipeline import PipelineConfig, train_pipeline

    for world, m in ((2, 4), (4, 8), (8, 16)):
        kw = dict(microbatches=m, layers=2 * world, batch=2 * m, steps=2)
        base = pl.launch(train_pipeline, world, PipelineConfig(schedule="1f1b", **kw), **LAUNCH)
        for name in V_NAMES if world != 8 else ("dualpipev",):
            run = pl.launch(train_pipeline, world, PipelineConfig(schedule=name, **kw), **LAUNCH)
            assert run.values[0]["losses"] == base.values[-1]["losses"], (
                name,
                world,
            )  # the loss is on rank 0
            for key in ("grads", "params"):
                ours, theirs = _merged_np(run, key), _merged_np(base, key)
                assert ours.keys() == theirs.keys()
                assert all(np.array_equal(ours[n], theirs[n]) for n in ours), (name, world, key)


def test_torchs_v_schedules_train_to_our_bits_on_gloo():
    """torch's ScheduleZBVZeroBubble and ScheduleDualPipeV on the same two V stages per rank (gloo, CPU):
    losses and parameters equal the lab's executor bit for bit."""
    import numpy as np
    import torch.nn.functional as F
    from test_pipeline import LAUNCH

    import parallel_lab as pl
    from parallel_lab.pipeline import PipelineConfig, train_pipeline

    cfgs = {name: PipelineConfig(schedule=name, microbatches=8, layers=8, steps=2) for name in V_NAMES}
    for name, cfg in cfgs.items():
        theirs = pl.launch(_torch_v, 4, cfg, F.mse_loss, **LAUNCH)
        ours = pl.launch(train_pipeline, 4, cfg, **LAUNCH)
        assert theirs.values[0][0] == ours.values[0]["losses"], name
        tp = {k: a for val in theirs.values for k, a in val[1].items()}
        op = _merged_np(ours, "params")
        assert tp.keys() == op.keys() and all(np.array_equal(tp[k], op[k]) for k in op), name


def _torch_v(ctx, cfg, loss_fn):
    import torch
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    from parallel_lab.models import build_model
    from parallel_lab.pipeline import reference_batches, stage_modules

    p, r = ctx.world_size, ctx.rank
    model = build_model(cfg.model_config, seed=cfg.seed, device=ctx.device)
    mods, params = stage_modules(model, p, 2, r, "v")
    stages = [PipelineStage(mods[c], (r, 2 * p - 1 - r)[c], 2 * p, ctx.device) for c in (0, 1)]
    cls = ScheduleZBVZeroBubble if cfg.schedule == "zb-v" else ScheduleDualPipeV
    schedule = cls(stages, cfg.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD([q for mod in mods.values() for q in mod.parameters()], lr=cfg.lr)
    losses = []
    for x, y in reference_batches(cfg):
        got: list = []
        x, y = x.to(ctx.device), y.to(ctx.device)
        schedule.step(*([x] if r == 0 else []), **({"target": y, "losses": got} if r == 0 else {}))
        opt.step()
        opt.zero_grad()
        losses.append(sum(t.item() for t in got) / len(got) if got else None)
    return losses, {n: q.detach().cpu().numpy().copy() for n, q in params.items()}


def test_v_schedules_in_three_d_with_a_tied_embedding_on_rank_0():
    """TinyGPT on 4 pipeline ranks: in a V, rank 0 holds the embedding and the head, one tied tensor
    (no embedding group), stepped once. Equal to 1F1B up to the order the tie's two gradients are added."""
    import numpy as np
    from test_pipeline import LAUNCH

    import parallel_lab as pl
    from parallel_lab.models import GPTConfig
    from parallel_lab.runtime.parallel_dims import ParallelDims
    from parallel_lab.three_d.run import ThreeDConfig, train_3d

    gpt = GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=8)
    runs = {name: pl.launch(train_3d, 4, ThreeDConfig(schedule=name, microbatches=8, steps=2, gpt=gpt),
                            ParallelDims(pp=4), **LAUNCH) for name in ("1f1b", "zb-v")}  # fmt: skip
    ref, got = (_merged_np(runs[n], "params") for n in ("1f1b", "zb-v"))
    assert ref.keys() == got.keys()
    assert max(float(np.abs(ref[k] - got[k]).max()) for k in ref) < 1e-5
    losses = [v["losses"] for v in runs["zb-v"].values if v["losses"] is not None]
    assert runs["zb-v"].values[0]["losses"] is not None and len(losses) == 1
    assert np.allclose(losses[0], [v["losses"] for v in runs["1f1b"].values if v["losses"]][0], atol=1e-6)
    # parameters held, each tensor once per rank: the V keeps its tie once (rank 0); the loop twice
    # (the embedding on rank 0, the head on rank 3, kept equal by the embedding group)
    from parallel_lab.models import build_model

    n = sum(q.numel() for q in build_model(gpt, seed=0).parameters())  # each tensor once
    assert sum(v["n_params"] for v in runs["zb-v"].values) == n
    assert sum(v["n_params"] for v in runs["1f1b"].values) == n + gpt.vocab * gpt.d_model


def test_v_memory_in_bytes_rank_0_near_1f1b_dualpipev_one_chunk_more():
    """The tracker on 4 ranks, m = 8 (section 6's sizes): ZB-V's rank 0 holds about 1F1B's bytes (2p chunk
    activations = p stages' worth, plus the last stage's head), and DualPipeV no less than ZB-V on any rank."""
    from test_pipeline import LAUNCH

    import parallel_lab as pl
    from parallel_lab.pipeline import PipelineConfig, peak_activation, train_pipeline

    b, h = 16, 256
    peaks = {}
    for name in ("1f1b", *V_NAMES):
        cfg = PipelineConfig(schedule=name, microbatches=8, layers=8, hidden=h, batch=8 * b, steps=2)
        peaks[name] = peak_activation(pl.launch(train_pipeline, 4, cfg, track_memory=True, **LAUNCH), step=1)
    unit = 5 * b * h * 4  # a middle 2-layer stage's saved tensors per micro-batch, as in test_pipeline
    # a sent activation is freed when its send completes (another thread): a peak moves by one message
    assert abs(peaks["zb-v"][0] - peaks["1f1b"][0]) < unit, peaks
    assert all(d >= z for d, z in zip(peaks["dualpipev"], peaks["zb-v"])), peaks


def _stand_in(monkeypatch, runs: list[dict], bubble, simulated: float) -> None:
    """Ranks and simulator stood in for: launch returns the next of `runs`, bubble(run, step) is the
    measured bubble, and the simulator always predicts `simulated`."""
    import parallel_lab.runtime.launch
    from parallel_lab.pipeline import viz

    seq = iter(runs)
    monkeypatch.setattr(parallel_lab.runtime.launch, "launch", lambda *a, **k: next(seq))
    monkeypatch.setattr(viz, "measured_bubble", bubble)
    monkeypatch.setattr(viz, "measured_times", lambda run, s, placement="loop": {"t_f": 1.0, "t_b": 1.0})
    monkeypatch.setattr(viz, "simulate", lambda *a, **k: type("Sim", (), {"bubble_fraction": simulated})())


@pytest.mark.parametrize(
    "gaps, runs",
    [((0.05, 0.04, 0.05), 3), ((0.05, 0.01), 2), ((-0.05,), 1), ((0.029,), 1)],
)
def test_a_run_is_repeated_only_when_slower_than_simulated_by_the_margin(monkeypatch, gaps, runs):
    """The rerun rule alone: measured minus simulated at or above the margin runs again (three runs
    at most); below it, or faster by any amount, stops."""
    from parallel_lab.pipeline import PipelineConfig, measure_against_simulator

    # step 1 is the least disturbed, and its gap to the prediction (0.21) is the run's `gap`
    _stand_in(monkeypatch, [{"gap": g} for g in gaps], lambda run, s: 0.2 + run["gap"] + 0.01 * s, 0.21)
    got = measure_against_simulator(PipelineConfig(schedule="zb-h1", microbatches=4, steps=3), 2)
    assert len(got.attempts) == runs and got.best == 1
    assert [round(m - s, 6) for m, s in got.attempts] == list(gaps[:runs])
    assert got.run["gap"] == gaps[runs - 1] and round(got.measured - got.simulated, 6) == gaps[runs - 1]
    with pytest.raises(ValueError, match="tries must be >= 1"):
        measure_against_simulator(PipelineConfig(), 2, tries=0)
    with pytest.raises(ValueError, match="warmup must be in"):
        measure_against_simulator(PipelineConfig(steps=2), 2, warmup=2)


@pytest.mark.parametrize("margin, runs", [(0.25, 3), (0.5, 1)])
def test_a_gap_equal_to_the_margin_runs_again(monkeypatch, margin, runs):
    """The boundary, in numbers exact in binary: measured 0.5 against 0.25 simulated is a gap of 0.25."""
    from parallel_lab.pipeline import PipelineConfig, measure_against_simulator

    _stand_in(monkeypatch, [{"n": n} for n in range(1, 10)], lambda run, s: 0.5 if s == 1 else 0.75, 0.25)
    got = measure_against_simulator(
        PipelineConfig(schedule="1f1b", microbatches=4, steps=3), 2, margin=margin
    )
    assert len(got.attempts) == runs and got.run["n"] == runs and got.measured == 0.5

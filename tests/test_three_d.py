"""3D parallelism: the mesh, a TinyGPT on DP x TP x PP against single-process, and the planner."""

from __future__ import annotations

import pytest

import parallel_lab as pl
from parallel_lab.costmodel.planner import (
    BLOOM,
    GPT3,
    JEAN_ZAY,
    ModelSpec,
    activation_bytes_per_layer,
    evaluate,
    fp32_param_bytes,
    gradient_traffic_per_iteration,
    lab_stage_memory,
    plan,
)
from parallel_lab.models import GPTConfig
from parallel_lab.runtime.context import RankError
from parallel_lab.runtime.parallel_dims import ParallelDims, plot_mesh
from parallel_lab.three_d import ThreeDConfig, compare_3d, train_3d

LAUNCH = {"threads": 1, "timeout": 120}  # one thread per forked rank: see tests/test_pipeline.py


# ----------------------------------------------------------------------------- the mesh
def test_parallel_dims_layout_and_groups():
    d = ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    assert [d.rank_of(**d.coords(r)) for r in range(8)] == list(range(8))
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: one node's fast links
    assert d.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for axis in ("tp", "dp", "pp"):  # every axis partitions the ranks
        assert sorted(r for g in d.groups(axis) for r in g) == list(range(8))
    odd = ParallelDims(dp=3, tp=1, pp=2)
    assert odd.groups("dp") == [[0, 1, 2], [3, 4, 5]] and odd.group_of("pp", 4) == [1, 4]
    fig = plot_mesh(d, gpus_per_node=4)
    assert len(fig.axes) == 3


def test_parallel_dims_bad_input():
    with pytest.raises(ValueError, match=r"dp \* tp \* pp = 2 \* 2 \* 3 = 12 must equal world_size = 8"):
        ParallelDims(dp=2, tp=2, pp=3, world_size=8)
    with pytest.raises(ValueError, match="ParallelDims.tp must be an int >= 1"):
        ParallelDims(tp=0)
    with pytest.raises(ValueError, match="axis must be one of"):
        ParallelDims(dp=2).groups("ep")
    with pytest.raises(ValueError, match="ThreeDConfig.microbatches must be an int >= 1"):
        ThreeDConfig(microbatches=0)
    with pytest.raises(RankError, match="must equal world_size = 4"):
        pl.launch(train_3d, 4, ThreeDConfig(), ParallelDims(dp=2, tp=2, pp=2), **LAUNCH)


def test_bad_layouts_are_named_on_the_ranks():
    # 4 heads cannot be split over 3 TP ranks; 4 layers cannot be split into 3 stages
    with pytest.raises(RankError, match="n_heads"):
        pl.launch(train_3d, 3, ThreeDConfig(), ParallelDims(tp=3), **LAUNCH)
    with pytest.raises(RankError, match=r"layers \(4\) must be divisible by stages x chunks = 3 x 1"):
        pl.launch(train_3d, 3, ThreeDConfig(batch=12, microbatches=4), ParallelDims(pp=3), **LAUNCH)


# ----------------------------------------------------------------------------- 3D parity and memory
def _peak_totals(result):
    out = {}
    for s in result.memory:
        out[s["rank"]] = max(out.get(s["rank"], 0), sum(s["bytes"].values()))
    return out


def test_3d_parity_on_8_ranks_and_planner_memory():
    """2 x 2 x 2: tied embeddings across the first and last stage, SGD so parameters compare tightly."""
    gpt = GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, tie_weights=True)
    cfg = ThreeDConfig(gpt=gpt, microbatches=4, batch=16, steps=3, optimizer="sgd", lr=0.1)
    dims = ParallelDims(dp=2, tp=2, pp=2)
    result = pl.launch(train_3d, 8, cfg, dims, track_memory=True, **LAUNCH)
    diff = compare_3d(result, cfg)
    # TP adds partial sums over ranks and PP sums micro-batch gradients: float order only (~1e-7)
    assert diff["loss"] < 2e-6 and diff["grad"] < 1e-6 and diff["param"] < 1e-6, diff
    assert sorted(tuple(v["coords"].values()) for v in result.values) == sorted(
        (pp, dp, tp) for pp in range(2) for dp in range(2) for tp in range(2)
    )
    peaks = _peak_totals(result)
    for v in result.values:  # the planner's lab-layout prediction against the tracker's measured peak
        pred = lab_stage_memory(
            gpt, dims, micro_batch=2, microbatches=4, stage=v["coords"]["pp"], optimizer="sgd"
        )
        assert abs(pred["total"] - peaks[v["rank"]]) / peaks[v["rank"]] < 0.15, (
            v["rank"],
            pred,
            peaks[v["rank"]],
        )


@pytest.mark.parametrize(
    "dims,kw",
    [
        (ParallelDims(tp=2, pp=2), {"optimizer": "adam", "lr": 1e-2}),
        (ParallelDims(dp=2, tp=2, pp=2), {"schedule": "interleaved", "chunks": 2}),
        (
            ParallelDims(tp=4),
            {"gpt": GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, tie_weights=False)},
        ),
    ],
)
def test_3d_parity_other_meshes(dims, kw):
    cfg = ThreeDConfig(**{"optimizer": "sgd", "lr": 0.1, **kw})
    diff = compare_3d(pl.launch(train_3d, dims.size, cfg, dims, **LAUNCH), cfg)
    # Adam divides by sqrt(v): gradients that differ in the 8th digit move a weight by up to ~1e-4 in 3 steps
    tol = 5e-4 if cfg.optimizer == "adam" else 1e-6
    assert diff["loss"] < 2e-6 and diff["grad"] < 1e-6 and diff["param"] < tol, diff


def test_planner_memory_within_15_percent_on_more_meshes():
    gpt = GPTConfig(vocab=128, seq_len=16, d_model=64, n_heads=4, n_layers=4, tie_weights=False)
    cfg = ThreeDConfig(gpt=gpt, microbatches=4, batch=16, steps=2)
    for dims in (ParallelDims(dp=2, pp=2), ParallelDims(pp=4)):
        result = pl.launch(train_3d, dims.size, cfg, dims, track_memory=True, **LAUNCH)
        peaks = _peak_totals(result)
        for v in result.values:
            pred = lab_stage_memory(gpt, dims, 16 // dims.dp // 4, 4, v["coords"]["pp"])
            err = (pred["total"] - peaks[v["rank"]]) / peaks[v["rank"]]
            assert abs(err) < 0.15, (
                f"{dims} rank {v['rank']}: predicted {pred['total']:,} vs {peaks[v['rank']]:,}"
            )
            assert v["n_params"] * 16 == pred["param"] + pred["grad"] + pred["optim"]  # fp32 Adam: 16 B/param


# ----------------------------------------------------------------------------- the planner
def test_seed_001_gpt3_numbers():
    assert fp32_param_bytes(175e9) == 700e9  # 700 GB
    assert gradient_traffic_per_iteration(175e9, 128) == pytest.approx(89.6e12)  # 89.6 TB
    assert GPT3.num_params == pytest.approx(175e9, rel=0.01)
    assert BLOOM.num_params == pytest.approx(176e9, rel=0.01)


def test_planner_finds_bloom_layout():
    plans = plan(BLOOM, JEAN_ZAY, global_batch=2048, micro_batch=2)
    feasible = [p for p in plans if p.fits]
    bloom = evaluate(
        BLOOM, JEAN_ZAY, dp=8, tp=4, pp=12, zero=1, checkpointing=True, global_batch=2048, micro_batch=2
    )
    assert bloom.fits and bloom.memory["total"] < 80e9
    rank = [(p.dp, p.tp, p.pp, p.zero, p.checkpointing) for p in feasible].index((8, 4, 12, 1, True))
    assert rank < 10 and bloom.time["total"] < 1.05 * feasible[0].time["total"]
    assert all(
        p.tp <= 8 and p.checkpointing for p in feasible
    )  # TP inside a node; 176B needs recomputation here
    no_zero = evaluate(BLOOM, JEAN_ZAY, 8, 4, 12, 0, True, 2048, 2)
    assert no_zero.memory["optim"] / bloom.memory["optim"] == pytest.approx(8, rel=1e-6)  # ZeRO-1 over dp = 8
    z2 = evaluate(BLOOM, JEAN_ZAY, 8, 4, 12, 2, True, 2048, 2)
    # ZeRO-2 under accumulation: a reduce-scatter per micro-batch (128) against one all-reduce a step
    assert z2.time["dp_comm"] > 20 * bloom.time["dp_comm"] and any(
        "reduce-scatter per micro-batch" in n for n in z2.notes
    )


def test_planner_formulas_and_bad_input():
    s, b, h, a = 2048, 1, 12288, 96
    spec = ModelSpec("gpt3-layer", 1, h, a, s, 50257)
    assert activation_bytes_per_layer(spec, b, 1) == pytest.approx(34 * s * b * h + 5 * a * s * s * b)
    assert activation_bytes_per_layer(spec, b, 8, sequence_parallel=True) == pytest.approx(
        (34 * s * b * h + 5 * a * s * s * b) / 8
    )
    with pytest.raises(ValueError, match="must equal the cluster's 384 GPUs"):
        evaluate(BLOOM, JEAN_ZAY, 8, 4, 8, 1, True, 2048, 2)
    with pytest.raises(ValueError, match="global_batch"):
        evaluate(BLOOM, JEAN_ZAY, 8, 4, 12, 1, True, 100, 2)

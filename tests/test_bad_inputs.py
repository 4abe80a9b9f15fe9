"""Bad input gets a clear error: the right exception type, and a message that names the argument.

One row per bad input across the public API (launch, comms, cost model, planner, pipeline, MoE,
quantization, memory, plots, RunResult); each is called as a careless learner would call it.
"""

from __future__ import annotations

import math

import pytest
import torch

import parallel_lab as pl
from parallel_lab import comms, costmodel, plots
from parallel_lab.costmodel import hardware, planner
from parallel_lab.moe import MoEConfig, switch_aux_loss
from parallel_lab.pipeline import PipelineConfig, make_schedule, max_in_flight, simulate, split_layers
from parallel_lab.quantization import int8_matmul, quantize_absmax
from parallel_lab.runtime.memory import MemoryTracker
from parallel_lab.runtime.parallel_dims import ParallelDims

NAN, INF = math.nan, math.inf


def _noop(ctx):
    return None


def _q():
    return quantize_absmax(torch.randn(4, 4))


ROWS = [
    # ---- launch
    ("launch world_size 0", lambda: pl.launch(_noop, 0), ValueError, "world_size"),
    ("launch world_size -2", lambda: pl.launch(_noop, -2), ValueError, "world_size"),
    ("launch world_size str", lambda: pl.launch(_noop, "2"), (TypeError, ValueError), "world_size"),
    ("launch world_size float", lambda: pl.launch(_noop, 2.5), (TypeError, ValueError), "world_size"),
    ("launch fn not callable", lambda: pl.launch(42, 2), TypeError, "fn"),
    ("launch timeout 0", lambda: pl.launch(_noop, 1, timeout=0), ValueError, "timeout"),
    ("launch timeout negative", lambda: pl.launch(_noop, 1, timeout=-1), ValueError, "timeout"),
    ("launch timeout inf", lambda: pl.launch(_noop, 1, timeout=INF), ValueError, "timeout"),
    ("launch timeout 1e15", lambda: pl.launch(_noop, 1, timeout=1e15), ValueError, "timeout"),
    ("launch timeout nan", lambda: pl.launch(_noop, 1, timeout=NAN), ValueError, "timeout"),
    ("launch timeout bool", lambda: pl.launch(_noop, 1, timeout=True), ValueError, "timeout"),
    ("launch backend bogus", lambda: pl.launch(_noop, 1, backend="mpi2"), ValueError, "backend"),
    ("launch start_method bogus", lambda: pl.launch(_noop, 1, start_method="thread"), ValueError, "start_method"),
    ("launch threads 0", lambda: pl.launch(_noop, 1, threads=0), ValueError, "threads"),
    ("launch live str", lambda: pl.launch(_noop, 1, live="yes"), TypeError, "live"),
    # ---- comms helpers
    ("chunk_sizes negative n", lambda: comms.chunk_sizes(-1, 2), ValueError, "numel"),
    ("chunk_sizes zero ranks", lambda: comms.chunk_sizes(10, 0), ValueError, "world_size"),
    # ---- cost model
    ("model_state_bytes negative params", lambda: costmodel.model_state_bytes(-5), ValueError, "num_params"),
    ("model_state_bytes nan params", lambda: costmodel.model_state_bytes(NAN), ValueError, "num_params"),
    ("model_state_bytes dp 0", lambda: costmodel.model_state_bytes(10, 0), ValueError, "dp_size"),
    ("model_state_bytes stage 4", lambda: costmodel.model_state_bytes(10, 2, 4), ValueError, "zero_stage"),
    ("model_state_bytes stage 2.0", lambda: costmodel.model_state_bytes(10, 2, 2.0), ValueError, "zero_stage"),
    ("model_state_bytes stage True", lambda: costmodel.model_state_bytes(10, 2, True), ValueError, "zero_stage"),
    ("model_state_bytes optimizer", lambda: costmodel.model_state_bytes(10, optimizer="lamb"), ValueError, "optimizer"),
    ("model_state_bytes precision", lambda: costmodel.model_state_bytes(10, precision="fp8"), ValueError, "precision"),
    ("allreduce_bytes nan", lambda: costmodel.allreduce_bytes_per_rank(NAN, 4), ValueError, "nbytes"),
    ("allreduce_bytes inf", lambda: costmodel.allreduce_bytes_per_rank(INF, 4), ValueError, "nbytes"),
    ("allreduce_bytes negative", lambda: costmodel.allreduce_bytes_per_rank(-1, 4), ValueError, "nbytes"),
    ("allreduce_bytes world 0", lambda: costmodel.allreduce_bytes_per_rank(10, 0), ValueError, "world_size"),
    ("allreduce_bytes str", lambda: costmodel.allreduce_bytes_per_rank("10", 2), TypeError, "nbytes"),
    ("training_flops nan", lambda: costmodel.training_flops(NAN, 10), ValueError, "num_params"),
    ("training_flops negative tokens", lambda: costmodel.training_flops(10, -1), ValueError, "tokens"),
    ("roofline zero bandwidth", lambda: costmodel.roofline(1.0, 1e12, 0), ValueError, "mem_bw"),
    ("roofline nan peak", lambda: costmodel.roofline(1.0, NAN, 1e9), ValueError, "peak_flops"),
    ("matmul_flops zero", lambda: costmodel.matmul_flops(0, 4, 4), ValueError, "b"),
    ("rule_of_thumb gb 0", lambda: costmodel.rule_of_thumb_bytes(10, 0), ValueError, "gb_per_billion"),
    ("rule_of_thumb gb inf", lambda: costmodel.rule_of_thumb_bytes(10, INF), ValueError, "gb_per_billion"),
    ("bubble stages 0", lambda: costmodel.pipeline_bubble_fraction(0, 4), ValueError, "stages"),
    ("bubble microbatches 0", lambda: costmodel.pipeline_bubble_fraction(4, 0), ValueError, "microbatches"),
    ("bubble chunks 0", lambda: costmodel.pipeline_bubble_fraction(4, 4, 0), ValueError, "chunks"),
    # ---- planner
    ("cluster gpus 0", lambda: planner.ClusterSpec(gpus=0), ValueError, "gpus"),
    ("cluster gpus negative", lambda: planner.ClusterSpec(gpus=-8), ValueError, "gpus"),
    ("cluster memory nan", lambda: planner.ClusterSpec(gpus=8, memory=NAN), ValueError, "memory"),
    ("cluster inter_bw 0", lambda: planner.ClusterSpec(gpus=8, inter_bw=0), ValueError, "inter_bw"),
    ("cluster gpu not a GPU", lambda: planner.ClusterSpec(gpus=8, gpu="A100"), TypeError, "gpu"),
    ("gpu gemm_efficiency 1.5", lambda: hardware.GPU("x", 1e12, 1e9, 1e9, 1e9, 1e9, gemm_efficiency=1.5), ValueError, "gemm_efficiency"),
    ("gpu overlap_slowdown 1", lambda: hardware.GPU("x", 1e12, 1e9, 1e9, 1e9, 1e9, overlap_slowdown=1.0), ValueError, "overlap_slowdown"),
    ("gpu hbm_bw 0", lambda: hardware.GPU("x", 1e12, 1e9, 0, 1e9, 1e9), ValueError, "hbm_bw"),
    ("planner checkpointing bad", lambda: planner.evaluate(planner.GPT3, planner.ClusterSpec(gpus=8), 1, 8, 1, 1, "some", 8), ValueError, "checkpointing"),
    ("planner chunks without pp", lambda: planner.evaluate(planner.GPT3, planner.ClusterSpec(gpus=8), 1, 8, 1, 1, True, 8, chunks=2), ValueError, "chunks"),
    ("model kv_heads not dividing", lambda: planner.ModelSpec("m", 2, 64, 8, 16, 10, kv_heads=3), ValueError, "kv_heads"),
    ("cluster gpus_per_node 0", lambda: planner.ClusterSpec(gpus=8, gpus_per_node=0), ValueError, "gpus_per_node"),
    ("model heads 0", lambda: planner.ModelSpec("m", 2, 64, 0, 16, 100), ValueError, "heads"),
    ("model layers 0", lambda: planner.ModelSpec("m", 0, 64, 4, 16, 100), ValueError, "layers"),
    ("model hidden not divisible", lambda: planner.ModelSpec("m", 2, 65, 4, 16, 100), ValueError, "hidden"),
    # ---- pipeline
    ("max_in_flight bogus", lambda: max_in_flight("bogus", 4, 8), ValueError, "name"),
    ("max_in_flight stages 0", lambda: max_in_flight("1f1b", 0, 8), ValueError, "stages"),
    ("split_layers stages 0", lambda: split_layers(8, 0), ValueError, "stages"),
    ("split_layers uneven", lambda: split_layers(8, 3), ValueError, "layers"),
    ("simulate empty schedule", lambda: simulate([]), ValueError, "schedule"),
    ("simulate negative t_f", lambda: simulate(make_schedule("1f1b", 2, 4), t_f=-1), ValueError, "t_f"),
    ("simulate nan t_b", lambda: simulate(make_schedule("1f1b", 2, 4), t_b=NAN), ValueError, "t_b"),
    ("simulate chunks 0", lambda: simulate(make_schedule("1f1b", 2, 4), chunks=0), ValueError, "chunks"),
    ("make_schedule bogus", lambda: make_schedule("zigzag", 2, 4), ValueError, "schedule"),
    ("pipeline config microbatches 0", lambda: PipelineConfig(microbatches=0), ValueError, "microbatches"),
    ("pipeline config schedule", lambda: PipelineConfig(schedule="zb-2p"), ValueError, "schedule"),
    ("dualpipev too few micro-batches", lambda: make_schedule("dualpipev", 4, 7), ValueError, "microbatches"),
    ("zb-v three chunks", lambda: make_schedule("zb-v", 4, 8, 3), ValueError, "chunks"),
    # ---- MoE
    ("moe d_model 0", lambda: MoEConfig(d_model=0), ValueError, "d_model"),
    ("moe experts 0", lambda: MoEConfig(num_experts=0), ValueError, "num_experts"),
    ("moe k 0", lambda: MoEConfig(k=0), ValueError, "k"),
    ("moe capacity nan", lambda: MoEConfig(capacity_factor=NAN), ValueError, "capacity_factor"),
    ("moe capacity 0", lambda: MoEConfig(capacity_factor=0), ValueError, "capacity_factor"),
    ("moe d_ff float", lambda: MoEConfig(d_ff=3.5), ValueError, "d_ff"),
    # ---- quantization
    ("int8_matmul row scales (n,)", lambda: int8_matmul(_q()[0], torch.ones(4), _q()[0], torch.tensor(1.0)), ValueError, "sa"),
    ("int8_matmul column scales (m,1)", lambda: int8_matmul(_q()[0], torch.tensor(1.0), _q()[0], torch.ones(4, 1)), ValueError, "sb"),
    # ---- memory tracker
    ("tracker bad category", lambda: MemoryTracker().category("weights").__enter__(), ValueError, "category"),
    ("tracker register non-tensor", lambda: MemoryTracker().register([1, 2], "param"), TypeError, "tensor"),
    ("tracker register bad category", lambda: MemoryTracker().register(torch.ones(2), "cache"), ValueError, "category"),
    ("tracker register_module non-module", lambda: MemoryTracker().register_module(torch.ones(2)), TypeError, "module"),
    # ---- mesh
    ("mesh product mismatch", lambda: ParallelDims(dp=2, tp=2, pp=3, world_size=8), ValueError, "world_size"),
    ("mesh tp 0", lambda: ParallelDims(dp=2, tp=0, pp=2, world_size=8), ValueError, "tp"),
    # ---- plots
    ("byte_unit bad", lambda: plots.byte_unit(10, "MB/s"), ValueError, "unit"),
    ("plot_timeline world_size -1", lambda: plots.plot_timeline([], world_size=-1), ValueError, "world_size"),
    ("plot_timeline color_by", lambda: plots.plot_timeline([], color_by="rank"), ValueError, "color_by"),
    ("plot_memory bad rank", lambda: plots.plot_memory([{"rank": 0, "t": 0.0, "bytes": {"param": 1}}], ranks=[-1]), ValueError, "ranks"),
    ("plot_memory not samples", lambda: plots.plot_memory([{"rank": 0}]), TypeError, "memory sample"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "call", "exc", "names"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_named(label, call, exc, names):
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    with pytest.raises(exc) as info:
        call()
    assert names in str(info.value), f"{label}: {type(info.value).__name__}: {info.value}"
    assert set(plt.get_fignums()) == before, "a refused call must not leave a figure open"


def test_empty_moe_batch_has_zero_aux_loss():
    probs = torch.empty(0, 4, requires_grad=True)
    aux = switch_aux_loss(probs, torch.empty(0, dtype=torch.long))
    assert aux.item() == 0.0 and not math.isnan(aux.item())
    aux.backward()  # still part of the graph


@pytest.mark.parametrize(
    "content", ["missing", "", "\x00\x01binary", "[1, 2]", '{"x": 1}', '{"parallel_lab": {"timeline": []}}']
)
def test_loading_a_bad_trace_names_the_file(tmp_path, content):
    path = tmp_path / "trace.json"
    if content != "missing":
        path.write_bytes(content.encode("latin-1"))
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        pl.RunResult.load(str(path))
    assert str(path) in str(info.value), info.value


def test_saving_a_trace_to_a_bad_path_names_it(tmp_path):
    res = pl.RunResult(
        values=[1], timeline=[], memory=[], comm_bytes=[{}], wall_time=0.0, world_size=1, backend="gloo"
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="file/trace.json"):
        res.save_chrome_trace(str(blocker / "trace.json"))
    with pytest.raises(ValueError, match="path"):
        res.save_chrome_trace("")


def test_a_dead_parents_run_folder_is_removed_by_the_next_launch(tmp_path):
    import os
    import subprocess
    import sys
    import tempfile

    from parallel_lab.runtime.launch import RUN_DIR_PREFIX, _remove_stale_run_dirs

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{int(dead.stdout)}-")
    mine = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
    try:
        assert stale in _remove_stale_run_dirs()
        assert not os.path.exists(stale) and os.path.exists(mine)
    finally:
        os.rmdir(mine)

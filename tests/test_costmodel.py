"""Cost model: the seeds' and papers' numbers, exact activation counts, FLOPs, validation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parallel_lab import costmodel as cm
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.runtime.memory import MemoryTracker

GB = 1e9


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and immune to a busy machine's oversubscription."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_7b_mixed_adam_is_112_gb():
    got = cm.model_state_bytes(7_000_000_000)
    assert got == {"param": 14e9, "grad": 14e9, "optim": 84e9, "total": 112e9}
    assert cm.bytes_per_param() == {"param": 2, "grad": 2, "optim": 12}


def test_70b_params_grads_adam():  # 140 / 140 / 840 GB
    got = cm.model_state_bytes(70e9)
    assert (got["param"] / GB, got["grad"] / GB, got["optim"] / GB) == (140, 140, 840)
    assert cm.bytes_per_param("adam")["optim"] * 70e9 == 840e9  # 12 bytes x 70B


def test_zero_paper_7_5b_on_64_gpus():  # 120 / 31.4 / 16.6 / 1.9 GB
    totals = [cm.model_state_bytes(7.5e9, dp_size=64, zero_stage=s)["total"] / GB for s in range(4)]
    assert totals == [120.0, 31.40625, 16.640625, 1.875]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_zero_stage_formulas_and_padding():
    psi, n = 1000, 8
    s = [cm.model_state_bytes(psi, n, k)["total"] for k in range(4)]
    assert s == [16 * psi, 4 * psi + 12 * psi // n, 2 * psi + 14 * psi // n, 16 * psi // n]
    # 10 params on 4 ranks: each shard holds ceil(10/4) = 3 elements.
    assert cm.shard_numel(10, 4) == 3
    assert cm.model_state_bytes(10, 4, 3) == {"param": 6, "grad": 6, "optim": 36, "total": 48}


def test_gpt3_fp32_params_and_rule_of_thumb():
    assert cm.model_state_bytes(175e9, precision="fp32")["param"] == 700e9
    assert cm.rule_of_thumb_bytes(1e9) == 6e9
    assert cm.rule_of_thumb_bytes(7e9) == 42e9  # vs 112 GB for mixed Adam
    # What the rule assumes: 16-bit weights, grads and one 16-bit optimizer state.
    assert cm.model_state_bytes(1e9, optimizer="momentum", precision="bf16")["total"] == 6e9


@pytest.mark.parametrize(
    "optimizer, precision, per_param",
    [("sgd", "fp32", 8), ("momentum", "fp32", 12), ("adam", "fp32", 16), ("adamw", "fp32", 16),
     ("sgd", "mixed", 8), ("momentum", "mixed", 12), ("adam", "mixed", 16),
     ("sgd", "bf16", 4), ("momentum", "bf16", 6), ("adam", "bf16", 8)],
)  # fmt: skip
def test_bytes_per_param_table(optimizer, precision, per_param):
    assert sum(cm.bytes_per_param(optimizer, precision).values()) == per_param
    assert cm.model_state_bytes(1000, optimizer=optimizer, precision=precision)["total"] == 1000 * per_param


def test_allreduce_and_bubble():
    assert cm.allreduce_bytes_per_rank(1000, 1) == 0
    assert cm.allreduce_bytes_per_rank(1000, 4) == 1500
    assert cm.pipeline_bubble_fraction(1, 8) == 0
    assert cm.pipeline_bubble_fraction(4, 8) == 3 / 11
    assert cm.pipeline_bubble_fraction(4, 8, chunks=2) == 3 / 19


def saved_for_backward(model, x, y) -> int:
    """Bytes autograd saves in model(x, y), each storage once, parameters excluded."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return sum(seen.values())


@pytest.mark.parametrize(
    "B, T, C, heads, layers, vocab",
    [(1, 1, 8, 2, 1, 10), (1, 16, 32, 4, 2, 64), (2, 8, 32, 4, 1, 64), (3, 5, 24, 1, 3, 50),
     (4, 16, 48, 3, 2, 97), (8, 12, 16, 4, 1, 33)],
)  # fmt: skip
def test_activation_bytes_exact(B, T, C, heads, layers, vocab):
    cfg = GPTConfig(vocab=vocab, seq_len=16, d_model=C, n_heads=heads, n_layers=layers)
    model = build_model(cfg, 0)
    x, y = synthetic_batch("tokens", B, seq_len=T, vocab=vocab)
    want = cm.activation_bytes(B, T, C, layers, heads=heads, vocab=vocab)
    assert saved_for_backward(model, x, y) == want
    # The tracker sees the same bytes live after forward, plus the 4-byte loss itself
    # (the inputs were made before start(): registering them counts them). The allocator
    # also sees, per layer, the 0-d float64 tensor autograd keeps for the Python number the
    # attention scores are scaled by (`att * (1 / sqrt(hd))`): made while parsing the call,
    # outside any op, so neither saved-tensor hooks nor a dispatch mode see it.
    for mechanism, scalars in (("allocator", 8 * layers), ("dispatch", 0)):
        with MemoryTracker(mechanism=mechanism) as mem:
            mem.register_module(model)
            mem.register(x, "activation")
            mem.register(y, "activation")
            loss = model(x, y)
            assert mem.snapshot()["activation"] == want + 4 + scalars, mechanism
        del loss


def test_activation_bytes_bf16():
    cfg = GPTConfig()
    model = build_model(cfg, 0).to(torch.bfloat16)
    x, y = synthetic_batch("tokens", 2, seq_len=8)
    want = cm.activation_bytes(2, 8, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.vocab, dtype_bytes=2)
    assert saved_for_backward(model, x, y) == want


def test_activation_bytes_grow_linearly_in_batch_quadratically_in_seq():
    f = lambda b, t: cm.activation_bytes(b, t, 64, 2, heads=4, vocab=100)
    assert f(8, 16) - f(4, 16) == 4 * (f(2, 16) - f(1, 16))  # b*X + Y: linear in the batch
    d1, d2 = f(2, 32) - f(2, 16), f(2, 48) - f(2, 32)
    assert d2 > d1  # the a*B*T^2 softmax term and the T^2 mask make it superlinear in T


def test_megatron_formula():
    # sbh(34 + 5as/h): s=2048, b=1, h=4096, a=32 -> 34*s*b*h + 5*a*s^2*b bytes per layer
    s, b, h, a = 2048, 1, 4096, 32
    assert cm.activation_bytes_megatron(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    assert cm.activation_bytes_megatron(s, b, h, a, layers=3) == 3 * cm.activation_bytes_megatron(s, b, h, a)


def test_flops_and_intensity():
    assert cm.training_flops(7e9, 2e12) == 6 * 7e9 * 2e12
    assert cm.matmul_flops(4, 5, 6) == 240
    assert cm.arithmetic_intensity_dot(1) == 1 / 6
    assert abs(cm.arithmetic_intensity_dot(10**9) - 0.5) < 1e-6  # -> 0.5 FLOP/byte in bf16
    assert cm.arithmetic_intensity_matmul(4, 5, 6) == 240 / (2 * (20 + 30 + 24))
    b = 64
    assert math.isclose(
        cm.arithmetic_intensity_matmul(b, 2**16, 2**16), b, rel_tol=0.002
    )  # ~B when B << D, F
    peak, bw = 1e15, 2e12
    assert cm.roofline(100, peak, bw) == 2e14  # memory-bound: intensity x bandwidth
    assert cm.roofline(1000, peak, bw) == peak  # compute-bound past the ridge (500)


def test_matmul_flops_match_flop_counter():
    x, w = torch.randn(8, 16), torch.randn(16, 24)
    with FlopCounterMode(display=False) as fc:
        x @ w
    assert fc.get_total_flops() == cm.matmul_flops(8, 16, 24)


@pytest.mark.parametrize(
    "call, match",
    [(lambda: cm.model_state_bytes(-1), "num_params"),
     (lambda: cm.model_state_bytes(1.5), "num_params"),
     (lambda: cm.model_state_bytes(10, dp_size=0), "dp_size"),
     (lambda: cm.model_state_bytes(10, zero_stage=4), "zero_stage"),
     (lambda: cm.model_state_bytes(10, optimizer="lion"), "optimizer"),
     (lambda: cm.model_state_bytes(10, precision="fp8"), "precision"),
     (lambda: cm.allreduce_bytes_per_rank(10, 0), "world_size"),
     (lambda: cm.allreduce_bytes_per_rank(-5, 2), "nbytes"),
     (lambda: cm.pipeline_bubble_fraction(0, 4), "stages"),
     (lambda: cm.pipeline_bubble_fraction(2, 0), "microbatches"),
     (lambda: cm.pipeline_bubble_fraction(2, 4, chunks=0), "chunks"),
     (lambda: cm.activation_bytes(0, 8, 32, 2), "batch"),
     (lambda: cm.activation_bytes(2, 8, 32, 2, dtype_bytes=0), "dtype_bytes"),
     (lambda: cm.training_flops(-1, 10), "num_params"),
     (lambda: cm.arithmetic_intensity_dot(0), "n"),
     (lambda: cm.roofline(1, 0, 1), "peak_flops"),
     (lambda: cm.rule_of_thumb_bytes(1e9, gb_per_billion=0), "gb_per_billion")],
)  # fmt: skip
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bad_types():
    with pytest.raises(TypeError, match="num_params"):
        cm.model_state_bytes("7B")
    with pytest.raises(TypeError, match="dp_size"):
        cm.model_state_bytes(10, dp_size=True)


# ----------------------------------------------------------------------------- context parallelism (lesson 17)
def test_context_parallel_divides_activations_and_shards_states_over_dp_x_cp():
    from parallel_lab.costmodel import ClusterSpec, ModelSpec, evaluate

    m = ModelSpec("long", layers=8, hidden=1024, heads=16, seq=32768, vocab=32000)
    c = ClusterSpec(gpus=8)
    a = evaluate(m, c, dp=2, tp=4, pp=1, zero=1, checkpointing=False, global_batch=8)
    b = evaluate(m, c, dp=1, tp=4, pp=1, zero=1, checkpointing=False, global_batch=8, cp=2)
    assert b.memory["optim"] == a.memory["optim"]  # ZeRO shards over the 2 replicas either way
    # cp=2 runs the whole batch on its one replica (m doubles) but each rank holds half of each sequence
    assert b.memory["activation"] == a.memory["activation"] / 2
    assert b.time["cp_comm"] >= 0 and a.time["cp_comm"] == 0 and b.cp == 2 and "cp=2" in str(b)
    with pytest.raises(ValueError, match=r"dp \* cp \* tp \* pp = 16 must equal the cluster's 8 GPUs"):
        evaluate(m, c, dp=2, tp=4, pp=1, zero=1, checkpointing=False, global_batch=8, cp=2)


def test_the_planner_turns_to_context_parallelism_only_for_long_sequences():
    from parallel_lab.costmodel import GPT3, ClusterSpec, ModelSpec, plan

    long = ModelSpec("8B at 128k tokens", layers=32, hidden=4096, heads=32, seq=131072, vocab=128256)
    plans = plan(long, ClusterSpec(gpus=64), global_batch=16)
    assert not [p for p in plans if p.cp == 1 and p.fits]  # no split of batch, weights or layers fits
    assert plans[0].fits and plans[0].cp > 1
    short = plan(GPT3, ClusterSpec(gpus=64), global_batch=64, zero_stages=(1,), checkpointing=(True,))
    assert {p.cp for p in short} == {1}

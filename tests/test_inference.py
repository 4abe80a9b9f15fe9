"""Lesson 14: generation with a KV cache, grouped-query heads, the paged cache, continuous batching,
tensor- and pipeline-parallel serving, tiled attention, and the serving cost model.

Every cached or parallel path is compared with the plain one: the same greedy tokens as the model
with no cache in one process, and bytes (cache, communication) equal to their formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from parallel_lab import launch
from parallel_lab.costmodel import SERVING_MODELS, inference_flops_per_token, kv_cache_bytes, serving_memory
from parallel_lab.inference import (
    KVCache,
    NoCache,
    OutOfBlocks,
    PagedKVCache,
    Request,
    ServingGPT,
    decode_roofline,
    flash_attention,
    fragmentation,
    generate,
    naive_attention,
    pp_generate,
    pp_serving_bytes,
    serve,
    tp_generate,
    tp_serving_bytes,
)
from parallel_lab.models import GPTConfig, build_model
from parallel_lab.runtime.memory import MemoryTracker

CFG = GPTConfig(vocab=64, seq_len=32, d_model=32, n_heads=4, n_layers=2)


def _model(cfg: GPTConfig = CFG, seed: int = 0):
    return build_model(cfg, seed).eval()


def _prompt(batch: int = 3, t: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(CFG.vocab, (batch, t), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the model and its cache
def test_serving_model_computes_the_models_logits():
    m = _model(GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, tie_weights=False))
    idx = _prompt(2, 9)
    with torch.no_grad():
        assert torch.equal(ServingGPT.from_gpt(m)(idx), m(idx))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cached_generation_gives_the_uncached_tokens(kv_heads):
    s = ServingGPT.from_gpt(_model(), kv_heads)
    prompt = _prompt()
    plain = generate(s, prompt, 20, NoCache())
    cached = generate(s, prompt, 20, KVCache())
    assert torch.equal(plain, cached)
    assert plain.shape == (3, 25)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cache_bytes_equal_the_formula_after_every_token(kv_heads):
    s = ServingGPT.from_gpt(_model(), kv_heads)
    seen = []
    generate(s, _prompt(), 12, KVCache(), on_token=lambda i, c: seen.append((c.length, c.nbytes())))
    for length, nbytes in seen:
        assert nbytes == kv_cache_bytes(CFG.n_layers, kv_heads, CFG.d_model // CFG.n_heads, length, 3, 4)
    assert [n for n, _ in seen] == list(range(5, 17))  # the prompt, then one token per step


def test_the_tracker_sees_the_cache_bytes_the_formula_gives():
    s = ServingGPT.from_gpt(_model(), 2)
    cache = KVCache()
    with MemoryTracker() as mem:
        generate(s, _prompt(), 10, cache)
        live = mem.total()
        del cache
        after = mem.total()
    assert live - after == kv_cache_bytes(CFG.n_layers, 2, 8, 14, 3, 4)


def test_grouped_query_pools_heads_and_multi_query_shares_one():
    m = _model()
    gqa = ServingGPT.from_gpt(m, 2)
    w = m.blocks[0].attn.qkv.weight[32:64].detach()  # the key rows: 4 heads of 8
    want = w.view(2, 2, 8, 32).mean(1).reshape(16, 32)
    assert torch.allclose(gqa.blocks[0].kv.weight[:16], want)
    with pytest.raises(ValueError, match="kv_heads must be a positive divisor of n_heads"):
        ServingGPT.from_gpt(m, 3)


def test_generation_refuses_a_context_it_cannot_hold():
    s = ServingGPT.from_gpt(_model())
    with pytest.raises(ValueError, match="seq_len=32"):
        generate(s, _prompt(1, 20), 13)
    with pytest.raises(ValueError, match="new_tokens must be a positive int"):
        generate(s, _prompt(), 0)


# ----------------------------------------------------------------------------- paged cache, batching
@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_paged_cache_gives_the_tokens_of_the_plain_cache(block_size):
    s = ServingGPT.from_gpt(_model(), 2)
    prompt = _prompt(3, 4)
    pool = PagedKVCache.for_model(s, block_size, 64)
    for i in range(3):
        pool.add(i)
    paged = generate(s, prompt, 15, pool.view([0, 1, 2]))
    assert torch.equal(paged, generate(s, prompt, 15, KVCache()))
    # 18 tokens cached per sequence: ceil(18 / block) blocks each
    assert pool.allocator.used == 3 * math.ceil(18 / block_size)
    assert pool.bytes_filled() == kv_cache_bytes(2, 2, 8, 18, 3, 4)
    for i in range(3):
        pool.free(i)
    assert pool.allocator.used == 0 and not pool.tables


def test_block_tables_never_share_a_block_and_running_out_is_all_or_nothing():
    pool = PagedKVCache(1, 1, 2, block_size=4, num_blocks=5)
    pool.add(0), pool.add(1)
    pool.reserve(0, 9)  # 3 blocks
    pool.reserve(1, 4)  # 1 block
    assert not set(pool.tables[0]) & set(pool.tables[1])
    with pytest.raises(OutOfBlocks):
        pool.reserve(1, 9)  # needs 2 more, 1 left
    assert pool.allocator.used == 4  # nothing taken by the failed request
    pool.free(0)
    pool.reserve(1, 9)
    assert pool.allocator.used == 3


def test_paged_fragmentation_is_measured_against_contiguous_buffers():
    lengths, max_len, bs = [5, 17, 30, 2, 64, 9], 64, 8
    s = ServingGPT.from_gpt(_model(GPTConfig(vocab=64, seq_len=64, d_model=32, n_heads=4, n_layers=2)), 2)
    pool = PagedKVCache.for_model(s, bs, 64)
    per_token = pool.block_bytes // bs
    for i, n in enumerate(lengths):
        pool.add(i)
        pool.reserve(i, n)
        pool.lengths[i] = n
    contiguous = [torch.zeros(2, 2, max_len, 2, 8) for _ in lengths]  # K and V, (layers, 2, max_len, kvh, hd)
    measured_contiguous = sum(t.untyped_storage().nbytes() for t in contiguous)
    f = fragmentation(lengths, max_len, bs, per_token)
    assert pool.bytes_in_use() == f.paged and measured_contiguous == f.contiguous
    assert pool.bytes_filled() == f.filled
    assert f.paged - f.filled < len(lengths) * bs * per_token  # under one block per sequence
    assert f.contiguous_waste > 0.6 > f.paged_waste


def _requests(n: int = 9, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [
        Request(
            torch.randint(64, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g),
            int(torch.randint(1, 20, (1,), generator=g)),
        )  # fmt: skip
        for _ in range(n)
    ]


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_every_request_gets_the_tokens_it_gets_alone(policy):
    s = ServingGPT.from_gpt(_model(), 2)
    reqs = _requests()
    pool = PagedKVCache.for_model(s, 4, 24)
    steps = serve(s, reqs, pool, max_batch=3, policy=policy)
    for r in reqs:
        alone = generate(s, r.prompt[None], r.max_new, KVCache())[0, r.prompt.numel() :]
        assert r.out == alone.tolist()
    assert sum(st.tokens for st in steps) == sum(r.max_new for r in reqs)
    assert max(st.running for st in steps) <= 3 and max(st.blocks for st in steps) <= 24
    assert pool.allocator.used == 0  # every block back in the pool


def test_continuous_batching_finishes_in_fewer_steps_than_static():
    s = ServingGPT.from_gpt(_model(), 2)
    static = serve(s, _requests(), PagedKVCache.for_model(s, 4, 64), 3, "static")
    cont = serve(s, _requests(), PagedKVCache.for_model(s, 4, 64), 3, "continuous")
    assert len(cont) < len(static)


# ----------------------------------------------------------------------------- parallel serving
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_tensor_parallel_serving_matches_one_process_and_its_byte_formula(kv_heads):
    s = ServingGPT.from_gpt(_model(), kv_heads)
    prompt = _prompt(4, 5)
    want = generate(s, prompt, 8, KVCache())
    r = launch(tp_generate, 2, s, prompt, 8)
    for v in r.values:
        assert torch.equal(v["tokens"], want)
        # the cache is split by heads: half the single-process cache on each rank
        assert v["cache_bytes"] == kv_cache_bytes(2, kv_heads // 2, 8, 12, 4, 4)
    assert [v["sent"] for v in r.values] == tp_serving_bytes(4, 5, 8, 32, 2, 2)


def test_tensor_parallel_serving_refuses_heads_it_cannot_split():
    s = ServingGPT.from_gpt(_model(), 1)
    with pytest.raises(
        Exception, match=r"kv_heads \(1\) must be divisible by the tensor-parallel size \(2\)"
    ):
        launch(tp_generate, 2, s, _prompt(), 4)


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 1), (2, 2), (2, 4)])
def test_pipeline_serving_matches_one_process_and_sends_only_activations(ranks, microbatches):
    s = ServingGPT.from_gpt(_model(), 2)
    prompt = _prompt(4, 5)
    want = generate(s, prompt, 8, KVCache())
    r = launch(pp_generate, ranks, s, prompt, 8, microbatches)
    assert torch.equal(r.values[-1]["tokens"], want)
    assert [v["sent"] for v in r.values] == pp_serving_bytes(4, 5, 8, 32, ranks)
    # each stage caches its own layers only
    assert all(v["cache_bytes"] == kv_cache_bytes(1, 2, 8, 12, 4, 4) for v in r.values)
    names = {e["name"] for e in r.timeline if e.get("kind") == "compute"}
    assert {f"decode mb{m}" for m in range(microbatches)} <= names


def test_pipeline_serving_on_one_rank_is_plain_generation():
    s = ServingGPT.from_gpt(_model(), 2)
    r = launch(pp_generate, 1, s, _prompt(4, 5), 6, 2)
    assert torch.equal(r.values[0]["tokens"], generate(s, _prompt(4, 5), 6))


def test_tensor_parallel_sends_more_bytes_per_token_than_pipeline_parallel():
    tp = tp_serving_bytes(8, 1, 2, 8192, 80, 8, 2)[0] - tp_serving_bytes(8, 1, 1, 8192, 80, 8, 2)[0]
    pp = pp_serving_bytes(8, 1, 2, 8192, 8, 2)[0] - pp_serving_bytes(8, 1, 1, 8192, 8, 2)[0]
    assert tp == 2 * 80 * 2 * 7 * 8 * 8192 * 2 // 8 and pp == 8 * 8192 * 2
    assert tp > 100 * pp


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("n", "m", "bq", "bk"), [(64, 64, 16, 16), (100, 100, 32, 24), (7, 40, 4, 8), (1, 33, 64, 5)]
)
def test_flash_attention_matches_sdpa(causal, n, m, bq, bk):
    g = torch.Generator().manual_seed(n + m)
    q, k, v = (torch.randn(2, 3, s, 16, generator=g) for s in (n, m, m))
    if causal:  # queries are the last n positions of the m keys
        mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        want = F.scaled_dot_product_attention(q, k, v)
    got = flash_attention(q, k, v, causal, block_q=bq, block_k=bk)
    assert (got - want).abs().max().item() < 1e-5
    assert (naive_attention(q, k, v, causal) - want).abs().max().item() < 1e-5


def test_flash_attention_survives_scores_that_overflow_exp():
    g = torch.Generator().manual_seed(0)
    # float64 so the shift itself is exact enough to compare; exp(3500) overflows it all the same
    q, k, v = (torch.randn(1, 1, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q[..., 0], k[..., 0] = 100.0, 100.0  # every score of a row shifted by the same ~3500: exp overflows
    got = flash_attention(q, k, v, block_q=8, block_k=8)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, F.scaled_dot_product_attention(q, k, v), atol=1e-9)


def _peak(fn, *args) -> int:
    with MemoryTracker() as mem:
        base = mem.total()
        mem.reset_peak()
        fn(*args)
        return sum(mem.peak().values()) - base


def test_flash_attention_memory_grows_linearly_and_naive_quadratically():
    peaks = {}
    for n in (256, 512, 1024):
        q = k = v = torch.randn(1, 2, n, 16)
        peaks[n] = (
            _peak(naive_attention, q, k, v),
            _peak(lambda *a: flash_attention(*a, block_q=64, block_k=64), q, k, v),
        )
    # naive holds (B, H, N, N) scores: 4x the bytes for 2x N; tiled: about 2x
    assert peaks[1024][0] / peaks[512][0] > 3.5
    assert peaks[1024][1] / peaks[512][1] < 2.5
    assert peaks[1024][0] > 8 * peaks[1024][1]


# ----------------------------------------------------------------------------- cost model
def test_serving_cost_model_numbers():
    m70 = SERVING_MODELS["70B"]
    assert inference_flops_per_token(70e9) == 140e9
    mem = serving_memory(m70, batch=8, context=4096)
    assert mem["activations"] == 8 * 4096 * 8192 * 2  # about 0.5 GB
    # 40 GiB of cache: batch 4 x 4096 with full multi-head attention, batch 32 x 4096 with 8 KV heads
    assert serving_memory(m70, 4, 4096, kv_heads=64)["kv_cache"] == 40 * 2**30
    assert serving_memory(m70, 32, 4096)["kv_cache"] == 40 * 2**30
    assert serving_memory(SERVING_MODELS["175B"], 1, 1, itemsize=4)["weights"] == 700e9  # fp32, against 80 GB


def test_decode_roofline_is_memory_bound_at_batch_one():
    s = ServingGPT.from_gpt(_model())
    machine = {"flops": 1e11, "bandwidth": 1e10}
    one, big = decode_roofline(s, 1, 16, machine), decode_roofline(s, 256, 1, machine)
    assert one["memory_s"] > one["compute_s"] and big["compute_s"] > big["memory_s"]
    assert one["bytes"] == sum(p.numel() for p in s.parameters()) * 4 + kv_cache_bytes(2, 4, 8, 16, 1, 4)

"""Lesson 15: distillation, pruning, quantization-aware training, sharing, low-rank factorization, storage.

Masks and parameter counts are exact; the distillation loss is checked against a hand computation;
the straight-through gradient and the fake quantization against torch's own op; every compressed
model is packed, read back, and must give the same outputs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.prune as torch_prune

from parallel_lab.compression import (
    CompactGPT,
    Corpus,
    Pruner,
    compact_param_count,
    deployed,
    distillation_loss,
    evaluate,
    factorize,
    fake_quantize,
    low_rank_linear,
    low_rank_params,
    magnitude_mask,
    pack,
    packed_bytes,
    prune_and_finetune,
    ptq,
    qat_model,
    reconstruction_error,
    semi_structured_mask,
    sparse_pays,
    sparsity,
    sparsity_schedule,
    storage,
    train_lm,
    unpack,
)
from parallel_lab.models import GPTConfig, build_model

CFG = GPTConfig(vocab=48, seq_len=16, d_model=32, n_heads=4, n_layers=2)


@pytest.fixture(scope="module")
def corpus():
    return Corpus(train_tokens=20_000, test_tokens=4_000)


def _x(corpus):
    return corpus.batch("test", 4, 16, torch.Generator().manual_seed(0))[0]


# ----------------------------------------------------------------------------- the task
def test_corpus_is_deterministic_and_training_lowers_held_out_loss(corpus):
    again = Corpus(train_tokens=20_000, test_tokens=4_000)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.test, again.test)
    assert not torch.equal(corpus.train[:4000], corpus.test)
    m = build_model(CFG, 0)
    before = evaluate(m, corpus, 16)
    train_lm(m, corpus, 150, seq_len=16)
    after = evaluate(m, corpus, 16)
    assert after < before - 0.3 and after > corpus.floor()
    assert before == pytest.approx(math.log(48), abs=0.1)


# ----------------------------------------------------------------------------- distillation
def test_distillation_loss_equals_a_hand_computation():
    s = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
    t = torch.tensor([[1.0, 1.5, -0.5], [2.0, -1.0, 0.0]])
    y = torch.tensor([0, 2])
    T, a = 2.0, 0.3
    kl = 0.0
    for i in range(2):
        ps = [math.exp(v / T) for v in s[i].tolist()]
        pt = [math.exp(v / T) for v in t[i].tolist()]
        ps, pt = [v / sum(ps) for v in ps], [v / sum(pt) for v in pt]
        kl += sum(q * math.log(q / p) for p, q in zip(ps, pt))
    ce = -sum(
        math.log(math.exp(s[i, y[i]].item()) / sum(math.exp(v) for v in s[i].tolist())) for i in range(2)
    )
    want = a * T * T * kl / 2 + (1 - a) * ce / 2
    assert distillation_loss(s, t, y, T, a).item() == pytest.approx(want, rel=1e-6)
    assert distillation_loss(s, t, y, T, 0.0).item() == pytest.approx(ce / 2, rel=1e-6)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        distillation_loss(s, t, y, 0.0, 0.5)


# ----------------------------------------------------------------------------- pruning
@pytest.mark.parametrize("amount", [0.0, 0.3, 0.5, 0.77, 1.0])
def test_magnitude_mask_is_torchs_l1_unstructured_mask(amount):
    layer = nn.Linear(24, 20)
    ours = magnitude_mask(layer.weight, amount)
    torch_prune.l1_unstructured(layer, "weight", amount=amount)
    assert torch.equal(ours, layer.weight_mask.bool())
    assert int((~ours).sum()) == round(amount * 480)


def test_two_four_keeps_the_two_largest_of_every_four():
    w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 1.1, -1.2, 0.0]])
    assert semi_structured_mask(w).tolist() == [[False, True, True, False, False, True, True, False]]
    m = semi_structured_mask(torch.randn(16, 32))
    assert (m.view(16, 8, 4).sum(-1) == 2).all()
    with pytest.raises(ValueError, match="divisible by 4"):
        semi_structured_mask(torch.randn(4, 6))


def test_sparsity_schedule_is_cubic_from_initial_to_final():
    assert sparsity_schedule(0, 100, 0.8) == 0.0 and sparsity_schedule(100, 100, 0.8) == pytest.approx(0.8)
    assert sparsity_schedule(50, 100, 0.8) == pytest.approx(0.8 * (1 - 0.5**3))


@pytest.mark.parametrize("final", [0.75, "2:4"])
def test_prune_and_finetune_reaches_the_sparsity_and_keeps_it(corpus, final):
    m = build_model(CFG, 0)
    prune_and_finetune(m, corpus, final, steps=40, prune_every=10, seq_len=16)
    assert sparsity(m) == pytest.approx(0.75 if final == 0.75 else 0.5, abs=1e-3)


# ----------------------------------------------------------------------------- quantization
@pytest.mark.parametrize("bits", [8, 4, 3])
def test_fake_quantize_is_torchs_op_and_its_gradient_is_straight_through(bits):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(6, 10, generator=g)
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().amax(1) / qmax / 1.3  # smaller than absmax: the largest weights are clipped
    ours = fake_quantize(w.requires_grad_(), bits, scale[:, None])
    theirs = torch.fake_quantize_per_channel_affine(
        w, scale, torch.zeros(6, dtype=torch.int32), 0, -qmax, qmax
    )
    assert torch.equal(ours, theirs)
    ours.sum().backward()
    inside = (w / scale[:, None]).abs() <= qmax
    assert torch.equal(w.grad, inside.float()) and not inside.all() and inside.any()


def test_quantization_aware_training_beats_rounding_after_training_at_4_bits(corpus):
    m = build_model(CFG, 0)
    train_lm(m, corpus, 150, seq_len=16)
    rounded = evaluate(ptq(m, 4), corpus, 16)
    control = copy.deepcopy(m)
    train_lm(control, corpus, 60, seq_len=16, lr=1e-3)  # the same extra training, unquantized
    q = qat_model(m, 4)
    train_lm(q, corpus, 60, seq_len=16, lr=1e-3)
    assert evaluate(q, corpus, 16) < rounded
    assert evaluate(ptq(m, 8), corpus, 16) == pytest.approx(evaluate(m, corpus, 16), abs=0.01)


# ----------------------------------------------------------------------------- sharing, low rank
@pytest.mark.parametrize(("unique", "embed"), [(2, 32), (1, 32), (2, 8), (1, 8)])
def test_compact_gpt_parameter_count_is_the_formula(unique, embed):
    m = CompactGPT(CFG, unique, embed)
    assert m.num_params() == compact_param_count(48, 16, 32, unique, embed)
    assert m(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 48)
    if (unique, embed) == (2, 32):  # the unshared, unfactorized model has TinyGPT's count
        assert m.num_params() == sum(p.numel() for p in build_model(CFG, 0).parameters())
    with pytest.raises(ValueError, match="unique_layers must divide n_layers"):
        CompactGPT(CFG, 3)


def test_low_rank_at_full_rank_reconstructs_and_counts_the_formula():
    layer = nn.Linear(20, 12)
    full = low_rank_linear(layer, 12)
    x = torch.randn(5, 20)
    assert torch.allclose(full(x), layer(x), atol=1e-5)
    assert reconstruction_error(layer, 12) < 1e-6 < reconstruction_error(layer, 6)
    half = low_rank_linear(layer, 6)
    assert sum(p.numel() for p in half.parameters()) == low_rank_params(20, 12, 6) == 6 * 32 + 12
    with pytest.raises(ValueError, match="rank must be an int in"):
        low_rank_linear(layer, 13)


# ----------------------------------------------------------------------------- storage
def _variants(corpus):
    base = build_model(CFG, 0)
    train_lm(base, corpus, 20, seq_len=16)
    pruned = copy.deepcopy(base)
    Pruner(pruned).prune(0.8)
    two_four = copy.deepcopy(base)
    Pruner(two_four).prune("2:4")
    both = qat_model(pruned, 4)
    return {"dense": base, "pruned 80%": pruned, "2:4": two_four, "ptq 8": ptq(base, 8), "ptq 4": ptq(base, 4),
            "pruned + 4 bit": both, "shared": CompactGPT(CFG, 1, 8), "low rank": factorize(base, 0.5)}  # fmt: skip


def test_every_compressed_model_reloads_with_the_same_outputs_and_weighs_less(corpus, tmp_path):
    models = _variants(corpus)
    x = _x(corpus)
    sizes = {}
    for name, m in models.items():
        (tmp_path / name).mkdir()
        path = (
            tmp_path / name / "archive.pt"
        )  # torch.save names its inner folder after the file: as packed_bytes
        torch.save(pack(m), path)
        like = copy.deepcopy(m)
        with torch.no_grad():
            for p in like.parameters():
                p.zero_()
        back = unpack(torch.load(path), like)
        with torch.no_grad():
            assert torch.allclose(back(x), m(x), atol=1e-5), name
        with torch.no_grad():
            assert torch.allclose(deployed(m)(x), m(x), atol=1e-5), (
                name
            )  # no fake quantization left, same outputs
        sizes[name] = packed_bytes(m)
        assert sizes[name] == path.stat().st_size
    dense = sizes["dense"]
    assert (
        sizes["pruned 80%"] < 0.6 * dense
        and sizes["ptq 8"] < 0.45 * dense
        and sizes["ptq 4"] < sizes["ptq 8"]
    )
    assert sizes["pruned + 4 bit"] < sizes["pruned 80%"]


def test_sparse_storage_only_below_the_density_where_value_plus_index_beats_the_value_alone(
    corpus, monkeypatch
):
    # kept · (b_v + 2) + (rows + 1) · 4 < rows · cols · b_v: density 2/3 for fp32, 1/3 for int8, 1/5 for 4 bits
    rows, cols = 64, 256
    n, offsets = rows * cols, (rows + 1) * 4
    for bits, b_v in ((32, 4), (8, 1), (4, 0.5)):
        edge = (n * b_v - offsets) / (b_v + 2)  # the break-even count of kept weights
        assert sparse_pays((rows, cols), math.ceil(edge) - 1, bits)
        assert not sparse_pays((rows, cols), math.ceil(edge), bits)
        assert abs(edge / n - b_v / (b_v + 2)) < 0.01
    # half zeros: sparse for fp32 values, dense for int8 codes, whose sparse layout would weigh more
    base = build_model(CFG, 0)
    train_lm(base, corpus, 5, seq_len=16)
    half = copy.deepcopy(base)
    Pruner(half).prune(0.5)
    half8 = qat_model(half, 8)
    Pruner(half8).prune(0.5)
    for model, want_sparse in ((half, True), (half8, False)):
        pruned = {f"{name}.weight" for name, m in model.named_modules() if hasattr(m, "_compression_mask")}
        packed = pack(model)
        assert pruned and all(("crow" in packed[name]) == want_sparse for name in pruned)
    dense8 = packed_bytes(half8)
    monkeypatch.setattr(storage, "sparse_pays", lambda *args: True)
    assert packed_bytes(half8) > dense8
    assert packed_bytes(half) < packed_bytes(base)

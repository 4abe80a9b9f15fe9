"""Tiny models, synthetic data and the reference trainer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel_lab.models import (
    GPTConfig,
    MLPConfig,
    TinyGPT,
    TinyMLP,
    build_model,
    compute_loss,
    make_optimizer,
    synthetic_batch,
    train_reference,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and immune to a busy machine's oversubscription."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_shapes():
    cfg = GPTConfig(vocab=50, seq_len=12, d_model=24, n_heads=3, n_layers=2)
    gpt = build_model(cfg, 0)
    idx, tgt = synthetic_batch("tokens", 3, seq_len=10, vocab=50)
    assert idx.shape == tgt.shape == (3, 10) and idx.dtype == torch.long
    assert gpt(idx).shape == (3, 10, 50)
    loss = gpt(idx, tgt)
    assert (
        loss.shape == () and abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.2
    )  # ~uniform at init
    mlp = build_model(MLPConfig(in_dim=5, hidden=7, out_dim=3, depth=3), 0)
    x, y = synthetic_batch("regression", 4, in_dim=5, out_dim=3)
    assert mlp(x).shape == y.shape == (4, 3)
    assert len(mlp.layers) == 3


def test_attention_is_causal():
    gpt = build_model(GPTConfig(), 0)
    idx, _ = synthetic_batch("tokens", 2, seq_len=8)
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 64
    a, b = gpt(idx), gpt(changed)
    assert torch.equal(a[:, :5], b[:, :5]), "a later token changed an earlier position's output"
    assert not torch.equal(a[:, 5:], b[:, 5:])


def test_same_seed_same_weights_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(GPTConfig(), seed=7)
    after = torch.rand(1)
    assert torch.equal(before, after), "build_model must not draw from the global RNG"
    torch.rand(100)  # whatever else a rank drew before
    b = build_model(GPTConfig(), seed=7)
    c = build_model(GPTConfig(), seed=8)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_data_is_deterministic_by_seed():
    for kind in ("regression", "tokens"):
        a, b, c = (synthetic_batch(kind, 4, seed=s) for s in (1, 1, 2))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert not torch.equal(a[0], c[0])
    x, y = synthetic_batch("tokens", 4)
    assert torch.equal(x[:, 1:], y[:, :-1]), "targets are the inputs shifted by one"
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()


def test_tied_weights_really_tied():
    gpt = build_model(GPTConfig(tie_weights=True), 0)
    assert gpt.lm_head.weight is gpt.wte.weight
    names = [n for n, _ in gpt.named_parameters()]
    assert "lm_head.weight" not in names  # one parameter, listed once
    idx, tgt = synthetic_batch("tokens", 2)
    gpt(idx, tgt).backward()
    # The gradient is the sum of both uses: embedding lookup + output projection.
    g_total = gpt.wte.weight.grad.clone()
    gpt.zero_grad()
    x = gpt.wte(idx).detach().requires_grad_()
    logits = gpt.lm_head(gpt.ln_f(_blocks(gpt, x + gpt.wpe(torch.arange(idx.shape[1])))))
    F.cross_entropy(logits.flatten(0, 1), tgt.flatten()).backward()
    g_head = gpt.wte.weight.grad.clone()
    g_embed = torch.zeros_like(g_head).index_add_(0, idx.flatten(), x.grad.flatten(0, 1))
    torch.testing.assert_close(g_total, g_head + g_embed)
    untied = build_model(GPTConfig(tie_weights=False), 0)
    assert untied.lm_head.weight is not untied.wte.weight


def _blocks(gpt: TinyGPT, x: torch.Tensor) -> torch.Tensor:
    for b in gpt.blocks:
        x = b(x)
    return x


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_loss_decreases(optimizer):
    lr = {"sgd": 0.5, "momentum": 0.1}.get(optimizer, 1e-2)
    gpt = build_model(GPTConfig(), 0)
    batches = [synthetic_batch("tokens", 8, seed=s) for s in range(4)]
    losses = train_reference(gpt, batches, optimizer=optimizer, lr=lr, steps=40)
    assert len(losses) == 40
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
    mlp = build_model(MLPConfig(), 0)
    mlp_lr = {"sgd": 0.5, "momentum": 0.1}.get(optimizer, 1e-2)
    losses = train_reference(mlp, [synthetic_batch("regression", 16, seed=s) for s in range(4)],
                             optimizer=optimizer, lr=mlp_lr, steps=40)  # fmt: skip
    assert sum(losses[-4:]) / 4 < 0.5 * losses[0], losses


def test_reference_is_reproducible():
    batches = [synthetic_batch("tokens", 4, seed=s) for s in range(2)]
    a = train_reference(build_model(GPTConfig(), 3), batches, steps=5)
    b = train_reference(build_model(GPTConfig(), 3), batches, steps=5)
    assert a == b


def test_compute_loss_matches_model():
    mlp = build_model(MLPConfig(), 0)
    x, y = synthetic_batch("regression", 4)
    assert torch.equal(compute_loss(mlp, x, y), F.mse_loss(mlp(x), y))


def test_bad_input():
    with pytest.raises(ValueError, match="n_heads"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig(n_layers=0)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)
    with pytest.raises(ValueError, match="depth"):
        TinyMLP(depth=0)
    with pytest.raises(ValueError, match="seq_len"):
        build_model(GPTConfig(seq_len=8), 0)(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(TypeError, match="cfg"):
        build_model({"vocab": 10}, 0)
    with pytest.raises(TypeError, match="seed"):
        build_model(GPTConfig(), "0")
    with pytest.raises(ValueError, match="kind"):
        synthetic_batch("images", 4)
    with pytest.raises(ValueError, match="batch"):
        synthetic_batch("tokens", 0)
    with pytest.raises(ValueError, match="optimizer"):
        make_optimizer("lion", build_model(MLPConfig(), 0).parameters(), 0.1)
    with pytest.raises(ValueError, match="batches"):
        train_reference(build_model(MLPConfig(), 0), [])
    with pytest.raises(ValueError, match="steps"):
        train_reference(build_model(MLPConfig(), 0), [synthetic_batch("regression", 2)], steps=0)

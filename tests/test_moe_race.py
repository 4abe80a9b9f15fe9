"""The balancing race (lesson 21): the aux loss's values, the bias run's loss, determinism, the outcome."""

from __future__ import annotations

import pytest
import torch

from parallel_lab.models import GPTConfig, synthetic_batch
from parallel_lab.moe.race import MoEGPT, RaceConfig, run_race, topk_aux_loss


@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny ops: one thread is faster, and does not fight the suite's other processes for the 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_topk_aux_loss_is_one_when_balanced_and_e_over_k_when_collapsed():
    t, e, k = 12, 6, 2
    uniform = torch.full((t, e), 0.5)
    balanced = torch.arange(t * k).remainder(e).view(t, k)  # every expert 4 of the 24 choices
    assert topk_aux_loss(uniform, balanced).item() == pytest.approx(1.0)
    collapsed_scores = torch.zeros(t, e)
    collapsed_scores[:, :k] = 1.0
    collapsed = torch.arange(k).expand(t, k)
    assert topk_aux_loss(collapsed_scores, collapsed).item() == pytest.approx(e / k)


def test_topk_aux_loss_gradient_flows_through_the_scores_only():
    scores = torch.rand(8, 4).requires_grad_()
    chosen = torch.tensor([[0, 1]] * 8)
    topk_aux_loss(scores, chosen).backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0


def test_the_bias_never_reaches_the_loss_or_its_gradient():
    """Same weights, bias zero vs a bias that changes no selection's gates: the LM loss is the same function
    of the weights; with a bias that changes selections, the loss differs (the bias chooses)."""
    cfg = GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2)
    torch.manual_seed(0)
    model = MoEGPT(cfg, n_routed=8, k=2)
    x, y = synthetic_batch("tokens", 4, seq_len=8, vocab=32, seed=1)
    base = model(x, y)
    for m in model.moe_layers():
        m.moe.bias.fill_(3.0)  # the same shift for every expert: the same top-k, the same gates
    assert model(x, y).item() == base.item()
    assert not any(p is m.moe.bias for m in model.moe_layers() for p in model.parameters())


def test_race_is_deterministic_and_methods_share_the_start():
    runs = {m: run_race(method=m, steps=3, batch=4) for m in ("none", "aux", "bias")}
    again = run_race(method="bias", steps=3, batch=4)
    assert again.loss == runs["bias"].loss and again.max_vio == runs["bias"].max_vio
    # step 0 is before any update: the same model, batch and routing for all three
    assert len({r.loss[0] for r in runs.values()}) == 1
    assert len({tuple(r.max_vio[0]) for r in runs.values()}) == 1


def test_bias_balances_better_than_no_balancing():
    none, bias = (
        run_race(method="none", steps=60, batch=16),
        run_race(method="bias", steps=60, batch=16, gamma=1e-2),
    )
    assert bias.mean_vio(30) < 0.8 * none.mean_vio(30)


def test_race_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="method"):
        RaceConfig(method="sinkhorn")
    with pytest.raises(ValueError, match="steps"):
        RaceConfig(steps=0)
    with pytest.raises(ValueError, match="gamma"):
        RaceConfig(gamma=-1.0)

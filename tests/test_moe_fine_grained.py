"""Fine-grained and shared experts (lesson 21, `moe.fine_grained`): the layer equals the dense reference
forward and backward, with and without a balancing bias; its parameters and FLOPs equal the formulas; the
fine-grained cut keeps parameters and FLOPs of the coarse layer it replaces."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parallel_lab.moe import FineGrainedMoE, dense_reference, moe_counts


def _layer(seed: int = 0, **kw) -> FineGrainedMoE:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FineGrainedMoE(**kw).double()


@pytest.mark.parametrize("biased", [False, True])
def test_the_layer_equals_the_dense_reference_forward_and_backward(biased):
    layer = _layer(d_model=12, d_expert=6, n_shared=2, n_routed=8, k=3)
    if biased:
        layer.bias.copy_(torch.linspace(-0.2, 0.2, 8))  # a balancing bias moves tokens between experts
    x = torch.randn(2, 9, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y, chosen, gates = layer(x)
    assert torch.allclose(gates.sum(-1), torch.ones(18, dtype=gates.dtype))
    ref = dense_reference(layer, x)
    assert torch.allclose(y, ref, atol=1e-12)
    g = torch.randn_like(y)
    mine = torch.autograd.grad(y, list(layer.parameters()), g, allow_unused=True)
    theirs = torch.autograd.grad(ref, list(layer.parameters()), g, allow_unused=True)
    for a, b in zip(mine, theirs):
        assert (a is None and (b is None or not b.any())) or torch.allclose(a, b, atol=1e-12)


def test_parameters_and_flops_equal_the_formulas_and_the_fine_cut_keeps_them():
    """4 shared + 16 routed experts of width 8, top-4, against the coarse layer they cut in four: 1 shared
    and 4 routed experts of width 32, top-1."""
    fine = dict(d_model=16, d_expert=8, n_shared=4, n_routed=16, k=4)
    coarse = dict(d_model=16, d_expert=32, n_shared=1, n_routed=4, k=1)
    for kw in (fine, coarse):
        layer = _layer(**kw).float()
        want = moe_counts(**kw)
        assert sum(p.numel() for p in layer.parameters()) == want["params"]
        x = torch.randn(10, 16)
        with FlopCounterMode(display=False) as fc:
            layer(x)
        assert fc.get_total_flops() == 10 * want["flops_per_token"]
    f, c = moe_counts(**fine), moe_counts(**coarse)
    # the same expert weights and the same expert FLOPs per token; only the router and the biases differ
    assert f["flops_per_token"] - 2 * 16 * 16 == c["flops_per_token"] - 2 * 16 * 4
    assert f["params"] - 16 * 16 - 20 * (8 + 16) == c["params"] - 16 * 4 - 5 * (32 + 16)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="k \\(9\\) must be at most n_routed \\(8\\)"):
        FineGrainedMoE(n_routed=8, k=9)
    with pytest.raises(ValueError, match="n_shared must be an int >= 0"):
        FineGrainedMoE(n_shared=-1)

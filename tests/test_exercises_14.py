"""Lesson 14's exercises: sliding-window attention with a rolling KV cache (the lesson's cache grows), and causal
blockwise attention that returns its log-sum-exp (the lesson's is unmasked and returns the output only). Each:
the solution passes, the wrong algorithms below fail naming the mistake, the lab's attention and torch's SDPA are
switched off, and an answer table logged in one grade run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, edit, run_check, solution_namespace


def test_the_solutions_pass(capsys):
    run_check("14", "check_rolling_cached_attention")
    run_check("14", "check_online_softmax_attention")
    assert capsys.readouterr().out.count(" passed: ") == 2


ROLL = "rolling_cached_attention"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # the lesson's growing cache: correct outputs, but the cache outgrows the window
        (edit("14", ROLL, "k[:, :, -window:], v[:, :, -window:]", "k, v"), "keeps at most"),
        # the window cut before attending: a long prompt loses keys its own queries need
        (edit("14", ROLL, "k = torch.cat([old_k, k_new], dim=2)", "k = torch.cat([old_k, k_new], dim=2)[:, :, -window:]")
         .replace("v = torch.cat([old_v, v_new], dim=2)", "v = torch.cat([old_v, v_new], dim=2)[:, :, -window:]")
         .replace("kpos = torch.arange(seen - old_k.shape[2], seen + t)", "kpos = torch.arange(seen + t - k.shape[2], seen + t)"),
         "output differs"),
        # the window one position too wide (p - window .. p)
        (edit("14", ROLL, "> qpos[:, None] - window)", ">= qpos[:, None] - window)"), "output differs"),
        # causal only: the window forgotten within a long chunk
        (edit("14", ROLL, " & (kpos[None, :] > qpos[:, None] - window)", ""), "output differs"),
    ],
    ids=["growing-cache", "cut-before-attending", "window-plus-one", "no-window-mask"],
)  # fmt: skip
def test_wrong_rolling_caches_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("14", "check_rolling_cached_attention", wrong)


ONLINE = "online_softmax_attention"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # the lesson's unmasked attention
        (edit("14", ONLINE, '        s = s.masked_fill(kpos > qpos, float("-inf"))', "        pass"), "out differs"),
        # the mask for queries at the first N positions, not the last N
        (edit("14", ONLINE, "qpos = torch.arange(M - N, M)[:, None]", "qpos = torch.arange(N)[:, None]"), "out differs"),
        # the running maximum left out of lse
        (edit("14", ONLINE, "(m + torch.log(total)).squeeze(-1)", "torch.log(total).squeeze(-1)"), "lse differs"),
        # no rescaling when the maximum rises
        (edit("14", ONLINE, "corr = torch.exp(m - m_new)", "corr = torch.ones_like(m)"), "differs|nan"),
    ],
    ids=["unmasked", "first-n-positions", "lse-without-max", "no-rescale"],
)  # fmt: skip
def test_wrong_online_attention_fails(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("14", "check_online_softmax_attention", wrong)


@pytest.mark.parametrize(
    "cheat, check",
    [
        ("import torch\ndef online_softmax_attention(q, k, v, block):\n"
         "    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n", "check_online_softmax_attention"),
        ("from parallel_lab.inference import attention\ndef online_softmax_attention(q, k, v, block):\n"
         "    attention.flash_attention(q, k, v, causal=True)\n", "check_online_softmax_attention"),
        ("from parallel_lab.inference import kv_cache\ndef rolling_cached_attention(q, k_new, v_new, cache, window):\n"
         "    kv_cache.KVCache().attend(0, q, k_new, v_new)\n", "check_rolling_cached_attention"),
    ],
    ids=["torch-sdpa", "lab-flash", "lab-cache"],
)  # fmt: skip
def test_wrappers_are_switched_off(cheat, check):
    with pytest.raises(AssertionError, match="switched off"):
        run_check("14", check, cheat)


def test_a_table_of_one_runs_attention_outputs_fails_the_next():
    """Keyed by the inputs' bytes; a miss returns zeros."""
    import torch

    ns = solution_namespace("14")
    real, table = ns[ONLINE], {}

    def key(q, k, v, block):
        return q.numpy().tobytes(), k.numpy().tobytes(), block

    def logging(q, k, v, block):
        table[key(q, k, v, block)] = out = real(q, k, v, block)
        return out

    cell = compile(_check_cell("14", "check_online_softmax_attention"), "<check>", "exec")
    ns[ONLINE] = logging
    exec(cell, ns)  # noqa: S102
    ns[ONLINE] = lambda q, k, v, block: table.get(
        key(q, k, v, block), (torch.zeros_like(q), torch.zeros(q.shape[:-1]))
    )
    with pytest.raises(AssertionError, match="differs"):
        exec(cell, ns)  # noqa: S102

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
        (edit("14", ROLL, "k[:, :, -window:].clone(), v[:, :, -window:].clone()", "k, v"), "keeps at most"),
        # the last `window` positions kept as slices: views that keep the whole concatenation alive
        (edit("14", ROLL, "k[:, :, -window:].clone(), v[:, :, -window:].clone()", "k[:, :, -window:], v[:, :, -window:]"),
         "a slice keeps the whole tensor"),
        # the window kept, and every key ever seen hidden in a nested list
        (edit("14", ROLL, "return out", "cache.setdefault('log', {'all': []})['all'].append(k_new)\n    return out"),
         "keeps at most"),
        # a growing history stacked into one tensor inside a tuple
        (edit("14", ROLL, "return out", "cache['hist'] = (k if cache.get('hist') is None else torch.cat([cache['hist'][0], k_new], 2),)\n    return out"),
         "keeps at most"),
        # the window cut before attending: a long prompt loses keys its own queries need
        (edit("14", ROLL, "k = torch.cat([old_k, k_new], dim=2)", "k = torch.cat([old_k, k_new], dim=2)[:, :, -window:]")
         .replace("v = torch.cat([old_v, v_new], dim=2)", "v = torch.cat([old_v, v_new], dim=2)[:, :, -window:]")
         .replace("kpos = torch.arange(seen - old_k.shape[2], seen + t, device=q.device)", "kpos = torch.arange(seen + t - k.shape[2], seen + t)"),
         "output differs"),
        # the window one position too wide (p - window .. p)
        (edit("14", ROLL, "> qpos[:, None] - window)", ">= qpos[:, None] - window)"), "output differs"),
        # causal only: the window forgotten within a long chunk
        (edit("14", ROLL, " & (kpos[None, :] > qpos[:, None] - window)", ""), "output differs"),
    ],
    ids=["growing-cache", "slices-not-copies", "history-in-nested-list", "history-in-tuple", "cut-before-attending",
         "window-plus-one", "no-window-mask"],
)  # fmt: skip
def test_wrong_rolling_caches_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("14", "check_rolling_cached_attention", wrong)


def test_keys_and_values_stacked_in_one_tensor_pass(capsys):
    """One (2, B, H, window, d) tensor holds as much as two (B, H, window, d) ones: accepted."""
    right = edit("14", ROLL, 'old_k = cache["k"] if cache["k"] is not None else k_new[:, :, :0]',
                 'old_k = cache["kv"][0] if cache.get("kv") is not None else k_new[:, :, :0]')  # fmt: skip
    right = right.replace('old_v = cache["v"] if cache["v"] is not None else v_new[:, :, :0]',
                          'old_v = cache["kv"][1] if cache.get("kv") is not None else v_new[:, :, :0]')  # fmt: skip
    right = right.replace('cache["k"], cache["v"], cache["seen"] = k[:, :, -window:].clone(), v[:, :, -window:].clone(), seen + t',
                          'cache["kv"], cache["seen"] = torch.stack([k[:, :, -window:], v[:, :, -window:]]), seen + t')  # fmt: skip
    assert 'cache["kv"], cache["seen"]' in right
    run_check("14", "check_rolling_cached_attention", right)
    assert " passed: " in capsys.readouterr().out


def test_the_solutions_run_on_another_device():
    """Every tensor the solutions create is made on q's device (meta here: a CPU tensor beside it fails)."""
    import torch

    ns = solution_namespace("14")
    q, k = torch.randn(1, 2, 5, 4, device="meta"), torch.randn(1, 2, 9, 4, device="meta")
    out, lse = ns[ONLINE](q, k, k, 4)
    assert out.device.type == lse.device.type == "meta"
    cache = {"k": None, "v": None, "seen": 0}
    assert ns[ROLL](q, q, q, cache, 3).device.type == "meta"
    assert ns[ROLL](q[:, :, :1], q[:, :, :1], q[:, :, :1], cache, 3).device.type == "meta"


ONLINE = "online_softmax_attention"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # the lesson's unmasked attention
        (edit("14", ONLINE, '        s = s.masked_fill(kpos > qpos, float("-inf"))', "        pass"), "out differs"),
        # the mask for queries at the first N positions, not the last N
        (edit("14", ONLINE, "qpos = torch.arange(M - N, M, device=q.device)[:, None]", "qpos = torch.arange(N)[:, None]"), "out differs"),
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


# a plain softmax for a block of queries at a time, over all M keys: small in memory, but not blockwise over keys
_QUERY_BLOCKS = """import math
import torch
def online_softmax_attention(q, k, v, block):
    N, M = q.shape[2], k.shape[2]
    outs, lses = [], []
    for i in range(0, N, {qb}):
        s = q[:, :, i : i + {qb}] @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        qpos = torch.arange(M - N + i, M - N + i + s.shape[2])[:, None]
        s = s.masked_fill(torch.arange(M)[None, :] > qpos, float("-inf"))
        outs.append(s.softmax(-1) @ v)
        lses.append(torch.logsumexp(s, -1))
    return torch.cat(outs, 2), torch.cat(lses, 2)
"""


@pytest.mark.parametrize("qb", [8, 32], ids=["8-queries", "32-queries"])
def test_query_blocks_against_all_keys_fail(qb):
    with pytest.raises(AssertionError, match="key positions at once"):
        run_check("14", "check_online_softmax_attention", _QUERY_BLOCKS.format(qb=qb))


@pytest.mark.parametrize(
    "cheat, check",
    [
        ("import torch\ndef online_softmax_attention(q, k, v, block):\n"
         "    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n", "check_online_softmax_attention"),
        ("from parallel_lab.inference import attention\ndef online_softmax_attention(q, k, v, block):\n"
         "    attention.flash_attention(q, k, v, causal=True)\n", "check_online_softmax_attention"),
        ("from parallel_lab.inference import kv_cache\ndef rolling_cached_attention(q, k_new, v_new, cache, window):\n"
         "    kv_cache.KVCache().attend(0, q, k_new, v_new)\n", "check_rolling_cached_attention"),
        # torch's private fused kernels, reached through torch.ops (it returns out and lse)
        ("import torch\ndef online_softmax_attention(q, k, v, block):\n"
         "    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[:2]\n",
         "check_online_softmax_attention"),
        ("import torch\ndef rolling_cached_attention(q, k_new, v_new, cache, window):\n"
         "    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k_new, v_new)\n", "check_rolling_cached_attention"),
        ("import torch\ndef online_softmax_attention(q, k, v, block):\n"
         "    torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)\n", "check_online_softmax_attention"),
        # the math fallback of SDPA, private
        ("import torch\ndef online_softmax_attention(q, k, v, block):\n"
         "    torch.ops.aten._scaled_dot_product_attention_math(q, k, v)\n", "check_online_softmax_attention"),
    ],
    ids=["torch-sdpa", "lab-flash", "lab-cache", "aten-flash-for-cpu", "aten-flash-in-cache", "aten-efficient",
         "aten-math"],
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


# torch modules whose attention-named functions do not compute attention on tensors a learner could call, by why
_NOT_THE_JOB = {
    "torch._dynamo.": "tracing",
    "torch._inductor.": "compiler: kernels, lowerings, autotuning",
    "torch._meta_registrations": "shape functions",
    "torch._subclasses.": "fake tensors",
    "torch.backends.cuda": "availability queries",
    "torch.distributed.tensor._ops.": "sharding strategies",
    "torch.distributed.tensor.experimental._context_parallel._sharding_rules": "sharding strategies",
    # ring attention needs a process group, and ends in aten._scaled_dot_product_* operators, which the dispatch
    # mode rejects
    "torch.distributed.tensor.experimental._context_parallel._attention": "ends in rejected operators",
    "torch.nested._internal.": "nested-tensor argument checks",
    "torch.nn.attention._fa": "CUDA FlashAttention-3/4 registrations",
    "torch.nn.attention._registry": "kernel registry",
    "torch.nn.attention._utils": "argument checks",
    "torch.nn.attention": "backend selection (sdpa_kernel)",
    "torch.onnx.": "graph exporters",
    "torch.sparse._triton_ops": "Triton (GPU) kernels on block-sparse tensors",
    "torch.testing.": "test inputs",
    "torch.utils.flop_counter": "FLOP formulas",
}


def test_torchs_own_attention_is_switched_off():
    """torch's Python functions named for attention (found in torch's source) that compute it are switched off
    while the learner's functions run; the rest are listed above with the reason they cannot do the job. A new torch
    that adds one fails here, not in a learner's notebook."""
    import importlib
    import re
    from pathlib import Path

    import torch

    from parallel_lab.grading.checks.inference import FORBIDDEN

    job = re.compile(
        r"^\s*def (\w*(?:scaled_dot_product_attention|flash_attention|efficient_attention|multi_head_attention"
        r"|flex_attention|sdpa)\w*)\(",
        re.M,
    )
    root = Path(torch.__file__).parent
    found: dict[str, list[str]] = {}
    for f in root.rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        for m in job.finditer(text):
            found.setdefault(module, []).append(m.group(1))
    assert "torch.nn.functional" in found, "the search finds nothing: torch's layout changed"
    missing = {
        module: [
            n for n in names if not any(k.startswith(module + ".") and n in k.split(".") for k in FORBIDDEN)
        ]
        for module, names in found.items()
        if not any(module == e or (e.endswith((".", "_fa")) and module.startswith(e)) for e in _NOT_THE_JOB)
    }
    # a function defined inside another (or a method) is not an attribute of its module: its outer one is checked
    missing = {
        m: [n for n in names if hasattr(importlib.import_module(m), n)]
        for m, names in missing.items()
        if names
    }
    missing = {m: n for m, n in missing.items() if n}
    assert not missing, f"torch attention functions not switched off: {missing}"


@pytest.mark.parametrize(
    "cheat",
    [
        "import torch\nfrom torch._decomp.decompositions import scaled_dot_product_flash_attention_for_cpu as f\n"
        "def online_softmax_attention(q, k, v, block):\n    return f(q, k, v, is_causal=True)[:2]\n",
        "from torch.nn.attention.flex_attention import flex_attention\n"
        "def online_softmax_attention(q, k, v, block):\n    return flex_attention(q, k, v, return_lse=True)\n",
    ],
    ids=["decomposition-for-cpu", "flex-attention"],
)
def test_torchs_python_attention_is_switched_off(cheat):
    with pytest.raises(AssertionError, match="switched off"):
        run_check("14", "check_online_softmax_attention", cheat)

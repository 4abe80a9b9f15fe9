"""Lesson 17's exercises: the reference solution passes, and wrappers of the lab's and torch's
functions, answer tables from an earlier grade run and wrong algorithms fail, each with a message
naming what differed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from solution_code import _check_cell, edit, run_check, solution_namespace

WRONG = [
    ("17", "check_merge_partials", "no max subtraction",
     "import torch\ndef merge(out_a, lse_a, out_b, lse_b):\n    wa, wb = torch.exp(lse_a), torch.exp(lse_b)\n    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None], torch.log(wa + wb)\n", "inf or nan"),
    ("17", "check_merge_partials", "outputs averaged, not rescaled", edit("17", "merge", "return out_a * share_a + out_b * share_b, lse", "return (out_a + out_b) / 2, lse"), "out differs"),
    ("17", "check_merge_partials", "log-sum-exp not merged", edit("17", "merge", "lse = top + torch.log(wa + wb)", "lse = top"), "lse differs"),
    ("17", "check_merge_partials", "wraps the lab's", "from parallel_lab.inference import merge_attention\ndef merge(a, la, b, lb):\n    return merge_attention(a, la, b, lb)\n", "switched off"),
    ("17", "check_zigzag_positions", "late chunk first", edit("17", "zigzag_positions", "return list(range(early * c, (early + 1) * c)) + list(range(late * c, (late + 1) * c))", "return list(range(late * c, (late + 1) * c)) + list(range(early * c, (early + 1) * c))"), "wrong order"),
    ("17", "check_zigzag_positions", "partner N + r", edit("17", "zigzag_positions", "early, late = rank, chunks - 1 - rank", "early, late = rank, world_size + rank"), "the partner that balances"),
    ("17", "check_zigzag_positions", "contiguous", edit("17", "zigzag_positions", "early, late = rank, chunks - 1 - rank", "early, late = 2 * rank, 2 * rank + 1"), "expected chunks"),
    ("17", "check_zigzag_positions", "accepts a length that cannot split", edit("17", "zigzag_positions", "if seq_len % chunks:", "if False:"), "instead of raising ValueError"),
    ("17", "check_merge_partials", "torch's private merger", "from torch.distributed.tensor.experimental._context_parallel._attention import _SDPAMerger\ndef merge(a, la, b, lb):\n    m = _SDPAMerger(True, seq_dim=2)\n    m.step(a, la, False)\n    m.step(b, lb, False)\n    return m.results()\n", "switched off"),
    ("17", "check_zigzag_positions", "torch's private load balancer", "from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer\ndef zigzag_positions(rank, world_size, seq_len):\n    idx = _HeadTailLoadBalancer(seq_len, world_size, 'cpu')._generate_indices()\n    return idx[0].reshape(world_size, -1)[rank].tolist()\n", "switched off"),
    ("17", "check_zigzag_positions", "wraps the lab's", "from parallel_lab.context_parallel import positions\ndef zigzag_positions(rank, world_size, seq_len):\n    return positions(rank, world_size, seq_len, zigzag=True)\n", "switched off"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("check", "label", "source", "want"), [w[1:] for w in WRONG], ids=[w[2] for w in WRONG]
)
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    with pytest.raises(AssertionError) as info:
        run_check("17", check, source)
    assert want in str(info.value), f"{label}: {info.value}"


# ----------------------------------------------------------------------------- cases drawn at grade time
def test_a_table_of_one_grade_runs_answers_fails_the_next():
    """A learner who logs the cases of one grade run and answers from that table passes the fixed
    cases but not the ones drawn the next run."""
    ns = solution_namespace("17")
    real, table = ns["zigzag_positions"], {}

    def logging(rank, world_size, seq_len):
        table[rank, world_size, seq_len] = out = real(rank, world_size, seq_len)
        return out

    ns["zigzag_positions"] = logging
    exec(compile(_check_cell("17", "check_zigzag_positions"), "<check>", "exec"), ns)  # noqa: S102
    assert len(table) > 36

    def from_the_table(rank, world_size, seq_len):
        if seq_len % (2 * world_size):
            raise ValueError("cannot split")
        return table.get((rank, world_size, seq_len), [])

    ns["zigzag_positions"] = from_the_table
    with pytest.raises(AssertionError, match="returned"):
        exec(compile(_check_cell("17", "check_zigzag_positions"), "<check>", "exec"), ns)  # noqa: S102


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's modules that do an exercise's job (found by name in torch's source) are all in the
    checks' switched-off list: a new torch that adds one fails here, not in a learner's notebook."""
    import torch

    from parallel_lab.grading.checks import long_sequences

    root = Path(torch.__file__).parent / "distributed"
    job = re.compile(r"^(?:class|def) (_?\w*(?:LoadBalancer|Merger)\b|_?\w*(?:zigzag|head_tail|partial_update)\w*)",
                     re.M | re.I)  # fmt: skip
    found = {}
    for f in root.rglob("*.py"):
        for name in job.findall(f.read_text(encoding="utf-8", errors="ignore")):
            module = ".".join(f.relative_to(root.parent.parent).with_suffix("").parts)
            found.setdefault(module, []).append(name)
    assert found, "the search finds nothing: torch's layout changed"
    covered = {k.rsplit(".", 2)[0] for k in long_sequences.TORCH_CP} | {
        k.rsplit(".", 1)[0] for k in long_sequences.TORCH_CP
    }
    missing = {m: names for m, names in found.items() if m not in covered}
    assert not missing, f"torch modules doing an exercise's job, not switched off: {missing}"

"""Lesson 17's exercises: the reference solution passes; wrappers of the lab's and torch's functions,
answer tables from an earlier grade run and wrong algorithms fail, each with a message naming what
differed; the optimum the balancing check compares with is the best of every pairing."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from solution_code import _check_cell, edit, fails_saying, passes_with_one_line, run_check, solution_namespace

HEAD = (
    "import torch\ndef merge_remote(acc, m, l, out_b, lse_b):\n    m_new = torch.maximum(m, lse_b)\n"
    "    ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)\n"
    "    wa, wb = torch.exp(m - ref), torch.exp(lse_b - ref)\n"
)
TO_LSE = "    lse_a = m + torch.log(l)\n    lse = torch.logaddexp(lse_a, lse_b)\n"
# Right answers other than the reference, which the check must pass: the merge written through log-sum-exp
# (it rounds m + log l to float32 at the row's scale before exponentiating), the remote part taken as a
# running state of its own (reference lse_b, l_b = 1, acc_b = out_b: exact, since exp(lse_b) = 1 x e^lse_b),
# and the union's lse kept as the reference (l = 1)
RIGHT = {
    "through log-sum-exp": (
        "import torch\ndef merge_remote(acc, m, l, out_b, lse_b):\n"
        + TO_LSE
        + "    top = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)\n"
        "    out_a = acc / torch.where(l > 0, l, torch.ones_like(l)).unsqueeze(-1)\n"
        "    out = torch.exp(lse_a - top).unsqueeze(-1) * out_a + torch.exp(lse_b - top).unsqueeze(-1) * out_b\n"
        "    m_new = torch.maximum(m, lse_b)\n"
        "    l_new = torch.exp(lse - torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new))\n"
        "    return out * l_new.unsqueeze(-1), m_new, l_new\n"
    ),
    "lse_b as the remote part's m, with l_b = 1": (
        "import torch\ndef merge_remote(acc, m, l, out_b, lse_b):\n"
        "    m_b, l_b = lse_b, torch.where(torch.isinf(lse_b), 0.0, 1.0)\n"
        "    m_new = torch.maximum(m, m_b)\n"
        "    ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)\n"
        "    wa, wb = torch.exp(m - ref), torch.exp(m_b - ref)\n"
        "    return wa[..., None] * acc + wb[..., None] * out_b, m_new, wa * l + wb * l_b\n"
    ),
    "the union's lse as the reference": (
        "import torch\ndef merge_remote(acc, m, l, out_b, lse_b):\n"
        + TO_LSE
        + "    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)\n"
        "    wa, wb = torch.exp(lse_a - ref), torch.exp(lse_b - ref)\n"
        "    out_a = acc / torch.where(l > 0, l, torch.ones_like(l))[..., None]\n"
        "    return wa[..., None] * out_a + wb[..., None] * out_b, lse, torch.where(torch.isinf(lse), 0.0, wa + wb)\n"
    ),
}
WRONG = [
    # ---- exercise 1: merge_remote
    ("check_merge_remote", "no rescaling of the local state", HEAD + "    return acc + wb[..., None] * out_b, m_new, l + wb\n",
     "you left the local acc and l as they came"),
    ("check_merge_remote", "rescales acc but not l", edit("17", "merge_remote", "l = wa * l + wb", "l = l + wb"),
     "acc is right, l is not"),
    ("check_merge_remote", "adds out_b without its mass",
     edit("17", "merge_remote", "acc = wa.unsqueeze(-1) * acc + wb.unsqueeze(-1) * out_b",
          "acc = wa.unsqueeze(-1) * acc + out_b"), "you added out_b as it came"),
    ("check_merge_remote", "lse-style weights on the unnormalised acc (double normalisation)",
     "import torch\ndef merge_remote(acc, m, l, out_b, lse_b):\n" + TO_LSE
     + "    top = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)\n"
     "    sa, sb = torch.exp(lse_a - top), torch.exp(lse_b - top)\n    m_new = torch.maximum(m, lse_b)\n"
     "    l_new = torch.exp(lse - torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new))\n"
     "    return sa[..., None] * acc + sb[..., None] * out_b, m_new, l_new\n",
     "divides it a second time"),
    ("check_merge_remote", "returns normalised attention as acc",
     edit("17", "merge_remote", "return acc, m_new, l",
          "return acc / torch.where(l > 0, l, torch.ones_like(l)).unsqueeze(-1), m_new, l"), "your acc is normalised"),
    ("check_merge_remote", "nan on a fully masked block",
     edit("17", "merge_remote", "ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)", "ref = m_new"),
     "exp(-inf - (-inf)) is nan"),
    ("check_merge_remote", "exponentiates the maxima and the lse themselves",
     edit("17", "merge_remote", "wa, wb = torch.exp(m - ref), torch.exp(lse_b - ref)",
          "wa, wb = torch.exp(m) / torch.exp(ref), torch.exp(lse_b) / torch.exp(ref)"), "overflows float32"),
    ("check_merge_remote", "keeps the local m as the reference",
     edit("17", "merge_remote", "m_new = torch.maximum(m, lse_b)", "m_new = m"), "taken from one part alone"),
    ("check_merge_remote", "takes the remote lse as the reference",
     edit("17", "merge_remote", "m_new = torch.maximum(m, lse_b)", "m_new = lse_b"), "taken from one part alone"),
    ("check_merge_remote", "wraps the lab's merge_attention",
     "import torch\nfrom parallel_lab.inference import merge_attention\n"
     "def merge_remote(acc, m, l, out_b, lse_b):\n"
     "    out, lse = merge_attention(acc / l[..., None], m + torch.log(l), out_b, lse_b)\n"
     "    m_new = torch.maximum(m, lse_b)\n    l_new = torch.exp(lse - m_new)\n"
     "    return out * l_new[..., None], m_new, l_new\n",
     "switched off"),
    ("check_merge_remote", "torch's private merger",
     "import torch\nfrom torch.distributed.tensor.experimental._context_parallel._attention import _SDPAMerger\n"
     "def merge_remote(acc, m, l, out_b, lse_b):\n    mg = _SDPAMerger(True, seq_dim=2)\n"
     "    mg.step(acc / l[..., None], m + torch.log(l), False)\n"
     "    mg.step(out_b, lse_b, False)\n    out, lse = mg.results()\n"
     "    m_new = torch.maximum(m, lse_b)\n    l_new = torch.exp(lse - m_new)\n"
     "    return out * l_new[..., None], m_new, l_new\n",
     "switched off"),
    ("check_merge_remote", "torch's public attention",
     "import torch\nimport torch.nn.functional as F\n"
     "def merge_remote(acc, m, l, out_b, lse_b):\n"
     "    F.scaled_dot_product_attention(acc, out_b, out_b)\n    return acc, m, l\n",
     "switched off"),
    ("check_merge_remote", "reads the check's own helpers",
     "from parallel_lab.grading.checks.long_sequences import _mistakes\n"
     "def merge_remote(acc, m, l, out_b, lse_b):\n"
     "    _mistakes((acc, m, l), (out_b, lse_b), m)\n    return acc, m, l\n", "switched off"),
    # ---- exercise 2: balanced_chunks
    ("check_balanced_chunks", "the causal zigzag",
     edit("17", "balanced_chunks", "return [(order[i], order[chunks - 1 - i]) for i in range(world_size)]",
          "return [(r, chunks - 1 - r) for r in range(world_size)]"), "causal zigzag"),
    ("check_balanced_chunks", "work counted as if causal over the whole sequence",
     edit("17", "balanced_chunks", "for n in doc_lens:\n        seen.extend(range(1, n + 1))",
          "seen.extend(range(1, seq_len + 1))"), "causal zigzag"),
    ("check_balanced_chunks", "contiguous chunks",
     edit("17", "balanced_chunks", "return [(order[i], order[chunks - 1 - i]) for i in range(world_size)]",
          "return [(2 * r, 2 * r + 1) for r in range(world_size)]"), "two neighbouring chunks"),
    ("check_balanced_chunks", "pairs by position, not by work",
     edit("17", "balanced_chunks", "return [(order[i], order[chunks - 1 - i]) for i in range(world_size)]",
          "return [(r, world_size + r) for r in range(world_size)]"), "follows the chunks' positions"),
    ("check_balanced_chunks", "sorted by work, the i-th with the (i+N)-th",
     edit("17", "balanced_chunks", "return [(order[i], order[chunks - 1 - i]) for i in range(world_size)]",
          "return [(order[i], order[i + world_size]) for i in range(world_size)]"),
     "the i-th lightest chunk with the (i+N)-th lightest"),
    ("check_balanced_chunks", "by position, r with r+N, on one document (not blamed on position)",
     edit("17", "balanced_chunks", "return [(order[i], order[chunks - 1 - i]) for i in range(world_size)]",
          "return [(r, r + world_size) if len(doc_lens) == 1 else (order[r], order[chunks - 1 - r])\n"
          "            for r in range(world_size)]"),
     "rdered by work, your pairing puts the i-th lightest"),
    ("check_balanced_chunks", "pairs heavy with heavy",
     edit("17", "balanced_chunks", "return [(order[i], order[chunks - 1 - i]) for i in range(world_size)]",
          "return [(order[2 * i], order[2 * i + 1]) for i in range(world_size)]"),
     "the two chunks with the most visible pairs"),
    ("check_balanced_chunks", "counts only the keys inside the chunk",
     edit("17", "balanced_chunks", "for n in doc_lens:\n        seen.extend(range(1, n + 1))",
          "starts = {sum(doc_lens[:i]) for i in range(len(doc_lens))}\n"
          "    for p in range(seq_len):\n"
          "        seen.append(1 if p in starts or p % c == 0 else seen[-1] + 1)"),
     "the best pairing's heaviest rank sees"),
    ("check_balanced_chunks", "a chunk held twice",
     edit("17", "balanced_chunks", "return [(order[i], order[chunks - 1 - i]) for i in range(world_size)]",
          "return [(order[0], order[-1])] * world_size"), "held twice"),
    ("check_balanced_chunks", "accepts documents that do not fill the sequence",
     edit("17", "balanced_chunks", "if sum(doc_lens) != seq_len:", "if False:"), "instead of raising ValueError"),
    ("check_balanced_chunks", "accepts a length that cannot split",
     edit("17", "balanced_chunks", "if seq_len % chunks:", "if False:"), "instead of raising ValueError"),
    ("check_balanced_chunks", "reads the check's own helpers",
     "from parallel_lab.grading.checks.long_sequences import _chunk_work\n"
     "def balanced_chunks(world_size, seq_len, doc_lens):\n"
     "    work = _chunk_work(2 * world_size, seq_len, doc_lens)\n"
     "    order = sorted(range(2 * world_size), key=work.__getitem__)\n"
     "    return [(order[i], order[-1 - i]) for i in range(world_size)]\n", "switched off"),
    ("check_balanced_chunks", "wraps the lab's layout",
     "from parallel_lab.context_parallel import chunk_ids\ndef balanced_chunks(world_size, seq_len, doc_lens):\n"
     "    return [chunk_ids(r, world_size, zigzag=True) for r in range(world_size)]\n", "switched off"),
    ("check_balanced_chunks", "torch's private work-based balancer",
     "import torch\nfrom torch.distributed.tensor.experimental._context_parallel._load_balancer import _PTRRLoadBalancer\n"
     "def balanced_chunks(world_size, seq_len, doc_lens):\n"
     "    c = seq_len // (2 * world_size)\n"
     "    seen = [t + 1 for n in doc_lens for t in range(n)]\n"
     "    work = torch.tensor([sum(seen[i * c:(i + 1) * c]) for i in range(2 * world_size)])\n"
     "    return _PTRRLoadBalancer.ptrr_scheduling(work, world_size).tolist()\n", "switched off"),
    ("check_balanced_chunks", "torch's private per-document zigzag",
     "from torch.distributed.tensor.experimental._context_parallel._load_balancer import _PerDocumentHeadTailLoadBalancer\n"
     "def balanced_chunks(world_size, seq_len, doc_lens):\n"
     "    idx = _PerDocumentHeadTailLoadBalancer([doc_lens], world_size, 'cpu')._generate_indices()\n"
     "    return [(r, 2 * world_size - 1 - r) for r in range(world_size)]\n", "switched off"),
]  # fmt: skip


@pytest.mark.parametrize("check", ["check_merge_remote", "check_balanced_chunks"])
def test_the_solution_passes_with_one_line(check, capsys):
    passes_with_one_line("17", check, capsys)


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    message = fails_saying("17", check, label, source, want)
    if "not blamed on position" in label:
        assert "position" not in message.split("doc_lens=[64])", 1)[1], message


@pytest.mark.parametrize("label", list(RIGHT))
def test_other_right_merges_pass(label, capsys):
    runs = 50 if label == "through log-sum-exp" else 3  # it rounds at the row's scale: run it on many draws
    for _ in range(runs):
        run_check("17", "check_merge_remote", RIGHT[label])
    lines = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith("check_merge_remote passed") for ln in lines) == runs


# ----------------------------------------------------------------------------- the optimum is the optimum
def _pairings(items):
    if not items:
        yield []
        return
    for i in range(1, len(items)):
        for rest in _pairings(items[1:i] + items[i + 1 :]):
            yield [(items[0], items[i]), *rest]


def test_the_sorted_pairing_is_the_best_of_every_pairing():
    """The check's optimum (sort, pair the largest with the smallest) against all pairings, on packings
    like the check's and on weights with many ties, for 1 to 5 ranks."""
    from parallel_lab.grading.checks.long_sequences import _chunk_work, _optimum

    rnd = random.Random(0)
    for trial in range(600):
        n = rnd.randint(1, 5)
        if trial % 2:
            work = [rnd.randint(0, 6) for _ in range(2 * n)]
        else:
            c = rnd.randint(1, 9)
            docs, left = [], 2 * n * c
            while left:
                docs.append(min(left, rnd.randint(1, 3 * c)))
                left -= docs[-1]
            work = _chunk_work(2 * n, 2 * n * c, docs)
        best = min(max(work[a] + work[b] for a, b in p) for p in _pairings(list(range(2 * n))))
        assert _optimum(work) == best, work


def test_chunk_work_counts_the_document_mask():
    """Visible pairs per chunk, counted from an explicit mask matrix."""
    import torch

    from parallel_lab.grading.checks.long_sequences import _chunk_work

    rnd = random.Random(1)
    for _ in range(50):
        chunks, c = 2 * rnd.randint(1, 4), rnd.randint(1, 6)
        length, docs = chunks * c, []
        while sum(docs) < length:
            docs.append(min(length - sum(docs), rnd.randint(1, 2 * c)))
        doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        pos = torch.arange(length)
        mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # (query, key)
        want = mask.sum(dim=1).reshape(chunks, c).sum(dim=1).tolist()
        assert _chunk_work(chunks, length, docs) == want


def test_every_drawn_packing_defeats_the_rules_by_position():
    from parallel_lab.grading.checks.long_sequences import (
        _chunk_work,
        _draw_packing,
        _grows,
        _heaviest,
        _optimum,
        _position_pairings,
    )

    rnd = random.Random(2)
    for _ in range(200):
        n, length, docs = _draw_packing(rnd)
        assert sum(docs) == length and length % (2 * n) == 0
        work = _chunk_work(2 * n, length, docs)
        assert all(_heaviest(p, work) > _optimum(work) for p in _position_pairings(n, work).values())
        assert not _grows(work)  # so a rule by position differs from its twin by work


# ----------------------------------------------------------------------------- cases drawn at grade time
def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("17", check), "<check>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_grade_runs_merges_fails_the_next():
    """A learner who logs the inputs and answers of one grade run and answers from that table fails
    the next run, whose shapes, values and masks are drawn again."""
    ns = solution_namespace("17")
    real, table = ns["merge_remote"], {}

    def key(*ts):
        return tuple(t.numpy().tobytes() for t in ts)

    def logging(*args):
        table[key(*args)] = out = real(*args)
        return out

    ns["merge_remote"] = logging
    _run(ns, "check_merge_remote")
    assert len(table) > 10

    def from_the_table(*args):
        return table.get(key(*args), args[:3])

    ns["merge_remote"] = from_the_table
    with pytest.raises(AssertionError, match="merge_remote"):
        _run(ns, "check_merge_remote")


def test_a_table_of_one_grade_runs_pairings_fails_the_next():
    ns = solution_namespace("17")
    real, table = ns["balanced_chunks"], {}

    def logging(world_size, seq_len, doc_lens):
        table[world_size, seq_len, tuple(doc_lens)] = out = real(world_size, seq_len, doc_lens)
        return out

    ns["balanced_chunks"] = logging
    _run(ns, "check_balanced_chunks")
    assert len(table) >= 20  # 7 fixed and 16 drawn packings (two drawn alike would share a row)

    def from_the_table(world_size, seq_len, doc_lens):
        if seq_len % (2 * world_size) or sum(doc_lens) != seq_len:
            raise ValueError("cannot split")
        zigzag = [(r, 2 * world_size - 1 - r) for r in range(world_size)]
        return table.get((world_size, seq_len, tuple(doc_lens)), zigzag)

    ns["balanced_chunks"] = from_the_table
    with pytest.raises(AssertionError, match="the best pairing's heaviest rank sees"):
        _run(ns, "check_balanced_chunks")


# ----------------------------------------------------------------------------- torch's own versions
# The search reads torch's source for the names of functions and classes that balance a sequence over
# ranks or merge partial softmax results. Two kinds it finds cannot run on a learner's tensors and are
# not switched off: device kernels (decorated with a JIT, e.g. @triton.jit, @cute.jit: they run inside
# a compiled kernel, and raise when called from Python) and inductor's code generators (methods
# that write a kernel's source text).
JOB = re.compile(
    r"^[ \t]*(?:class|def) (_?\w*(?:LoadBalanc|load_balanc|Merger|merge_att|merge_lse|lse_merge|combine_lse"
    r"|online_softmax|softmax_merge|softmax_combine|partial_update|zigzag|head_tail|ptrr)\w*)",
    re.M | re.I,
)


def _decorators(lines: list[str], at: int) -> list[str]:
    out, i = [], at - 1
    while i >= 0 and (lines[i].strip().startswith(("@", "#")) or not lines[i].strip()):
        if lines[i].strip().startswith("@"):
            out.append(lines[i].strip())
        i -= 1
    return out


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's functions that do an exercise's job (found by name in torch's source) are all in the
    checks' switched-off lists: a new torch that adds one fails here, not in a learner's notebook."""
    import torch

    from parallel_lab.grading.checks import long_sequences

    root = Path(torch.__file__).parent
    off = {**long_sequences.MERGE_FORBIDDEN, **long_sequences.BALANCE_FORBIDDEN}
    found, kernels = {}, []
    for f in root.rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        if not JOB.search(text):
            continue
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        lines = text.splitlines()
        for match in JOB.finditer(text):
            name, at = match.group(1), text.count("\n", 0, match.start())
            if any(".jit" in d for d in _decorators(lines, at)) or module.startswith(
                "torch._inductor.codegen."
            ):
                kernels.append(f"{module}.{name}")
                continue
            found.setdefault(module, []).append(name)
    assert "torch.distributed.tensor.experimental._context_parallel._load_balancer" in found, (
        "the search finds nothing: torch's layout changed"
    )
    missing = {
        m: [n for n in names if not any(k.startswith(m + ".") and n in k.split(".") for k in off)]
        for m, names in found.items()
    }
    missing = {m: names for m, names in missing.items() if names}
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"
    # the kernels left on really are kernels: none of them can be called on a tensor from Python
    assert all(".runtime." in k or "._vendor." in k or ".codegen." in k for k in kernels), kernels

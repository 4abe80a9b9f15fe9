"""Checks for lesson 17's exercises: merging partial attention results kept in FlashAttention-2's
running form, and balancing a packed batch over the ranks of a context-parallel group under a
document mask.

`merge_running(acc_a, m_a, l_a, acc_b, m_b, l_b)` is fed states computed here in float64 over
disjoint blocks of keys: two blocks, then chains of 2 to 5 blocks merged in an order drawn each run
(left to right and as a drawn tree), with a block no query may see, a block only some rows see,
two blocks that hide the same rows, and scores of 120 to 400 (exp() overflows float32 past 88.7). The
result must keep the form: m the larger maximum exactly, l and acc relative to it, and after the
last merge acc / l equals attention over every visible key in float64 (within 1e-4).
`balanced_chunks(world_size, seq_len, doc_lens)` must partition the 2N chunks into N pairs whose
heaviest pair sees exactly as few visible (query, key) pairs as the best pairing; the optimum is
the sorted pairing (largest with smallest), which tests/test_exercises_17.py checks against every
pairing by brute force. Fixed edge cases plus 16 packings drawn each run, each drawn so that the
causal zigzag, contiguous pairs, pairs by position and heavy-with-heavy all miss the optimum.

While the learner's function runs, the lab's implementations and torch's own (context
parallelism's load balancers and its partial-attention merger, private to torch) are off.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

#: torch's context parallelism (private: torch.distributed.tensor.experimental), where load
#: balancers lay out the sequence (_HeadTailLoadBalancer: the zigzag; _PerDocumentHeadTailLoadBalancer:
#: a zigzag inside every document; _PTRRLoadBalancer.ptrr_scheduling: blocks paired by their work)
#: and _SDPAMerger merges partial attention results
TORCH_CP = family(
    "torch.distributed.tensor.experimental._context_parallel._load_balancer",
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.experimental._attention",
    missing_ok=True,
)
_SDPA = "merge the two states yourself"
MERGE_FORBIDDEN = {
    **family("parallel_lab.inference.attention", "parallel_lab.context_parallel.ring"),
    **TORCH_CP,
    "torch.nn.functional.scaled_dot_product_attention": _SDPA,
    "torch._C._nn.scaled_dot_product_attention": _SDPA,
}
BALANCE_FORBIDDEN = {**family("parallel_lab.context_parallel.layout"), **TORCH_CP}
#: and this module's own helpers, which compute both answers to grade them (added when a check runs)
_SELF = "parallel_lab.grading.checks.long_sequences"

__all__ = ["check_balanced_chunks", "check_merge_running"]


# ----------------------------------------------------------------------------- exercise 1: merge_running
def _state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None):
    """(acc, m, l) of these keys in float64: m the row maximum of the scores (-inf where a row sees
    none), l = sum exp(s - m), acc = sum exp(s - m) v (not divided by l)."""
    s = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, n, keys)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(dim=-1)  # (B, H, n)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1))  # a row that sees nothing: all 0
    return p @ v.double(), m, p.sum(dim=-1)


def _f32(state):
    return tuple(t.float() for t in state)


def _call_merge(fn, a, b, what: str):
    got = fn(*(t.clone() for t in a), *(t.clone() for t in b))
    ok = isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)
    assert ok, f"{what}: return (acc, m, l), three tensors; got {type(got).__name__}"
    for name, t, like in zip(("acc", "m", "l"), got, a):
        assert t.shape == like.shape, (
            f"{what}: {name} must keep the shape {tuple(like.shape)}; got {tuple(t.shape)}"
        )
    return tuple(got)


def _named_mistakes(a, b):
    """What three wrong merges return on (a, b), in float64: no rescaling, rescaling acc but not l,
    and acc weighted like a normalised (out, lse) result."""
    (acc_a, m_a, l_a), (acc_b, m_b, l_b) = (tuple(t.double() for t in x) for x in (a, b))
    m = torch.maximum(m_a, m_b)
    ref = torch.where(torch.isinf(m), 0.0, m)
    wa, wb = torch.exp(m_a - ref), torch.exp(m_b - ref)
    union = wa * l_a + wb * l_b
    mass_a, mass_b = wa * l_a, wb * l_b  # each part's share of the union's mass, as (out, lse) merges weight
    total = torch.where(union > 0, union, 1.0)
    shares = (mass_a / total).unsqueeze(-1) * acc_a + (mass_b / total).unsqueeze(-1) * acc_b
    rescaled = wa.unsqueeze(-1) * acc_a + wb.unsqueeze(-1) * acc_b
    return {"plain sums": (acc_a + acc_b, l_a + l_b), "acc only": (rescaled, l_a + l_b),
            "normalised": (shares, union), "attention": (rescaled / total.unsqueeze(-1), union)}  # fmt: skip


def _close(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, tol: float) -> bool:
    return bool(((x.double() - y.double()).abs() <= tol * scale).all())


def _compare_state(got, want, what: str, parts=None) -> None:
    """got (float32) against want (float64): m exactly, l within 1e-5 of itself, acc within 1e-4 of l,
    and acc / l against attention within 1e-4; a mistake `parts` (the two inputs) can explain is named."""
    acc, m, lsum = got
    w_acc, w_m, w_l = want
    empty = torch.isinf(w_m)  # rows that see no key of either part
    if not (torch.isfinite(acc).all() and torch.isfinite(lsum).all() and not torch.isnan(m).any()):
        if (
            not (torch.isfinite(acc[empty]).all() and torch.isfinite(lsum[empty]).all())
            or torch.isnan(m[empty]).any()
        ):
            raise AssertionError(
                f"{what}: nan or inf in rows that see no key of either block (there m = -inf, l = 0, acc = 0 "
                "on both sides, and must stay so): exp(-inf - (-inf)) is nan, so no exponent may subtract "
                "one -inf from another"
            )
        raise AssertionError(
            f"{what}: your result holds inf or nan in rows that see keys, where every value is finite. "
            "exp() of anything above 88.7 overflows float32, and scores here may pass 100: exponentiate "
            "only differences of maxima, never a maximum itself"
        )
    if not torch.equal(m.double(), w_m.float().double()):
        raise AssertionError(
            f"{what}: m differs from the running maximum of the union (the largest score over both "
            "blocks, -inf where a row sees no key of either): the merged state keeps the form of its parts"
        )
    scale = w_l.unsqueeze(-1)  # |acc| <= l max|v|, and the values here are of order 1
    l_ok = _close(lsum, w_l, w_l.clamp_min(1e-30), 1e-5)  # exactly 0 in a row that sees nothing
    acc_ok = _close(acc, w_acc, scale, 1e-4)
    if l_ok and acc_ok:
        out = acc.double() / torch.where(w_l > 0, lsum.double(), 1.0).unsqueeze(-1)
        want_out = w_acc / torch.where(w_l > 0, w_l, 1.0).unsqueeze(-1)
        err = (out - want_out).abs().max().item()
        assert err <= 1e-4, f"{what}: acc / l differs from attention over both blocks by up to {err:.3g}"
        return
    named = ""
    if parts is not None:
        wrong = _named_mistakes(*parts)
        for key, (acc_x, l_x) in wrong.items():
            if _close(acc, acc_x, scale, 1e-4) and _close(lsum, l_x, l_x.abs().clamp_min(1e-30), 1e-5):
                named = {
                    "plain sums": (
                        "; you added the two parts' acc and l as they came: each was summed relative to "
                        "its own block's maximum, and a sum taken against one maximum cannot be added to "
                        "one taken against another until both refer to the union's m"
                    ),
                    "acc only": (
                        "; acc is right, l is not: l was summed relative to its block's maximum just "
                        "as acc was, so it needs the same change of reference"
                    ),
                    "normalised": (
                        "; your acc is weighted by each part's share of the union's total mass, which is "
                        "how a normalised (out, lse) result merges. Here acc is the unnormalised sum: "
                        "weighting it by shares normalises it a second time. It is divided by l only once, "
                        "after the last merge"
                    ),
                    "attention": (
                        "; your acc is already normalised (it equals attention over both blocks): in this "
                        "form acc stays unnormalised, and only acc / l after the last merge is attention"
                    ),
                }[key]
                break
    if not l_ok:
        bad = (lsum.double() - w_l).abs().max().item()
        raise AssertionError(
            f"{what}: l differs from the union's sum of exp(s - m) over both blocks by up to {bad:.3g}"
            + (named or " (l must be relative to the merged m, the larger of m_a and m_b)")
        )
    bad = ((acc.double() - w_acc).abs() / scale.clamp_min(1e-30)).max().item()
    raise AssertionError(
        f"{what}: acc differs from the union's sum of exp(s - m) v by up to {bad:.3g} times the row's l"
        + (named or " (acc must be relative to the merged m, and not divided by anything)")
    )


def _describe(B: int, H: int, n: int, d: int, top: float) -> str:
    return f"B={B}, H={H}, {n} queries, d={d}, largest score {top:.0f}"


def check_merge_running(merge_running: Callable) -> None:
    """`merge_running(acc_a, m_a, l_a, acc_b, m_b, l_b)` -> (acc, m, l) of the union of two blocks of keys."""
    require_callable(merge_running, "merge_running")
    fn = guarded(merge_running, {**MERGE_FORBIDDEN, **family(_SELF)}, "this exercise (merge_running)")
    rnd = random.Random(draw_seed())
    g = torch.Generator().manual_seed(rnd.getrandbits(62))
    call = "merge_running(acc_a, m_a, l_a, acc_b, m_b, l_b)"
    cases = 0
    # shapes, splits, masks and values drawn this run; in the last third the largest score is 120 to 400
    for big in (False, False, True):
        B, H, n, d = rnd.randint(1, 3), rnd.randint(1, 4), rnd.randint(2, 9), rnd.choice((4, 8, 16))
        keys = rnd.randint(8, 20)
        q = torch.randn(B, H, n, d, generator=g)
        k, v = torch.randn(B, H, keys, d, generator=g), torch.randn(B, H, keys, d, generator=g)
        top = (q.double() @ k.double().transpose(-2, -1) / math.sqrt(d)).max().item()
        q = q * (rnd.uniform(120, 400) / max(top, 1e-3) if big else rnd.uniform(1, 4))
        top = (q.double() @ k.double().transpose(-2, -1) / math.sqrt(d)).max().item()
        shape = _describe(B, H, n, d, top)

        # two blocks, in both orders
        cut = rnd.randint(1, keys - 1)
        a = _f32(_state(q, k[:, :, :cut], v[:, :, :cut]))
        b = _f32(_state(q, k[:, :, cut:], v[:, :, cut:]))
        want = _state(q, k, v)
        what = f"{call} with block a = keys 0-{cut - 1} and block b = keys {cut}-{keys - 1} ({shape})"
        ab = _call_merge(fn, a, b, what)
        _compare_state(ab, want, what, (a, b))
        what = f"{call} with block a = keys {cut}-{keys - 1} and block b = keys 0-{cut - 1} ({shape})"
        _compare_state(_call_merge(fn, b, a, what), want, what, (b, a))
        ba = _call_merge(fn, b, a, what)
        spread = (ab[0].double() - ba[0].double()).abs().max().item()
        assert spread <= 1e-4 * max(1.0, ab[2].max().item()), (
            f"{call}: merging a into b and b into a give acc differing by {spread:.3g}: the union of two "
            "blocks does not depend on which one came first"
        )
        cases += 2

        # a chain of 2-5 blocks, one no query sees and one only some rows see (a causal diagonal)
        count = rnd.randint(2, 5)
        edges = [0, *sorted(rnd.sample(range(1, keys), count - 1)), keys]
        hidden, diagonal = rnd.sample(range(count), 2)
        visible = torch.ones(n, keys, dtype=torch.bool)
        lo, hi = edges[hidden], edges[hidden + 1]
        visible[:, lo:hi] = False
        lo2, hi2 = edges[diagonal], edges[diagonal + 1]
        shift = rnd.randint(-n, 0)  # query i sees key lo2 + j of this block when j <= i + shift
        visible[:, lo2:hi2] = torch.arange(hi2 - lo2)[None, :] <= torch.arange(n)[:, None] + shift
        blocks = [
            _f32(_state(q, k[:, :, x:y], v[:, :, x:y], visible[:, x:y])) for x, y in zip(edges, edges[1:])
        ]
        want = _state(q, k, v, visible)
        order = rnd.sample(range(count), count)
        spans = ", ".join(f"{x}-{y - 1}" for x, y in zip(edges, edges[1:]))
        where = (f"{count} blocks of keys ({spans}; block {hidden} seen by no query, block {diagonal} only by "
                 f"some rows) merged")  # fmt: skip
        state, ids = blocks[order[0]], [order[0]]
        for i in order[1:]:
            what = (f"{call} with block a = blocks {ids} merged and block b = block {i}, in {where} one after "
                    f"another ({shape})")  # fmt: skip
            nxt = _call_merge(fn, state, blocks[i], what)
            _compare_state(
                nxt, _state(q, k, v, visible & _keys_of(edges, [*ids, i], n, keys)), what, (state, blocks[i])
            )
            state, ids = nxt, [*ids, i]
        _compare_state(state, want, f"{where} in the order {order} ({shape})")
        # the same blocks as a tree drawn this run: merging is associative as well as commutative
        pool = [(blocks[i], [i]) for i in rnd.sample(range(count), count)]
        while len(pool) > 1:
            j = rnd.randrange(len(pool) - 1)
            (sa, ia), (sb, ib) = pool[j], pool[j + 1]
            what = f"{call} with block a = blocks {ia} merged and block b = blocks {ib} merged, in {where} as a tree ({shape})"
            merged = _call_merge(fn, sa, sb, what)
            _compare_state(
                merged, _state(q, k, v, visible & _keys_of(edges, ia + ib, n, keys)), what, (sa, sb)
            )
            pool[j : j + 2] = [(merged, ia + ib)]
        _compare_state(pool[0][0], want, f"{where} as a tree drawn this run ({shape})")
        cases += 2

    # two blocks that hide the same rows (a causal mask's future, twice): the union hides them too
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    none = torch.zeros(4, 4, dtype=torch.bool)
    some = torch.arange(4)[None, :] <= torch.arange(4)[:, None] - 2  # rows 0 and 1 see nothing
    empty, partial = _f32(_state(q, k, v, none)), _f32(_state(q, k, v, some))
    what = f"{call} where both blocks hide every row (m = -inf, l = 0, acc = 0 on both sides)"
    _compare_state(_call_merge(fn, empty, empty, what), _state(q, k, v, none), what, (empty, empty))
    what = f"{call} where block a hides every row and block b hides rows 0 and 1"
    _compare_state(_call_merge(fn, empty, partial, what), _state(q, k, v, some), what, (empty, partial))
    passed(
        "check_merge_running",
        f"{cases + 2} cases with shapes, orders and masks drawn this run, largest scores 120 to 400 in the last third",
    )


def _keys_of(edges: list[int], ids: list[int], n: int, keys: int) -> torch.Tensor:
    cols = torch.zeros(keys, dtype=torch.bool)
    for i in ids:
        cols[edges[i] : edges[i + 1]] = True
    return cols.expand(n, keys)


# ----------------------------------------------------------------------------- exercise 2: balanced_chunks
def _chunk_work(chunks: int, seq_len: int, doc_lens: list[int]) -> list[int]:
    """Visible (query, key) pairs of each chunk's queries under the document mask."""
    c = seq_len // chunks
    seen = [t + 1 for n in doc_lens for t in range(n)]  # a query sees its document from the start to itself
    return [sum(seen[i * c : (i + 1) * c]) for i in range(chunks)]


def _optimum(work: list[int]) -> int:
    """The smallest possible heaviest pair: sorted, the largest with the smallest (tests: brute force)."""
    w, n = sorted(work), len(work)
    return max(w[i] + w[n - 1 - i] for i in range(n // 2))


def _heaviest(pairs, work: list[int]) -> int:
    return max(work[a] + work[b] for a, b in pairs)


def _position_pairings(n: int, work: list[int]) -> dict[str, list[tuple[int, int]]]:
    order = sorted(range(2 * n), key=work.__getitem__)
    return {
        "zigzag": [(r, 2 * n - 1 - r) for r in range(n)],
        "contiguous": [(2 * r, 2 * r + 1) for r in range(n)],
        "strided": [(r, n + r) for r in range(n)],
        "heavy": [(order[2 * r], order[2 * r + 1]) for r in range(n)],
    }


def _draw_packing(rnd: random.Random) -> tuple[int, int, list[int]]:
    """A packed sequence whose best pairing no rule by position (nor heavy-with-heavy) reaches."""
    while True:
        n, c = rnd.randint(3, 8), rnd.randint(2, 24)  # at 2 ranks one of the three pairings is by position
        length = 2 * n * c
        docs, left = [], length
        while left:
            kind = rnd.random()
            size = (
                rnd.randint(1, c)
                if kind < 0.5
                else rnd.randint(c, 4 * c)
                if kind < 0.85
                else rnd.randint(1, length)
            )
            docs.append(min(size, left))
            left -= docs[-1]
        work = _chunk_work(2 * n, length, docs)
        best = _optimum(work)
        if all(_heaviest(p, work) > best for p in _position_pairings(n, work).values()):
            return n, length, docs


_MISTAKES = {
    "zigzag": (
        "that is the causal zigzag (chunk r with chunk 2N-1-r), the pairing that balances a mask causal over "
        "the whole sequence; under a document mask a query sees only its own document, so a chunk's work "
        "restarts at every document start and no longer grows with its position"
    ),
    "contiguous": "each rank holds two neighbouring chunks (2r and 2r+1), which pairs no heavy chunk with a light one",
    "strided": (
        "your pairing follows the chunks' positions (chunk r with chunk N + r), not their work: measure each "
        "chunk's visible pairs under the document mask first"
    ),
}


def _as_pairs(got, n: int, where: str) -> list[tuple[int, int]]:
    if isinstance(got, torch.Tensor):
        got = got.tolist()
    assert isinstance(got, (list, tuple)) and len(got) == n, (
        f"{where}: return one pair of chunk indices per rank, {n} in all; got "
        f"{len(got) if isinstance(got, (list, tuple)) else type(got).__name__}"
    )
    pairs = []
    for r, entry in enumerate(got):
        entry = entry.tolist() if isinstance(entry, torch.Tensor) else entry
        ok = isinstance(entry, (list, tuple)) and len(entry) == 2
        ok = ok and all(not isinstance(x, bool) and hasattr(x, "__index__") for x in entry)
        assert ok, f"{where}: rank {r}'s entry must be two chunk indices (ints); got {entry!r}"
        pairs.append((int(entry[0]), int(entry[1])))
    flat = sorted(x for p in pairs for x in p)
    if flat != list(range(2 * n)):
        twice = sorted({x for x in flat if flat.count(x) > 1})
        missing = sorted(set(range(2 * n)) - set(flat))
        outside = sorted({x for x in flat if not 0 <= x < 2 * n})
        raise AssertionError(
            f"{where}: every one of the {2 * n} chunks (0 to {2 * n - 1}) must go to exactly one rank; "
            + "; ".join(
                s
                for s in (
                    f"held twice: {twice}" if twice else "",
                    f"held by no rank: {missing}" if missing else "",
                    f"not a chunk: {outside}" if outside else "",
                )
                if s
            )  # fmt: skip
        )
    return pairs


def check_balanced_chunks(balanced_chunks: Callable) -> None:
    """`balanced_chunks(world_size, seq_len, doc_lens)` -> N pairs of chunks whose heaviest is as light as can be."""
    require_callable(balanced_chunks, "balanced_chunks")
    fn = guarded(balanced_chunks, {**BALANCE_FORBIDDEN, **family(_SELF)}, "this exercise (balanced_chunks)")
    rnd = random.Random(draw_seed())
    fixed = [
        (1, 6, [6]),  # one rank: its two chunks
        (1, 10, [4, 6]),
        (4, 64, [64]),  # one document: the mask is causal, and the zigzag is one best pairing
        (3, 30, [30]),
        (2, 24, [2, 3, 1, 4, 2, 5, 3, 4]),  # documents shorter than a chunk
        (3, 24, [4] * 6),  # one document per chunk: every chunk sees the same
        (2, 16, [12, 4]),
    ]
    drawn = [_draw_packing(rnd) for _ in range(16)]  # packings no table of an earlier run holds
    for n, length, docs in fixed + drawn:
        where = f"balanced_chunks(world_size={n}, seq_len={length}, doc_lens={docs})"
        pairs = _as_pairs(fn(n, length, list(docs)), n, where)
        work = _chunk_work(2 * n, length, docs)
        best, mine = _optimum(work), _heaviest(pairs, work)
        if mine == best:
            continue
        r = max(range(n), key=lambda i: work[pairs[i][0]] + work[pairs[i][1]])
        same = {frozenset(p) for p in pairs}
        named = {k: {frozenset(p) for p in v} == same for k, v in _position_pairings(n, work).items()}
        top_two = sorted(work)[-2:]
        why = [text for key, text in _MISTAKES.items() if named.get(key)]
        if sorted((work[pairs[r][0]], work[pairs[r][1]])) == top_two:
            why.append(
                "that rank holds the two chunks with the most visible pairs: pair heavy chunks with light ones"
            )
        why = "; ".join(why) or (
            "count each chunk's visible pairs under the document mask (a query sees the keys of its own "
            "document, from the document's start up to itself) and compare them with yours"
        )
        raise AssertionError(
            f"{where}: your heaviest rank, rank {r} with chunks {pairs[r]}, sees {mine} visible (query, key) pairs; "
            f"the best pairing's heaviest rank sees {best}. {why[0].upper()}{why[1:]}"
        )
    raising = [(3, 20, [20], "20 tokens do not split into 2 x 3 = 6 equal chunks"),
               (2, 18, [9, 9], "18 tokens do not split into 2 x 2 = 4 equal chunks"),
               (2, 16, [4, 4, 4], "the documents hold 12 tokens, not 16"),
               (1, 8, [6, 4], "the documents hold 10 tokens, not 8")]  # fmt: skip
    for n, length, docs, why in raising:
        try:
            fn(n, length, list(docs))
        except ValueError:
            continue
        raise AssertionError(
            f"balanced_chunks(world_size={n}, seq_len={length}, doc_lens={docs}) returned instead of raising "
            f"ValueError: {why}"
        )
    passed(
        "check_balanced_chunks",
        f"{len(fixed)} fixed packings, {len(drawn)} drawn this run, {len(raising)} that must raise ValueError",
    )

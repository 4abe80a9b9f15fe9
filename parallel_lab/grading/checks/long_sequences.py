"""Checks for lesson 17's exercises: folding a partial attention result that arrives normalised, as
(out, lse), into a running state kept in FlashAttention-2's form, and balancing a packed batch over
the ranks of a context-parallel group under a document mask.

`merge_remote(acc, m, l, out_b, lse_b)` is fed a running state of one block of keys and partials
(out, lse) of others, all computed here in float64 from drawn queries, keys and values and rounded
to float32: two blocks each way round, then chains of 2 to 5 blocks folded in orders drawn each run,
with a block no query sees, a block only some rows see, parts that hide the same rows, and scores of
120 to 400 (exp() overflows float32 past 88.7). The state's m is a reference the learner picks; l and
acc are compared, in float64, with the union's sums taken relative to the m returned. Each step's
inputs are the learner's previous output, so each step is compared with the exact merge of the
float32 inputs it was given (no error carried over from earlier steps), within
1e-5 + 4 eps |m| of l (eps = float32's machine epsilon, |m| the largest reference or lse in the row:
float32 holds a number of size |m| to eps |m| / 2, and a merge through log-sum-exp rounds a few such
numbers before it exponentiates their difference), acc within 1e-4 of l plus that rounding at the
values' size ((1e-4 + tol (1 + max |out|)) l); and acc / l against attention over every key folded in
so far, from the scores, within 1e-4.
`balanced_chunks(world_size, seq_len, doc_lens)` must partition the 2N chunks into N pairs whose
heaviest pair sees exactly as few visible (query, key) pairs as the best pairing; the optimum is
the sorted pairing (largest with smallest), which tests/test_exercises_17.py checks against every
pairing by brute force. Fixed edge cases plus 16 packings drawn each run, each drawn so that its
chunks' work does not grow with their position and the causal zigzag, contiguous pairs, pairs by
position and heavy-with-heavy all miss the optimum.

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
_SDPA = "fold the partial in yourself"
MERGE_FORBIDDEN = {
    **family("parallel_lab.inference.attention", "parallel_lab.context_parallel.ring"),
    **TORCH_CP,
    "torch.nn.functional.scaled_dot_product_attention": _SDPA,
    "torch._C._nn.scaled_dot_product_attention": _SDPA,
}
BALANCE_FORBIDDEN = {**family("parallel_lab.context_parallel.layout"), **TORCH_CP}
#: and this module's own helpers, which compute both answers to grade them (added when a check runs)
_SELF = "parallel_lab.grading.checks.long_sequences"

__all__ = ["check_balanced_chunks", "check_merge_remote"]

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7


# ----------------------------------------------------------------------------- exercise 1: merge_remote
def _scores(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, n, keys) scores in float64, -inf where a query may not see a key."""
    s = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    return s if visible is None else s.masked_fill(~visible, float("-inf"))


def _running(s: torch.Tensor, v: torch.Tensor):
    """(acc, m, l) of these scores in float32: m the row maximum as float32 holds it (-inf where a row
    sees nothing), and l = sum exp(s - m), acc = sum exp(s - m) v taken relative to that very m."""
    m = s.amax(dim=-1).float().double()  # (B, H, n)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1))  # a row that sees nothing: all 0
    return (p @ v.double()).float(), m.float(), p.sum(dim=-1).float()


def _attention(s: torch.Tensor, v: torch.Tensor):
    """(out, lse) in float64: softmax attention over these scores and its log-sum-exp; 0 and -inf in a
    row that sees nothing."""
    m = s.amax(dim=-1)
    ref = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(s - ref.unsqueeze(-1))
    total = p.sum(dim=-1)
    out = (p @ v.double()) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    return out, ref + torch.log(total)  # log(0) = -inf


def _partial(s: torch.Tensor, v: torch.Tensor):
    return tuple(t.float() for t in _attention(s, v))


def _call(fn, local, remote, what: str):
    got = fn(*(t.clone() for t in local), *(t.clone() for t in remote))
    ok = isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)
    assert ok, f"{what}: return (acc, m, l), three tensors; got {type(got).__name__}"
    for name, t, like in zip(("acc", "m", "l"), got, local):
        assert t.shape == like.shape, (
            f"{what}: {name} must keep the shape {tuple(like.shape)}; got {tuple(t.shape)}"
        )
    return tuple(got)


def _mistakes(local, remote, m_got: torch.Tensor):
    """What wrong merges return on these inputs relative to the learner's m, in float64, as
    {name: (acc, l or None)}, None where the mistake leaves l as it should be."""
    acc, m, lsum = (t.double() for t in local)
    out_b, lse_b = (t.double() for t in remote)
    ref = m_got.double()
    wa, wb = torch.exp(m - ref), torch.exp(lse_b - ref)  # each part's weight relative to the learner's m
    lse_a = m + torch.log(lsum)
    lse = torch.logaddexp(lse_a, lse_b)
    top = torch.where(torch.isinf(lse), 0.0, lse)
    sa, sb = torch.exp(lse_a - top), torch.exp(lse_b - top)  # shares of the union's mass
    good_acc, good_l = wa[..., None] * acc + wb[..., None] * out_b, wa * lsum + wb
    return {
        "plain": (acc + wb[..., None] * out_b, lsum + wb),
        "acc only": (good_acc, lsum + wb),
        "unweighted": (wa[..., None] * acc + out_b, None),
        "normalised": (sa[..., None] * acc + sb[..., None] * out_b, None),
        "attention": (good_acc / torch.where(good_l > 0, good_l, 1.0)[..., None], None),
    }


_NAMED = {
    "plain": (
        "; you left the local acc and l as they came: both are sums taken relative to the local m, and "
        "against a different m they are different numbers, as the remote part's are"
    ),
    "acc only": (
        "; acc is right, l is not: the local l was summed relative to the local m just as acc was, so it "
        "needs the same change of reference"
    ),
    "unweighted": (
        "; you added out_b as it came: out_b is normalised (its weights sum to 1) and acc is not, so the "
        "remote part enters acc with the weight of all its keys, taken relative to your m"
    ),
    "normalised": (
        "; your acc weights the local acc by its share of the union's mass, which is how a normalised "
        "(out, lse) partial merges. The local acc is not normalised: weighting it so divides it a second "
        "time. In the running form acc is divided by l only once, after the last merge"
    ),
    "attention": (
        "; your acc is normalised (it equals attention over both parts): in the running form acc stays "
        "unnormalised, and only acc / l after the last merge is attention"
    ),
}


def _compare(got, local, remote, s: torch.Tensor, v: torch.Tensor, what: str) -> None:
    """got (float32) against the exact merge of the float32 inputs `local` and `remote` in float64,
    relative to the m returned, and acc / l against attention over the scores `s` (the union)."""
    acc, m, lsum = got
    want_out, want_lse = _attention(s, v)
    empty = torch.isinf(want_lse)  # rows that see no key of either part
    bad = torch.isnan(acc[empty]).any() or torch.isnan(lsum[empty]).any() or torch.isnan(m[empty]).any()
    if bad or not (torch.isfinite(acc[empty]).all() and torch.isfinite(lsum[empty]).all()):
        raise AssertionError(
            f"{what}: nan or inf in rows that see no key of either part (there m = -inf, l = 0, acc = 0 on the "
            "local side, out_b = 0 and lse_b = -inf on the remote one): exp(-inf - (-inf)) is nan, so no "
            "exponent may subtract one -inf from another"
        )
    if not (torch.isneginf(m[empty]).all() and (lsum[empty] == 0).all() and (acc[empty] == 0).all()):
        raise AssertionError(
            f"{what}: rows that see no key of either part must keep the empty state, m = -inf, l = 0 and "
            "acc = 0"
        )
    seen = ~empty
    if not torch.isfinite(m[seen]).all():
        raise AssertionError(
            f"{what}: m is {m[seen][~torch.isfinite(m[seen])][0].item()} in a row that sees keys, where the "
            "merged m must be a finite reference. A reference taken from one part alone is -inf in the rows "
            "where that part saw nothing"
        )
    if not (torch.isfinite(acc[seen]).all() and torch.isfinite(lsum[seen]).all() and (lsum[seen] > 0).all()):
        raise AssertionError(
            f"{what}: your result holds inf, nan or l = 0 in rows that see keys, where l > 0 and every value is "
            "finite. exp() of anything above 88.7 overflows float32, and scores here may pass 100: no "
            "exponent may be of a score's size, and no reference may sit far below what it is compared with"
        )
    acc_in, m_in, l_in = (t.double() for t in local)
    out_b, lse_b = (t.double() for t in remote)
    ref = torch.where(seen, m.double(), 0.0)
    wa, wb = torch.exp(m_in - ref), torch.exp(lse_b - ref)  # 0 for a part that saw nothing
    w_l = torch.where(seen, wa * l_in + wb, 0.0)
    w_acc = torch.where(seen[..., None], wa[..., None] * acc_in + wb[..., None] * out_b, 0.0)
    size = torch.stack([t.abs().nan_to_num(0.0, 0.0, 0.0) for t in (m_in, lse_b, ref)]).amax(dim=0)
    tol = 1e-5 + 4 * EPS32 * size  # relative, per row: float32 rounding at the row's scale
    l_ok = bool(((lsum.double() - w_l).abs() <= tol * w_l).all())
    acc_err = (acc.double() - w_acc).abs().amax(dim=-1)  # (B, H, n)
    acc_tol = (1e-4 + tol * (1 + want_out.abs().amax(dim=-1))) * w_l  # rounding scales with |acc| = |out| l
    acc_ok = bool((acc_err <= acc_tol).all())
    if l_ok and acc_ok:
        out = acc.double() / torch.where(seen, lsum.double(), 1.0)[..., None]
        err = (out - want_out).abs().max().item()
        assert err <= 1e-4, (
            f"{what}: acc / l differs from attention over every key seen so far by up to {err:.3g}"
        )
        return
    named = ""
    for key, (acc_x, l_x) in _mistakes(local, remote, ref).items():
        acc_like = bool(((acc.double() - acc_x).abs().amax(dim=-1) <= acc_tol).all())
        l_like = l_ok if l_x is None else bool(((lsum.double() - l_x).abs() <= tol * l_x.abs()).all())
        if acc_like and l_like:
            named = _NAMED[key]
            break
    if not l_ok:
        worst = ((lsum.double() - w_l).abs() / w_l.clamp_min(1e-300)).max().item()
        raise AssertionError(
            f"{what}: l differs from the union's sum of exp(s - m), taken relative to the m you returned, by up "
            f"to {worst:.3g} of itself" + (named or " (l and acc must both be relative to the m you return)")
        )
    worst = (acc_err / w_l.clamp_min(1e-300)).max().item()
    raise AssertionError(
        f"{what}: acc differs from the union's sum of exp(s - m) v, taken relative to the m you returned, by "
        f"up to {worst:.3g} times the row's l"
        + (named or " (acc is a sum relative to your m, divided by nothing)")
    )


def _describe(B: int, H: int, n: int, d: int, top: float) -> str:
    return f"B={B}, H={H}, {n} queries, d={d}, largest score {top:.0f}"


def _merge_cases(fn, rnd: random.Random) -> int:
    """Every case of one grade run, drawn from `rnd`; returns how many calls were checked."""
    g = torch.Generator().manual_seed(rnd.getrandbits(62))
    call = "merge_remote(acc, m, l, out_b, lse_b)"
    cases = 0

    # fixed first: parts that hide the same rows (a causal mask's future), small scores
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    none = torch.zeros(4, 4, dtype=torch.bool)
    some = torch.arange(4)[None, :] <= torch.arange(4)[:, None] - 2  # rows 0 and 1 see nothing
    every = torch.ones(4, 4, dtype=torch.bool)
    k2, v2 = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 4, 8, generator=g)
    kk, vv = torch.cat([k, k2], dim=2), torch.cat([v, v2], dim=2)
    for loc, rem, text in (
        (none, none, "the local state and the remote partial both hide every row"),
        (none, some, "the local state hides every row and the remote partial hides rows 0 and 1"),
        (some, none, "the local state hides rows 0 and 1 and the remote partial hides every row"),
        (every, some, "the local state sees every key and the remote partial hides rows 0 and 1"),
    ):
        s = _scores(q, kk, torch.cat([loc, rem], dim=1))
        local, remote = _running(s[..., :4], v), _partial(s[..., 4:], v2)
        what = f"{call} where {text}"
        _compare(_call(fn, local, remote, what), local, remote, s, vv, what)
        cases += 1

    # shapes, splits, masks and values drawn this run; in the last third the largest score is 120 to 400
    for big in (False, False, True):
        B, H, n, d = rnd.randint(1, 3), rnd.randint(1, 4), rnd.randint(2, 9), rnd.choice((4, 8, 16))
        keys = rnd.randint(8, 20)
        q = torch.randn(B, H, n, d, generator=g)
        k, v = torch.randn(B, H, keys, d, generator=g), torch.randn(B, H, keys, d, generator=g)
        top = _scores(q, k).max().item()
        q = q * (rnd.uniform(120, 400) / max(top, 1e-3) if big else rnd.uniform(1, 4))
        s_all = _scores(q, k)
        shape = _describe(B, H, n, d, s_all.max().item())

        # two blocks, each way round: which part is local does not change the union
        cut = rnd.randint(1, keys - 1)
        halves = [(slice(0, cut), f"keys 0-{cut - 1}"), (slice(cut, keys), f"keys {cut}-{keys - 1}")]
        outs = []
        for (a, a_txt), (b, b_txt) in (halves, halves[::-1]):
            local, remote = _running(s_all[..., a], v[:, :, a]), _partial(s_all[..., b], v[:, :, b])
            what = f"{call} with the local state over {a_txt} and the remote partial over {b_txt} ({shape})"
            got = _call(fn, local, remote, what)
            _compare(got, local, remote, s_all, v, what)
            outs.append(got[0].double() / got[2].double()[..., None])
            cases += 1
        spread = (outs[0] - outs[1]).abs().max().item()
        assert spread <= 1e-4, (
            f"{call} ({shape}): folding keys {cut}-{keys - 1} into keys 0-{cut - 1} and the other way round "
            f"give acc / l differing by {spread:.3g}: the union does not depend on which part is local"
        )

        # a chain of 2-5 blocks, one no query sees and one only some rows see (a causal diagonal), folded
        # in two orders drawn this run
        count = rnd.randint(2, 5)
        edges = [0, *sorted(rnd.sample(range(1, keys), count - 1)), keys]
        hidden, diagonal = rnd.sample(range(count), 2)
        visible = torch.ones(n, keys, dtype=torch.bool)
        visible[:, edges[hidden] : edges[hidden + 1]] = False
        lo, hi = edges[diagonal], edges[diagonal + 1]
        shift = rnd.randint(-n, 0)  # query i sees key lo + j of this block when j <= i + shift
        visible[:, lo:hi] = torch.arange(hi - lo)[None, :] <= torch.arange(n)[:, None] + shift
        s_vis = _scores(q, k, visible)
        spans = ", ".join(f"{x}-{y - 1}" for x, y in zip(edges, edges[1:]))
        where = f"{count} blocks of keys ({spans}; block {hidden} seen by no query, block {diagonal} only by some rows)"
        finals = []
        for _ in range(2):
            order = rnd.sample(range(count), count)
            cols = _columns(edges, order[:1], keys)
            state = _running(s_vis[..., cols], v[:, :, cols])
            for j, i in enumerate(order[1:], start=1):
                block = _columns(edges, [i], keys)
                remote = _partial(s_vis[..., block], v[:, :, block])
                what = (f"{call} folding block {i} into the local state of blocks {order[:j]}, in {where} folded "
                        f"in the order {order} ({shape})")  # fmt: skip
                nxt = _call(fn, state, remote, what)
                cols = _columns(edges, order[: j + 1], keys)
                _compare(nxt, state, remote, s_vis[..., cols], v[:, :, cols], what)
                state = nxt
                cases += 1
            finals.append(
                (order, state[0].double() / torch.where(state[2] > 0, state[2], 1).double()[..., None])
            )
        spread = (finals[0][1] - finals[1][1]).abs().max().item()
        assert spread <= 1e-4, (
            f"{where} folded in the orders {finals[0][0]} and {finals[1][0]} ({shape}): acc / l differs by "
            f"{spread:.3g}; the union does not depend on the order"
        )
    return cases


def _columns(edges: list[int], ids: list[int], keys: int) -> torch.Tensor:
    cols = torch.zeros(keys, dtype=torch.bool)
    for i in ids:
        cols[edges[i] : edges[i + 1]] = True
    return cols


def check_merge_remote(merge_remote: Callable) -> None:
    """`merge_remote(acc, m, l, out_b, lse_b)` -> the running state (acc, m, l) of the local keys and the
    remote partial's keys together."""
    require_callable(merge_remote, "merge_remote")
    fn = guarded(merge_remote, {**MERGE_FORBIDDEN, **family(_SELF)}, "this exercise (merge_remote)")
    threads = torch.get_num_threads()
    # tensors of a few hundred numbers: a second thread only adds waiting (over 10x slower on a busy 2-core machine)
    torch.set_num_threads(1)
    try:
        _merge_cases(fn, random.Random(draw_seed()))
    finally:
        torch.set_num_threads(threads)
    passed(
        "check_merge_remote",
        "4 fixed cases, then blocks, orders and masks drawn this run, largest scores 120 to 400 in the last third",
    )


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


def _grows(work: list[int]) -> bool:
    """Whether the chunks' work never falls from one position to the next: then an order by position is
    an order by work, and a pairing cannot tell which of the two it followed."""
    return all(a <= b for a, b in zip(work, work[1:]))


def _work_pairs(pairs, work: list[int]) -> list[tuple[int, int]]:
    """A pairing as the works of its pairs, which ties between equal chunks do not change."""
    return sorted(tuple(sorted((work[a], work[b]))) for a, b in pairs)


def _position_pairings(n: int, work: list[int]) -> dict[str, list[tuple[int, int]]]:
    order = sorted(range(2 * n), key=work.__getitem__)
    return {
        "zigzag": [(r, 2 * n - 1 - r) for r in range(n)],
        "contiguous": [(2 * r, 2 * r + 1) for r in range(n)],
        "strided": [(r, n + r) for r in range(n)],
        "heavy": [(order[2 * r], order[2 * r + 1]) for r in range(n)],
    }


def _draw_packing(rnd: random.Random) -> tuple[int, int, list[int]]:
    """A packed sequence whose chunks' work does not grow with their position, and whose best pairing
    none of the four rules of `_position_pairings` (zigzag, contiguous, r with N + r, heavy with heavy)
    reaches."""
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
        rules = _position_pairings(n, work).values()
        if not _grows(work) and all(_heaviest(p, work) > best for p in rules):
            return n, length, docs


_MISTAKES = {
    "zigzag": (
        "that is the causal zigzag (chunk r with chunk 2N-1-r), the pairing that balances a mask causal over "
        "the whole sequence; under a document mask a query sees only its own document"
    ),
    "contiguous": "each rank holds two neighbouring chunks (2r and 2r+1), which pairs no heavy chunk with a light one",
    "strided": ("your pairing follows the chunks' positions (chunk r with chunk N + r)"),
}
#: named on any case (they speak of the chunks ordered by work, not by position)
_SORTED_MISTAKES = {
    "sorted strided": (
        "ordered by work, your pairing puts the i-th lightest chunk with the (i+N)-th lightest: the light half "
        "and the heavy half pair up in the same order, so the heaviest chunk's partner is the heaviest of the "
        "light half"
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
        (2, 24, [2, 3, 1, 4, 2, 5, 3, 4]),  # documents shorter than a chunk
        (3, 24, [4] * 6),  # one document per chunk: every chunk sees the same
        (2, 16, [12, 4]),
    ]
    drawn = [_draw_packing(rnd) for _ in range(16)]  # packings no table of an earlier run holds
    # one document, last: the mask is causal, the zigzag is one best pairing, and the chunks' order by
    # position is their order by work (a slip there cannot be told from its twin by the other order)
    causal = [(4, 64, [64]), (3, 30, [30])]
    for n, length, docs in fixed + drawn + causal:
        where = f"balanced_chunks(world_size={n}, seq_len={length}, doc_lens={docs})"
        pairs = _as_pairs(fn(n, length, list(docs)), n, where)
        work = _chunk_work(2 * n, length, docs)
        best, mine = _optimum(work), _heaviest(pairs, work)
        if mine == best:
            continue
        r = max(range(n), key=lambda i: work[pairs[i][0]] + work[pairs[i][1]])
        same = {frozenset(p) for p in pairs}
        named = {k: {frozenset(p) for p in v} == same for k, v in _position_pairings(n, work).items()}
        top_two, w = sorted(work)[-2:], sorted(work)
        # a rule by position is named only where the work does not grow with position: there it differs
        # from its twin by work, and naming it cannot blame position for a pairing chosen by work
        why = [text for key, text in _MISTAKES.items() if named.get(key) and not _grows(work)]
        by_work = {"sorted strided": [(w[i], w[i + n]) for i in range(n)]}
        why += [_SORTED_MISTAKES[k] for k, v in by_work.items() if _work_pairs(pairs, work) == sorted(v)]
        if sorted((work[pairs[r][0]], work[pairs[r][1]])) == top_two:
            why.append(
                "that rank holds the two chunks with the most visible pairs: which partner would lighten it?"
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
        f"{len(fixed + causal)} fixed packings, {len(drawn)} drawn this run, {len(raising)} that must raise ValueError",
    )

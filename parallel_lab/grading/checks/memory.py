"""Checks for lesson 02 (where the memory goes): the model-state memory calculator."""

from __future__ import annotations

import math
from collections.abc import Callable

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

# The lab's byte accounting, switched off while the learner's function runs.
FORBIDDEN = {**family("parallel_lab.costmodel.formulas"), **family("parallel_lab.runtime.memory_state")}

__all__ = ["check_memory_calculator", "check_peak_memory"]

_KEYS = ("param", "grad", "optim", "total")
_SIZES = (1_000_000_000, 7_000_000_000, 70_000_000_000, 123_457)
_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
_PRECISIONS = ("fp32", "mixed", "bf16")
# Real steps measured under MemoryTracker (one per precision, plus an optimizer without state).
_MEASURED = (("adam", "fp32"), ("adam", "mixed"), ("momentum", "bf16"), ("sgd", "mixed"))


def _fmt(n: float) -> str:
    return f"{n:,.0f} B ({n / 1e9:.4g} GB)" if n >= 1e6 else f"{n:,.0f} B"


def _call(fn: Callable, n: int, optimizer: str, precision: str) -> dict:
    got = fn(n, optimizer, precision)
    where = f"fn({n:,}, {optimizer!r}, {precision!r})"
    assert isinstance(got, dict), f"{where} must return a dict with keys {_KEYS}, got {type(got).__name__}"
    missing = [k for k in _KEYS if k not in got]
    assert not missing, f"{where} returned keys {sorted(got)}; missing {missing}"
    for k in _KEYS:
        v = got[k]
        assert isinstance(v, (int, float)) and not isinstance(v, bool), (
            f"{where}[{k!r}] must be a number of bytes, got {type(v).__name__}"
        )
    parts = got["param"] + got["grad"] + got["optim"]
    assert math.isclose(got["total"], parts, rel_tol=1e-9), (
        f"{where}: total {_fmt(got['total'])} is not param + grad + optim = {_fmt(parts)}"
    )
    return got


def check_memory_calculator(fn: Callable[[int, str, str], dict]) -> None:
    """`fn(num_params, optimizer, precision)` -> {'param', 'grad', 'optim', 'total'} bytes per rank.

    optimizer: 'sgd', 'momentum', 'adam', 'adamw'; precision: 'fp32', 'mixed'
    (16-bit weights and grads, fp32 master copy + fp32 states), 'bf16' (everything
    in bf16, no master copy). Checked against the cost model on large sizes, then
    against bytes measured in real training steps of a TinyGPT.
    """
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (memory_calculator)")
    import random

    from parallel_lab.costmodel import model_state_bytes

    rnd = random.Random(draw_seed())
    drawn = (rnd.randint(10**6, 10**12), rnd.randint(1, 10**6))  # two sizes drawn afresh every grade run
    cases = 0
    for n in (*_SIZES, *drawn):
        for opt in _OPTIMIZERS:
            for prec in _PRECISIONS:
                got = _call(fn, n, opt, prec)
                want = model_state_bytes(n, optimizer=opt, precision=prec)
                for k in _KEYS:
                    assert math.isclose(got[k], want[k], rel_tol=1e-9), (
                        f"{n:,} params, optimizer={opt!r}, precision={prec!r}: {k} should be "
                        f"{_fmt(want[k])} ({want[k] / n:g} bytes/param), got {_fmt(got[k])} "
                        f"({got[k] / n:g} bytes/param)"
                    )
                cases += 1

    import torch

    from parallel_lab.models import GPTConfig, build_model, synthetic_batch
    from parallel_lab.runtime.memory_state import measure_model_state

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest
    try:
        model = build_model(GPTConfig(vocab=40, seq_len=8, d_model=24, n_heads=2, n_layers=2), seed=0)
        n = sum(p.numel() for p in model.parameters())
        batch = synthetic_batch("tokens", 2, seq_len=8, vocab=40)
        for opt, prec in _MEASURED:
            measured = measure_model_state(model, batch, opt, prec)
            got = _call(fn, n, opt, prec)
            for k in ("param", "grad", "optim"):
                assert math.isclose(got[k], measured[k], rel_tol=1e-9), (
                    f"a real {opt}/{prec} training step of a TinyGPT with {n:,} parameters, measured "
                    f"under MemoryTracker, holds {measured[k]:,} bytes of {k} "
                    f"({measured[k] / n:g} bytes/param); your calculator says {got[k]:,}"
                )
    finally:
        torch.set_num_threads(threads)
    passed("check_memory_calculator", f"{cases} configs vs the cost model, {len(_MEASURED)} measured steps")


# ----------------------------------------------------------------------------- the tracker's bookkeeping
def _reference_peak(events: list[tuple]) -> tuple[int, dict]:
    live: dict = {}
    total = peak = 0
    at_peak: dict = {}
    for ev in events:
        if ev[0] == "alloc":
            _, name, nbytes, cat = ev
            live[name] = (nbytes, cat)
            total += nbytes
        else:
            total -= live.pop(ev[1])[0]
        if total > peak:
            peak = total
            at_peak = {}
            for nbytes, cat in live.values():
                if nbytes:
                    at_peak[cat] = at_peak.get(cat, 0) + nbytes
    return peak, at_peak


def _events(seed: int, n: int) -> list[tuple]:
    import random

    rng = random.Random(seed)
    cats = ("param", "grad", "optim", "activation", "comm", "other")
    live, out = [], []
    for i in range(n):
        if live and rng.random() < 0.45:
            out.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            name = f"t{i}"
            out.append(
                ("alloc", name, rng.choice((0, 4, 64, 4096, 1 << 20)) * rng.randint(1, 9), rng.choice(cats))
            )
            live.append(name)
    return out


def check_peak_memory(fn: Callable[[list], tuple]) -> None:
    """`fn(events)` -> (peak, by_category): replay allocations ("alloc", name, nbytes, category) and frees
    ("free", name) in order; `peak` is the largest total of live bytes, `by_category` the live bytes per
    category at the first moment that total was reached (categories with no live bytes left out)."""
    require_callable(fn)
    fn = guarded(fn, {**FORBIDDEN, **family("parallel_lab.runtime.memory")}, "this exercise (peak_memory)")
    cases = [
        ("empty trace", []),
        ("one tensor", [("alloc", "w", 64, "param")]),
        (
            "a temporary makes the peak",
            [
                ("alloc", "w", 64, "param"),
                ("alloc", "tmp", 100, "other"),
                ("free", "tmp"),
                ("alloc", "g", 64, "grad"),
            ],
        ),
        (
            "the same peak twice: the first counts",
            [("alloc", "a", 10, "activation"), ("free", "a"), ("alloc", "b", 10, "comm")],
        ),
        ("zero-byte tensors", [("alloc", "e", 0, "other"), ("alloc", "w", 8, "param"), ("free", "e")]),
    ] + [
        (f"random trace {s}", _events(s, 400)) for s in (draw_seed() for _ in range(4))
    ]  # fmt: skip  drawn per run
    for label, events in cases:
        want = _reference_peak(events)
        got = fn(list(events))
        assert isinstance(got, tuple) and len(got) == 2, (
            f"{label}: return (peak, by_category), got {got!r:.80}"
        )
        peak, cats = got
        assert peak == want[0], f"{label}: peak {peak:,} bytes, expected {want[0]:,}"
        cats = {k: v for k, v in dict(cats).items() if v}
        assert cats == want[1], f"{label}: at the peak you have {cats}, expected {want[1]}"
    passed("check_peak_memory", f"{len(cases)} allocation traces replayed")

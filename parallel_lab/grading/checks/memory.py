"""Checks for lesson 02 (where the memory goes): model-state bytes of optimizers the lesson did not show,
measured in real steps, and the peak of an allocation trace under a caching allocator's rounding."""

from __future__ import annotations

import functools
import numbers
import random
from collections.abc import Callable, Mapping

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

__all__ = ["check_memory_calculator", "check_peak_memory"]

_SELF = "parallel_lab.grading.checks.memory"
# The lab's byte accounting (formula and measurement) and its tracker.
LAB = ("parallel_lab.costmodel.formulas", "parallel_lab.runtime.memory_state", "parallel_lab.runtime.memory")
# torch's trackers of live memory by category (parameters, gradients, optimizer states, ...).
TORCH_TRACKERS = (
    "torch.distributed._tools.mem_tracker",
    "torch.distributed._tools.memory_tracker",
    "torch.distributed._tools.fsdp2_mem_tracker",
)
# The optimizers the calculator covers: running one step and counting its state would skip the exercise.
TORCH_OPTIMIZERS = ("torch.optim.adagrad", "torch.optim.rmsprop", "torch.optim.adam", "torch.optim.adadelta")
# torch's private functional copies of them build the same state (in __init__ or step, readable from
# `.state` even when the update itself fails), and AdamW's keeps AMSGrad's running maximum as Adam's does.
TORCH_PRIVATE_OPTIMIZERS = (
    "torch.distributed.optim.functional_adagrad",
    "torch.distributed.optim.functional_rmsprop",
    "torch.distributed.optim.functional_adadelta",
    "torch.distributed.optim.functional_adam",
    "torch.distributed.optim.functional_adamw",
    "torch.optim._functional",
)
# torch's peak-memory replays and estimators (module, or module.name where the module is large).
TORCH_PEAKS = (
    "torch._inductor.memory",
    "torch._inductor.fx_passes.memory_estimator",
    "torch._inductor.runtime.debug_utils",
    "torch.distributed._tools.ilp_utils",
    "torch.profiler._memory_profiler",
    "torch._functorch._activation_checkpointing.graph_info_provider",
    "torch.cuda._memory_viz",
)
TORCH_PEAK_NAMES = (
    "torch._inductor.comms.reorder_communication_preserving_peak_memory",
    "torch._inductor.comms._initialize_memory_tracking",
    "torch._inductor.comms._calculate_potential_peak_memory_reorder",
    "torch._inductor.comms._update_memory_tracking_after_swap_reorder",
    "torch._inductor.comms._reorder_communication_preserving_peak_memory_internal",
    "torch._inductor.comms._update_memory_tracking_after_swap_sink_waits",
    "torch._inductor.comms._calculate_potential_peak_memory_sink_waits",
    "torch._inductor.scheduler.Scheduler._init_peak_memory_context",
    "torch._inductor.scheduler.Scheduler.can_fusion_increase_peak_memory",
    "torch.profiler.profiler.profile._memory_profile",
    "torch.profiler.profiler.profile.export_memory_timeline",
)


def _no_enum_machinery(targets: dict[str, str]) -> dict[str, str]:
    # An Enum class's own hooks (run by the enum module itself) are no answer to anything.
    return {k: v for k, v in targets.items() if not k.endswith(("._generate_next_value_", "._missing_"))}


_READ_THE_DOCS = "work the state out from the algorithm in torch's documentation"


@functools.cache
def calculator_forbidden() -> dict[str, str]:
    """What is switched off while the learner's `memory_calculator` runs (built on first use: torch's
    trackers take a second to import)."""
    return _no_enum_machinery(
        {
            **family(*LAB, _SELF),
            **family(*TORCH_TRACKERS, missing_ok=True),
            **family(*TORCH_OPTIMIZERS, instead=_READ_THE_DOCS),
            **_quietly(family, *TORCH_PRIVATE_OPTIMIZERS, instead=_READ_THE_DOCS, missing_ok=True),
        }
    )


def _quietly(f: Callable, *args, **kwargs):
    # torch.distributed.optim's functional modules warn, on import, that torch.jit.script is deprecated:
    # the check cell's output must stay one line
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return f(*args, **kwargs)


@functools.cache
def peak_forbidden() -> dict[str, str]:
    """What is switched off while the learner's `peak_memory` runs."""
    return _no_enum_machinery(
        {
            **family(*LAB, _SELF),
            **family(*TORCH_TRACKERS, *TORCH_PEAKS, missing_ok=True),
            **dict.fromkeys(TORCH_PEAK_NAMES, ""),
        }
    )


# ----------------------------------------------------------------------------- 1. the calculator
OPTIMIZERS = ("adagrad", "rmsprop", "rmsprop_momentum", "rmsprop_centered", "adam_amsgrad", "adadelta")
PRECISIONS = ("fp32", "mixed", "bf16")
_KEYS = ("param", "grad", "optim", "total")
_STATE_BYTES = {"fp32": 4, "mixed": 4, "bf16": 2}  # the dtype the states live in
_DTYPE = {"fp32": "fp32", "mixed": "fp16", "bf16": "bf16"}  # of the weights and gradients
_TINY = {"vocab": 16, "seq_len": 4, "d_model": 8, "n_heads": 2, "n_layers": 1}


def calculator_measurements() -> tuple[int, dict]:
    """(parameters of a tiny GPT, {(optimizer, precision): bytes per parameter of param/grad/optim}) from one
    real training step each, measured under MemoryTracker; every count is a whole number per parameter.

    Measured afresh on every call (a tenth of a second), and kept in no cache: a plain function, it is
    switched off with the rest of this module while the learner's function runs, and no stored table of
    the answers outlives the check."""
    import torch

    from parallel_lab.models import GPTConfig, build_model, synthetic_batch
    from parallel_lab.runtime.memory_state import measure_model_state

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest
    try:
        model = build_model(GPTConfig(**_TINY), seed=0)
        n = sum(p.numel() for p in model.parameters())
        batch = synthetic_batch("tokens", 1, seq_len=_TINY["seq_len"], vocab=_TINY["vocab"])
        out = {}
        for opt in OPTIMIZERS:
            for prec in PRECISIONS:
                got = measure_model_state(model, batch, opt, prec)
                assert all(got[k] % n == 0 for k in ("param", "grad", "optim")), (opt, prec, got)
                out[opt, prec] = {k: got[k] // n for k in ("param", "grad", "optim")}
    finally:
        torch.set_num_threads(threads)
    return n, out


def _call(fn: Callable, n: int, opt: str, prec: str, where: str) -> dict:
    from parallel_lab.grading.checks import call_learner

    got = call_learner(fn, where, n, opt, prec)
    assert isinstance(got, Mapping), f"{where} must return a dict with keys {_KEYS}, got {type(got).__name__}"
    missing = [k for k in _KEYS if k not in got]
    assert not missing, f"{where} returned keys {sorted(got)}; missing {missing}"
    for k in _KEYS:
        v = got[k]
        assert _is_number(v), f"{where}[{k!r}] must be a number of bytes, got {type(v).__name__}"
    parts = got["param"] + got["grad"] + got["optim"]
    assert got["total"] == parts, f"{where}: total {got['total']:,} is not param + grad + optim = {parts:,}"
    return got


def _is_number(v) -> bool:
    # numpy's integers and floats are numbers.Real too; a bool is not a count of bytes
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


_REREAD = (
    "reread {opt}'s update rule in torch's documentation: which quantities does it read back from step t-1, "
    "and which of them hold a value per parameter (a step counter is one number per parameter tensor, "
    "left out)"
)


def _why_optim(opt: str, prec: str, per: float, want: int) -> str:
    """What a wrong optimizer-state count most likely missed (`per`: the learner's bytes per parameter).
    It never says by how many state tensors the count is off: that count is the exercise."""
    d, s = per - want, _STATE_BYTES[prec]
    if prec == "mixed" and d <= -4:
        # fp32 passed before mixed is asked, so the states are right there: the master copy goes first
        why = (
            "in mixed precision the optimizer steps an fp32 master copy of the 16-bit weights, 4 bytes per "
            "parameter it holds beside its states"
        )
        return why if d == -4 else why + "; and with it added you still count fewer state bytes than measured"
    if d != int(d) or int(d) % s:
        return f"that is not a whole number of {s}-byte state tensors per parameter on top of what is fixed"
    what = _REREAD.format(opt=_torch_name(opt))
    if opt == "adam_amsgrad" and d < 0:
        what = (
            "with amsgrad=True the algorithm also carries a quantity plain Adam does not, from step to step"
        )
    elif opt == "rmsprop" and d > 0:
        what = "torch's RMSprop defaults to momentum=0, and without momentum its algorithm keeps no buffer for it"
    elif opt == "adagrad" and d < 0:
        what = "Adagrad's update divides by something it accumulates over every step so far; that is state"
    return what


def _torch_name(opt: str) -> str:
    return {
        "adagrad": "Adagrad",
        "rmsprop": "RMSprop (momentum=0)",
        "rmsprop_momentum": "RMSprop with momentum",
        "rmsprop_centered": "centered RMSprop with momentum",
        "adam_amsgrad": "Adam with amsgrad=True",
        "adadelta": "Adadelta",
    }.get(opt, opt)


def check_memory_calculator(fn: Callable[[int, str, str], dict]) -> None:
    """`fn(num_params, optimizer, precision)` -> {'param', 'grad', 'optim', 'total'} bytes per rank, for
    optimizers the lesson did not show (`OPTIMIZERS`) in each of `PRECISIONS`: exact against one real
    training step per configuration, measured under MemoryTracker, then at sizes drawn every grade run."""
    require_callable(fn)
    fn = guarded(fn, calculator_forbidden(), "this exercise (memory_calculator)")
    n_tiny, per_param = calculator_measurements()
    rnd = random.Random(draw_seed())
    sizes = (n_tiny, 1, 7_000_000_000, rnd.randint(2, 10**6), rnd.randint(10**9, 10**12))  # last two drawn
    for n in sizes:
        for opt in OPTIMIZERS:
            for prec in PRECISIONS:
                where = f"memory_calculator(num_params={n:,}, optimizer={opt!r}, precision={prec!r})"
                got = _call(fn, n, opt, prec, where)
                for k in ("param", "grad", "optim"):
                    want = per_param[opt, prec][k] * n
                    if got[k] == want:
                        continue
                    measured = (
                        f"a real {opt}/{prec} step of a GPT with {n:,} parameters, measured under MemoryTracker, holds"
                        if n == n_tiny
                        else f"real {opt}/{prec} steps, measured under MemoryTracker and scaled to {n:,} parameters, hold"
                    )
                    more = "more" if got[k] > want else "fewer"
                    why = (
                        _why_optim(opt, prec, got[k] / n, want // n)
                        if k == "optim"
                        else f"a {prec} model's {'weights' if k == 'param' else 'gradients'} are {_DTYPE[prec]}"
                    )
                    raise AssertionError(
                        f"{where}: {k} is {got[k]:,} bytes ({got[k] / n:g} per parameter), {more} than "
                        f"{measured}: {why}"
                    )
    passed("check_memory_calculator", f"{len(OPTIMIZERS)} optimizers x {len(PRECISIONS)} precisions, exact "
           "against real steps, at 5 sizes (2 drawn this run)")  # fmt: skip


# ----------------------------------------------------------------------------- 2. the peak under rounding
def _up(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block


def _replay(events: list[tuple], size: Callable[[int], int], last: bool = False) -> tuple[int, dict]:
    """(peak, by category at its first moment; at its last with `last`), each tensor occupying size(nbytes)."""
    live: dict = {}
    total = peak = 0
    at_peak: dict = {}
    for ev in events:
        if ev[0] == "alloc":
            live[ev[1]] = (size(ev[2]), ev[3])
            total += live[ev[1]][0]
        else:
            total -= live.pop(ev[1])[0]
        if total > peak or (last and total == peak and total):
            peak, at_peak = total, {}
            for nbytes, cat in live.values():
                if nbytes:
                    at_peak[cat] = at_peak.get(cat, 0) + nbytes
    return peak, at_peak


def _replay_rounding_total(events: list[tuple], block: int) -> int:
    """The peak of the raw running total, rounded up: the allocator's rounding applied once, not per tensor."""
    return _up(_replay(events, int)[0], block)


def reference_peak(events: list[tuple], block: int) -> tuple[int, dict]:
    return _replay(events, lambda b: _up(b, block))


_CATS = ("param", "grad", "optim", "activation", "comm", "other")


def _random_trace(rnd: random.Random, n: int, block: int) -> list[tuple]:
    live, out = [], []
    for i in range(n):
        if live and rnd.random() < 0.45:
            out.append(("free", live.pop(rnd.randrange(len(live)))))
            continue
        size = rnd.choice((
            0, rnd.randint(1, block), rnd.randint(1, block), rnd.randint(block, 4 * block),
            block * rnd.randint(1, 8), rnd.randint(1, 1 << 20),
        ))  # fmt: skip
        out.append(("alloc", f"t{i}", size, rnd.choice(_CATS)))
        live.append(f"t{i}")
    return out


def _moved_peak_trace(rnd: random.Random, block: int) -> list[tuple]:
    """A trace whose rounded peak comes later than its raw one: one large temporary, then k small tensors
    that each ask for a little more than a block (less in all than the temporary asked for)."""
    k = rnd.randint(3, 6)
    small = [block + rnd.randint(1, max(1, block // 4)) for _ in range(k)]
    big = (2 * k - 1) * block - rnd.randint(0, block // 2)  # > sum(small), occupies (2k - 1) blocks
    cats = rnd.sample(_CATS, 3)
    out = [
        ("alloc", "w", block * rnd.randint(1, 8), cats[0]),
        ("alloc", "tmp", big, cats[1]),
        ("free", "tmp"),
    ]
    out += [("alloc", f"s{i}", s, cats[2]) for i, s in enumerate(small)]
    return out + [("free", f"s{i}") for i in range(k)]


def peak_moves(events: list[tuple], block: int) -> bool:
    """Rounding moves the peak: the first moment of the rounded peak is not that of the raw one."""

    def moment(size):
        live, total, best, at = {}, 0, 0, -1
        for i, ev in enumerate(events):
            if ev[0] == "alloc":
                live[ev[1]] = size(ev[2])
                total += live[ev[1]]
            else:
                total -= live.pop(ev[1])
            if total > best:
                best, at = total, i
        return at

    return moment(int) != moment(lambda b: _up(b, block))


def drawn_cases(seed: int) -> list[tuple[str, list[tuple], int]]:
    """(label, events, block) drawn for one grade run: block sizes drawn (powers of two and one that is not),
    random traces, and one trace whose rounded peak comes at another moment than the raw one."""
    rnd = random.Random(seed)
    odd = rnd.randint(3, 3000)
    while not odd & (odd - 1):
        odd = rnd.randint(3, 3000)
    blocks = [2 ** rnd.randint(4, 12) for _ in range(3)] + [odd]
    cases = [
        (f"drawn trace {i + 1} of 300 events", _random_trace(rnd, 300, b), b) for i, b in enumerate(blocks)
    ]
    b = rnd.choice(blocks)
    return [*cases, ("drawn trace whose peak moves under rounding", _moved_peak_trace(rnd, b), b)]


FIXED = [
    ("an empty trace", [], 512),
    (
        "block=1: nothing is rounded, the lesson's bookkeeping",
        [
            ("alloc", "w", 64, "param"),
            ("alloc", "tmp", 100, "other"),
            ("free", "tmp"),
            ("alloc", "g", 64, "grad"),
        ],
        1,
    ),
    (
        "zero-byte tensors take no block",
        [("alloc", "e", 0, "other"), ("alloc", "w", 8, "param"), ("free", "e")],
        512,
    ),
    ("exact multiples stay as they are", [("alloc", "a", 1024, "param"), ("alloc", "b", 512, "grad")], 512),
    (
        "the same rounded peak twice: the first counts",
        [("alloc", "a", 100, "activation"), ("free", "a"), ("alloc", "b", 500, "comm")],
        512,
    ),
    (
        "rounding moves the peak",
        [("alloc", "w", 4096, "param"), ("alloc", "big", 2600, "activation"), ("free", "big")]
        + [("alloc", f"s{i}", 520, "comm") for i in range(4)],
        512,
    ),
]


_SHOWN = 16  # a trace up to this long is printed in full in a failure message


def _show(label: str, events: list[tuple], block: int, full: bool = False) -> str:
    shown = repr(events) if full or len(events) <= _SHOWN else f"<{len(events)} events>"
    return f"{label}: peak_memory(events={shown}, block={block})"


def _judge(fn: Callable, label: str, events: list[tuple], block: int, full: bool = False) -> None:
    """Raise AssertionError, naming the mistake, when `fn`'s answer on this one trace is wrong."""
    from parallel_lab.grading.checks import call_learner

    where = _show(label, events, block, full)
    got = call_learner(fn, where, list(events), block)
    assert isinstance(got, tuple) and len(got) == 2, f"{where}: return (peak, by_category), got {got!r:.80}"
    peak, cats = got
    assert _is_number(peak), f"{where}: peak must be a number of bytes, got {type(peak).__name__}"
    want_peak, want_cats = reference_peak(events, block)
    if peak != want_peak:
        if peak == _replay(events, int)[0]:
            why = "that is the peak of the bytes asked for: each tensor occupies whole blocks"
        elif peak == _replay_rounding_total(events, block):
            why = "that rounds the running total; each tensor gets blocks of its own (three 1-byte tensors take three)"
        elif peak == _replay(events, lambda b, block=block: round(b / block) * block)[0]:
            why = (
                "that rounds each size to the nearest multiple; a tensor never fits in less than it asked for"
            )
        else:
            why = "replay every event, each allocation at the size of the block it occupies"
        raise AssertionError(f"{where}: peak {peak:,} bytes, expected {want_peak:,}: {why}")
    assert isinstance(cats, Mapping), (
        f"{where}: by_category must be a dict {{category: bytes}}, got {type(cats).__name__}"
    )
    bad = [k for k, v in cats.items() if not _is_number(v)]
    assert not bad, (
        f"{where}: by_category[{bad[0]!r}] must be a number of bytes, got {type(cats[bad[0]]).__name__}"
    )
    cats = {k: v for k, v in cats.items() if v}
    if cats != want_cats:
        why = (
            "that is the last moment the peak was reached; report the first"
            if cats == _replay(events, lambda b, block=block: _up(b, block), last=True)[1]
            else "report what each category occupied at the first moment of the peak"
        )
        raise AssertionError(f"{where}: at the peak you have {cats}, expected {want_cats}: {why}")


def _shortest_failing_start(fn: Callable, label: str, events: list[tuple], block: int) -> int | None:
    """The fewest leading events of a trace on which `fn` is wrong (each start of a trace is a trace)."""
    for k in range(1, len(events) + 1):
        try:
            _judge(fn, label, events[:k], block)
        except AssertionError:
            return k
    return None  # right on every start, wrong on the whole: a function that remembers earlier calls


def check_peak_memory(fn: Callable[..., tuple]) -> None:
    """`fn(events, block=512)` -> (peak, by_category) of a trace of ("alloc", name, nbytes, category) and
    ("free", name): the peak of what the caching allocator's memory_allocated() would report, with `block`
    in place of its 512-byte kMinBlockSize, and what each category occupied at the first moment of it
    (categories that occupy nothing left out). Fixed edge cases, then traces and blocks drawn every grade
    run. A wrong answer on a long drawn trace is shown on the shortest start of it that is also wrong."""
    require_callable(fn)
    fn = guarded(fn, peak_forbidden(), "this exercise (peak_memory)")
    from parallel_lab.grading.checks import call_learner

    cases = [*FIXED, *drawn_cases(draw_seed())]
    for label, events, block in cases:
        try:
            _judge(fn, label, events, block)
        except AssertionError:
            if len(events) <= _SHOWN:
                raise
            k = _shortest_failing_start(fn, label, events, block)
            if k is None:
                _judge(fn, label, events, block, full=True)
                raise
            _judge(fn, f"{label}, its first {k} events (the shortest start of it your answer gets wrong)",
                   events[:k], block, full=True)  # fmt: skip
            raise
    default = call_learner(
        fn, "peak_memory(events=[('alloc', 'x', 1, 'other')])", [("alloc", "x", 1, "other")]
    )
    assert isinstance(default, tuple) and len(default) == 2 and default[0] == 512, (
        f"peak_memory(events=[('alloc', 'x', 1, 'other')]) returned {default!r:.80}: without a block argument "
        "the block is 512 bytes, so the one tensor occupies 512"
    )
    passed("check_peak_memory", f"{len(FIXED)} fixed traces and {len(cases) - len(FIXED)} drawn this run")

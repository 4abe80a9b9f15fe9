"""Exercise checks, one module per lesson (`comms/ring.py`, `runtime/memory.py`, ...).

`parallel_lab.grading` re-exports every name in each module's `__all__`, so a new
lesson adds a module here and its check cells can call
`parallel_lab.grading.check_<name>(learner_fn)` at once.

The contract a check keeps (graders and `python -m parallel_lab grade` rely on it):
- wrong answer -> `AssertionError` whose message says what differed, on which rank
  and by how much;
- unfinished exercise -> the learner's `NotImplementedError` comes out unchanged
  (use `launch_learner` below: a rank raising it must not turn into a `RankError`);
- right answer -> exactly one short deterministic line on stdout (`passed`), nothing
  on stderr, so the check cell can be `# NBVAL_CHECK_OUTPUT`.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
import warnings
from collections.abc import Iterator
from typing import Any

# A learner's code runs in a Jupyter kernel, whose cells compile to files like
# /tmp/ipykernel_1234/567.py (or <ipython-input-3-...> on old IPython): frames there are theirs.
_LEARNER_FILE = re.compile(r"ipykernel_\d+[/\\]\d+\.py|<ipython-input-")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)\n(?:\s{4,}(\S.*)\n)?', re.M)


def learner_frames(traceback_text: str) -> str:
    """The frames of a traceback that are the learner's own code (notebook cells), one per line
    pair, innermost last; '' when there is none. The grader maps them to cell numbers."""
    out = []
    for file, line, fn, code in _FRAME.findall(traceback_text + "\n"):
        if _LEARNER_FILE.search(file):
            out.append(f'  File "{file}", line {line}, in {fn}\n    {code.strip()}')
    return "\n".join(out)


def rank_verdict(e: BaseException) -> AssertionError:
    """A check that failed on a rank, as the check's verdict: the rank's message in full, then
    the frames of the learner's own code that led there (none of the grader's)."""
    text = str(e)
    message = text.split(": ", 1)[1] if ": " in text else text
    message = message.split("\n\n--- traceback", 1)[0]
    yours = learner_frames(getattr(e, "remote_traceback", "") or "")
    where = f"\n\nyour code, on rank {getattr(e, 'rank', '?')}:\n{yours}" if yours else ""
    return AssertionError(message + where)


class WriteItYourself(AssertionError):
    """Raised by a library function that a check switched off: the exercise asks for the learner's own."""


@contextlib.contextmanager
def unavailable(targets: dict[str, str], exercise: str) -> Iterator[None]:
    """While the learner's function runs, the library's answer to the exercise is switched off.

    `targets` maps dotted names ("parallel_lab.comms.ring.ring_all_reduce",
    "torch.distributed.all_reduce") to what the learner should do instead. A Python function
    gets a new body (its `__code__`), so every alias of it fails, also one imported before the
    check (`from parallel_lab.comms import ring_all_reduce as mine`); a built-in collective is
    replaced on its module and on the process group, where every `torch.distributed` call lands.
    Calling one raises `WriteItYourself` naming the function and the exercise.
    """
    undo: list[tuple[Any, str, Any]] = []
    try:
        for dotted, instead in targets.items():
            owner, name, fn = _resolve(dotted)
            if fn is None:
                continue
            message = (
                f"{exercise} asks you to write this yourself: {dotted} is switched off while the check runs"
            )
            message += f" ({instead})" if instead else ""
            if _swappable(fn):
                undo.append((fn, "__code__", fn.__code__))
                fn.__code__ = _raiser(dotted, message).__code__.replace(co_name=fn.__code__.co_name)
            else:
                undo.append((owner, name, fn))
                setattr(owner, name, _raiser(dotted, message))
        yield
    finally:
        for obj, attr, old in reversed(undo):
            setattr(obj, attr, old)


_MESSAGES: dict[str, str] = {}  # dotted name -> message, read by the raisers' shared code


def _raiser(dotted: str, message: str):
    _MESSAGES[dotted] = message

    def switched_off(*args, **kwargs):
        # Runs as the swapped-in body of a library function, with that function's globals:
        # reach this module by import, and find the message under the code's own file name.
        checks = __import__("parallel_lab.grading.checks", fromlist=["_MESSAGES"])
        code = __import__("sys")._getframe(0).f_code
        raise checks.WriteItYourself(checks._MESSAGES.get(code.co_filename, "this function is switched off"))

    switched_off.__code__ = switched_off.__code__.replace(co_filename=dotted)
    return switched_off


def _swappable(fn: Any) -> bool:
    """A plain Python function without closure cells: its body can be replaced in place."""
    return type(fn).__name__ == "function" and not fn.__code__.co_freevars


def _resolve(dotted: str) -> tuple[Any, str, Any]:
    """(owner object, attribute, value) for "pkg.module.attr" or "pkg.module.Class.method"."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:-1]:
            obj = getattr(obj, attr, None)
        if obj is None:
            return None, parts[-1], None
        if isinstance(obj, type):  # a class: its own entry (a pybind method must go back unbound)
            for klass in obj.__mro__:
                if parts[-1] in vars(klass):
                    value = vars(klass)[parts[-1]]
                    return (
                        obj,
                        parts[-1],
                        getattr(value, "__func__", value)
                        if _swappable(getattr(value, "__func__", None))
                        else value,
                    )
            return obj, parts[-1], None
        return obj, parts[-1], getattr(obj, parts[-1], None)
    return None, parts[-1], None


#: Every built-in collective, at both places a learner can reach it: torch.distributed's
#: functions and the process group's methods that they (and any alias of them) end in.
TORCH_COLLECTIVES: dict[str, str] = {
    **{f"torch.distributed.{n}": "" for n in (
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
        "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather",
        "scatter")},
    **{f"torch._C._distributed_c10d.ProcessGroup.{n}": "" for n in (
        "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
        "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
        "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "alltoall", "alltoall_base", "gather",
        "scatter")},
}  # fmt: skip


def family(
    *modules: str, instead: str = "", keep: tuple[str, ...] = (), missing_ok: bool = False
) -> dict[str, str]:
    """Every function and method defined in `modules` (dotted names), as `unavailable` targets:
    the lab's whole implementation of a technique, switched off at once. `keep` lists names the
    learner may still call (helpers that are not the exercise's answer). `missing_ok`: a module
    this torch release does not have is skipped (torch's private modules move between releases)."""
    out: dict[str, str] = {}
    for name in modules:
        try:
            with (
                warnings.catch_warnings()
            ):  # torch.distributed.optim scripts functions on import (deprecated)
                warnings.simplefilter("ignore", DeprecationWarning)
                module = importlib.import_module(name)
        except ImportError:
            if missing_ok:
                continue
            raise
        for attr, value in vars(module).items():
            if attr.startswith("__") or attr in keep or getattr(value, "__module__", None) != name:
                continue
            if isinstance(value, type):
                for meth, fn in vars(value).items():
                    fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
                    if type(fn).__name__ == "function" and not (meth.startswith("__") and meth != "__init__"):
                        out[f"{name}.{attr}.{meth}"] = instead
            elif type(value).__name__ == "function":
                out[f"{name}.{attr}"] = instead
    return out


def draw_seed() -> int:
    """A seed for one grade run, from the operating system's entropy: the cases a check draws with
    it differ run to run, so a table of one run's answers fails the next."""
    import random

    return random.SystemRandom().getrandbits(62)


def uneven_vocab(config: dict, world_size: int) -> int:
    """A vocabulary size drawn afresh every grade run for a small GPT (`config`: GPTConfig's fields), such
    that `world_size` does not divide the model's parameter count: the padded-shard case stays covered."""
    import random

    from parallel_lab.models import GPTConfig, build_model

    rnd = random.Random(draw_seed())
    for _ in range(200):
        vocab = rnd.randint(20, 79)
        model = build_model(GPTConfig(**{**config, "vocab": vocab}), seed=0)
        if sum(q.numel() for q in model.parameters()) % world_size:
            return vocab
    raise ValueError(
        f"world_size={world_size}: no vocabulary from 20 to 79 makes this model's parameter count indivisible by it"
    )


def tensors_in(obj: Any, depth: int = 0) -> list:
    """Every tensor in `obj`, looking inside lists, tuples, sets, dicts and objects' attributes (six levels):
    where a learner's code may keep state a check must count."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 6:
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [t for v in obj for t in tensors_in(v, depth + 1)]
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return tensors_in(list(vars(obj).values()), depth + 1)
    return []


def guarded(fn: Any, targets: dict[str, str], exercise: str) -> Any:
    """`fn` wrapped so that it runs under `unavailable(targets, exercise)`, on whichever rank calls it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with unavailable(targets, exercise):
            return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "fn")
    call.__wrapped__ = fn
    return call


def require_callable(fn: Any, name: str = "fn") -> None:
    """Fail early, and clearly, when a check is handed something that is not a function."""
    if not callable(fn):
        raise TypeError(f"{name} must be a function, got {type(fn).__name__}")


def launch_learner(fn: Any, world_size: int, *args: Any, **kwargs: Any):
    """`parallel_lab.runtime.launch`, except that a learner's unfinished exercise stays a `NotImplementedError`.

    A rank that raises reaches the parent as a `RankError`; when the rank raised
    `NotImplementedError` (the stub `make_exercises` writes), re-raise that type so
    the grader reports "not implemented" rather than a crash.
    """
    from parallel_lab.runtime.launch import RankError, launch

    try:
        return launch(fn, world_size, *args, **kwargs)
    except RankError as e:
        if e.exc_type == "NotImplementedError":
            raise NotImplementedError(str(e).split("\n", 1)[0].split(": ", 1)[-1]) from None
        raise


def call_learner(fn: Any, where: str, *args: Any) -> Any:
    """`fn(*args)`, with the learner's mistakes turned into the check's verdict (prefixed by `where`);
    an unfinished exercise stays a `NotImplementedError`."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except AssertionError as e:
        raise AssertionError(f"{where}: {str(e) or 'an assert in your function failed'}") from None
    except Exception as e:
        raise AssertionError(f"{where}: your function raised {type(e).__name__}: {e}") from e


def threads_off(why: str) -> dict[str, str]:
    """`unavailable` targets that keep the learner's function on the calling thread: dispatch modes and
    autograd hooks a check sets are per thread, so a new thread would escape them."""
    names = ("threading.Thread.start", "threading._start_new_thread", "_thread.start_new_thread", "_thread.start_new",
             "_thread.start_joinable_thread")  # the last is Python 3.13's (absent before: skipped)  # fmt: skip
    return dict.fromkeys(names, why)


def differentiation_off(instead: str) -> dict[str, str]:
    """`unavailable` targets for every way to let torch differentiate from Python: reverse mode (the engine's
    Python entry points), torch.func's transforms, torch.autograd.functional and forward mode. What runs the
    engine without them (`Variable._execution_engine.run_backward`, a node called by hand) records a graph
    first: a check's dispatch mode refuses that with `differentiation_refused`."""
    return {
        "torch.autograd.grad": instead,
        "torch.autograd.backward": instead,
        "torch.Tensor.backward": instead,
        "torch.autograd.graph._engine_run_backward": instead,
        **family("torch.func", "torch.autograd.functional", "torch.autograd.forward_ad", instead=instead),
        **family(
            "torch._functorch.eager_transforms", "torch._functorch.apis", instead=instead, missing_ok=True
        ),
    }


def stay_in_torch(instead: str) -> dict[str, str]:
    """`unavailable` targets that keep a learner's computation in tensor operations, where a check's dispatch
    mode sees (and counts) it: no moving tensors to numpy or to Python lists."""
    return dict.fromkeys(("torch.Tensor.numpy", "torch.Tensor.tolist", "torch.Tensor.__array__"), instead)


def differentiation_refused(func: Any, tensors: list) -> str:
    """Why a dispatch mode watching a gradient written by hand refuses the aten op `func` given `tensors`
    ('' when it does not): torch's backward kernels (aten's *_backward ops, autograd's own formulas), and any
    op given a tensor that requires grad (an autograd graph would be recorded, whatever then runs it)."""
    name = func.overloadpacket.__name__
    if "backward" in name:
        return f"torch's backward kernels are switched off while the check runs (aten.{name})"
    if any(t.requires_grad for t in tensors):
        return (
            f"autograd is switched off while the check runs: aten.{name} was given a tensor that requires "
            "grad (an autograd graph would be recorded)"
        )
    return ""


def finite_number(got: Any, where: str, what: str) -> float:
    """A learner's number (int, float, Fraction, numpy scalar or 0-d tensor) as a finite float, or the verdict."""
    try:
        value = float(got) if not isinstance(got, (bool, str, bytes)) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise AssertionError(f"{where} must return a finite number of {what}, got {got!r}")
    return value


def passed(check: str, detail: str = "") -> None:
    """Print the one success line a check cell shows, e.g. `check_add passed: 5 cases`."""
    print(f"{check} passed" + (f": {detail}" if detail else ""))

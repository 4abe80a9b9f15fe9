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

from typing import Any


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
            raise NotImplementedError(str(e).split("\n", 1)[0]) from None
        raise


def passed(check: str, detail: str = "") -> None:
    """Print the one success line a check cell shows, e.g. `check_add passed: 5 cases`."""
    print(f"{check} passed" + (f": {detail}" if detail else ""))

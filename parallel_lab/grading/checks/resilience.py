"""Checks for lesson 13's exercises: an atomic file write, a resumable sampler, the checkpoint interval.

`atomic_write(path, data)` runs in a forked child that is killed in the middle of the write (its
file writes are intercepted: half the bytes, then the process dies) and right after the last byte:
the file at `path` must still hold its old content, whole, every time. A plain `open(path, "wb")`
leaves a torn file and fails. The check also asks that the bytes reach the disk (`os.fsync`) before
the new name points at them.
`Sampler(n, seed)` must hand out the positions of each epoch's permutation (`order(epoch)`, given)
in order, and after `state_dict()` -> JSON -> `load_state_dict()` in a fresh sampler continue where
it stopped: every sample exactly once per epoch, however the run is cut.
`best_interval(checkpoint_cost, mtbf)` is compared with the interval that minimises the expected
wall time of the lesson's failure process (exponential failures that lose the work since the last
checkpoint), computed exactly, in 3 fixed regimes and 5 drawn each run: it must come within 6%
(Young's first-order interval is 0.7-4.1% long in these regimes; one off by sqrt(2) is 26-29% short).
"""

from __future__ import annotations

import builtins
import io
import json
import math
import os
import random
import tempfile
from collections import Counter
from collections.abc import Callable

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

FORBIDDEN = {
    **family("parallel_lab.resilience.checkpoint", "parallel_lab.resilience.sampler",
             "parallel_lab.resilience.failures", keep=("parallel_lab.resilience.failures.simulate_goodput",)),
    "torch.save": "write the bytes you are given yourself",
}  # fmt: skip

__all__ = ["check_atomic_write", "check_best_interval", "check_resumable_sampler"]


# ----------------------------------------------------------------------------- atomic write
def _crashing_child(fn: Callable, path: str, data: bytes, crash: str) -> int:
    """Fork; in the child run fn(path, data) with file writes intercepted; crash as asked. Returns the
    child's exit code (77: crashed where asked, 0: fn returned, 3: fn raised, 5: no crash point met)."""
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    code = 5
    try:
        real_open, real_write, real_replace, real_rename = builtins.open, os.write, os.replace, os.rename
        state = {"written": 0, "fsynced": False}

        def die() -> None:
            os._exit(77)

        def opener(file, mode="r", *a, **k):
            f = real_open(file, mode, *a, **k)
            if "w" in mode or "a" in mode or "+" in mode:
                raw_write = f.write

                def write(b):
                    if crash == "mid-write":
                        n = raw_write(b[: max(1, len(b) // 2)])
                        f.flush()
                        die()
                        return n
                    state["written"] += len(b)
                    return raw_write(b)

                f.write = write
            return f

        def os_write(fd, b):
            if crash == "mid-write":
                real_write(fd, b[: max(1, len(b) // 2)])
                die()
            return real_write(fd, b)

        def replace(src, dst, *a, **k):
            if crash == "at-rename":
                die()
            return real_replace(src, dst, *a, **k)

        def rename(src, dst, *a, **k):
            if crash == "at-rename":
                die()
            return real_rename(src, dst, *a, **k)

        builtins.open, io.open, os.write, os.replace, os.rename = opener, opener, os_write, replace, rename
        glb = getattr(fn, "__globals__", {})
        if "open" in glb:  # a notebook's own `open` (IPython puts a wrapper in the user namespace)
            glb["open"] = opener  # (this is the child process: the learner's namespace is untouched)
        try:
            fn(path, data)
            code = 0
        except BaseException:  # noqa: BLE001 - the parent only needs to know it raised
            code = 3
    finally:
        os._exit(code)


def check_atomic_write(atomic_write: Callable) -> None:
    """`atomic_write(path, data)`: afterwards `path` holds `data`; a crash at any point leaves the old file."""
    require_callable(atomic_write, "atomic_write")
    fn = guarded(atomic_write, FORBIDDEN, "this exercise (atomic_write)")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rank-00000.pt")
        fn(path, b"first version")
        got = open(path, "rb").read()
        assert got == b"first version", f"after atomic_write(path, b'first version') the file holds {got!r}"
        left = sorted(set(os.listdir(d)) - {"rank-00000.pt"})
        assert not left, (
            f"atomic_write left other files next to it: {left} (rename the temporary file, do not copy it)"
        )
        new = b"second version, longer than the first " * 50
        for crash in ("mid-write", "at-rename"):
            code = _crashing_child(atomic_write, path, new, crash)
            now = open(path, "rb").read()
            assert now == b"first version", (
                f"a crash {crash.replace('-', ' ')} left the file holding {len(now)} bytes "
                f"({now[:24]!r}...) instead of the old content: write to a temporary name in the same "
                "folder, then rename it over `path` in one step"
            )
            assert code in (77, 0, 3), f"the crashed writer exited with {code}"
        calls = {"fsync": 0, "replace": 0, "order": []}
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd):
            calls["order"].append("fsync")
            return real_fsync(fd)

        def replace(a, b, *x, **k):
            calls["order"].append("rename")
            return real_replace(a, b, *x, **k)

        def rename(a, b, *x, **k):
            calls["order"].append("rename")
            return real_rename(a, b, *x, **k)

        os.fsync, os.replace, os.rename = fsync, replace, rename
        try:
            fn(path, new)
        finally:
            os.fsync, os.replace, os.rename = real_fsync, real_replace, real_rename
        assert open(path, "rb").read() == new, (
            "after a write that did not crash, the file must hold the new bytes"
        )
        assert "rename" in calls["order"], "the new content must reach `path` by a rename (os.replace)"
        first_rename = calls["order"].index("rename")
        assert "fsync" in calls["order"][:first_rename], (
            "call os.fsync on the temporary file before the rename: otherwise after a power loss the name "
            "can point at bytes that never reached the disk"
        )
    passed("check_atomic_write", "the old file survived a crash in the middle of the write and at the rename")


# ----------------------------------------------------------------------------- sampler
def check_resumable_sampler(Sampler: type) -> None:
    """`Sampler(n, seed)`: `take(k)` -> the next k (epoch, index) pairs; `state_dict`/`load_state_dict`."""
    require_callable(Sampler, "Sampler")
    from parallel_lab.resilience import ResumableSampler as Reference

    make = guarded(Sampler, FORBIDDEN, "this exercise (Sampler)")
    import random

    rnd = random.Random(draw_seed())  # one more dataset, seed and set of cuts, drawn afresh every grade run
    n = rnd.randint(2, 40)
    drawn = (n, rnd.getrandbits(31), tuple(rnd.randint(1, 2 * n) for _ in range(rnd.randint(3, 7))))
    for n, seed, cuts in (
        (10, 0, (3, 4, 7, 2, 9, 5)),
        (7, 3, (7, 7, 1, 6, 14)),
        (12, 1, (5, 5, 5, 5, 5, 5)),
        drawn,
    ):
        ref, s = Reference(n, seed), make(n, seed)
        seen: Counter = Counter()
        for i, k in enumerate(cuts):
            got = guarded(s.take, FORBIDDEN, "this exercise (take)")(k)
            got = [tuple(int(v) for v in p) for p in got]
            want = ref.take(k)
            where = (
                f"n={n}, seed={seed}, take #{i + 1} ({k} samples, after a resume)"
                if i
                else f"n={n}, seed={seed}"
            )
            assert len(got) == k, f"{where}: take({k}) returned {len(got)} pairs"
            seen.update(got)
            twice = [p for p, c in seen.items() if c > 1]
            assert not twice, f"{where}: (epoch, index) {twice[0]} was handed out twice"
            assert got == want, (
                f"{where}: got {got[:6]}..., expected {want[:6]}... (follow order(epoch) from the saved "
                "offset, and go on into the next epoch when this one runs out)"
            )
            state = json.loads(json.dumps(s.state_dict()))  # it must survive a trip through a file
            s = make(n, seed)
            s.load_state_dict(state)
    passed("check_resumable_sampler", "every sample once per epoch across 17 resumes and a drawn run")


# ----------------------------------------------------------------------------- interval
def _exact_interval(c: float, m: float) -> float:
    """The interval that minimises the expected wall time of `simulate_goodput`'s failure process.

    A segment of T seconds of work plus its checkpoint C, under exponential failures of mean M that
    lose the segment and then cost a restart R, takes (M + R)(e^((T+C)/M) - 1) on average, so the
    wall time per second of work is proportional to (e^((T+C)/M) - 1) / T, whatever R. Its minimum
    is the root of e^((T+C)/M) (T/M - 1) + 1 = 0 (bisection)."""
    lo, hi = 1e-9 * m, 10.0 * m
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.exp((mid + c) / m) * (mid / m - 1) + 1 < 0 else (lo, mid)
    return (lo + hi) / 2


def check_best_interval(best_interval: Callable) -> None:
    """`best_interval(checkpoint_cost, mtbf)` -> seconds between checkpoints, within 6% of the optimum."""
    require_callable(best_interval, "best_interval")
    from parallel_lab.resilience import simulate_goodput

    fn = guarded(best_interval, FORBIDDEN, "this exercise (best_interval)")
    rnd = random.Random(draw_seed())
    regimes = [(60.0, 4 * 3600.0), (5.0, 3600.0), (600.0, 24 * 3600.0)]
    for _ in range(5):  # drawn this run: checkpoints of 2 s to 10 min, failures 200 to 5,000 times rarer
        c = 10 ** rnd.uniform(0.3, 2.8)
        regimes.append((round(c, 1), round(c * 10 ** rnd.uniform(2.3, 3.7))))
    for c, m in regimes:
        t = float(fn(c, m))
        where = f"checkpoint_cost={c:g} s, mtbf={m:g} s"
        assert t > 0, f"{where}: the interval must be positive, got {t:g}"
        best = _exact_interval(c, m)
        if abs(t / best - 1) > 0.06:
            mine = sum(simulate_goodput(t, c, 2 * c, m, work=200 * m, seed=s).goodput for s in range(3)) / 3
            top = sum(simulate_goodput(best, c, 2 * c, m, work=200 * m, seed=s).goodput for s in range(3)) / 3
            side = "it pays for more checkpoints" if t < best else "each failure loses more work"
            raise AssertionError(
                f"{where}: your interval of {t:.4g} s is {abs(t / best - 1):.0%} "
                f"{'shorter' if t < best else 'longer'} than the one that wastes least ({side}); simulated "
                f"goodput {mine:.4f} against {top:.4f}. Near the optimum goodput changes little, so the check "
                "compares intervals: yours must come within 6%"
            )
    passed(
        "check_best_interval", f"within 6% of the optimum in {len(regimes)} regimes, 5 of them drawn this run"
    )

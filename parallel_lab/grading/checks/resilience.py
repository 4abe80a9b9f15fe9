"""Checks for lesson 13's exercises: a checkpoint of several files committed at once, a sampler with a fixed
share per rank resumed mid-epoch on another world size, the checkpoint interval when checkpoints are expensive.

`commit_checkpoint(folder, step, files)` / `latest_checkpoint(folder)`: the commit runs in a forked
child whose file-system calls (open for writing, write, flush, fsync, rename, mkdir, unlink, ...) are
counted; then it runs again, once per operation, killed before that operation (in the middle of it, for
a write). After every crash `latest_checkpoint`, in the parent, must return the previous checkpoint or
the new one, each whole and exactly as committed; then a new commit (the same step again when the
crashed one did not count) must work among the crashed commit's debris. It runs for a first commit
into an empty folder and for a second one over it. The commit point (the first operation after which
a crash leaves the new checkpoint visible) must come after every byte and every name it makes visible
(files', folders' and links') was fsync'ed, bytes still in Python's buffer not counting as synced, and
the folder where it made its name must be fsync'ed before the commit returns: a power loss keeps only
what was. Each file must lie under its own name, holding exactly its bytes. Names, sizes, contents and
step numbers are drawn every grade run (the steps cross a power of ten, so a reader that sorts names as
text picks the older one).
`Sampler(n, seed, rank, world_size)`: each epoch's samples are dealt into contiguous shards, one per rank,
read k at a time in step; jobs on 1 to 5 ranks are saved (up to three times in one epoch, and as an epoch
ends) and resumed on as many, fewer and more ranks, each new rank loading the state of a drawn old rank,
where a resume deals the rest of the epoch among the new ranks. Every resume runs twice from the same
states, and a new job follows the old ones, so a place kept outside the state shows. Every rank's pairs
are compared with the rule's, step after step.
`best_interval(checkpoint_cost, restart_cost, mtbf)` is compared with the interval that minimises the
expected wall time per second of work of `simulate_goodput`'s failure process, solved exactly, within
1%, for C/M from 1/20 to 2 (where sqrt(2 C M) is 11% to 111% long, and Daly's higher-order estimate
is within 1% only below C/M of about 0.7), R from 0 to 5 C: four fixed regimes and six drawn per run.
"""

from __future__ import annotations

import builtins
import io
import json
import math
import os
import random
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from parallel_lab.grading.checks import _resolve, draw_seed, family, guarded, passed, require_callable

_SELF = "parallel_lab.grading.checks.resilience"


def _own(targets: dict[str, str]) -> dict[str, str]:
    """`targets` less the functions a module only inherits (an Enum's `_generate_next_value_` is enum's own:
    switching it off would break every enum, `re` included)."""
    out = {}
    for dotted, instead in targets.items():
        parts = dotted.split(".")
        module = next(
            ".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in sys.modules
        )
        if getattr(_resolve(dotted)[2], "__module__", module) == module:
            out[dotted] = instead
    return out


#: the lab's checkpoint writer and reader, and torch's: DCP's storage writers (the file system's,
#: fsspec's, Hugging Face's, the experimental one, each writing its metadata last), and its atomic
#: file writes (inductor's cache, dynamo's AOT artefacts)
CHECKPOINT_FORBIDDEN = {
    **family("parallel_lab.resilience.checkpoint", "parallel_lab.resilience.flash"),
    **_own(
        family(
            "torch.distributed.checkpoint.filesystem",
            "torch.distributed.checkpoint.storage",
            "torch.distributed.checkpoint.state_dict_saver",
            "torch.distributed.checkpoint._fsspec_filesystem",
            "torch.distributed.checkpoint.hf_storage",
            "torch.distributed.checkpoint._experimental.checkpoint_writer",
            "torch.distributed.checkpoint._experimental.checkpointer",
            missing_ok=True,
        )
    ),
    "torch._inductor.codecache.write_atomic": "",
    "torch._dynamo.aot_compile.atomic_write_binary": "",
    "torch.save": "write the bytes you are given yourself",
}
#: the lab's resumable sampler, and torch's samplers that split an epoch over ranks (the base class
#: `Sampler` stays: a learner's class may derive from it)
SAMPLER_FORBIDDEN = {
    **family("parallel_lab.resilience.sampler", "parallel_lab.resilience.train"),
    **family(
        "torch.utils.data.distributed",
        "torch.distributed.elastic.utils.data.elastic_distributed_sampler",
        missing_ok=True,
    ),
    **family("torch.utils.data.sampler", keep=("Sampler",)),
}
#: the lab's intervals and first-order goodput (the simulation stays: measuring is allowed)
INTERVAL_FORBIDDEN = family(
    "parallel_lab.resilience.failures", keep=("simulate_goodput", "GoodputRun", "_positive")
)

__all__ = ["check_best_interval", "check_commit_checkpoint", "check_elastic_sampler"]


# ----------------------------------------------------------------------------- exercise 1: commit
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CRASHED, _RAISED = 77, 3


class _FsOps:
    """In a forked child: the file-system calls a commit makes, counted, logged and (at `crash_at`) fatal.

    Every call that changes the disk is one operation. Before each, it notes what would not survive a
    power loss if that operation were the commit point: a file written since its last fsync (a write
    still in Python's buffer counts from its flush: an fsync before it misses it), and a name (a file's,
    a folder's, a link's) made in a folder that was not fsync'ed since (except the name the operation
    itself renames). After each operation that makes a name (rename, mkdir, link, symlink, an open that
    creates a file) it notes the folder that then holds it, whose fsync before the commit returns makes
    the commit itself durable."""

    def __init__(self, root: str, crash_at: int | None) -> None:
        self.root, self.crash_at, self.n = os.path.realpath(root), crash_at, 0
        self.ops: list[dict] = []
        self.files: dict[tuple[int, int], dict] = {}  # (dev, inode) -> path, when named, written, synced
        self.names: dict[
            str, int
        ] = {}  # folders, links and renamed-in names that are not files above -> when made
        self.synced: dict[tuple[int, int], int] = {}  # folder or file -> last operation that fsync'ed it
        self.everything = -1  # the last os.sync(), which writes out every file and folder
        self.real = {n: getattr(os, n) for n in (
            "open", "write", "fsync", "fdatasync", "replace", "rename", "mkdir", "rmdir", "unlink", "remove",
            "symlink", "link", "truncate", "ftruncate", "sync")}  # fmt: skip
        self.real_open = builtins.open

    # -- bookkeeping
    def rel(self, p) -> str:
        p = os.fsdecode(p)
        return os.path.relpath(p, self.root) if p.startswith(self.root) else p

    def path(self, p, dir_fd=None) -> str:
        p = os.fsdecode(p)
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(p))), os.path.basename(p))

    @staticmethod
    def key(st) -> tuple[int, int]:
        return st.st_dev, st.st_ino

    def op(self, text: str, renames: str | None = None) -> int:
        """Note operation number n (not yet done) and what a commit point here would leave unsynced."""
        i, self.n = self.n, self.n + 1
        problems = []
        named = [(p, n) for p, n in self.names.items()]
        for f in list(self.files.values()):
            if f["buffered"] is not None or (
                f["written"] is not None
                and max(-1 if f["synced"] is None else f["synced"], self.everything) < f["written"]
            ):
                problems.append(
                    f"the bytes of {self.rel(f['path'])} were not fsync'ed"
                    + (
                        " (an os.fsync that came before f.flush() missed the bytes Python still held in its "
                        "buffer, not yet in the file)"
                        if f["early"]
                        else ""
                    )
                )
            if f["named"] is not None:
                named.append((f["path"], f["named"]))
        for path, made in named:
            if path == renames:
                continue
            try:
                folder = self.key(os.stat(os.path.dirname(path)))
            except OSError:
                continue
            if max(self.synced.get(folder, -1), self.everything) < made:
                problems.append(
                    f"the name {self.rel(path)} was made after its folder "
                    f"{self.rel(os.path.dirname(path)) or '.'} was last fsync'ed"
                )
        self.ops.append({"text": text, "problems": problems, "holds": None})
        return i

    def track(self, fd: int, path: str | None, created: bool, truncated: bool, i: int) -> tuple[int, int]:
        st = os.fstat(fd)
        k = self.key(st)
        if not stat.S_ISREG(st.st_mode):
            return k
        if path is None:
            path = os.readlink(f"/proc/self/fd/{fd}")
        f = self.files.setdefault(
            k,
            {"path": path, "named": None, "written": None, "synced": None, "buffered": None, "early": False},
        )
        if created:
            f["named"] = i
        if truncated:
            f["written"] = i
        return k

    def wrote(self, k: tuple[int, int] | None, i: int) -> None:
        if k in self.files:
            self.files[k]["written"] = i

    def buffered(self, k: tuple[int, int] | None, i: int) -> None:
        """Write i went into Python's buffer: it reaches the file only at the next flush."""
        if k in self.files:
            self.files[k]["buffered"] = i

    def flushed(self, k: tuple[int, int] | None) -> None:
        """The buffer reached the file now, after every operation so far: only a later fsync covers it."""
        if k in self.files and self.files[k]["buffered"] is not None:
            self.files[k]["buffered"], self.files[k]["written"] = None, self.n

    def made(self, path: str, i: int, what: tuple[int, int]) -> None:
        """Operation i made the name `path` (not a file tracked above) in the folder `what`."""
        self.names[path] = i
        self.holds(i, what)

    def die(self) -> None:
        os._exit(_CRASHED)

    def moved(self, src: str, dst: str, i: int) -> None:
        if src == dst:
            return
        for k, f in list(self.files.items()):
            if f["path"] == dst:
                del self.files[k]  # replaced by the rename
        self.names.pop(dst, None)
        file = False
        for f in self.files.values():
            if f["path"] == src:
                f["path"], f["named"], file = dst, i, True
            elif f["path"].startswith(src + os.sep):  # inside a renamed folder: its own name is unchanged
                f["path"] = dst + f["path"][len(src) :]
        names = {}
        for p, made in self.names.items():
            if p.startswith(src + os.sep):
                names[dst + p[len(src) :]] = made
            elif p != src:
                names[p] = made
        if not file:
            names[dst] = i  # a folder, a link, or a file made before the commit: a new name all the same
        self.names = names

    def removed(self, p: str) -> None:
        for k, f in list(self.files.items()):
            if f["path"] == p:
                del self.files[k]
        self.names = {q: n for q, n in self.names.items() if q != p and not q.startswith(p + os.sep)}

    def holds(self, i: int, what: tuple[int, int]) -> None:
        self.ops[i]["holds"] = what

    # -- the intercepted calls
    def install(self, fn: Callable) -> None:
        me, r = self, self.real

        def opener(file, mode="r", *a, **k):
            if not any(c in mode for c in "wax+"):
                return me.real_open(file, mode, *a, **k)
            path = None if isinstance(file, int) else me.path(file)
            existed = path is not None and os.path.lexists(path)
            emptied = " (which empties the existing file)" if existed and "w" in mode else ""
            i = me.op(f"open({me.rel(path) if path else file!r}, {mode!r}){emptied}")
            if i == me.crash_at:
                me.die()
            f = me.real_open(file, mode, *a, **k)
            fk = me.track(f.fileno(), path, not existed, "w" in mode, i)
            if path is not None and not existed:
                me.holds(i, me.key(os.stat(os.path.dirname(path))))
            raw_write, raw_flush, raw_close = f.write, f.flush, f.close
            unbuffered = isinstance(f, io.RawIOBase)

            def write(b):
                j = me.op(
                    f"write({len(b)} {'bytes' if isinstance(b, (bytes, bytearray)) else 'chars'}) to {me.rel(me.files.get(fk, {}).get('path', '?'))}"
                )
                if j == me.crash_at:
                    raw_write(b[: len(b) // 2])
                    raw_flush()
                    me.die()
                out = raw_write(b)
                (me.wrote if unbuffered else me.buffered)(fk, j)
                return out

            def flush():
                out = raw_flush()
                me.flushed(fk)
                return out

            def close():
                if not f.closed:
                    raw_flush()
                    me.flushed(fk)
                return raw_close()

            f.write, f.flush, f.close = write, flush, close
            return f

        def os_open(path, flags, mode=0o777, *, dir_fd=None):
            if not flags & _WRITING:
                return r["open"](path, flags, mode, dir_fd=dir_fd)
            p = me.path(path, dir_fd)
            existed = os.path.lexists(p)
            i = me.op(f"os.open({me.rel(p)!r}, flags={flags:#o})")
            if i == me.crash_at:
                me.die()
            fd = r["open"](path, flags, mode, dir_fd=dir_fd)
            me.track(fd, p, not existed, bool(flags & os.O_TRUNC), i)
            if not existed:
                me.holds(i, me.key(os.stat(os.path.dirname(p))))
            return fd

        def os_write(fd, b):
            k = me.key(os.fstat(fd))
            i = me.op(f"os.write({len(b)} bytes) to {me.rel(me.files.get(k, {}).get('path', '?'))}")
            if i == me.crash_at:
                r["write"](fd, b[: len(b) // 2])
                me.die()
            out = r["write"](fd, b)
            me.wrote(k, i)
            return out

        def syncer(name):
            def sync(fd):
                num = fd if isinstance(fd, int) else fd.fileno()
                k = me.key(os.fstat(num))
                what = me.files.get(k, {}).get("path") or os.readlink(f"/proc/self/fd/{num}")
                i = me.op(f"os.{name}({me.rel(what) or '.'})")
                if i == me.crash_at:
                    me.die()
                out = r[name](fd)
                me.synced[k] = i
                if k in me.files:
                    me.files[k]["synced"] = i
                    me.files[k]["early"] |= me.files[k]["buffered"] is not None
                return out

            return sync

        def sync_all():
            i = me.op("os.sync()")
            if i == me.crash_at:
                me.die()
            r["sync"]()
            me.everything = i

        def renamer(name):
            def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
                s, d = me.path(src, src_dir_fd), me.path(dst, dst_dir_fd)
                i = me.op(f"os.{name}({me.rel(s)!r}, {me.rel(d)!r})", renames=s)
                if i == me.crash_at:
                    me.die()
                out = r[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                me.moved(s, d, i)
                me.holds(i, me.key(os.stat(os.path.dirname(d))))
                return out

            return rename

        def maker(name):
            def make(*args, dir_fd=None, **kw):
                p = me.path(args[1] if name in ("symlink", "link") else args[0], dir_fd)
                i = me.op(
                    f"os.{name}({', '.join(repr(me.rel(a)) if isinstance(a, str) else repr(a) for a in args)})"
                )
                if i == me.crash_at:
                    me.die()
                out = r[name](*args, dir_fd=dir_fd, **kw) if dir_fd is not None else r[name](*args, **kw)
                me.made(p, i, me.key(os.stat(os.path.dirname(p))))
                return out

            return make

        def remover(name):
            def remove(path, *, dir_fd=None):
                p = me.path(path, dir_fd)
                i = me.op(f"os.{name}({me.rel(p)!r})")
                if i == me.crash_at:
                    me.die()
                out = r[name](path, dir_fd=dir_fd)
                me.removed(p)
                return out

            return remove

        def truncater(name):
            def truncate(target, length):
                i = me.op(f"os.{name}({target!r}, {length})")
                if i == me.crash_at:
                    me.die()
                out = r[name](target, length)
                fd_or_path = os.fstat(target) if isinstance(target, int) else os.stat(target)
                me.wrote(me.key(fd_or_path), i)
                return out

            return truncate

        builtins.open = io.open = opener
        os.open, os.write = os_open, os_write
        os.fsync, os.fdatasync, os.sync = syncer("fsync"), syncer("fdatasync"), sync_all
        os.replace, os.rename = renamer("replace"), renamer("rename")
        os.mkdir, os.symlink, os.link = maker("mkdir"), maker("symlink"), maker("link")
        os.unlink, os.remove, os.rmdir = remover("unlink"), remover("remove"), remover("rmdir")
        os.truncate, os.ftruncate = truncater("truncate"), truncater("ftruncate")
        glb = getattr(getattr(fn, "__wrapped__", fn), "__globals__", {})
        if "open" in glb:  # a notebook's own `open` (IPython puts a wrapper in the user namespace)
            glb["open"] = opener  # (this is the child process: the learner's namespace is untouched)


def _commit_in_child(commit: Callable, folder: str, step: int, files: dict, crash_at: int | None, log: str):
    """Fork; in the child run commit(folder, step, files) under `_FsOps` and write its log to `log`.
    Returns the child's exit code (77: killed where asked, 0: the commit returned, 3: it raised)."""
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    code, error = 5, ""
    try:
        fs = _FsOps(folder, crash_at)
        real_open = fs.real_open
        fs.install(commit)
        try:
            commit(folder, step, files)
            code = 0
        except BaseException as e:  # noqa: BLE001 - the parent reports it
            code, error = _RAISED, f"{type(e).__name__}: {e}"
        holds = [o["holds"] for o in fs.ops]
        for i, o in enumerate(fs.ops):
            o["durable"] = holds[i] is None or max(fs.synced.get(holds[i], -1), fs.everything) > i
            o.pop("holds")
        with real_open(log, "w") as f:
            json.dump({"ops": fs.ops, "error": error}, f)
    finally:
        os._exit(code)


def _describe(files: dict) -> str:
    return "{" + ", ".join(f"{k!r}: <{len(v)} bytes>" for k, v in files.items()) + "}"


def _as_checkpoint(got) -> tuple[int, dict] | None | str:
    """The learner's answer as (step, {name: bytes}), None, or a sentence saying why it is neither."""
    if got is None:
        return None
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[1], dict)):
        return f"return (step, {{name: bytes}}) or None, not {type(got).__name__}"
    try:
        return int(got[0]), {str(k): bytes(v) for k, v in got[1].items()}
    except (TypeError, ValueError) as e:
        return f"return (step, {{name: bytes}}): {e}"


def _difference(got: tuple[int, dict], want: tuple[int, dict]) -> str:
    step, files = got
    missing = sorted(set(want[1]) - set(files))
    extra = sorted(set(files) - set(want[1]))
    other = sorted(k for k in set(files) & set(want[1]) if files[k] != want[1][k])
    out = []
    if missing:
        out.append(f"without {missing}")
    if extra:
        out.append(f"with {extra}, which the commit was not given (keep your bookkeeping out of the answer)")
    for k in other[:2]:
        out.append(f"{k!r} holding {len(files[k])} bytes that differ from the {len(want[1][k])} committed")
    return f"step {step} " + "; ".join(out)


def _read(latest: Callable, folder: str, where: str, crashed: bool = False) -> tuple[int, dict] | None:
    try:
        got = latest(folder)
    except NotImplementedError:
        raise
    except Exception as e:
        why = (
            (
                ". After a crash the folder holds what the commit did up to there, and the reader must still find "
                "the previous checkpoint or the new one, whole"
            )
            if crashed
            else ""
        )
        raise AssertionError(
            f"{where}: latest_checkpoint(folder) raised {type(e).__name__}: {e}{why}"
        ) from None
    got = _as_checkpoint(got)
    assert not isinstance(got, str), f"{where}: latest_checkpoint(folder) must {got}"
    return got


def _expect(got, want: tuple[int, dict] | None, where: str) -> None:
    if got == want:
        return
    if want is None:
        raise AssertionError(f"{where}: latest_checkpoint(folder) returned step {got[0]}, expected None")
    if got is None:
        raise AssertionError(f"{where}: latest_checkpoint(folder) returned None, expected step {want[0]}")
    if got[0] != want[0]:
        raise AssertionError(
            f"{where}: latest_checkpoint(folder) returned step {got[0]}, expected step {want[0]}"
            + (
                " (steps are numbers: is step 10 before or after step 9 in your order?)"
                if got[0] < want[0]
                else ""
            )
        )
    raise AssertionError(f"{where}: latest_checkpoint(folder) returned {_difference(got, want)}")


def _draw_files(rnd: random.Random, ranks: int) -> dict[str, bytes]:
    tag = "".join(rnd.choice("abcdefghkmnpqrstuvwxyz") for _ in range(rnd.randint(2, 5)))
    ext = rnd.choice(["bin", "pt", "shard", "safetensors"])
    files = {f"rank{r:0{rnd.randint(1, 3)}d}-{tag}.{ext}": rnd.randbytes(rnd.choice([0, 1, 7, rnd.randint(8, 3000)]))
             for r in range(ranks)}  # fmt: skip
    files[f"meta-{tag}.json"] = json.dumps({"ranks": ranks, "lr": rnd.random()}).encode()
    return dict(sorted(files.items(), key=lambda kv: rnd.random()))


def _fast_tmp() -> str | None:
    """tmpfs where there is one: the check fsyncs hundreds of times, and the calls are what it reads."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _own_names(folder: str, files: dict, call: str) -> None:
    """Each committed file lies in the folder under its own name, holding exactly its bytes."""
    found: dict[str, list[str]] = {}
    for d, _, names in os.walk(folder):
        for name in names:
            found.setdefault(name, []).append(os.path.join(d, name))
    for name, data in files.items():
        held = []
        for path in found.get(name, []):
            with open(path, "rb") as f:
                held.append(f.read())
        if data not in held:
            raise AssertionError(
                f"after {call} returned, no file named {name!r} in the folder "
                + (f"holds its {len(data)} bytes" if held else "exists")
                + ": store each file under its own name, holding exactly its bytes (a checkpoint's files are "
                "read one by one, by other tools too), not packed into one file of your own"
            )


def _crash_everywhere(commit, latest, top: Path, base: Path | None, before, step, files, again, label):
    """Commit (step, files) over a copy of `base` (or an empty folder), killed at each operation in turn;
    after each crash the reader must see `before` or the new checkpoint, and a new commit must work.
    Returns the clean run's operations and the index of the commit point."""
    label_call = f"commit_checkpoint(folder, step={step}, files={_describe(files)})"
    log = str(top / f"log-{label}.json")

    def fresh(name: str) -> str:
        d = top / name
        if base is None:
            d.mkdir()
        else:
            shutil.copytree(base, d, symlinks=True)
        return str(d)

    clean = fresh(f"{label}-clean")
    code = _commit_in_child(commit, clean, step, files, None, log)
    report = json.loads(Path(log).read_text())
    if report["error"].startswith("NotImplementedError: "):  # an exercise not done yet stays one
        raise NotImplementedError(report["error"].split(": ", 1)[1])
    assert code == 0, f"{label_call} raised {report['error']}"
    ops = report["ops"]
    assert ops, f"{label_call} changed nothing on disk"
    new = (step, files)
    _expect(_read(latest, clean, f"after {label_call}"), new, f"after {label_call}")
    _own_names(clean, files, label_call)
    first_new = len(ops)
    for k in range(len(ops)):
        folder = fresh(f"{label}-crash-{k}")
        code = _commit_in_child(commit, folder, step, files, k, log)
        how = "in the middle of" if ops[k]["text"].startswith(("write", "os.write")) else "just before"
        where = (
            f"{label_call}{', with step ' + str(before[0]) + ' committed before,' if before else ' into an empty folder'} "
            f"was killed {how} its operation {k + 1} of {len(ops)}, {ops[k]['text']}"
        )
        if code == _RAISED:
            raise AssertionError(f"{where}: it raised instead ({json.loads(Path(log).read_text())['error']})")
        got = _read(latest, folder, where, crashed=True)
        if got == new:
            first_new = min(first_new, k)
        elif got != before:
            if got is None:
                raise AssertionError(
                    f"{where}: latest_checkpoint(folder) then returned None, but step {before[0]} was committed "
                    "whole before: a crash may not take the previous checkpoint away"
                )
            if got[0] != step and (before is None or got[0] != before[0]):
                raise AssertionError(
                    f"{where}: latest_checkpoint(folder) then returned step {got[0]}, but "
                    + (f"only step {before[0]} is complete" if before else "nothing was committed yet")
                    + ": until the commit point, readers must see the folder as it was"
                )
            raise AssertionError(
                f"{where}: latest_checkpoint(folder) then returned {_difference(got, new if got[0] == step else before)}; "
                "after a crash it must return the previous checkpoint or the new one, whole: a checkpoint of "
                "several files is not complete until all of them are, and readers must not see it before"
            )
        # the job restarts from what it read, and commits again (the same step, when that one was lost)
        nxt = (step, again) if got != new else (step + 1 + k, again)
        call = f"commit_checkpoint(folder, step={nxt[0]}, files={_describe(again)})"
        try:
            commit(folder, *nxt)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(
                f"{where}; then {call} raised {type(e).__name__}: {e}. After a crash the job commits again "
                "into the same folder, among whatever the crashed commit left there"
            ) from None
        _expect(_read(latest, folder, f"{where}; then {call}"), nxt, f"{where}; then {call}")
        shutil.rmtree(folder)
    return ops, first_new - 1


def _durable(ops: list[dict], point: int, call: str) -> None:
    if point < 0:
        return
    commit = ops[point]
    where = f"{call}: its commit point is operation {point + 1} of {len(ops)}, {commit['text']}"
    if commit["problems"]:
        raise AssertionError(
            f"{where}, but then {commit['problems'][0]}: after a power loss the disk holds a file's bytes "
            "only once the file was fsync'ed, and a new or renamed name only once its folder was, so the "
            "commit could point at what is not there. Make everything it makes visible durable before it"
        )
    if not commit["durable"]:
        raise AssertionError(
            f"{where}, and the folder holding the name it made was not fsync'ed after it: a commit that "
            "returned must stay committed after a power loss (the job goes on, and may delete older "
            "checkpoints, on the strength of it)"
        )


def check_commit_checkpoint(commit_checkpoint: Callable, latest_checkpoint: Callable) -> None:
    """`commit_checkpoint(folder, step, files)`, `latest_checkpoint(folder)`: a crash at any operation of a
    commit leaves the previous checkpoint or the new one, whole; what the commit point shows is durable."""
    require_callable(commit_checkpoint, "commit_checkpoint")
    require_callable(latest_checkpoint, "latest_checkpoint")
    off = {**CHECKPOINT_FORBIDDEN, **family(_SELF, keep=("_FsOps",))}
    commit = guarded(commit_checkpoint, off, "this exercise (commit_checkpoint)")
    latest = guarded(latest_checkpoint, off, "this exercise (latest_checkpoint)")
    rnd = random.Random(draw_seed())
    power = 10 ** rnd.randint(1, 8)
    first, second = power - rnd.randint(1, 3), power + rnd.randint(0, 3)  # across a power of ten
    a, b, c = (_draw_files(rnd, rnd.randint(1, 3)) for _ in range(3))
    c = {**c, next(iter(b)): rnd.randbytes(rnd.randint(1, 99))}  # a name the crashed commit also wrote
    with tempfile.TemporaryDirectory(dir=_fast_tmp()) as tmp:
        top = Path(tmp)
        (top / "empty").mkdir()
        _expect(_read(latest, str(top / "empty"), "on an empty folder"), None, "on an empty folder")
        ops, point = _crash_everywhere(commit, latest, top, None, None, first, a, c, "first")
        _durable(ops, point, f"commit_checkpoint(folder, step={first}, files={_describe(a)})")
        base = top / "base"
        base.mkdir()
        commit(str(base), first, a)
        ops, point = _crash_everywhere(commit, latest, top, base, (first, a), second, b, c, "second")
        _durable(ops, point, f"commit_checkpoint(folder, step={second}, files={_describe(b)})")
    passed(
        "check_commit_checkpoint",
        "a crash at every operation of a commit left the old checkpoint or the new one, whole",
    )


# ----------------------------------------------------------------------------- exercise 2: sampler
def _order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def _cut(rest: list[int], world: int, r: int) -> list[int]:
    """Shard r of a deal of `rest` among `world` ranks: contiguous, in rank order, the first len % world one longer."""
    q, m = divmod(len(rest), world)
    lo = r * q + min(r, m)
    return rest[lo : lo + q + (r < m)]


class _Job:
    """Where a job stands, by the exercise's rule: the epoch, the places of order(epoch) that its last deal
    cut (in that order), the world size it cut them for, and how many of its shard each rank has read since."""

    def __init__(self, n: int, seed: int, world: int) -> None:
        self.n, self.seed, self.world = n, seed, world
        self.epoch, self.rest, self.read = 0, list(range(n)), 0
        self.perms: dict[int, list[int]] = {}

    def perm(self, epoch: int) -> list[int]:
        if epoch not in self.perms:
            self.perms[epoch] = _order(self.n, self.seed, epoch)
        return self.perms[epoch]

    def longest(self) -> int:
        return -(-len(self.rest) // self.world)

    def step(self, k: int) -> list[list[tuple[int, int]]]:
        if self.read >= self.longest():  # the last step emptied the longest shard: a new epoch, a new deal
            self.epoch, self.rest, self.read = self.epoch + 1, list(range(self.n)), 0
        perm = self.perm(self.epoch)
        out = [[(self.epoch, perm[p]) for p in _cut(self.rest, self.world, r)[self.read : self.read + k]]
               for r in range(self.world)]  # fmt: skip
        self.read += k
        return out

    def left(self) -> list[int]:
        return [p for r in range(self.world) for p in _cut(self.rest, self.world, r)[self.read :]]

    def resume(self, world: int) -> _Job:
        job = _Job(self.n, self.seed, world)
        job.epoch, job.rest, job.perms = self.epoch, self.left(), self.perms
        return job


def _pairs(got, where: str) -> list[tuple[int, int]]:
    try:
        return [(int(e), int(i)) for e, i in got]
    except (TypeError, ValueError):
        raise AssertionError(f"{where}: return a list of (epoch, index) pairs") from None


def _sampler_plans(rnd: random.Random) -> list[tuple[int, int, list[tuple[int, list[int]]]]]:
    """(n, seed, [(world_size, [k of each step]), ...]): a job's segments, each resumed from the one before."""

    def steps(n: int, w: int, count: int) -> list[int]:
        return [rnd.randint(1, max(1, -(-n // (2 * w)))) for _ in range(count)]

    def n_for(lo: int, hi: int, *worlds: int) -> int:
        while True:  # no world size divides n: the shards differ in length
            n = rnd.randint(lo, hi)
            if all(n % w for w in worlds if w > 1):
                return n

    w = rnd.randint(2, 4)
    n = n_for(5, 40, w)
    plans = [
        (n, rnd.getrandbits(20), [(w, steps(n, w, rnd.randint(3, 6)))]),  # a fresh job, across an epoch's end
        (n_for(9, 60, w), rnd.getrandbits(20), [(w, [1, 2]), (w, [2, 1, 3])]),  # resumed on as many ranks
        (4, 7, [(1, [3, 2]), (2, [1, 4])]),  # one rank, saved as its epoch ended, then two
        (1, 0, [(3, [2]), (2, [1, 3])]),  # one sample: most shards are empty
        (10, rnd.getrandbits(20), [(2, [4]), (4, [1, 1])]),  # fewer samples left than new ranks
    ]
    big, small = rnd.randint(3, 5), rnd.randint(1, 2)
    n = n_for(2 * big + 1, 60, big, small)
    plans.append((n, rnd.getrandbits(20), [(big, steps(n, big, 2)), (small, steps(n, small, 3))]))  # fewer
    a, b, c = rnd.randint(2, 3), rnd.randint(4, 5), rnd.randint(2, 3)
    n = n_for(40, 120, a, b, c)
    k = max(1, n // (6 * b))  # three resumes inside the first epoch
    plans.append((n, rnd.getrandbits(20), [(a, [k, k]), (b, [k]), (c, [k, 1]), (a, steps(n, a, 3))]))
    return plans


def _call(n: int, seed: int, r: int, world: int) -> str:
    return f"Sampler(n={n}, seed={seed}, rank={r}, world_size={world})"


def _steps(
    off: dict, ranks: list, job: _Job, ks: list[int], where: Callable[[int, int, int], str],
    prev: _Job | None = None, old: int | None = None,
) -> None:  # fmt: skip
    """Run steps `ks` on `ranks` against `job`; `prev`, `old`: the job as saved and its world size, at a resume."""
    for i, k in enumerate(ks):
        before = _Job(job.n, job.seed, job.world)
        before.epoch, before.rest, before.read, before.perms = job.epoch, job.rest, job.read, job.perms
        want = job.step(k)
        got = [
            _pairs(guarded(sampler.take, off, "this exercise (take)")(k), where(i, r, k))
            for r, sampler in enumerate(ranks)
        ]
        for r in range(len(ranks)):
            if got[r] != want[r]:
                raise AssertionError(
                    f"{where(i, r, k)} returned {_show(got[r])}, expected {_show(want[r])}; "
                    + _sampler_mistake(before, k, r, got, want, prev if i == 0 else None, old)
                )


def _show(pairs: list) -> str:
    return f"{pairs[:6]}{'...' if len(pairs) > 6 else ''}" if pairs else "[] (nothing)"


def _sampler_mistake(
    job: _Job, k: int, r: int, every: list, wanted: list, prev: _Job | None, old: int | None
) -> str:
    """Why rank r's pairs differ, as far as every rank's pairs of the step tell. `job`: the job before the step;
    `prev`: the job as it was saved, where this is the first step after a resume; `old`: its world size."""
    n, w, e = job.n, job.world, job.epoch
    got, want = every[r], wanted[r]
    if job.read >= job.longest():
        e, rest, read = e + 1, list(range(n)), 0
    else:
        rest, read = job.rest, job.read

    def pairs(places: list[int], epoch: int = e) -> list[tuple[int, int]]:
        return [(epoch, job.perm(epoch)[p]) for p in places]

    def model(rest: list[int], read: int) -> bool:
        """Whether every rank's pairs are this step's, had the epoch been dealt `rest` and `read` of each shard read."""
        m = _Job(n, job.seed, w)
        m.epoch, m.rest, m.read, m.perms = job.epoch, rest, read, job.perms
        return m.step(k) == every

    if prev is not None and e == job.epoch and len(rest) < n:
        told = (
            f"the job was saved by {old} rank{'s' * (old > 1)} in the middle of epoch {e}, with {len(rest)} of its "
            f"{n} samples not yet read, and resumed on {w}: "
        )
        if model(list(range(n)), 0):
            return told + "this rank started the epoch over, so samples already read come again"
        c = n - len(rest)
        if model(list(range(c, n)), 0):
            return told + (
                f"it dealt the rest of order(epoch) from place {c} on, as if the {c} samples read were the first "
                f"{c} of the order; but every rank read from its own shard, so what was read is the start of each "
                "shard. The state must say which samples of the epoch are left"
            )
        if prev.rest != list(range(n)):
            once = _Job(n, job.seed, prev.world)
            once.epoch, once.read, once.perms = prev.epoch, prev.read, prev.perms
            if model(once.left(), 0):
                return told + (
                    "it forgot an earlier resume in this epoch: the last deal was of what was left then, not of all "
                    f"{n} samples, so what the state leaves out must count every deal of the epoch"
                )
        if any(model(base, prev.read) for base in (prev.rest, list(range(n)))):
            return told + (
                f"it cut the epoch for {w} ranks and skipped the {prev.read} of each shard that each old rank had "
                f"read; but those were the shards of {old} ranks: the state must say which samples of the epoch are "
                "left, not how far each shard got"
            )
        return told + (
            f"a resume deals the {len(rest)} samples left, in the order of order(epoch), among the {w} ranks: "
            f"contiguous shards in rank order, the first {len(rest) % w} of them one longer"
        )
    if any(pe == e + 1 for pe, _ in got) and len(want) < k:
        return (
            f"this rank's shard of epoch {e} has {len(want)} sample{'s' * (len(want) != 1)} left, and a step never runs "
            "into the next epoch: take returns fewer pairs (or none), and the next epoch starts with the step after "
            "the one that empties the longest shard, on every rank at once"
        )
    if any(pe == e + 1 for pe, _ in got):
        return (
            f"epoch {e} is not over: the longest shard still has samples, and the next epoch starts only after it is "
            "empty, on every rank at once"
        )
    if w > 1 and every == [pairs(rest[rr::w][read : read + k]) for rr in range(w)]:
        return (
            f"that is one sample in every {w}, from place {r} on (DistributedSampler's own cut); here each rank's shard is a "
            "contiguous run of the samples dealt, in rank order"
        )
    lengths = [len(_cut(rest, w, rr)) for rr in range(w)]
    return (
        f"epoch {e}'s deal cut {len(rest)} samples into {w} contiguous shards of {lengths} (in rank order, the first "
        f"{len(rest) % w} one longer); this step reads places {read} to {read + k - 1} of each shard, and "
        f"{'' if read else 'none of '}the earlier steps since the deal read the places before"
    )


def _resumed(
    make: Callable, off: dict, n: int, seed: int, world: int, states: list[dict], src: list[int]
) -> list:
    """New ranks 0..world-1, new rank r loading the state old rank src[r] saved."""
    out = []
    for r in range(world):
        sampler = make(n, seed, r, world)
        guarded(sampler.load_state_dict, off, "this exercise (load_state_dict)")(states[src[r]])
        out.append(sampler)
    return out


def _run_job(make: Callable, off: dict, rnd: random.Random, n: int, seed: int, segments: list) -> None:
    """One job: its first segment fresh, each later one resumed from the states the one before saved."""
    history: list[str] = []

    def where(world: int, first: int = 0) -> Callable[[int, int, int], str]:
        return lambda i, r, k: (f"n={n}, seed={seed}: {'; '.join(history)}; at step {first + i + 1} after that, "
                                f"{_call(n, seed, r, world)}.take({k})")  # fmt: skip

    world, ks = segments[0]
    job, ranks = _Job(n, seed, world), [make(n, seed, r, world) for r in range(world)]
    history.append(f"a job on {world} rank{'s' * (world > 1)}")
    _steps(off, ranks, job, ks, where(world))
    history[-1] += f", {len(ks)} step{'s' * (len(ks) > 1)} of k = {', '.join(map(str, ks))}"
    for world, ks in segments[1:]:
        states = []
        for r, sampler in enumerate(ranks):
            state = guarded(sampler.state_dict, off, "this exercise (state_dict)")()
            try:
                states.append(json.loads(json.dumps(state)))  # it goes into the checkpoint's files
            except (TypeError, ValueError) as e:
                raise AssertionError(
                    f"{_call(n, seed, r, len(ranks))}.state_dict() must survive json.dumps: {e}"
                ) from None
        old, saved = len(ranks), job
        src = [rnd.randrange(old) for _ in range(world)]
        history.append(f"then saved, and resumed on {world} rank{'s' * (world > 1)}, each loading the state "
                       f"that one of the {old} saved (new rank r loaded old rank {src})")  # fmt: skip
        # a first copy of the resumed job takes one step and is dropped; the job itself then resumes from the
        # same states: a place kept anywhere but in the state shows here
        _steps(off, _resumed(make, off, n, seed, world, states, src), saved.resume(world), ks[:1], where(world),
               saved, old)  # fmt: skip
        job, ranks = saved.resume(world), _resumed(make, off, n, seed, world, states, src)
        try:
            _steps(off, ranks, job, ks[:1], where(world), saved, old)
        except AssertionError as e:
            raise AssertionError(
                f"{e}. A first copy of this job, resumed from the same saved states, took this step right: where "
                "the job stands must travel in the state it saved, not in anything the samplers share (a class or "
                "module variable)"
            ) from None
        _steps(off, ranks, job, ks[1:], where(world, 1))
        history[-1] += f", {len(ks)} step{'s' * (len(ks) > 1)} of k = {', '.join(map(str, ks))}"


def check_elastic_sampler(Sampler: type) -> None:
    """`Sampler(n, seed, rank, world_size)`: `take(k)` -> this rank's next k (epoch, index) pairs of its fixed shard of
    the epoch; a state saved by any rank of N resumes the job on M ranks, the rest of the epoch dealt among them."""
    require_callable(Sampler, "Sampler")
    off = {**SAMPLER_FORBIDDEN, **family(_SELF)}
    make = guarded(Sampler, off, "this exercise (Sampler)")
    rnd = random.Random(draw_seed())
    plans = _sampler_plans(rnd)
    for n, seed, segments in plans:
        _run_job(make, off, rnd, n, seed, segments)
    n, seed, ((world, ks),) = plans[0]
    try:
        _steps(off, [make(n, seed, r, world) for r in range(world)], _Job(n, seed, world), ks[:1],
               lambda i, r, k: f"n={n}, seed={seed}: after that job ran, a new job on {world} ranks that loaded no "
                               f"state: {_call(n, seed, r, world)}.take({k})")  # fmt: skip
    except AssertionError as e:
        raise AssertionError(
            f"{e}. A new sampler starts its job at epoch 0, whatever ran before in this process: where a job stands "
            "belongs to its samplers and their state, not to anything they share (a class or module variable)"
        ) from None
    passed(
        "check_elastic_sampler",
        "every rank read its shard, and every resume dealt the rest of the epoch, on fewer, as many and more ranks",
    )


# ----------------------------------------------------------------------------- exercise 3: interval
def _exact_interval(c: float, m: float) -> float:
    """The interval T that minimises the expected wall time per second of work of `simulate_goodput`'s process.

    A try at T seconds of work plus its checkpoint C succeeds with probability e^(-(T+C)/M); a failed
    try costs the time up to the failure and a restart R, then the try starts over. The expected time
    to get the interval done is (M + R)(e^((T+C)/M) - 1), so the wall time per second of work is
    (M + R)(e^((T+C)/M) - 1) / T: R scales it and does not move its minimum, the root of
    e^((T+C)/M)(T/M - 1) + 1 = 0 in (0, M), found by bisection."""
    lo, hi = 0.0, m
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.exp((mid + c) / m) * (mid / m - 1) + 1 < 0 else (lo, mid)
    return (lo + hi) / 2


def _young(c: float, m: float) -> float:
    return math.sqrt(2 * c * m)


def _daly(c: float, m: float) -> float:
    """Daly 2006's higher-order estimate (FGCS 22(3)): sqrt(2 C M)(1 + sqrt(C/2M)/3 + C/18M) - C, M past 2M."""
    if c >= 2 * m:
        return m
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


def _interval(fn: Callable, c: float, r: float, m: float, where: str) -> float:
    try:
        t = float(fn(c, r, m))
    except (TypeError, ValueError) as e:
        raise AssertionError(f"{where}: return a number of seconds ({e})") from None
    assert math.isfinite(t) and t > 0, (
        f"{where}: the interval must be a positive number of seconds, got {t:g}"
    )
    return t


def check_best_interval(best_interval: Callable) -> None:
    """`best_interval(checkpoint_cost, restart_cost, mtbf)` -> seconds of work between checkpoints, within 1%
    of the exact optimum of the lesson's failure process."""
    require_callable(best_interval, "best_interval")
    fn = guarded(best_interval, {**INTERVAL_FORBIDDEN, **family(_SELF)}, "this exercise (best_interval)")
    rnd = random.Random(draw_seed())
    regimes = [(90.0, 0.0, 1800.0), (600.0, 1800.0, 1200.0), (1200.0, 300.0, 1000.0), (2400.0, 0.0, 1200.0)]
    for lo, hi in [(1 / 20, 1 / 2)] * 4 + [(0.8, 2.0)] * 2:  # C/M drawn this run, log-uniform
        m = float(f"{10 ** rnd.uniform(2.5, 5):.3g}")  # 5 minutes to a day
        c = float(f"{m * math.exp(rnd.uniform(math.log(lo), math.log(hi))):.3g}")
        regimes.append((c, float(f"{c * rnd.uniform(0, 5):.3g}"), m))
    for c, r, m in regimes:
        where = f"best_interval(checkpoint_cost={c:g}, restart_cost={r:g}, mtbf={m:g})"
        t = _interval(fn, c, r, m, where)
        best = _exact_interval(c, m)
        off = t / best - 1
        if abs(off) <= 0.01:
            continue
        why = []
        if abs(t / _young(c, m) - 1) < 0.002:
            why.append(
                "that is the first-order sqrt(2 C M), which counts at most one failure per interval and none "
                "during a checkpoint: true only while C is a small fraction of M"
            )
        elif abs(t / _daly(c, m) - 1) < 0.002:
            why.append(
                "that is Daly's higher-order estimate (2006), a series in C/M that drifts once C approaches M"
            )
        other = _interval(fn, c, 0.0 if r else 2 * c, m, where)
        if abs(other / t - 1) > 1e-3:
            why.append(
                f"your interval moves with the restart cost ({other:.4g} s at restart_cost={0.0 if r else 2 * c:g}): "
                "under memoryless failures every failed try costs one restart more, whatever the interval, so "
                "R multiplies the expected time of every interval by the same factor and cannot move its minimum"
            )
        side = "it pays for more checkpoints" if off < 0 else "each failure loses more work"
        why = "; ".join(why) or "count every failed try of an interval and its checkpoint exactly"
        raise AssertionError(
            f"{where} returned {t:.5g} s, {abs(off):.1%} {'shorter' if off < 0 else 'longer'} than the interval "
            f"that wastes least ({side}); it must come within 1%. {why[0].upper()}{why[1:]}"
        )
    passed(
        "check_best_interval", f"within 1% of the optimum in {len(regimes)} regimes, 6 of them drawn this run"
    )

"""launch(): run one function on N real processes from a notebook cell or a script.

Ranks meet through a FileStore in a fresh temporary folder (no port to pick, so two
notebooks launching at once never collide, and no store thread running in the
parent when it forks: a TCPStore served from the parent hung ~3% of forked
start-ups on a lock copied mid-use). The parent forks the ranks where that is safe (fast, and
forked children see functions defined in `__main__`, i.e. in notebook cells; elsewhere they come
from a forkserver, see `choose_start_method`), streams
their events back over one queue for live plots, and turns every way a run can go
wrong into one clear exception in the parent.

Invariant: when `launch` returns or raises, no rank process is left alive.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from parallel_lab.runtime import device as mesh
from parallel_lab.runtime.context import Context, LaunchTimeout, RankError, _make_context, _run_fn, _to_cpu
from parallel_lab.runtime.processes import _drain, _reap, _root_cause
from parallel_lab.runtime.result import RunResult

#: A launch asks for at most this many ranks: beyond it a laptop thrashes, and
#: every lesson is written for 1..8.
MAX_WORLD_SIZE = 64
START_METHODS = ("auto", "fork", "forkserver", "spawn")
# What the forkserver imports once, so every rank forked from it starts with torch, the lab and the
# compiler stack (which a first optimizer step imports: 3 s) loaded; the first sets the server to die
# with the kernel that started it.
FORKSERVER_PRELOAD = ["parallel_lab.runtime.forkserver_init", "parallel_lab.runtime.launch", "torch._dynamo"]


# ---------------------------------------------------------------------------- validation
MAX_TIMEOUT = 1e6  # seconds (11.6 days): above it the ranks' timers overflow (and inf never ends)


IN_RANK_ENV = "PARALLEL_LAB_LAUNCHED_RANK"  # set in every launched rank: a launch inside one is refused


def _check_args(fn, world_size, timeout, backend, start_method, threads) -> None:
    if os.environ.get(IN_RANK_ENV) is not None:
        raise RuntimeError(
            f"launch was called inside a launched function (on rank {os.environ[IN_RANK_ENV]}): a rank "
            "cannot start ranks of its own. Launch from the notebook or script, and pass what the inner "
            "run needed as arguments of the outer one."
        )
    if not callable(fn):
        raise TypeError(f"fn must be callable (a function taking ctx first), got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(
            f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT:g}, got {timeout!r}"
        )
    if backend not in mesh.BACKENDS:
        raise ValueError(f"backend must be one of {mesh.BACKENDS}, got {backend!r}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    import multiprocessing as mp

    if start_method != "auto" and start_method not in mp.get_all_start_methods():
        raise ValueError(
            f"start_method={start_method!r} is not available on this platform ({sys.platform}): use 'auto' or one "
            f"of {tuple(mp.get_all_start_methods())}"
        )
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be None or an int >= 1, got {threads!r}")


def _check_keyword_clash(fn, n_args: int, given: dict[str, Any]) -> None:
    """A keyword of launch's own (`seed=`, `timeout=`, ...) never reaches `fn`. When `fn` has a
    parameter of that name that the call seems to mean (it has no default, or launch's keyword was
    given a non-default value), say so instead of running with a value the learner did not mean."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]  # after ctx
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return
    named = {
        p.name: p
        for i, p in enumerate(params)
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and not (p.kind == p.POSITIONAL_OR_KEYWORD and i < n_args)
    }
    defaults = {k: v.default for k, v in inspect.signature(launch).parameters.items()}
    for name, value in given.items():
        p = named.get(name)
        if p is None:
            continue
        if p.default is inspect.Parameter.empty or value != defaults[name]:
            raise TypeError(
                f"{name}={value!r} is taken by launch itself, but fn {getattr(fn, '__name__', fn)!r} also has "
                f"a parameter named {name!r}, which would never receive it. Rename fn's parameter, or pass "
                "it positionally after world_size."
            )


def choose_start_method(start_method: str, backend: str, threads: int | None) -> str:
    """fork where it is safe and fast (gloo on Linux, one thread per rank); else a forkserver.

    - NCCL: never fork. A CUDA context does not survive fork, and this process may already
      have initialised the CUDA driver without `torch.cuda.is_initialized()` saying so (a
      notebook that called `torch.cuda.is_available()`): every forked rank would then fail at
      its first CUDA call.
    - a CUDA context already here: never fork.
    - a GPU visible, even for gloo ranks on the CPU: never fork. The first backward in this
      process starts autograd's per-GPU worker threads (torch/csrc/autograd/engine.cpp), and a
      child forked after that raises "Unable to handle autograd's threading in combination
      with fork-based multiprocessing" at its own first backward: a notebook on a one-GPU
      machine runs more ranks than GPUs on gloo, and would fail there after any backward.
    - threads > 1: never fork. GNU OpenMP's thread pool does not survive fork, so a forked
      rank's first multi-threaded op would hang once this process has done threaded math.

    In those cases, on Linux, ranks come from a forkserver: a clean process started once per
    notebook, which imports torch and the lab and then only forks. It never touches CUDA, runs
    no backward and no threaded math, so its children are as safe as spawned ones (torch's
    multiprocessing notes allow CUDA with "spawn" or "forkserver"), but each starts in
    milliseconds instead of importing torch again (seconds; tens of seconds on a GPU machine).
    Elsewhere (macOS, Windows): spawn. Functions travel by value (cloudpickle) unless forked.
    """
    can_fork = (
        sys.platform.startswith("linux")
        and not mesh.cuda_initialized()
        and mesh.gpu_count() == 0
        and backend != "nccl"
    )
    if start_method == "auto":
        if can_fork and (threads is None or threads == 1):
            return "fork"
        return "forkserver" if sys.platform.startswith("linux") else "spawn"
    if start_method == "fork" and threads is not None and threads > 1:
        raise ValueError(
            f"threads={threads} needs start_method='forkserver', 'spawn' or 'auto': OpenMP thread pools "
            "do not survive fork"
        )
    if start_method == "fork" and backend == "nccl":
        raise ValueError(
            "start_method='fork' cannot run NCCL ranks (CUDA does not survive fork): use 'auto', 'forkserver' "
            "or 'spawn'"
        )
    return start_method


# ---------------------------------------------------------------------------- the rank side
class _Batched:
    """The rank's trace sink: events, memory samples and collective entries leave in batches.

    One queue message per event would wake the queue's feeder thread and the parent each time;
    on a 2-core machine that took ~0.5 ms from every traced collective (measured on a 2-rank
    ring all-reduce). A daemon thread sends what has gathered every `every` seconds, so a rank
    blocked inside a collective still reports that it entered it; `close()` sends the rest
    before the rank's result or error, which keeps the parent's order."""

    def __init__(self, q, every: float = 0.02):
        self.q, self.every = q, every
        self._buf: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trace-sink", daemon=True)
        self._thread.start()

    def __call__(self, what: str, payload: dict) -> None:
        with self._lock:
            self._buf.append((what, payload))

    def flush(self) -> None:
        with self._lock:
            buf, self._buf = self._buf, []
        if buf:
            self.q.put(("batch", buf))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()


class _QueueWriter:
    """stdout/stderr of a rank, forwarded to the parent so prints land in the notebook cell.

    Line-buffered: `print(a, b)` is several writes, and sent one by one they would interleave
    with another rank's line in the parent. Whole lines are sent as one message each."""

    def __init__(self, q, stream: str, rank: int):
        self.q, self.stream, self.rank = q, stream, rank
        self._pending = ""

    def write(self, s: str) -> int:
        self._pending += s
        if "\n" in self._pending:
            lines, _, self._pending = self._pending.rpartition("\n")
            self.q.put(("text", {"rank": self.rank, "stream": self.stream, "text": lines + "\n"}))
        return len(s)

    def flush(self) -> None:
        if self._pending:
            self.q.put(("text", {"rank": self.rank, "stream": self.stream, "text": self._pending}))
            self._pending = ""

    def isatty(self) -> bool:
        return False


def _user_traceback(e: BaseException) -> str:
    """The rank's traceback without the launcher's own frames: the learner's code is the story."""
    te = traceback.TracebackException.from_exception(e)
    here = os.path.abspath(__file__)
    frames = [f for f in te.stack if os.path.abspath(f.filename) != here]
    te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def _die_with_parent() -> None:
    """Linux: ask the kernel to kill this rank if the parent (the notebook kernel) dies."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass


def _die_with(pid: int) -> None:
    """Kill this rank when process `pid` (the notebook kernel) exits.

    A forkserver rank's parent is the server, and PR_SET_PDEATHSIG watches the parent only. The
    server does not die with the kernel while a rank lives: every child it forks holds the pipe
    whose closing tells the server its client is gone (CPython's multiprocessing/forkserver.py).
    So the rank watches the kernel itself: a pidfd becomes readable when that process exits.
    """
    import signal

    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel) or the kernel is already gone
        if not _alive(pid):
            os.kill(os.getpid(), signal.SIGKILL)
        fd = None

    def watch() -> None:
        import select

        if fd is not None:
            select.select([fd], [], [])  # returns when the process exits
        else:
            while _alive(pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parallel_lab-watch-kernel", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclasses.dataclass(frozen=True)
class _Forkserved:
    """A forkserver rank's payload: the notebook's environment now, and the pickled (fn, args, kwargs).

    multiprocessing already sends sys.path and the working directory with every process it starts;
    the environment it does not: a forked rank would see the server's, as it was at the first launch."""

    environ: dict[str, str]
    payload: bytes
    kernel: int  # the launching process's pid: the rank dies with it


def _adopt_environment(environ: dict[str, str]) -> None:
    """Variables read later than torch's import (CUDA_VISIBLE_DEVICES before CUDA starts, NCCL_*, the
    lab's own) take the notebook's values; TORCH_DISTRIBUTED_DEBUG, read when torch.distributed was
    imported in the server, is read again. (OMP_NUM_THREADS and the like keep the server's.)"""
    os.environ.clear()
    os.environ.update(environ)
    dist.set_debug_level_from_env()


def _worker(
    rank, world_size, store_path, backend, t0, seed, threads, timeout, check_shapes, track_memory, q, payload
):
    _die_with_parent()
    if isinstance(payload, _Forkserved):  # the notebook's environment first, then the function
        _die_with(payload.kernel)
        _adopt_environment(payload.environ)
        payload = payload.payload
    os.environ[IN_RANK_ENV] = str(rank)
    sys.stdout = _QueueWriter(q, "stdout", rank)
    sys.stderr = _QueueWriter(q, "stderr", rank)
    sink = None
    try:
        # Under NCCL this rank's GPU is made current before anything touches CUDA: a CUDA tensor in the
        # arguments is rebuilt when the payload is unpickled, and would otherwise open a context on GPU 0.
        device = mesh.device_for(backend, rank)
        if isinstance(payload, bytes):  # spawn or forkserver: the function came by value
            import cloudpickle

            payload = cloudpickle.loads(payload)
        fn, args, kwargs = payload
        torch.set_num_threads(threads)
        _loopback_only()
        store = dist.FileStore(store_path, world_size)
        # The process group waits a little longer than the parent, so the parent's
        # diagnosis (which rank is stuck where) wins over gloo's generic timeout.
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout + 10),
            **mesh.group_kwargs(device),
        )
        q.put(("ready", {"rank": rank}))
        sink = _Batched(q)
        ctx = _make_context(
            rank, world_size, rank, backend, t0, seed, sink, check_shapes, track_memory, device=device,
        )  # fmt: skip
        value = _run_fn(ctx, fn, args, kwargs)
        # Pickled here, by value: through the queue torch would share tensors by file
        # descriptor, which dies with this process if it exits before the parent reads.
        try:
            blob = pickle.dumps(_to_cpu(value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(
                f"the value fn returned ({type(value).__name__}) cannot be sent back to the parent: "
                f"pickling it failed with {type(e).__name__}: {e}. Return tensors, numbers, strings, or "
                "lists and dicts of them."
            ) from None
        sink.close()  # every event before the result
        sink = None
        q.put(("result", {"rank": rank, "value": blob, "comm": ctx.recorder.comm_totals()}))
        try:
            dist.barrier()  # nobody tears down sockets a peer still reads from
            dist.destroy_process_group()
        except Exception:
            pass
        code = 0
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        tb = _user_traceback(e)
        if isinstance(e, SystemExit):  # sys.exit(): say so, the bare code means nothing on its own
            e = SystemExit(f"the function called sys.exit({e.code!r})")
        try:
            if sink is not None:
                sink.close()  # what the rank did before it failed, then the failure
            q.put(("error", {"rank": rank, "type": type(e).__name__, "message": str(e), "traceback": tb}))
        except Exception:
            pass
        code = 1
    for w in (sys.stdout, sys.stderr):
        try:
            w.flush()
        except Exception:
            pass
    q.close()
    q.join_thread()
    os._exit(code)  # skip the parent's atexit handlers (a forked notebook kernel has many)


# ---------------------------------------------------------------------------- the parent side
def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float = 120.0,
    live: Any = False,
    track_memory: bool = False,
    seed: int = 0,
    threads: int | None = None,
    start_method: str = "auto",
    check_shapes: bool = True,
    **kwargs: Any,
) -> RunResult:
    """Run `fn(ctx, *args, **kwargs)` on `world_size` ranks and return a `RunResult`.

    backend "auto" picks NCCL with one GPU per rank where enough GPUs exist, else
    gloo on CPU. `live=True` draws the timeline (and memory, with
    `track_memory=True`) while the run goes, in a notebook; `live=out` (an ipywidgets
    `Output`) draws it inside that widget. `threads`: torch threads
    per rank; forked ranks use 1 (OpenMP pools do not survive fork), so asking for more
    starts ranks from the forkserver instead (spawn off Linux). Ranks that do not fork from
    the notebook do not see torch settings it changed (default dtype, deterministic flags):
    set those inside `fn`.
    """
    import multiprocessing as mp

    _check_args(fn, world_size, timeout, backend, start_method, threads)
    _check_keyword_clash(
        fn, len(args),
        {"backend": backend, "timeout": timeout, "live": live, "track_memory": track_memory, "seed": seed,
         "threads": threads, "start_method": start_method, "check_shapes": check_shapes},
    )  # fmt: skip
    if not isinstance(live, bool) and not hasattr(live, "outputs"):
        raise TypeError(f"live must be True, False or an ipywidgets Output, got {type(live).__name__}")
    backend = mesh.resolve_backend(backend, world_size)
    start_method = choose_start_method(start_method, backend, threads)
    if threads is None:
        threads = 1 if start_method == "fork" else max(1, mesh.cpu_cores() // world_size)
    mpctx = mp.get_context(start_method)
    if start_method == "fork":
        _warm_imports()
    payload: Any = (fn, args, kwargs)
    if start_method != "fork":
        import cloudpickle

        payload = cloudpickle.dumps(payload)
    if start_method == "forkserver":
        # Read only when the server starts (the first forkserver launch of this process).
        mpctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        # The server was started by an earlier launch: what changed here since must reach the rank.
        payload = _Forkserved(dict(os.environ), payload, os.getpid())

    _remove_stale_run_dirs()
    tmpdir = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
    store_path = os.path.join(tmpdir, "store")
    q = mpctx.Queue()
    t0 = time.perf_counter()
    procs = [
        mpctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                store_path,
                backend,
                t0,
                seed,
                threads,
                timeout,
                check_shapes,
                track_memory,
                q,
                payload,
            ),
            daemon=True,
            name=f"parallel_lab-rank{r}",
        )
        for r in range(world_size)
    ]
    view = progress = None
    if live is not False and live is not None:
        from parallel_lab.plots import LiveRunView

        # live=True: under the cell; live=<ipywidgets Output>: inside that widget (interactive cells)
        target = None if live is True else live
        view = LiveRunView(world_size, timeline=True, memory=track_memory, target=target)
    elif "ipykernel" in sys.modules:  # a notebook: one status line while the ranks run
        from parallel_lab.plots import RunProgress

        progress = RunProgress(getattr(fn, "__name__", "fn"), world_size)
    timeline: list[dict] = []
    memory: list[dict] = []
    values: dict[int, Any] = {}
    comm: dict[int, dict] = {}
    last_op: dict[int, str | None] = dict.fromkeys(range(world_size))
    inside: dict[int, list[str]] = {r: [] for r in range(world_size)}  # collectives a rank is in now
    ready: set[int] = set()  # ranks whose process group is up
    try:
        for p in procs:
            p.start()
        deadline = t0 + timeout
        # A rank puts its last message and flushes the queue before it exits, so once a rank is
        # seen dead, the next empty drain proves it said nothing more: no grace period to guess.
        seen_dead: set[int] = set()
        while len(values) < world_size:
            batch = _drain(q)
            for i, (what, msg) in enumerate(batch):
                if what == "event":
                    timeline.append(msg)
                elif what == "memory":
                    memory.append(msg)
                elif what == "reset":  # a rank forgot its warm-up: forget what it streamed
                    timeline[:] = [e for e in timeline if e["rank"] != msg["rank"]]
                    memory[:] = [m for m in memory if m["rank"] != msg["rank"]]
                elif what == "ready":
                    ready.add(msg["rank"])
                elif what == "enter":
                    last_op[msg["rank"]] = msg["op"]
                    inside[msg["rank"]].append(msg["op"])
                elif what == "leave" and msg["op"] in inside[msg["rank"]]:
                    inside[msg["rank"]].remove(msg["op"])
                elif what == "text":
                    (sys.stdout if msg["stream"] == "stdout" else sys.stderr).write(msg["text"])
                elif what == "result":
                    values[msg["rank"]] = pickle.loads(msg["value"])
                    comm[msg["rank"]] = msg["comm"]
                elif what == "error":
                    raise _root_cause(msg, q, procs, set(values), later=batch[i + 1 :])
            now = time.perf_counter()
            if not batch:
                for r in seen_dead - set(values):  # dead at the previous drain, silent since
                    raise RankError(r, "ProcessDied", f"exited with code {procs[r].exitcode} without returning",
                                    "(no Python traceback: the process was killed or crashed)")  # fmt: skip
                seen_dead = {r for r, p in enumerate(procs) if r not in values and not p.is_alive()}
            if now > deadline:
                stuck = {r: last_op[r] for r in range(world_size) if r not in values}
                raise LaunchTimeout(
                    timeout, stuck, starting=set(stuck) - ready, inside=inside, backend=backend
                )
            if view is not None:
                view.update(timeline, memory)  # rate-limited inside: cheap when it does not draw
            if progress is not None:
                progress.update(len(values), len(timeline))
    except (RankError, LaunchTimeout) as e:
        # what was recorded up to the failure: a restart can draw the lost work on one timeline
        e.timeline = sorted(timeline, key=lambda ev: (ev["start"], ev["rank"]))
        e.memory = sorted(memory, key=lambda m: (m["t"], m["rank"]))
        raise
    finally:
        _reap(procs, graceful=len(values) == world_size)
        if view is not None:
            view.finish(timeline, memory)
        if progress is not None:
            progress.finish()
        q.close()
        q.cancel_join_thread()
        shutil.rmtree(tmpdir, ignore_errors=True)
    timeline.sort(key=lambda e: (e["start"], e["rank"]))
    memory.sort(key=lambda s: (s["t"], s["rank"]))
    return RunResult(
        values=[values[r] for r in range(world_size)],
        timeline=timeline,
        memory=memory,
        comm_bytes=[comm[r] for r in range(world_size)],
        wall_time=time.perf_counter() - t0,
        world_size=world_size,
        backend=backend,
    )


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS), or None."""
    import socket

    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _loopback_only() -> None:
    """Every rank of a local launch is on this machine: gloo and NCCL listen on the loopback interface
    only, never on the address the hostname resolves to (often a LAN address anyone nearby can reach).
    A variable the user set wins."""
    lo = loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


RUN_DIR_PREFIX = "parallel_lab-"  # + parent pid + "-": the run's rendezvous folder in the temp dir


def _remove_stale_run_dirs() -> list[str]:
    """Delete run folders whose launching process is dead (a parent killed with SIGKILL cannot clean
    up after itself); a live process's folders are left alone. Returns what was removed."""
    removed = []
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(RUN_DIR_PREFIX):
            continue
        pid = name[len(RUN_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or someone else's: PermissionError below)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _warm_imports() -> None:
    """Import once in the parent what every rank would otherwise import on its own.

    The first optimizer built in a process imports torch._dynamo (optimizer methods
    are wrapped by torch._disable_dynamo): ~1-3 s, paid by every forked rank at once
    on a laptop's few cores. Imported here, forked ranks inherit it for free."""
    import torch._dynamo  # noqa: F401


__all__ = ["Context", "LaunchTimeout", "RankError", "RunResult", "launch"]

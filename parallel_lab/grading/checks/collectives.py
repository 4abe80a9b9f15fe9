"""Checks for lesson 01's exercises: collectives built from point-to-point messages, on cases the lesson
does not show.

1. `torus_all_reduce(ctx, tensor, rows)`: the p ranks form a rows x cols grid (rank r at row r // cols,
   column r % cols); every rank returns the sum over all ranks. Run on grids 1x1, 2x2, 2x3, 3x2, 1x4 and
   4x1 (a ring of 4 has a member that is no neighbour: sending straight to every member of a row or column
   fails there), on 1 and 1001 elements (float32; 0 and 7 too on 1x1 and 2x2) and one size drawn per run
   (uneven splits at both levels, bfloat16), small integers drawn per run: the sums compare exactly with
   the sum of every rank's input. The trace judges the algorithm: every message goes to a torus
   neighbour, a rank sends at most 2(cols-1) + 2(rows-1) messages, all ranks together send exactly the
   bytes of a ring all-reduce (which the flat ring sends too: its peers and its message count tell it
   apart), and no rank sends more than the busiest rank of a two-level ring (each row and column spreads
   its work evenly: a chain or tree through a column sends the right total but piles it on some ranks).
2. `ring_all_gather_v(ctx, tensor, sizes)`: rank r holds sizes[r] elements; returns the concatenation in
   rank order. On 1 to 4 ranks with fixed and drawn sizes (0 included): exact result, sends only to the
   right and receives only from the left, and each rank sends exactly the bytes of the pieces a ring
   forwards.
3. `all_to_all_v(ctx, tensors)`: `tensors[j]` goes to rank j, lengths chosen by the sender (0 included);
   returns what each rank sent. Exact result; to each peer the piece's bytes plus at most one small
   length message (8 bytes or less); a rank's own piece never travels.
4. `torus_bytes(n, rows, cols, rank, itemsize)`: predicted, then compared exactly with the bytes the check's
   own torus all-reduce (`_torus_all_reduce`, which passes check 1) sends on grids 1x3, 2x1, 2x2, 2x3 and
   3x2, measured by the byte counter (one launch of 6 ranks: the ranks outside a grid sit it out).

Every message of the learner's function goes through a tap on `post_p2p` (the one place comms posts
messages): it records (peer, bytes) and matches the two ends of each message through the launch's store,
so a receive buffer of the wrong size fails naming both sizes before any data moves (gloo would abort
the process), and a message whose other end is never posted (a deadlock) fails after `WAIT_S` seconds
naming the message, instead of hanging until the launch's timeout. The tap also keeps each rank's
batches (one per post_p2p call) in posting order; after each case they are gathered through the store and
run through `comms.check_blocking_sends`, NCCL's rules: an exchange that gloo lets through but that would
hang on NCCL (an isend posted on its own before the irecv its peer waits for) fails naming the stuck batches.

While the learner's function runs, torch's collectives (public, private and the c10d operators), the
lab's own collectives (comms, and those of the MoE, ZeRO, tensor- and sequence-parallel modules and the
scripts: every lab function whose name says it does one of these jobs), the byte formulas and this module's
own helpers are switched off. Numbers and one size per grid are drawn per grade run (`draw_seed`): a
table of one run's answers fails the next.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel_lab.grading.checks import (
    TORCH_COLLECTIVES,
    draw_seed,
    family,
    guarded,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
    unavailable,
)

__all__ = ["check_all_to_all_v", "check_ring_all_gather_v", "check_torus_all_reduce", "check_torus_bytes"]

#: seconds a message's end waits for its other end to be posted before the check calls it a deadlock
WAIT_S = 5.0

# ----------------------------------------------------------------------------- what is switched off
_INSTEAD = "build it from comms.sendrecv / isend / irecv / send / recv"
#: names of the jobs these exercises ask for, as torch and the lab spell them
TORCH_JOB = re.compile(r"all_?reduce|all_?gather|all_?to_?all|reduce_?scatter", re.I)
#: torch's modules holding functions or classes that do these jobs on tensors (found by
#: tests/test_exercises_01.py in torch's source; compiler passes and torch's own tests are left out there)
TORCH_MODULES = (
    "torch.cuda.nccl",
    "torch.distributed.distributed_c10d",
    "torch.distributed._functional_collectives",
    "torch.distributed._functional_collectives_impl",
    "torch.distributed._local_tensor._c10d",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops._common",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops.embedding_bag",
    "torch.distributed._state_dict_utils",
    "torch.distributed._symmetric_memory",
    "torch.distributed.algorithms._comm_hooks.default_hooks",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch.distributed.algorithms.ddp_comm_hooks.mixed_precision_hooks",
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks",
    "torch.distributed.checkpoint.utils",
    "torch.distributed.collective_utils",
    "torch.distributed.flight_recorder.components.utils",
    "torch.distributed.fsdp._flat_param",
    "torch.distributed.fsdp._fsdp_extensions",
    "torch.distributed.fsdp._fully_shard._fsdp_api",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives",
    "torch.distributed.fsdp._fully_shard._fsdp_param",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed.fsdp._optim_utils",
    "torch.distributed.fsdp._runtime_utils",
    "torch.distributed.fsdp._shard_utils",
    "torch.distributed.nn.functional",
    "torch.distributed.rpc.api",
    "torch.distributed.tensor._collective_utils",
    "torch.distributed.tensor._shards_wrapper",
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.experimental._context_parallel._cp_custom_ops",
    "torch.distributed.tensor.parallel.fsdp",
    "torch.distributed.tensor.parallel.loss",
    "torch.nn.parallel.distributed",
)
#: c10d operators that are point-to-point or bookkeeping: comms itself runs on these
_P2P_OPS = {"send", "recv_", "recv_any_source_", "isend", "irecv", "batch_p2p_ops", "wait_tensor", "barrier",
            "monitored_barrier_", "check_for_nan", "_wrap_tensor_autograd"}  # fmt: skip


def _torch_versions() -> dict[str, str]:
    """torch's own collectives: the public functions and process-group methods, every function, method
    and class whose name says it does one of these jobs in `TORCH_MODULES` (private ones included), and
    the c10d operators a learner can call as torch.ops.<namespace>.<op>."""
    import importlib
    import warnings

    out = dict(TORCH_COLLECTIVES)
    with warnings.catch_warnings():  # reading a module's names touches deprecated ones (dist.reduce_op)
        warnings.simplefilter("ignore")
        _scan(out, importlib, TORCH_MODULES)
    for op in torch._C._dispatch_get_all_op_names():
        namespace, _, name = op.partition("::")
        name = name.split(".")[0]
        if "c10d" in namespace and name not in _P2P_OPS:
            out[f"torch.ops.{namespace}.{name}"] = ""
    return out


def _scan(out: dict[str, str], importlib, modules: tuple[str, ...]) -> None:
    for module in modules:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        here = getattr(mod, "__file__", None)
        for name, value in vars(mod).items():
            if isinstance(value, type):
                # a class defined here (public classes may carry their package's __module__): its methods and
                # properties whose names say the job (all of them when the class's name does), and the class
                if not (value.__module__ == module or _defined_in(value, here)):
                    continue
                for attr, member in vars(value).items():
                    fn = getattr(member, "__func__", getattr(member, "fget", member))
                    wanted = TORCH_JOB.search(attr) or (
                        TORCH_JOB.search(name) and attr in ("__init__", "__call__")
                    )
                    if wanted or (TORCH_JOB.search(name) and not attr.startswith("__")):
                        if callable(fn) or isinstance(member, property):
                            out[f"{module}.{name}.{attr}"] = ""
                if TORCH_JOB.search(name):
                    out[f"{module}.{name}"] = ""
            elif callable(value) and TORCH_JOB.search(name):
                # functions defined here, and the wrapped ones (lru_cache, torch.library custom ops)
                if getattr(value, "__module__", None) == module or type(value).__name__ != "function":
                    out[f"{module}.{name}"] = ""


def _defined_in(cls: type, path: str | None) -> bool:
    return any(getattr(getattr(m, "__code__", None), "co_filename", None) == path for m in vars(cls).values())


_SELF = "parallel_lab.grading.checks.collectives"
#: the lab's modules that hold one of these jobs among other code: only the functions, methods and classes
#: whose names say the job are switched off (tests/test_exercises_01.py finds them in the lab's source)
LAB_MODULES = (
    "parallel_lab.data_parallel.naive",
    "parallel_lab.scripts.collectives",
    "parallel_lab.scripts.ddp",
    "parallel_lab.tensor_parallel.sequence_parallel",
)


def _lab_versions() -> dict[str, str]:
    """The lab's own collectives: comms' and the modules built on them for MoE (the all-to-all of uneven
    pieces), ZeRO (rings over uneven pieces) and tensor parallelism, whole; in `LAB_MODULES` by name."""
    import importlib

    out = {
        **family(
            "parallel_lab.comms.ring",
            "parallel_lab.comms.tree",
            "parallel_lab.comms.builtin",
            "parallel_lab.moe.expert_parallel",
            "parallel_lab.zero.comm",
            "parallel_lab.tensor_parallel.operators",
            instead=_INSTEAD,
        ),
        **family("parallel_lab.comms.cost", keep=("chunk_sizes",)),
        "parallel_lab.costmodel.formulas.allreduce_bytes_per_rank": "",
    }
    _scan(out, importlib, LAB_MODULES)
    return out


FORBIDDEN = {**_lab_versions(), **_torch_versions()}


def _own() -> dict[str, str]:
    """This module's own helpers (they compute the answers), but not the tap the learner's messages go
    through: switched off around each call of the learner's function, inside a rank that has FORBIDDEN
    switched off for its whole run (`_in_rank`: switching hundreds of names per call cost more than the
    call, with 6 ranks on 2 cores)."""
    global _OWN
    if _OWN is None:
        _OWN = family(_SELF, keep=("_Tap", "_Met"))
    return _OWN


def _off() -> dict[str, str]:
    return {**FORBIDDEN, **_own()}


_OWN: dict[str, str] | None = None
#: predicting is not measuring: no launching ranks inside torus_bytes
_NO_RUNS = {
    "parallel_lab.runtime.launch.launch": "predict the bytes from the sizes",
    "parallel_lab.grading.checks.launch_learner": "predict the bytes from the sizes",
}


# ----------------------------------------------------------------------------- the tap on every message
class _Tap:
    """Records every message the learner's function posts and matches its two ends through the store.

    Ends pair up as gloo pairs them (NCCL: posting order; tags ignored): the k-th non-empty message from a
    to b with one tag meets the k-th non-empty receive at b from a with that tag; empty tensors are no
    message (post_p2p skips them). Each end writes its size under its own key, then reads the other end's:
    whichever end is posted second sees the first and compares, before its message is posted, so no
    mismatched pair ever moves data. Each post is also kept as one batch, for `check_order`."""

    def __init__(self, ctx, case: int, mismatch_hint: str):
        from torch.distributed import distributed_c10d as c10d

        self.store = c10d._get_default_store()
        self.me, self.case, self.hint = ctx.rank, case, mismatch_hint
        self.sends: list[tuple[int, int]] = []  # (dst, bytes), non-empty messages in posting order
        self.recvs: list[tuple[int, int]] = []  # (src, bytes)
        self.batches: list[list[tuple[str, int]]] = []  # each post's non-empty messages, in posting order
        self.count: Counter = Counter()

    def _key(self, src: int, dst: int, tag: int, side: str) -> tuple[str, str, int]:
        k = self.count[src, dst, tag, side]
        self.count[src, dst, tag, side] += 1
        base = f"lesson01/{self.case}/{src}->{dst}/{tag}/{k}"
        return f"{base}/{side}", f"{base}/{'r' if side == 's' else 's'}", k

    @staticmethod
    def _describe(t: torch.Tensor) -> str:
        return f"{t.numel()} x {str(t.dtype).replace('torch.', '')} ({t.numel() * t.element_size()} bytes)"

    def _compare(self, side: str, peer: int, k: int, mine: str, theirs: str) -> None:
        my_bytes, their_bytes = int(mine.split("|")[0]), int(theirs.split("|")[0])
        if my_bytes == their_bytes:
            return
        send, recv = (mine, theirs) if side == "s" else (theirs, mine)
        src, dst = (self.me, peer) if side == "s" else (peer, self.me)
        raise AssertionError(
            f"message {k + 1} from rank {src} to rank {dst} carries {send.split('|')[1]}, but rank {dst} "
            f"posted a receive buffer of {recv.split('|')[1]} for it: {self.hint}"
        )

    def post(self, real: Callable, group, sends=(), recvs=(), tag: int = 0) -> list:
        def _global(group, r: int) -> int:  # a group rank as a global rank (what comms' core does)
            return r if group is None else dist.get_global_rank(group, r)

        ends = []  # (my key, the other end's key, side, peer, k, my description)
        for side, items in (("r", recvs), ("s", sends)):
            for m in items:
                t, peer, k_tag = m[0], _global(group, m[1]), m[2] if len(m) > 2 else tag
                if t.numel() == 0:
                    continue
                if peer == self.me:
                    raise AssertionError(
                        f"rank {self.me} posted a {'send to' if side == 's' else 'receive from'} itself "
                        f"({self._describe(t)}): a rank's own piece never travels; copy it"
                    )
                src, dst = (self.me, peer) if side == "s" else (peer, self.me)
                mine, other, k = self._key(src, dst, k_tag, side)
                text = f"{t.numel() * t.element_size()}|{self._describe(t)}"
                self.store.set(mine, text)
                (self.sends if side == "s" else self.recvs).append((peer, t.numel() * t.element_size()))
                ends.append((other, side, peer, k, text))
        if ends:
            self.batches.append([("send" if e[1] == "s" else "recv", e[2]) for e in ends])
        for other, side, peer, k, text in ends:  # the other end, if posted already, must agree now
            if self.store.check([other]):
                self._compare(side, peer, k, text, self.store.get(other).decode())
        works = real(group, sends, recvs, tag)
        if len(works) == len(ends):  # one work per message, receives first (gloo): each waits for its own end
            return [_Met(w, self, [e]) for w, e in zip(works, ends)]
        return [_Met(w, self, ends) for w in works]  # one batch (NCCL): every work waits for every end

    def meet(self, ends: list) -> None:
        """Wait (at most WAIT_S) until the other end of each message has been posted, and compare."""
        for other, side, peer, k, text in ends:
            try:
                self.store.wait([other], timedelta(seconds=WAIT_S))
            except Exception:
                if side == "s":
                    raise AssertionError(
                        f"rank {self.me} waited {WAIT_S:g} s for rank {peer} to post a receive for its message "
                        f"{k + 1} to rank {peer} ({text.split('|')[1]}), and none came: a send finishes only "
                        f"once its receive is posted, so ranks that all send before they receive (with "
                        f"blocking send) wait for each other forever; post each send together with the "
                        f"receive it needs (comms.sendrecv), or check that rank {peer} receives it at all"
                    ) from None
                raise AssertionError(
                    f"rank {self.me} waited {WAIT_S:g} s for message {k + 1} from rank {peer} "
                    f"({text.split('|')[1]}), and rank {peer} never sent it: a receive with no matching "
                    f"send (an empty piece is no message) waits forever, or rank {peer} is itself stuck "
                    f"in a send nobody receives"
                ) from None
            self._compare(side, peer, k, text, self.store.get(other).decode())

    def check_order(self, p: int) -> None:
        """Gather every rank's batches through the store and hold them to NCCL's rules
        (`comms.check_blocking_sends`): gloo runs each message on its own, so a posting order that hangs
        NCCL can finish here. The last rank to get here sees every rank's batches; one that waits longer
        than WAIT_S leaves the verdict to it."""
        import json

        from parallel_lab import comms

        base = f"lesson01/{self.case}/batches"
        self.store.set(f"{base}/{self.me}", json.dumps(self.batches))
        keys = [f"{base}/{r}" for r in range(p)]
        try:
            self.store.wait(keys, timedelta(seconds=WAIT_S))
        except Exception:
            return
        batches = [[[tuple(m) for m in b] for b in json.loads(self.store.get(k))] for k in keys]
        try:
            comms.check_blocking_sends(batches)
        except RuntimeError as e:
            stuck = "; ".join(
                f"rank {r} at its batch [{', '.join(map(_message, _ITEM.findall(b)))}]"
                for r, b in _STUCK.findall(str(e))
            )
            raise AssertionError(
                f"on NCCL (the GPU backend) these messages would never finish, though gloo let them through: "
                f"{stuck}. NCCL runs a rank's posts in the order it makes them (each comms call is one batch) "
                "and a batch finishes only once every message in it has its other end posted; post the send "
                "and the receive of one step together (comms.sendrecv, comms.isendrecv or comms.post_batch), "
                "not as a comms.isend and a comms.irecv of their own"
            ) from None


_STUCK = re.compile(r"rank (\d+) in batch \[([^\]]*)\]")  # comms.check_blocking_sends' report
_ITEM = re.compile(r"(send|recv) #(\d+) (\d+)->(\d+)")


def _message(m: tuple[str, str, str, str]) -> str:
    """('send', k, a, b) from comms.check_blocking_sends' report, in words."""
    kind, k, a, b = m
    what = f"send to rank {b}" if kind == "send" else f"receive from rank {a}"
    return f"{what} (message {int(k) + 1} from rank {a} to rank {b})"


class _Met:
    """A posted message's work whose wait first makes sure the other end exists and agrees."""

    def __init__(self, work, tap: _Tap, ends: list):
        self._work, self._tap, self._ends = work, tap, ends

    def wait(self, *args, **kwargs):
        if self._ends:
            self._tap.meet(self._ends)
            self._ends = []
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def _tapped(ctx, case: int, mismatch_hint: str) -> Iterator[_Tap]:
    import parallel_lab.comms as comms_pkg
    from parallel_lab.comms import core, p2p

    tap = _Tap(ctx, case, mismatch_hint)
    real = core.post_p2p

    def post_p2p(group, sends=(), recvs=(), tag: int = 0) -> list:
        return tap.post(real, group, sends, recvs, tag)

    owners = [m for m in (core, p2p, comms_pkg) if getattr(m, "post_p2p", None) is real]
    for m in owners:
        m.post_p2p = post_p2p
    try:
        yield tap
    finally:
        for m in owners:
            m.post_p2p = real


# ----------------------------------------------------------------------------- shared plumbing
def _data(rank: int, numel: int, dtype: torch.dtype, device, salt: int) -> torch.Tensor:
    """Small integers: any summation order gives the same bits, so answers compare exactly. Drawn on
    the CPU from the grade run's seed (in `salt`), the same on every rank for a given rank and case."""
    g = torch.Generator().manual_seed((7919 * rank + 104729 * numel + salt) % 2**62)
    return torch.randint(-8, 9, (numel,), generator=g).to(device=device, dtype=dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _call(fn: Callable, exercise: str, where: str, ctx, case: int, hint: str, *args):
    """Run the learner's function with everything but point-to-point messages switched off."""
    with _tapped(ctx, case, hint) as tap:
        try:
            with unavailable(_own(), f"this exercise ({exercise})"):
                got = fn(ctx, *args)
        except NotImplementedError:
            raise
        except AssertionError as e:  # the tap's verdict, a switched-off function, or the learner's assert
            raise AssertionError(f"{where}: {e or 'an assert in your function failed'}") from e
        except Exception as e:
            raise AssertionError(f"{where}: your function raised {type(e).__name__}: {e}") from e
        try:
            tap.check_order(ctx.world_size)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
    return got, tap


def _first_difference(got, want: torch.Tensor, where: str) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{where}: expected a tensor, got {type(got).__name__}")
    if got.numel() != want.numel():
        raise AssertionError(
            f"{where}: the result has {got.numel()} elements (shape {tuple(got.shape)}), expected {want.numel()}"
        )
    g, w = got.detach().reshape(-1).double().cpu(), want.reshape(-1).double().cpu()
    wrong = (g != w).nonzero()
    if len(wrong):
        i = int(wrong[0])
        raise AssertionError(
            f"{where}: {len(wrong)} wrong element(s); first at index {i}: got {g[i].item():g}, "
            f"expected {w[i].item():g}"
        )


def _in_rank(ctx, run: Callable, exercise: str, *args):
    """`run` on this rank with FORBIDDEN switched off throughout: the check's own code between the
    learner's calls uses no collective (expected sums are computed here, counts go through the store)."""
    with unavailable(FORBIDDEN, f"this exercise ({exercise})"):
        return run(ctx, *args)


def _launch(run: Callable, p: int, exercise: str, *args) -> list:
    try:
        return launch_learner(_in_rank, p, run, exercise, *args, timeout=60.0).values
    except Exception as e:
        if getattr(e, "exc_type", None) in ("AssertionError", "WriteItYourself"):  # our verdict, on a rank
            raise rank_verdict(e) from None
        if type(e).__name__ == "LaunchTimeout":
            raise AssertionError(
                f"on {p} ranks the ranks did not finish in 60 s: a message whose other end is never posted "
                "waits forever"
            ) from None
        if getattr(e, "exc_type", None) == "ProcessDied":
            raise AssertionError(
                f"on {p} ranks a rank's process died without a Python error (gloo aborts a process that "
                "receives a message bigger than its receive buffer)"
            ) from None
        raise


# ----------------------------------------------------------------------------- exercise 1: torus all-reduce
#: (rows, cols): rings of 1 to 4 ranks either way round; in a ring of 4 one member is no neighbour
GRIDS = ((1, 1), (2, 2), (2, 3), (3, 2), (1, 4), (4, 1))


def _torus_sizes(rows: int, cols: int, rnd: random.Random) -> list[tuple[int, torch.dtype]]:
    """1 element (empty chunks at both levels), 1001 (uneven splits), and one size drawn per run, uneven
    at both levels where the grid allows it; on the grids of 1 and 4 ranks also 7 and 0 (nothing to send).
    Each case costs the ranks a few synchronisations: the bigger grids keep to the three that matter."""
    while True:
        n = rnd.randint(11, 999)
        c = -(-n // cols)
        if (cols == 1 or n % cols) and (rows == 1 or c % rows):
            break
    small = [(7, torch.float32), (0, torch.float32)] if (rows, cols) in ((1, 1), (2, 2)) else []
    return [*small, (1, torch.float32), (1001, torch.float32), (n, torch.bfloat16)]


def _neighbours(r: int, rows: int, cols: int) -> set[int]:
    i, j = divmod(r, cols)
    return {i * cols + (j + 1) % cols, i * cols + (j - 1) % cols, ((i + 1) % rows) * cols + j,
            ((i - 1) % rows) * cols + j} - {r}  # fmt: skip


def _at(r: int, cols: int) -> str:
    return f"rank {r} (row {r // cols}, column {r % cols})"


def _torus_bound(n: int, rows: int, cols: int) -> int:
    """Elements a rank sends at most in a two-level ring all-reduce, either level first."""

    def two(a: int, b: int) -> int:  # rings of a ranks outside, rings of b ranks inside
        c = -(-n // a)
        return 2 * (a - 1) * c + 2 * (b - 1) * -(-c // b)

    return max(two(cols, rows), two(rows, cols))


def _run_torus(ctx, fn: Callable, rows: int, seed: int) -> int:
    p, r = ctx.world_size, ctx.rank
    cols = p // rows
    sizes = _torus_sizes(rows, cols, random.Random(seed * 31 + p * 7 + rows))
    for case, (n, dtype) in enumerate(sizes):
        salt = seed + 17 * case
        where = (f"torus_all_reduce(ctx, tensor, rows={rows}) on the {rows}x{cols} grid (p={p}), tensor of {n} "
                 f"{_dtype_name(dtype)} elements, {_at(r, cols)}")  # fmt: skip
        x = _data(r, n, dtype, ctx.device, salt)
        want = sum(_data(q, n, torch.float64, ctx.device, salt) for q in range(p)).to(
            dtype
        )  # small integers: exact
        got, tap = _call(fn, "torus_all_reduce", where, ctx, case, "a receive buffer must hold exactly what "
                         "arrives", x.clone(), rows)  # fmt: skip
        if got is None:
            raise AssertionError(f"{where}: your function returned None; return the summed tensor")
        try:
            _first_difference(got, want, where)
        except AssertionError as e:
            raise AssertionError(
                str(e) + _which_sum(got, r, n, dtype, ctx.device, salt, rows, cols)
            ) from None
        sent = sum(b for _, b in tap.sends)
        if n and p > 1 and not tap.sends:
            raise AssertionError(
                f"{where}: your function sent nothing through parallel_lab.comms; send every message with "
                "comms.sendrecv / isend / irecv / send / recv (they are traced, so the check can count them)"
            )
        near = _neighbours(r, rows, cols)
        for peer, _ in [*tap.sends, *tap.recvs]:
            if peer not in near:
                if (
                    peer // cols == r // cols or peer % cols == r % cols
                ):  # in its row or column, not beside it
                    line = "row" if peer // cols == r // cols else "column"
                    why = (f"it is in this rank's {line}, but not next to it: a message straight to every member "
                           f"of a {line} skips the ranks between, whose links a torus has instead")  # fmt: skip
                elif peer in ((r + 1) % p, (r - 1) % p):
                    why = f"a ring through all {p} ranks in rank order jumps from the end of one row to the start of the next"
                else:
                    why = "it shares neither this rank's row nor its column"
                raise AssertionError(
                    f"{where}: {_at(r, cols)} exchanged a message with {_at(peer, cols)}, which is not its "
                    f"torus neighbour: on a torus a rank talks only to the ranks next to it in its row (column "
                    f"±1 mod {cols}) and in its column (row ±1 mod {rows}); {why}"
                )
        most = 2 * (cols - 1) + 2 * (rows - 1)
        if len(tap.sends) > most:
            raise AssertionError(
                f"{where}: this rank sent {len(tap.sends)} messages; the two-level all-reduce needs at most "
                f"{most} (2(cols-1) in its row, 2(rows-1) in its column): {2 * (p - 1)} is a ring through all "
                f"{p} ranks"
            )
        # every rank's bytes (through the store), to judge the total first (what crossed twice), then the spread
        keys = [f"lesson01/{case}/sent/{q}" for q in range(p)]
        tap.store.set(keys[r], str(sent))
        tap.store.wait(keys, timedelta(seconds=30))
        each = [int(tap.store.get(k)) for k in keys]
        total, ring = sum(each), 2 * (p - 1) * n * x.element_size()
        if total != ring:
            raise AssertionError(
                f"{where}: your {p} ranks together sent {total} bytes; a two-level ring all-reduce sends "
                f"{ring} (as many as one ring through all ranks): "
                + ("more means some data crossed twice: after its row's reduce-scatter a rank holds a shard, "
                   "and only that shard crosses the column" if total > ring else "less means some never travelled")
            )  # fmt: skip
        bound = _torus_bound(n, rows, cols) * x.element_size()
        if sent > bound:
            raise AssertionError(
                f"{where}: this rank sent {sent} bytes, more than its share ({bound} bytes at most); your ranks "
                f"sent {each}, the right total, but unevenly: in a two-level ring every row and every column "
                "spreads its work evenly over its ranks, while a chain or a tree through a column (sum towards "
                "one rank, then send the result back) sends the same total and piles it on the ranks between"
            )
    return len(sizes)


def _which_sum(got, r: int, n: int, dtype, device, salt: int, rows: int, cols: int) -> str:
    """Name the usual partial sums: over this rank's row only, or its column only."""
    i, j = divmod(r, cols)
    g = got.detach().reshape(-1).double().cpu()
    for label, members in (
        ("row", [i * cols + k for k in range(cols)]),
        ("column", [k * cols + j for k in range(rows)]),
    ):
        part = sum(_data(q, n, dtype, device, salt).double().cpu() for q in members)
        if len(members) < rows * cols and torch.equal(g, part):
            return (f"; your result is the sum over this rank's {label} only (ranks {members}): the other "
                    f"{'rows' if label == 'row' else 'columns'}' contributions never reached it")  # fmt: skip
    return ""


def check_torus_all_reduce(fn: Callable) -> None:
    """`fn(ctx, tensor, rows)` returns the sum of `tensor` over all ranks, talking only to torus neighbours."""
    require_callable(fn)
    seed = draw_seed() % 2**40
    for rows, cols in GRIDS:
        _launch(_run_torus, rows * cols, "torus_all_reduce", fn, rows, seed)
    passed("check_torus_all_reduce", f"sums exact on {len(GRIDS)} grids, every message to a torus neighbour")


# ----------------------------------------------------------------------------- exercise 2: all-gather of uneven pieces
def _gather_cases(p: int, rnd: random.Random) -> list[list[int]]:
    """Equal pieces first (a wrong piece forwarded shows as a wrong block), then uneven ones: fixed
    (zeros included) and drawn per run."""
    fixed = [
        [4] * p,
        [3 + 2 * k for k in range(p)],
        [(5 * k) % 7 for k in range(p)],
        [0] * p,
        [1] + [0] * (p - 1),
    ]
    drawn = [[rnd.randint(0, 40) for _ in range(p)] for _ in range(2)] + [
        [rnd.randint(1, 600) for _ in range(p)]
    ]
    return fixed + drawn


def _run_gather(ctx, fn: Callable, seed: int) -> int:
    p, r = ctx.world_size, ctx.rank
    right, left = (r + 1) % p, (r - 1) % p
    rnd = random.Random(seed * 13 + p)
    cases = _gather_cases(p, rnd)
    for case, sizes in enumerate(cases):
        dtype = torch.bfloat16 if case == len(cases) - 1 else torch.float32
        salt = seed + 101 * case
        where = f"ring_all_gather_v(ctx, tensor, sizes={sizes}) on {p} ranks, {_dtype_name(dtype)}, rank {r}"
        pieces = [_data(k, sizes[k], dtype, ctx.device, salt) for k in range(p)]
        got, tap = _call(fn, "ring_all_gather_v", where, ctx, case, "each step receives the piece of the rank "
                         "it comes from, whose size is in `sizes`, not the size of this rank's own piece",
                         pieces[r].clone(), list(sizes))  # fmt: skip
        if isinstance(got, (list, tuple)):
            got = torch.cat([torch.as_tensor(t).reshape(-1) for t in got]) if len(got) else torch.empty(0)
        want = torch.cat(pieces)
        if (
            isinstance(got, torch.Tensor)
            and got.numel() == want.numel()
            and not torch.equal(got.reshape(-1).cpu(), want.cpu())
        ):
            _wrong_block(got, pieces, sizes, where)
        _first_difference(got, want, where)
        for peer, _ in tap.sends:
            if peer != right:
                raise AssertionError(
                    f"{where}: rank {r} sent a message to rank {peer}; in a ring a rank sends only to its right "
                    f"neighbour, rank {right}, which forwards what it received"
                )
        for peer, _ in tap.recvs:
            if peer != left:
                raise AssertionError(
                    f"{where}: rank {r} received from rank {peer}; in a ring a rank receives only from its left "
                    f"neighbour, rank {left}"
                )
        sent, pieces_sent = sum(b for _, b in tap.sends), len(tap.sends)
        want_sent = (sum(sizes) - sizes[right]) * pieces[r].element_size()
        if sent != want_sent or pieces_sent > p - 1:
            raise AssertionError(
                f"{where}: rank {r} sent {sent} bytes in {pieces_sent} messages; a ring forwards p-1 = {p - 1} "
                f"pieces, each once: its own and those it received, except the last to arrive, {want_sent} bytes"
            )
    return len(cases)


def _wrong_block(got: torch.Tensor, pieces: list, sizes: list[int], where: str) -> None:
    """Where a block holds another rank's piece (a piece forwarded out of turn), say whose."""
    g, at = got.reshape(-1).cpu(), 0
    for k, n in enumerate(sizes):
        block = g[at : at + n]
        if n and not torch.equal(block, pieces[k].cpu()):
            for q, other in enumerate(pieces):
                if q != k and sizes[q] == n and torch.equal(block, other.cpu()):
                    raise AssertionError(
                        f"{where}: where rank {k}'s piece belongs (elements {at}..{at + n - 1}) your result "
                        f"holds rank {q}'s piece: at each step a rank forwards the piece that arrived last"
                    )
        at += n


def check_ring_all_gather_v(fn: Callable) -> None:
    """`fn(ctx, tensor, sizes)` returns the concatenation, in rank order, of every rank's 1-D tensor."""
    require_callable(fn)
    seed = draw_seed() % 2**40
    total = sum(_launch(_run_gather, p, "ring_all_gather_v", fn, seed)[0] for p in (1, 2, 3, 4))
    passed("check_ring_all_gather_v", f"all {total} cases on 1 to 4 ranks")


# ----------------------------------------------------------------------------- exercise 3: all-to-all of uneven pieces
def _lengths(p: int, rnd: random.Random) -> list[list[list[int]]]:
    """lengths[r][j]: how many elements rank r sends to rank j. First a case where every pair's two
    lengths differ and none is 0, then zeros, then drawn ones."""
    first = [[2 + 3 * r + j for j in range(p)] for r in range(p)]
    zeros = [[0 if (r + j) % 2 else r + 2 * j + 1 for j in range(p)] for r in range(p)]
    drawn = [[[rnd.randint(0, 30) for _ in range(p)] for _ in range(p)] for _ in range(2)]
    big = [[rnd.randint(0, 500) for _ in range(p)] for _ in range(p)]
    return [first, zeros, *drawn, big]


def _run_a2a(ctx, fn: Callable, seed: int) -> int:
    p, r = ctx.world_size, ctx.rank
    rnd = random.Random(seed * 17 + p)
    cases = _lengths(p, rnd)
    for case, lengths in enumerate(cases):
        salt = seed + 211 * case
        dtype = torch.float32
        where = f"all_to_all_v(ctx, tensors) on {p} ranks, rank r sends lengths[r][j] elements to rank j, lengths={lengths}, rank {r}"

        def piece(src: int, dst: int, lengths=lengths, salt=salt) -> torch.Tensor:
            return _data(src * p + dst, lengths[src][dst], torch.float32, ctx.device, salt)

        mine = [piece(r, j) for j in range(p)]
        got, tap = _call(fn, "all_to_all_v", where, ctx, case, "the receiver cannot know a piece's length "
                         "until its sender tells it (send the length first)", [t.clone() for t in mine])  # fmt: skip
        if not isinstance(got, (list, tuple)) or len(got) != p:
            raise AssertionError(f"{where}: expected a list of {p} tensors, got {type(got).__name__}"
                                 + (f" of {len(got)}" if isinstance(got, (list, tuple)) else ""))  # fmt: skip
        for j in range(p):
            _first_difference(got[j], piece(j, r), f"{where}, the piece from rank {j}")
        size = torch.tensor([], dtype=dtype).element_size()
        to = {j: [b for q, b in tap.sends if q == j] for j in range(p)}
        for j in range(p):
            if j == r:
                continue
            data, extra = lengths[r][j] * size, sum(to[j]) - lengths[r][j] * size
            if not 0 <= extra <= 8 or len(to[j]) > 2 or (len(to[j]) == 2 and not extra):
                raise AssertionError(
                    f"{where}: rank {r} sent rank {j} {sum(to[j])} bytes in {len(to[j])} messages {to[j]}; "
                    f"its piece is {data} bytes, sent once, plus at most one small message (8 bytes at most) "
                    "saying how long it is"
                )
    return len(cases)


def check_all_to_all_v(fn: Callable) -> None:
    """`fn(ctx, tensors)`: `tensors[j]` (1-D, any length) goes to rank j; returns p tensors, [j] from rank j."""
    require_callable(fn)
    seed = draw_seed() % 2**40
    total = sum(_launch(_run_a2a, p, "all_to_all_v", fn, seed)[0] for p in (1, 2, 3, 4))
    passed("check_all_to_all_v", f"all {total} cases on 1 to 4 ranks")


# ----------------------------------------------------------------------------- exercise 4: predict, then measure
def _ring_reduce_scatter(ctx, chunks: list[torch.Tensor], ring: list[int], me: int) -> None:
    """The lesson's ring on the ranks `ring` (global ranks, this one at position `me`): at step s send
    chunk me-s-1 to the right, add what arrives into chunk me-s-2; position k ends with chunk k."""
    from parallel_lab import comms

    q = len(ring)
    for s in range(q - 1):
        k = (me - s - 2) % q
        got = torch.empty_like(chunks[k])
        comms.sendrecv(ctx, chunks[(me - s - 1) % q], ring[(me + 1) % q], got, ring[(me - 1) % q])
        chunks[k] += got


def _ring_all_gather(ctx, chunks: list[torch.Tensor], ring: list[int], me: int) -> None:
    from parallel_lab import comms

    q = len(ring)
    for s in range(q - 1):
        comms.sendrecv(
            ctx, chunks[(me - s) % q], ring[(me + 1) % q], chunks[(me - s - 1) % q], ring[(me - 1) % q]
        )


def _torus_all_reduce(ctx, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The reference: reduce-scatter along the row, all-reduce of the shard along the column, all-gather
    along the row; chunks cut by comms.chunk_sizes at both levels."""
    return _torus(ctx, tensor, rows, ctx.world_size // rows)


def _torus(ctx, tensor: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`_torus_all_reduce` on the grid of ranks 0 .. rows*cols - 1 (the others take no part)."""
    from parallel_lab import comms

    i, j = divmod(ctx.rank, cols)
    flat = tensor.view(-1)
    row, col = [i * cols + k for k in range(cols)], [k * cols + j for k in range(rows)]
    chunks = list(flat.split(comms.chunk_sizes(flat.numel(), cols)))  # views into tensor
    _ring_reduce_scatter(ctx, chunks, row, j)
    shard = list(chunks[j].split(comms.chunk_sizes(chunks[j].numel(), rows)))  # views into chunk j
    _ring_reduce_scatter(ctx, shard, col, i)
    _ring_all_gather(ctx, shard, col, i)
    _ring_all_gather(ctx, chunks, row, j)
    return tensor


def _measure_torus(ctx, grids: tuple, sizes: list[tuple[int, int]]) -> list[list[int]]:
    """Bytes this rank sends in the reference torus all-reduce of each (n, itemsize) on each grid it is in
    (read from the byte counter); one launch for every grid, the ranks outside a grid sit it out."""
    out = []
    for rows, cols in grids:
        row = []
        for n, itemsize in sizes:
            if ctx.rank >= rows * cols:
                row.append(None)
                continue
            dtype = {4: torch.float32, 2: torch.bfloat16}[itemsize]
            before = sum(c.get("sent", 0) for c in ctx.recorder.comm.values())
            _torus(ctx, torch.ones(n, dtype=dtype, device=ctx.device), rows, cols)
            row.append(sum(c.get("sent", 0) for c in ctx.recorder.comm.values()) - before)
        out.append(row)
    return out


def check_torus_bytes(fn: Callable) -> None:
    """`fn(n, rows, cols, rank, itemsize)` -> the bytes `rank` sends in the torus all-reduce of n elements,
    predicted, then compared exactly with the bytes the check's own torus all-reduce sends."""
    from parallel_lab import comms

    require_callable(fn)
    guard = guarded(fn, {**_off(), **_NO_RUNS}, "this exercise (torus_bytes)")
    rnd = random.Random(draw_seed())
    grids = ((1, 3), (2, 1), (2, 2), (2, 3), (3, 2))
    sizes = [(1, 4), (5, 4), (7, 4), (1001, 4), (rnd.randint(11, 999), 4), (rnd.randint(1000, 20_000), 4),
             (rnd.randint(11, 999), 2)]  # fmt: skip
    measured = launch_learner(_measure_torus, 6, grids, sizes, timeout=60.0).values
    for g, (rows, cols) in enumerate(grids):
        p = rows * cols
        for r in range(p):
            for (n, itemsize), got in zip(sizes, measured[r][g]):
                call = f"torus_bytes(n={n}, rows={rows}, cols={cols}, rank={r}, itemsize={itemsize})"
                said = guard(n, rows, cols, r, itemsize)
                if not isinstance(said, (int, float)) or isinstance(said, bool):
                    raise AssertionError(f"{call} must return a number of bytes, got {type(said).__name__}")
                if said != got:
                    hint, c = "", comms.chunk_sizes(n, p)
                    if said == (2 * n - c[r] - c[(r + 1) % p]) * itemsize:
                        hint = f"; that is what rank {r} sends in one ring through all {p} ranks, not in the torus"
                    elif abs(said - 2 * (p - 1) / p * n * itemsize) < 1:
                        hint = (
                            "; 2(p-1)/p·n is the average over ranks: when the chunks are uneven, at either "
                            "level, one rank's count differs from it"
                        )
                    raise AssertionError(
                        f"{call}: you predict {said} bytes, the torus all-reduce sent {got}{hint}"
                    )
    passed("check_torus_bytes", f"every prediction equals the bytes measured on {len(grids)} grids")

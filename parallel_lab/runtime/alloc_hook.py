"""The allocation hook under MemoryTracker on CPU: torch's CPU allocator, wrapped in C++.

A dispatch mode (alloc_mode.py) costs a trip through Python on every op; for the
small models of the lessons that trip is as long as the op, and a tracked step
ran 2-3x slower than an untracked one. Every CPU storage, though, is made by one
allocator, and c10 lets a program put its own in front (`c10::SetCPUAllocator`).
`alloc_hook.cpp` does that: each allocation and each free updates a byte count per
category in C++, with no Python per op.

The C++ file is compiled once per torch install with the system's C++ compiler and
cached (`~/.cache/parallel_lab`, or `$PARALLEL_LAB_CACHE`); ctypes loads it. Where
no compiler is found (or on a platform where the build fails) `load()` returns
None and the tracker falls back to the dispatch mode, which sees the same storages.

Invariant: once installed, the wrapper stays in front of torch's allocator for the
life of the process (storages made through it must be freed through it); with no
tracker active it only forwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

_SRC = Path(__file__).with_name("alloc_hook.cpp")
NCATS = 16  # size of the per-category arrays on the C++ side


def _cache_dir() -> Path:
    root = os.environ.get("PARALLEL_LAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "parallel_lab"
    )
    return Path(root)


def _compiler() -> str | None:
    for cxx in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    return None


@contextlib.contextmanager
def _build_lock(so: Path) -> Iterator[None]:
    """One builder at a time: eight ranks starting on a fresh machine compile once, not eight times."""
    so.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock here: concurrent builds are wasteful but still safe (atomic rename)
        yield
        return
    with open(so.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(cxx: str, out: Path) -> None:
    tdir = Path(torch.__file__).parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f"-I{tdir / 'include'}", str(_SRC), f"-L{tdir / 'lib'}", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{tdir / 'lib'}"]  # fmt: skip
    if sys.platform == "darwin":
        cmd += ["-undefined", "dynamic_lookup"]
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: ranks that start together never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([*cmd, "-o", tmp], check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i, i64, u64, p = ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    pi64, pi = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int)
    sigs = {
        "pl_install": (i, []),
        "pl_new_state": (i, []),
        "pl_free_state": (None, [i]),
        "pl_set_active": (None, [i, i]),
        "pl_push_label": (None, [i, i]),
        "pl_pop_label": (None, [i]),
        "pl_push_only": (None, [i]),
        "pl_pop_only": (None, []),
        "pl_relabel": (u64, [i, p, i64, i]),
        "pl_category": (i, [i, p]),
        "pl_forget": (None, [i, p, u64]),
        "pl_read": (None, [i, pi64, pi64, pi64]),
        "pl_reset_peak": (None, [i]),
        "pl_take_high_water": (i64, [i]),
        "pl_largest": (i, [i, i, pi64, pi]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled hook, installed in front of torch's CPU allocator; None where it cannot be built.

    Set `PARALLEL_LAB_TRACKER=dispatch` to never build or load it.
    """
    if os.environ.get("PARALLEL_LAB_TRACKER") == "dispatch" or sys.platform == "win32":
        return None
    # One build per source, torch install and Python: two venvs never share a library linked to the other's torch.
    ident = f"{torch.__version__}|{Path(torch.__file__).parent}|{sys.version}".encode()
    key = hashlib.sha256(_SRC.read_bytes() + ident).hexdigest()[:16]
    so = _cache_dir() / f"alloc_hook-{key}.so"
    try:
        if not so.exists():
            cxx = _compiler()
            if cxx is None:
                return None
            with _build_lock(so):
                if not so.exists():  # another process may have built it while we waited
                    _build(cxx, so)
        lib = _bind(ctypes.CDLL(str(so)))
    except (OSError, subprocess.SubprocessError):
        return None
    return lib if lib.pl_install() == 1 else None


__all__ = ["NCATS", "load"]

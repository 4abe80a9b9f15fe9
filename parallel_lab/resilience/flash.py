"""Flash checkpoint: copy the training state into host shared memory (training waits only for
that copy), and let another process write it to disk in the background.

DLRover's flash checkpoint takes a checkpoint in two tiers: a synchronous copy into host
memory, which costs a memory copy, and an asynchronous write to storage that overlaps the next
steps. A restart on a machine that survived reads the copy back from memory instead of from disk.
A copy in a machine's own memory dies with that machine; Gemini (Wang et al. 2023, SOSP) places
checkpoint replicas in the CPU memory of other machines, so that recovery from memory survives
the loss of a whole machine. This module keeps only the local copy (and the disk one).

Here the "agent" is the process that launches the ranks (`FlashAgent`, used around
`run_with_restarts`): it owns one shared-memory segment per rank, so the copies outlive a rank
that dies, and a background thread of the agent persists complete snapshots (every rank's, same
step) as ordinary checkpoints (`checkpoint.write_files`: atomic files, manifest last).

A segment is a 64-byte header (magic, state, step, length of the pickled description) then the
description (names, shapes, dtypes, offsets, and the small non-tensor values), then the raw
tensor bytes. A rank marks its segment "writing" before copying and "ready" with the step after:
a rank that dies mid-copy leaves a segment the agent and the restart both ignore.

Invariant: the agent persists a step only when every rank's segment is ready at that step, and
each rank's bytes are what it copied (the disk files are checksummed as they are written).
"""

from __future__ import annotations

import _posixshmem
import io
import mmap
import os
import pickle
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallel_lab.resilience import checkpoint as ckpt

_MAGIC = 0x464C4153  # "FLAS"
_HEADER = struct.Struct("<IIqqi36x")  # magic, state, step, description length, world size; 64 bytes
_EMPTY, _WRITING, _READY = 0, 1, 2
SEGMENT_PREFIX = "parallel_lab_flash_"


@dataclass(frozen=True)
class FlashSpec:
    """What a rank needs to find its segment: names by rank, and each one's capacity in bytes."""

    names: tuple[str, ...]
    capacity: int

    def name(self, rank: int) -> str:
        return self.names[rank]


class _Segment:
    """A POSIX shared-memory segment, opened without multiprocessing's `SharedMemory`: that class
    registers every segment with a resource tracker that unlinks segments it believes leaked and
    complains when several processes attach to one (Python 3.13 added `track=False` for this)."""

    def __init__(self, name: str, create: bool = False, size: int = 0) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.name = name
        self.fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, os.fstat(self.fd).st_size)
        except OSError:
            os.close(self.fd)
            raise
        self.buf = memoryview(self.mm)

    def close(self) -> None:
        self.buf.release()
        self.mm.close()
        os.close(self.fd)

    def unlink(self) -> None:
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass


def _open(name: str, create: bool = False, size: int = 0) -> _Segment:
    return _Segment(name, create, size)


def _flatten(state: dict) -> tuple[dict, list[torch.Tensor]]:
    """Split a nested dict into (description with tensor placeholders, tensors in order)."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return ("__tensor__", len(tensors) - 1, tuple(x.shape), str(x.dtype).replace("torch.", ""))
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(state), tensors


def snapshot(spec: FlashSpec, rank: int, step: int, state: dict, world_size: int) -> int:
    """Copy `state` (nested dicts/lists of tensors and plain values) into this rank's segment.
    Returns the bytes copied. This is all the training waits for."""
    desc, tensors = _flatten(state)
    sizes = [t.numel() * t.element_size() for t in tensors]
    head = pickle.dumps((desc, sizes), protocol=pickle.HIGHEST_PROTOCOL)
    need = _HEADER.size + len(head) + sum(sizes)
    if need > spec.capacity:
        raise ValueError(f"the state needs {need:,} bytes, the flash segment holds {spec.capacity:,}: "
                         "give FlashAgent a larger capacity")  # fmt: skip
    shm = _open(spec.name(rank))
    try:
        buf = shm.buf
        _HEADER.pack_into(buf, 0, _MAGIC, _WRITING, -1, 0, 0)  # a death from here on leaves it "writing"
        off = _HEADER.size
        buf[off : off + len(head)] = head
        off += len(head)
        dst = (
            torch.frombuffer(buf, dtype=torch.uint8, count=sum(sizes), offset=off)
            if sizes and sum(sizes)
            else None
        )
        pos = 0
        for t, n in zip(tensors, sizes):
            if n:
                dst[pos : pos + n].copy_(t.contiguous().cpu().view(-1).view(torch.uint8))  # (n,) bytes
            pos += n
        del dst
        _HEADER.pack_into(buf, 0, _MAGIC, _READY, step, len(head), world_size)  # last: the snapshot is whole
    finally:
        shm.close()
    return need


def read_snapshot(spec: FlashSpec, rank: int) -> tuple[int, dict] | None:
    """(step, state) from this rank's segment if it holds a whole snapshot, else None."""
    try:
        shm = _open(spec.name(rank))
    except FileNotFoundError:
        return None
    try:
        magic, state, step, hlen, _ = _HEADER.unpack_from(shm.buf, 0)
        if magic != _MAGIC or state != _READY:
            return None
        off = _HEADER.size
        desc, sizes = pickle.loads(bytes(shm.buf[off : off + hlen]))
        off += hlen
        raw = bytes(shm.buf[off : off + sum(sizes)])  # one copy out: the segment may be reused at once
    finally:
        shm.close()
    tensors, pos = [], 0
    for n in sizes:
        tensors.append(raw[pos : pos + n])
        pos += n

    def build(x: Any) -> Any:
        if isinstance(x, tuple) and len(x) == 4 and x[0] == "__tensor__":
            _, i, shape, dtype = x
            data = bytearray(tensors[i])
            dt = getattr(torch, dtype)
            if not data:
                return torch.empty(shape, dtype=dt)
            return torch.frombuffer(data, dtype=dt).reshape(shape).clone()
        if isinstance(x, dict):
            return {k: build(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(build(v) for v in x)
        return x

    return step, build(desc)


class FlashAgent:
    """Owns the segments and persists ready snapshots to `root` every `persist_every` steps.

    A rank's snapshot is {"shard": what `checkpoint.save` would write for it, "meta": the manifest's
    meta (rank 0's counts)}. The agent writes the newest whole snapshot whose step is a multiple of
    `persist_every`; if the ranks have moved past one before it looked, it writes the next one.

    Use it around the runs: `with FlashAgent(world_size, capacity, root) as agent:` then pass
    `agent.spec` to the training function. On exit the segments are unlinked and the thread
    stopped; `persisted` lists the steps written to disk."""

    def __init__(self, world_size: int, capacity: int, root: str | os.PathLike, persist_every: int = 1,
                 poll: float = 0.02) -> None:  # fmt: skip
        for name, v in (("world_size", world_size), ("capacity", capacity), ("persist_every", persist_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.root, self.persist_every, self.poll = Path(root), persist_every, poll
        tag = uuid.uuid4().hex[:10]
        self.segments = [_open(f"{SEGMENT_PREFIX}{os.getpid()}_{tag}_{r}", create=True, size=capacity)
                         for r in range(world_size)]  # fmt: skip
        for s in self.segments:
            _HEADER.pack_into(s.buf, 0, _MAGIC, _EMPTY, -1, 0, 0)
        self.spec = FlashSpec(tuple(s.name for s in self.segments), capacity)
        self.persisted: list[int] = []
        self.persist_seconds: list[float] = []
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="parallel_lab-flash-persist")
        self._thread.start()

    def ready(self) -> tuple[int, int] | None:
        """(step, world size) of a whole snapshot, or None (see `ready_snapshot`)."""
        return ready_snapshot(self.spec)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.persist_now()

    def persist_now(self) -> int | None:
        """Write the current snapshot to disk if every rank's is ready at one step not yet written.
        (The agent's thread calls it; callers may too: one persist runs at a time.)"""
        with self._lock:
            return self._persist()

    def _persist(self) -> int | None:
        found = self.ready()
        if found is None or found[0] in self.persisted or found[0] % self.persist_every:
            return None
        step, world = found
        t = time.perf_counter()
        shards = []
        for r in range(world):
            got = read_snapshot(self.spec, r)
            if got is None or got[0] != step:  # a rank started its next snapshot meanwhile: next time
                return None
            shards.append(got[1])
        # a snapshot is {"shard": that rank's checkpoint file, "meta": the manifest's meta (rank 0's)}
        ckpt.write_files(self.root, step, [_to_bytes(s["shard"]) for s in shards], shards[0].get("meta", {}))
        self.persisted.append(step)
        self.persist_seconds.append(time.perf_counter() - t)
        return step

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for s in self.segments:
            s.close()
            s.unlink()

    def __enter__(self) -> FlashAgent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def ready_snapshot(spec: FlashSpec) -> tuple[int, int] | None:
    """(step, world size) when the first `world size` segments (the world rank 0 recorded) all hold
    a whole snapshot of that step and world; else None. A shrunk run leaves the extra segments stale."""
    seen = []
    for r in range(len(spec.names)):
        try:
            shm = _open(spec.name(r))
        except FileNotFoundError:
            return None
        try:
            magic, state, step, _, world = _HEADER.unpack_from(shm.buf, 0)
        finally:
            shm.close()
        if magic != _MAGIC or state != _READY:
            return None
        seen.append((step, world))
        if len(seen) == seen[0][1]:
            break
    if not seen or len(seen) != seen[0][1] or len(set(seen)) != 1:
        return None
    return seen[0]


def _to_bytes(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def leaked_segments() -> list[str]:
    """Flash segments still in /dev/shm (Linux): after every run there should be none."""
    d = Path("/dev/shm")
    return sorted(p.name for p in d.glob(f"{SEGMENT_PREFIX}*")) if d.is_dir() else []


__all__ = ["FlashAgent", "FlashSpec", "leaked_segments", "read_snapshot", "ready_snapshot", "snapshot"]

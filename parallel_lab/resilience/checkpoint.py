"""Checkpoints that a crash cannot tear: every file written atomically, a manifest written last.

A checkpoint is a folder `step-000012/` with one file per rank (`rank-00001-of-00004.pt`: that
rank's shard of the training state) and `MANIFEST.json`, which rank 0 writes only after every
rank's file is complete, listing each file's size and SHA-256. Each file is written to a
temporary name, flushed and fsync'ed, then renamed over its final name (`os.replace`, atomic on
POSIX), and the folder is fsync'ed so the rename itself survives a power loss; the step folder's
own name is fsync'ed into `root` when it is made, or a power loss could keep the files and lose the
folder that holds them.

So a crash at any moment leaves either a folder without a manifest (torn: skipped and reported)
or a complete checkpoint; never a file that is half old and half new. Loading checks the
manifest, every size and every checksum, and that the checkpoint was made for this model, and
names the file and the reason when something is wrong. The same rules as
`torch.distributed.checkpoint`, whose `.metadata` file is likewise written last by the
coordinator.

Invariant: `latest(root)` returns the newest checkpoint whose manifest and files all verify.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from parallel_lab import comms

FORMAT = 1
MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: carries the file and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path, self.reason = str(path), reason
        super().__init__(f"{path}: {reason}")


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


# ----------------------------------------------------------------------------- atomic files
def atomic_write(path: str | os.PathLike, data: bytes, fault: Callable[[str], None] | None = None) -> str:
    """Write `data` to `path` so that a crash leaves the old file or the new one, never a mix.

    `fault(point)` is called at "written" (the temporary file complete, not yet renamed) and
    "renamed": the tests kill the process there."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")  # unique per writer
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    if fault is not None:
        fault("written")
    os.replace(tmp, path)  # atomic: readers see the old name target or the new one
    _fsync_dir(path.parent)  # and the rename itself is on disk
    if fault is not None:
        fault("renamed")
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """Every random generator a training step may draw from on this rank."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU the saving rank saw; a resume may see fewer (another slice of
        # CUDA_VISIBLE_DEVICES): restore those that exist
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


# ----------------------------------------------------------------------------- save
def save(ctx, root: str | os.PathLike, step: int, shard: dict, meta: dict | None = None,
         fault: Callable[[str], None] | None = None, keep: int = 2) -> Path:  # fmt: skip
    """Every rank calls it with its own `shard` (a dict of tensors and plain values); rank 0
    writes the manifest (with `meta`, JSON) once all shards are on disk. A collective.

    `keep`: complete checkpoints to keep (older ones are removed after the new one is complete).
    `fault(point)`: called at "written"/"renamed" for the shard, "shards" (all shards complete,
    no manifest yet) and "manifest" (after it): the tests crash ranks there."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    d = step_dir(root, step)
    if ctx.rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        _fsync_dir(d.parent)  # the step folder's own name is on disk before anything inside it counts
    comms.dist_barrier(ctx)  # the folder exists for everyone
    buf = io.BytesIO()
    torch.save(shard, buf)
    data = buf.getvalue()
    digest = atomic_write(d / shard_name(ctx.rank, ctx.world_size), data, fault)
    mine = torch.tensor([len(data), *bytes.fromhex(digest)], dtype=torch.int64, device=ctx.device)  # (33,)
    every = comms.dist_all_gather(ctx, mine)  # (world, 33): rank 0 needs them all for the manifest
    if fault is not None:
        fault("shards")
    if ctx.rank == 0:
        files = {
            shard_name(r, ctx.world_size): {"bytes": int(row[0]), "sha256": bytes(row[1:].tolist()).hex()}
            for r, row in enumerate(every)
        }
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": ctx.world_size,
            "files": files,
            "meta": meta or {},
        }
        atomic_write(d / MANIFEST, json.dumps(manifest, indent=1).encode())
        for old, _ in complete(root)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    if fault is not None:
        fault("manifest")
    comms.dist_barrier(ctx)  # nobody resumes training before the checkpoint is complete
    return d


def write_files(root: str | os.PathLike, step: int, shards: list[bytes], meta: dict | None = None,
                keep: int = 2) -> Path:  # fmt: skip
    """Write a whole checkpoint from one process (a flash checkpoint's persisting agent): the
    ranks' serialized shards, each atomically, then the manifest. Same layout as `save`."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    _fsync_dir(d.parent)  # the step folder's own name is on disk before anything inside it counts
    world = len(shards)
    files = {}
    for r, data in enumerate(shards):
        files[shard_name(r, world)] = {
            "bytes": len(data),
            "sha256": atomic_write(d / shard_name(r, world), data),
        }
    manifest = {"format": FORMAT, "step": step, "world_size": world, "files": files, "meta": meta or {}}
    atomic_write(d / MANIFEST, json.dumps(manifest, indent=1).encode())
    for old, _ in complete(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return d


# ----------------------------------------------------------------------------- verify and load
def verify(d: str | os.PathLike) -> dict:
    """The manifest of checkpoint folder `d` once every file it lists has its size and checksum;
    else CheckpointError naming the file and the reason."""
    d = Path(d)
    mpath = d / MANIFEST
    if not mpath.exists():
        raise CheckpointError(d, "no MANIFEST.json: the checkpoint was not finished (torn)")
    try:
        manifest = json.loads(mpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(mpath, f"not a readable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise CheckpointError(mpath, f"not a checkpoint manifest of format {FORMAT}")
    for name, info in manifest["files"].items():
        p = d / name
        if not p.exists():
            raise CheckpointError(p, "missing: the manifest lists it but the file is not there")
        data = p.read_bytes()
        if len(data) != info["bytes"]:
            raise CheckpointError(
                p, f"truncated or padded: {len(data)} bytes, the manifest says {info['bytes']}"
            )
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise CheckpointError(p, "wrong checksum: the file changed after it was written")
    return manifest


def complete(root: str | os.PathLike) -> list[tuple[Path, dict]]:
    """Every checkpoint under `root` that verifies, newest first."""
    out = []
    for d, _ in _step_dirs(root):
        try:
            out.append((d, verify(d)))
        except CheckpointError:
            continue
    return out


def latest(root: str | os.PathLike) -> tuple[Path | None, dict | None, list[CheckpointError]]:
    """(folder, manifest) of the newest checkpoint that verifies, and the errors of the newer
    ones that did not (torn or corrupt: reported, skipped). (None, None, errors) if none."""
    skipped: list[CheckpointError] = []
    for d, _ in _step_dirs(root):
        try:
            return d, verify(d), skipped
        except CheckpointError as e:
            skipped.append(e)
    return None, None, skipped


def _step_dirs(root: str | os.PathLike) -> list[tuple[Path, int]]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(p, int(m.group(1))) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, key=lambda x: -x[1])


def read_shard(d: str | os.PathLike, rank: int, manifest: dict) -> dict:
    """Rank `rank`'s shard of a verified checkpoint (its checksum checked again: it is read now)."""
    name = shard_name(rank, manifest["world_size"])
    p = Path(d) / name
    info = manifest["files"].get(name)
    if info is None:
        raise CheckpointError(p, f"not in the manifest (the checkpoint has {manifest['world_size']} ranks)")
    data = p.read_bytes()
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CheckpointError(p, "wrong checksum: the file changed after it was written")
    # map_location: a shard saved by an NCCL rank holds tensors of that rank's GPU; read it on the
    # CPU, so a resume on fewer GPUs or none works and the caller moves it to its own ctx.device
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def check_model(manifest: dict, signature: list, path: str | os.PathLike) -> None:
    """Refuse a checkpoint made for another model: compare parameter names and shapes."""
    theirs = [tuple(x) if isinstance(x, list) else x for x in manifest.get("meta", {}).get("model", [])]
    ours = [(n, list(s)) for n, s in signature]
    theirs = [(n, list(s)) for n, s in theirs]
    if theirs != ours:
        diff = next(((a, b) for a, b in zip(theirs, ours) if a != b), None)
        why = (f"parameter {diff[0][0]!r} has shape {tuple(diff[0][1])} there, this model has "
               f"{diff[1][0]!r} {tuple(diff[1][1])}") if diff else (
               f"it has {len(theirs)} parameters, this model {len(ours)}")  # fmt: skip
        raise CheckpointError(Path(path) / MANIFEST, f"made for another model: {why}")


def model_signature(model: torch.nn.Module) -> list[tuple[str, list[int]]]:
    return [(n, list(p.shape)) for n, p in model.named_parameters()]


__all__ = [
    "CheckpointError",
    "atomic_write",
    "check_model",
    "complete",
    "latest",
    "model_signature",
    "read_shard",
    "rng_state",
    "save",
    "set_rng_state",
    "shard_name",
    "step_dir",
    "verify",
    "write_files",
]

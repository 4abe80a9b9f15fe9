"""Finding what went wrong: who stopped making progress and where it is, and which rank is faulty.

- Heartbeats and stacks. Each rank notes its progress (step and time) in a small file and asks
  `faulthandler` to dump every thread's stack to another file when it receives SIGUSR1. When no
  rank has made progress for `deadline` seconds, the watcher (in the process that launched the
  ranks) signals them all and reads their stacks. Ranks blocked in the same collective have the
  same innermost frame; the rank whose stack differs from the majority's is the one to look at
  (3 ranks in all_reduce and 1 in its own code: that one). The same idea as torch's flight
  recorder and DLRover's hang diagnosis, with Python stacks only.
- Pairwise tests. Every rank runs the same matmul, and ranks exchange results in pairs; a rank
  whose result differs, or whose pair is slow, is suspect; pairing each suspect with a known-good
  rank in a second round tells which of the two it was.

Invariant: a report only states what was observed (stacks, times, results); the culprit is the
rank that differs from the others, or none when all agree.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from parallel_lab import comms

_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')


class Heartbeat:
    """On a rank: `beat(step)` after every step; stacks dumped on SIGUSR1 into `folder`."""

    def __init__(self, ctx, folder: str | os.PathLike) -> None:
        self.rank, self.folder = ctx.rank, Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank-{self.rank}.pid").write_text(str(os.getpid()))
        self._stack_file = open(self.folder / f"rank-{self.rank}.stack", "w")  # noqa: SIM115 - kept for the handler
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        self.beat(-1)

    def beat(self, step: int) -> None:
        tmp = self.folder / f".rank-{self.rank}.beat"
        tmp.write_text(json.dumps({"step": step, "t": time.time()}))
        os.replace(tmp, self.folder / f"rank-{self.rank}.beat")


def main_thread_frames(dump: str) -> list[tuple[str, int, str]]:
    """The frames (file, line, function) of the thread that received the signal, innermost first."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    main = next((b for b in blocks if b.startswith("Current thread")), blocks[0] if blocks else "")
    matches = [_FRAME.match(line) for line in main.splitlines()]
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in matches if m]


def where(frames: list[tuple[str, int, str]]) -> str:
    """A short name for where a rank is: its innermost frame's function, and the first frame of
    the caller's own code (not torch's, not the lab's) when there is one."""
    if not frames:
        return "no Python frame (in native code, or not started)"
    inner = f"{frames[0][2]} ({Path(frames[0][0]).name}:{frames[0][1]})"
    own = next((fr for fr in frames if "site-packages" not in fr[0] and "parallel_lab" not in fr[0]), None)
    return inner if own is None or own == frames[0] else f"{inner}, called from {own[2]}:{own[1]}"


class HangWatcher:
    """In the launching process: watches the heartbeats of `world_size` ranks in `folder`; when none
    has progressed for `deadline` seconds, collects every rank's stack once (`report`)."""

    def __init__(
        self, folder: str | os.PathLike, world_size: int, deadline: float = 3.0, poll: float = 0.1
    ) -> None:
        if not deadline > 0:
            raise ValueError(f"deadline must be a positive number of seconds, got {deadline!r}")
        self.folder, self.world_size, self.deadline, self.poll = Path(folder), world_size, deadline, poll
        self.report: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="parallel_lab-hang-watch")
        self._thread.start()

    def _beats(self) -> dict[int, dict]:
        out = {}
        for r in range(self.world_size):
            try:
                out[r] = json.loads((self.folder / f"rank-{r}.beat").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            beats = self._beats()
            if len(beats) < self.world_size:
                continue
            if time.time() - max(b["t"] for b in beats.values()) > self.deadline:
                self.report = self.collect(beats)
                return

    def collect(self, beats: dict[int, dict] | None = None) -> dict:
        """Signal every rank, read its stack; name the ranks whose place differs from the majority's."""
        beats = beats if beats is not None else self._beats()
        for r in range(self.world_size):
            (self.folder / f"rank-{r}.stack").write_text("")
        for r in range(self.world_size):
            try:
                os.kill(int((self.folder / f"rank-{r}.pid").read_text()), signal.SIGUSR1)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
        time.sleep(0.5)  # faulthandler writes from a signal handler: give it a moment
        places = {r: where(main_thread_frames((self.folder / f"rank-{r}.stack").read_text()))
                  for r in range(self.world_size)}  # fmt: skip
        count = Counter(places.values())
        majority, n = count.most_common(1)[0]
        culprits = [r for r, p in places.items() if p != majority] if n > self.world_size / 2 else []
        return {"steps": {r: b["step"] for r, b in beats.items()}, "where": places, "majority": majority,
                "culprits": culprits}  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> HangWatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_report(report: dict) -> str:
    """The report, one line per rank, then the rank(s) to look at."""
    lines = [f"rank {r}: step {report['steps'].get(r)}, in {w}" for r, w in sorted(report["where"].items())]
    if report["culprits"]:
        who = report["culprits"]
        name = f"rank {who[0]} is" if len(who) == 1 else f"ranks {', '.join(map(str, who))} are"
        lines.append(f"{name} not where the others are: look there first")
    else:
        lines.append("every rank is in the same place: no single culprit")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- pairwise tests
def _pair_test(ctx, group, n: int, slow: dict[int, float], wrong: set[int]) -> tuple[float, bool]:
    """Every rank of `group` multiplies the same (n, n) matrices; the results are all-gathered in the
    group and compared; returns (seconds, results agree)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(ctx.device) for _ in range(2))  # (n, n) each
    t0 = time.perf_counter()
    c = a @ b  # (n, n)
    if ctx.rank in wrong:
        c[0, 0] += 1.0  # a faulty unit computes a wrong number
    if ctx.rank in slow:
        time.sleep(slow[ctx.rank])  # a slow card or a throttled link
    every = comms.dist_all_gather(ctx, c.sum().reshape(1), group=group)  # (2, 1)
    return time.perf_counter() - t0, bool((every == every[0]).all())


def find_faulty(ctx, n: int = 256, slow: dict[int, float] | None = None, wrong: set[int] | None = None,
                factor: float = 3.0, min_gap: float = 0.25) -> dict:  # fmt: skip
    """Two rounds of pairwise tests (world size even). Round 1 pairs (0,1), (2,3), ...; a pair that
    disagrees or takes `factor` x the median time is suspect. Round 2 pairs every rank of a suspect
    pair with a rank of a good pair; the rank whose new pair fails again is faulty. `slow`/`wrong`
    inject faults (rank -> extra seconds; ranks that compute wrong results) for the lesson. A pair is
    slow when it takes more than `factor` x the fastest pair's time and `min_gap` seconds more (a
    loaded machine's jitter is not a fault)."""
    p = ctx.world_size
    if p % 2:
        raise ValueError(f"the world size must be even to pair the ranks, got {p}")
    slow, wrong = slow or {}, set(wrong or ())

    def round_(pairs: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[float, bool]]:
        groups = [dist.new_group(list(pr)) for pr in pairs]  # every rank creates every group, in order
        mine = next(i for i, pr in enumerate(pairs) if ctx.rank in pr)
        t, ok = _pair_test(ctx, groups[mine], n, slow, wrong)
        rows = comms.dist_all_gather(
            ctx, torch.tensor([t, float(ok)], device=ctx.device)
        )  # (p, 2): every rank learns all
        return {pr: (max(rows[pr[0], 0].item(), rows[pr[1], 0].item()), bool(rows[pr[0], 1] and rows[pr[1], 1]))
                for pr in pairs}  # fmt: skip

    first = [(i, i + 1) for i in range(0, p, 2)]
    r1 = round_(first)
    fastest = min(t for t, _ in r1.values())  # the baseline: with two pairs a median is just their mean
    bad = [pr for pr, (t, ok) in r1.items() if not ok or (t > factor * fastest and t - fastest > min_gap)]
    good = [pr for pr in first if pr not in bad]
    faulty: list[int] = []
    r2: dict = {}
    if bad and good:
        # each suspect rank meets a rank of a good pair; ranks left over meet each other
        suspects = [r for pr in bad for r in pr]
        helpers = [r for pr in good for r in pr]
        pairs2, used = [], set()
        for s, h in zip(suspects, helpers):
            pairs2.append((min(s, h), max(s, h)))
            used |= {s, h}
        rest = [r for r in range(p) if r not in used]
        pairs2 += [(rest[i], rest[i + 1]) for i in range(0, len(rest), 2)]
        r2 = round_(pairs2)
        fastest2 = min(t for t, _ in r2.values())
        for pr, (t, ok) in r2.items():
            if not ok or (t > factor * fastest2 and t - fastest2 > min_gap):
                faulty += [r for r in pr if r in suspects]
    return {"round1": {f"{a}-{b}": v for (a, b), v in r1.items()}, "suspect_pairs": bad,
            "round2": {f"{a}-{b}": v for (a, b), v in r2.items()}, "faulty": sorted(faulty)}  # fmt: skip


__all__ = ["HangWatcher", "Heartbeat", "find_faulty", "format_report", "main_thread_frames", "where"]

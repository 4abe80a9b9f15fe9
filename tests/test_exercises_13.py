"""Lesson 13's exercises: the reference solution passes; other right designs pass too; wrappers of the lab's
and torch's functions, answer tables from an earlier grade run and wrong algorithms fail, each with a message
naming what differed; the optimum the interval check compares with is the optimum of the simulated process."""

from __future__ import annotations

import math
import re

import pytest
from solution_code import (
    _check_cell,
    edit,
    fails_saying,
    functions_doing,
    not_switched_off,
    passes_with_one_line,
    run_check,
    solution_namespace,
    table_cheat_fails,
)

CHECKS = ["check_commit_checkpoint", "check_elastic_sampler", "check_best_interval"]

# ----------------------------------------------------------------------------- exercise 1: pieces of answers
FSYNC_DIR = (
    "def _sync_dir(path):\n    fd = os.open(path, os.O_RDONLY)\n    try:\n        os.fsync(fd)\n"
    "    finally:\n        os.close(fd)\n"
)
HEAD = "import os, re, shutil, json\n" + FSYNC_DIR
ATOMIC = (
    "def _atomic(path, data):\n    tmp = os.path.join(os.path.dirname(path), '_' + os.path.basename(path) + '.tmp')\n"
    "    with open(tmp, 'wb') as f:\n        f.write(data)\n        f.flush()\n        os.fsync(f.fileno())\n"
    "    os.replace(tmp, path)\n    _sync_dir(os.path.dirname(path))\n"
)
HIGHEST_DIR = (
    "def latest_checkpoint(folder):\n"
    "    steps = [int(n[5:]) for n in os.listdir(folder) if re.fullmatch(r'step-\\d+', n)]\n"
    "    if not steps:\n        return None\n    d = os.path.join(folder, f'step-{max(steps):09d}')\n"
    "    return max(steps), {n: open(os.path.join(d, n), 'rb').read() for n in os.listdir(d) if n[0] not in '._'}\n"
)
# a manifest written last into the step's folder (the lesson's own design), with `{mkdir}`, `{clear}` and
# `{reader}` open for the mistakes below
MANIFEST = (
    HEAD
    + ATOMIC
    + "def commit_checkpoint(folder, step, files):\n    d = os.path.join(folder, f'step-{step:09d}')\n"
    "{clear}    {mkdir}\n    _sync_dir(folder)\n    for name, data in files.items():\n        _atomic(os.path.join(d, name), data)\n"
    "    _atomic(os.path.join(d, '_MANIFEST'), json.dumps(sorted(files)).encode())\n"
    "{reader}"
)


def _manifest(clear: str, mkdir: str, reader: str) -> str:
    return MANIFEST.replace("{clear}", clear).replace("{mkdir}", mkdir).replace("{reader}", reader)


CLEAR = "    shutil.rmtree(os.path.join(folder, f'step-{step:09d}'), ignore_errors=True)\n"
VERIFYING = (
    "def latest_checkpoint(folder):\n"
    "    for s in sorted((int(n[5:]) for n in os.listdir(folder) if re.fullmatch(r'step-\\d+', n)), reverse=True):\n"
    "        d = os.path.join(folder, f'step-{s:09d}')\n"
    "        if os.path.exists(os.path.join(d, '_MANIFEST')):\n"
    "            names = json.loads(open(os.path.join(d, '_MANIFEST')).read())\n"
    "            return s, {n: open(os.path.join(d, n), 'rb').read() for n in names}\n"
    "    return None\n"
)
EVERY_FILE = VERIFYING.replace("for n in names}", "for n in os.listdir(d) if n[0] != '_'}")
POINTER_READER = (
    "def latest_checkpoint(folder):\n    p = os.path.join(folder, '_LATEST')\n    if not os.path.exists(p):\n"
    "        return None\n    s = int(open(p).read())\n    d = os.path.join(folder, f'step-{s:09d}')\n"
    "    return s, {n: open(os.path.join(d, n), 'rb').read() for n in os.listdir(d)}\n"
)
POINTER_FILES = (
    "    d = os.path.join(folder, f'step-{step:09d}')\n    shutil.rmtree(d, ignore_errors=True)\n    os.mkdir(d)\n"
    "    _sync_dir(folder)\n    for name, data in files.items():\n        with open(os.path.join(d, name), 'wb') as f:\n"
    "            f.write(data)\n            f.flush()\n            os.fsync(f.fileno())\n    _sync_dir(d)\n"
)
DONE_READER = (
    "def latest_checkpoint(folder):\n"
    "    for s in sorted((int(n[5:]) for n in os.listdir(folder) if re.fullmatch(r'step-\\d+', n)), reverse=True):\n"
    "        d = os.path.join(folder, f'step-{s:09d}')\n        if os.path.exists(os.path.join(d, '_DONE')):\n"
    "            return s, {n: open(os.path.join(d, n), 'rb').read() for n in os.listdir(d) if n[0] != '_'}\n"
    "    return None\n"
)


def _done_marker(sync_root: bool) -> str:
    """Files written and fsync'ed into step-N/, step-N/ fsync'ed, then an empty _DONE marker made and never fsync'ed;
    the root folder fsync'ed after the mkdir or not."""
    return (
        HEAD
        + "def commit_checkpoint(folder, step, files):\n    d = os.path.join(folder, f'step-{step:09d}')\n"
        "    shutil.rmtree(d, ignore_errors=True)\n    os.mkdir(d)\n"
        + ("    _sync_dir(folder)\n" if sync_root else "")
        + "    for name, data in files.items():\n        with open(os.path.join(d, name), 'wb') as f:\n"
        "            f.write(data)\n            f.flush()\n            os.fsync(f.fileno())\n    _sync_dir(d)\n"
        "    open(os.path.join(d, '_DONE'), 'w').close()\n" + DONE_READER
    )


RIGHT = {
    "a manifest written last, checked by the reader": _manifest(
        clear=CLEAR, mkdir="os.makedirs(d, exist_ok=True)", reader=VERIFYING
    ),
    "a pointer file replaced atomically": HEAD
    + ATOMIC
    + "def commit_checkpoint(folder, step, files):\n"
    + POINTER_FILES
    + "    _atomic(os.path.join(folder, '_LATEST'), str(step).encode())\n"
    + POINTER_READER,
    "a symlink switched by a rename": HEAD
    + "def commit_checkpoint(folder, step, files):\n    v = f'_v-{step:09d}'\n    d = os.path.join(folder, v)\n"
    "    shutil.rmtree(d, ignore_errors=True)\n    os.mkdir(d)\n    _sync_dir(folder)\n    for name, data in files.items():\n"
    "        fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
    "        os.write(fd, data)\n        os.fsync(fd)\n        os.close(fd)\n    _sync_dir(d)\n"
    "    tmp = os.path.join(folder, '_current.tmp')\n    if os.path.lexists(tmp):\n        os.unlink(tmp)\n"
    "    os.symlink(v, tmp)\n    os.replace(tmp, os.path.join(folder, '_current'))\n    _sync_dir(folder)\n"
    "def latest_checkpoint(folder):\n    p = os.path.join(folder, '_current')\n    if not os.path.lexists(p):\n"
    "        return None\n    v = os.readlink(p)\n    d = os.path.join(folder, v)\n"
    "    return int(v[3:]), {n: open(os.path.join(d, n), 'rb').read() for n in os.listdir(d)}\n",
    "pathlib, tempfile and os.sync": "import os, re, tempfile\nfrom pathlib import Path\n"
    "def commit_checkpoint(folder, step, files):\n    tmp = Path(tempfile.mkdtemp(dir=folder, prefix='_new-'))\n"
    "    for name, data in files.items():\n        (tmp / name).write_bytes(data)\n    os.sync()\n"
    "    tmp.rename(Path(folder) / f'step-{step:09d}')\n    os.sync()\n" + HIGHEST_DIR,
}


def _sampler_edit(*pairs: tuple[str, str]) -> str:
    """The solution's Sampler with each (old, new) replaced once."""
    src = edit("13", "Sampler", *pairs[0])
    for old, new in pairs[1:]:
        assert old in src, old
        src = src.replace(old, new, 1)
    return src


# a rank whose shard runs out fills its step from the next epoch's shard
SPILL = _sampler_edit(
    (
        """        each, extra = divmod(len(self.dealt), self.world_size)
        if self.read >= each + (extra > 0):""",
        """        out = []
        while len(out) < k:
            out += self._take(k - len(out))
        return out

    def _take(self, k):
        each, extra = divmod(len(self.dealt), self.world_size)
        if self.read >= each + (extra > 0):""",
    )
)
# the job's place kept in the class, per (n, seed): right while one job runs from start to end in one process
CLASS_STATE = """_Ref = Sampler
class Sampler:
    JOBS = {}
    def __init__(self, n, seed, rank, world_size):
        self.key, self.rank, self.world_size = (n, seed), rank, world_size
        Sampler.JOBS.setdefault(self.key, {"state": _Ref(n, seed, 0, world_size).state_dict(), "done": 0})
    def take(self, k):
        job = Sampler.JOBS[self.key]
        s = _Ref(*self.key, self.rank, self.world_size)
        s.load_state_dict(job["state"])
        out = s.take(k)
        job["done"] += 1
        if job["done"] == self.world_size:
            job["state"], job["done"] = s.state_dict(), 0
        return out
    def state_dict(self):
        return {}
    def load_state_dict(self, state):
        pass
"""
# another right state: the indices read so far this epoch, not the places left
READ_SET = _sampler_edit(
    ('return {"epoch": self.epoch, "left": left}',
     'perm = self.order(self.epoch).tolist()\n'
     '        return {"epoch": self.epoch, "done": sorted(set(perm) - {perm[p] for p in left})}'),
    ('self.epoch, self.dealt, self.read = int(state["epoch"]), [int(p) for p in state["left"]], 0',
     'self.epoch, self.read, done = state["epoch"], 0, set(state["done"])\n'
     '        self.dealt = [p for p, i in enumerate(self.order(self.epoch).tolist()) if i not in done]'),
)  # fmt: skip

WRONG = [
    # ---- exercise 1: commit_checkpoint and latest_checkpoint
    ("check_commit_checkpoint", "each file atomic, no commit point",
     HEAD + ATOMIC + "def commit_checkpoint(folder, step, files):\n    d = os.path.join(folder, f'step-{step:09d}')\n"
     "    os.makedirs(d, exist_ok=True)\n    _sync_dir(folder)\n    for name, data in files.items():\n"
     "        _atomic(os.path.join(d, name), data)\n" + HIGHEST_DIR,
     "is not complete until all of them are"),
    ("check_commit_checkpoint", "the pointer written before the files",
     HEAD + ATOMIC + "def commit_checkpoint(folder, step, files):\n"
     "    _atomic(os.path.join(folder, '_LATEST'), str(step).encode())\n" + POINTER_FILES + POINTER_READER,
     "the reader must still find the previous checkpoint or the new one"),
    ("check_commit_checkpoint", "the pointer rewritten in place",
     HEAD + "def commit_checkpoint(folder, step, files):\n" + POINTER_FILES
     + "    with open(os.path.join(folder, '_LATEST'), 'w') as f:\n        f.write(str(step))\n"
     "        f.flush()\n        os.fsync(f.fileno())\n" + POINTER_READER,
     "in the middle of its operation"),
    ("check_commit_checkpoint", "no fsync of the files before the commit",
     edit("13", "commit_checkpoint", "            os.fsync(f.fileno())  # the bytes are on disk\n", ""),
     "were not fsync'ed"),
    ("check_commit_checkpoint", "the step folder's own name never fsync'ed, a marker made last",
     _done_marker(sync_root=False), "the name step-"),
    ("check_commit_checkpoint", "a marker made last, its folder not fsync'ed after",
     _done_marker(sync_root=True), "was not fsync'ed after it"),
    ("check_commit_checkpoint", "fsync before the buffer is flushed",
     edit("13", "commit_checkpoint", "            f.flush()\n", ""), "before f.flush()"),
    ("check_commit_checkpoint", "everything pickled into one file, replaced atomically",
     HEAD + "import pickle\ndef commit_checkpoint(folder, step, files):\n    tmp = os.path.join(folder, '_all.tmp')\n"
     "    with open(tmp, 'wb') as f:\n        f.write(pickle.dumps((step, files)))\n        f.flush()\n"
     "        os.fsync(f.fileno())\n    os.replace(tmp, os.path.join(folder, '_all'))\n    _sync_dir(folder)\n"
     "def latest_checkpoint(folder):\n    p = os.path.join(folder, '_all')\n"
     "    return pickle.loads(open(p, 'rb').read()) if os.path.exists(p) else None\n",
     "under its own name"),
    ("check_commit_checkpoint", "no fsync of the new folder before the rename",
     edit("13", "commit_checkpoint", "    fsync_folder(incoming)  # and so are their names\n", ""),
     "was last fsync'ed"),
    ("check_commit_checkpoint", "no fsync after the commit",
     edit("13", "commit_checkpoint", "    fsync_folder(folder)  # and so does the rename\n", ""),
     "was not fsync'ed after it"),
    ("check_commit_checkpoint", "the reader takes the highest folder, complete or not",
     _manifest(clear=CLEAR, mkdir="os.makedirs(d, exist_ok=True)", reader=HIGHEST_DIR),
     "is not complete until all of them are"),
    ("check_commit_checkpoint", "steps compared as text",
     edit("13", "commit_checkpoint", 'f"step-{step:09d}"', 'f"step-{step}"')
     + "\ndef latest_checkpoint(folder):\n    names = [n for n in os.listdir(folder) if n.startswith('step-')]\n"
     "    if not names:\n        return None\n    d = os.path.join(folder, max(names))\n"
     "    return int(max(names)[5:]), {n: open(os.path.join(d, n), 'rb').read() for n in os.listdir(d)}\n",
     "steps are numbers"),
    ("check_commit_checkpoint", "a second commit stops at the crashed one's folder",
     _manifest(clear="", mkdir="os.mkdir(d)", reader=VERIFYING), "among whatever the crashed commit left"),
    ("check_commit_checkpoint", "a second commit keeps the crashed one's files",
     _manifest(clear="", mkdir="os.makedirs(d, exist_ok=True)", reader=EVERY_FILE),
     "which the commit was not given"),
    ("check_commit_checkpoint", "remembers the last commit instead of reading the disk",
     "import os\nMEMORY = {}\ndef commit_checkpoint(folder, step, files):\n    MEMORY[folder] = (step, dict(files))\n"
     "    fd = os.open(os.path.join(folder, '_mark'), os.O_WRONLY | os.O_CREAT)\n    os.fsync(fd)\n    os.close(fd)\n"
     "def latest_checkpoint(folder):\n    return MEMORY.get(folder)\n", "expected step"),
    ("check_commit_checkpoint", "wraps the lab's write_files",
     "from parallel_lab.resilience import write_files, latest, read_shard\n"
     "def commit_checkpoint(folder, step, files):\n    write_files(folder, step, list(files.values()))\n"
     "def latest_checkpoint(folder):\n    d, m, _ = latest(folder)\n    return None if d is None else (m['step'], {})\n",
     "switched off"),
    ("check_commit_checkpoint", "torch's atomic write, inductor's",
     "import os\nfrom torch._inductor.codecache import write_atomic\n" + HIGHEST_DIR
     + "def commit_checkpoint(folder, step, files):\n    for name, data in files.items():\n"
     "        write_atomic(os.path.join(folder, f'step-{step:09d}', name), data, make_dirs=True)\n",
     "switched off"),
    ("check_commit_checkpoint", "torch's DCP file-system writer",
     "import os\nfrom torch.distributed.checkpoint import FileSystemWriter\n" + HIGHEST_DIR
     + "def commit_checkpoint(folder, step, files):\n    FileSystemWriter(os.path.join(folder, f'step-{step:09d}'))\n",
     "switched off"),
    ("check_commit_checkpoint", "torch.save",
     "import io, os, torch\n" + HIGHEST_DIR
     + "def commit_checkpoint(folder, step, files):\n    torch.save(files, io.BytesIO())\n", "switched off"),
    ("check_commit_checkpoint", "reads the check's own helpers",
     "from parallel_lab.grading.checks.resilience import _as_checkpoint\n" + edit(
         "13", "latest_checkpoint", "    return step, files", "    return _as_checkpoint((step, files))"),
     "switched off"),
    # ---- exercise 2: Sampler
    ("check_elastic_sampler", "what was read taken for a prefix of the order (the lesson's running position)",
     _sampler_edit(('return {"epoch": self.epoch, "left": left}', 'return {"epoch": self.epoch, "count": self.n - len(left)}'),
                   ('[int(p) for p in state["left"]]', 'list(range(state["count"], self.n))')), "as if the"),
    ("check_elastic_sampler", "starts the epoch over on resume",
     _sampler_edit(('[int(p) for p in state["left"]]', 'list(range(self.n))')), "started the epoch over"),
    ("check_elastic_sampler", "the old deal and its read count, cut anew for the new ranks",
     _sampler_edit(('return {"epoch": self.epoch, "left": left}',
                    'return {"epoch": self.epoch, "dealt": self.dealt, "read": self.read}'),
                   ('self.epoch, self.dealt, self.read = int(state["epoch"]), [int(p) for p in state["left"]], 0',
                    'self.epoch, self.dealt, self.read = state["epoch"], state["dealt"], state["read"]')),
     "not how far each shard got"),
    ("check_elastic_sampler", "only the last deal remembered",
     _sampler_edit(('return {"epoch": self.epoch, "left": left}',
                    'return {"epoch": self.epoch, "world": self.world_size, "read": self.read}'),
                   ('self.epoch, self.dealt, self.read = int(state["epoch"]), [int(p) for p in state["left"]], 0',
                    'w, t, n = state["world"], state["read"], self.n\n'
                    '        q, m = divmod(n, w)\n'
                    '        left = [p for r in range(w) for p in list(range(n))[r * q + min(r, m) : r * q + min(r, m) + q + (r < m)][t:]]\n'
                    '        self.epoch, self.dealt, self.read = state["epoch"], left, 0')),
     "forgot an earlier resume"),
    ("check_elastic_sampler", "this rank's own leftovers saved, not the job's",
     _sampler_edit(('return {"epoch": self.epoch, "left": left}',
                    'start = self.rank * each + min(self.rank, extra)\n'
                    '        return {"epoch": self.epoch, "left": self.dealt[start : start + each + (self.rank < extra)][self.read :]}')),
     "samples left, in the order"),
    ("check_elastic_sampler", "strided shards (DistributedSampler's cut)",
     _sampler_edit(("self.dealt[start : start + each + (self.rank < extra)][self.read : self.read + k]",
                    "self.dealt[self.rank :: self.world_size][self.read : self.read + k]")),
     "DistributedSampler's own cut"),
    ("check_elastic_sampler", "a step runs on into the next epoch", SPILL, "never runs into the next epoch"),
    ("check_elastic_sampler", "keeps the job's place in a class attribute", CLASS_STATE, "from the same saved states"),
    ("check_elastic_sampler", "wraps the lab's ResumableSampler",
     "from parallel_lab.resilience import ResumableSampler\nclass Sampler:\n"
     "    def __init__(self, n, seed, rank, world_size):\n        self.s, self.r, self.w = ResumableSampler(n, seed), rank, world_size\n"
     "    def take(self, k):\n        return self.s.take(k * self.w)[self.r::self.w]\n"
     "    def state_dict(self):\n        return self.s.state_dict()\n"
     "    def load_state_dict(self, state):\n        self.s.load_state_dict(state)\n", "switched off"),
    ("check_elastic_sampler", "torch's DistributedSampler",
     "from torch.utils.data.distributed import DistributedSampler\nclass Sampler:\n"
     "    def __init__(self, n, seed, rank, world_size):\n"
     "        self.d = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed)\n"
     "    def take(self, k):\n        return [(0, i) for i in list(iter(self.d))[:k]]\n"
     "    def state_dict(self):\n        return {}\n    def load_state_dict(self, state):\n        pass\n",
     "switched off"),
    ("check_elastic_sampler", "torch's ElasticDistributedSampler",
     "from torch.distributed.elastic.utils.data.elastic_distributed_sampler import ElasticDistributedSampler\n"
     "class Sampler:\n    def __init__(self, n, seed, rank, world_size):\n"
     "        self.d = ElasticDistributedSampler(range(n), num_replicas=world_size, rank=rank)\n"
     "    def take(self, k):\n        return [(0, i) for i in list(iter(self.d))[:k]]\n"
     "    def state_dict(self):\n        return {}\n    def load_state_dict(self, state):\n        pass\n",
     "switched off"),
    ("check_elastic_sampler", "torch's RandomSampler",
     "import torch\nfrom torch.utils.data import RandomSampler\nclass Sampler:\n"
     "    def __init__(self, n, seed, rank, world_size):\n        self.s = RandomSampler(range(n))\n"
     "    def take(self, k):\n        return [(0, i) for i in list(iter(self.s))[:k]]\n"
     "    def state_dict(self):\n        return {}\n    def load_state_dict(self, state):\n        pass\n",
     "switched off"),
    # ---- exercise 3: best_interval
    ("check_best_interval", "the first-order sqrt(2 C M)",
     "def best_interval(checkpoint_cost, restart_cost, mtbf):\n    return (2 * checkpoint_cost * mtbf) ** 0.5\n",
     "first-order sqrt(2 C M)"),
    ("check_best_interval", "sqrt(2 C (M + R))",
     "def best_interval(checkpoint_cost, restart_cost, mtbf):\n"
     "    return (2 * checkpoint_cost * (mtbf + restart_cost)) ** 0.5\n", "moves with the restart cost"),
    ("check_best_interval", "Daly's higher-order estimate",
     "def best_interval(c, r, m):\n    if c >= 2 * m:\n        return m\n"
     "    return (2 * c * m) ** 0.5 * (1 + (c / (2 * m)) ** 0.5 / 3 + c / (18 * m)) - c\n",
     "Daly's higher-order estimate"),
    ("check_best_interval", "the restart counted as part of the checkpoint",
     edit("13", "best_interval", "c, m = checkpoint_cost, mtbf", "c, m = checkpoint_cost + restart_cost, mtbf"),
     "moves with the restart cost"),
    ("check_best_interval", "the lesson's first-order goodput, maximised",
     "def best_interval(c, r, m):\n    good = lambda t: t / (t + c) * (1 - (r + (t + c) / 2) / m)\n"
     "    lo, hi = 1e-6 * m, m\n    for _ in range(200):\n        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3\n"
     "        lo, hi = (a, hi) if good(a) < good(b) else (lo, b)\n    return lo\n", "that wastes least"),
    ("check_best_interval", "a failure that loses half an interval, counted once",
     "def best_interval(c, r, m):\n    # waste per second of work: c / t + (t + c) / (2 m), minimised\n"
     "    return (2 * c * m + c * c) ** 0.5\n", "must come within 1%"),
    ("check_best_interval", "a tuned constant",
     "def best_interval(checkpoint_cost, restart_cost, mtbf):\n    return 0.7 * mtbf\n", "must come within 1%"),
    ("check_best_interval", "wraps the lab's young_daly_interval",
     "from parallel_lab.resilience import young_daly_interval\ndef best_interval(c, r, m):\n"
     "    return young_daly_interval(c, m)\n", "switched off"),
    ("check_best_interval", "reads the check's own optimum",
     "from parallel_lab.grading.checks.resilience import _exact_interval\ndef best_interval(c, r, m):\n"
     "    return _exact_interval(c, m)\n", "switched off"),
]  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    passes_with_one_line("13", check, capsys)


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("13", check, label, source, want)


@pytest.mark.parametrize("label", list(RIGHT))
def test_other_right_commits_pass(label, capsys):
    run_check("13", "check_commit_checkpoint", RIGHT[label])
    assert "check_commit_checkpoint passed" in capsys.readouterr().out


def test_another_right_sampler_state_passes(capsys):
    """The state may say what was read (indices) instead of what is left (places): the check reads behaviour."""
    run_check("13", "check_elastic_sampler", READ_SET)
    assert "check_elastic_sampler passed" in capsys.readouterr().out


def test_the_class_attribute_cheat_passes_one_job_at_a_time():
    """The cheat the branch and the new job catch does follow the rule while one job runs alone: so those two
    probes are what fails it, not something else."""
    ns = solution_namespace("13")
    exec(compile(CLASS_STATE, "<cheat>", "exec"), ns)  # noqa: S102
    from parallel_lab.grading.checks.resilience import _Job

    for n, world, ks, then in [(11, 3, [2, 1, 3, 2], 2), (7, 2, [3, 3, 1], 4)]:
        job, ranks = _Job(n, 5, world), [ns["Sampler"](n, 5, r, world) for r in range(world)]
        for k in ks:
            assert [s.take(k) for s in ranks] == job.step(k)
        job, ranks = job.resume(then), [ns["Sampler"](n, 5, r, then) for r in range(then)]
        for k in ks:
            assert [s.take(k) for s in ranks] == job.step(k)


def test_the_checks_are_quick():
    import time

    solution_namespace("13")
    for check in CHECKS:
        start = time.perf_counter()
        run_check("13", check)
        assert time.perf_counter() - start < 5.0, check  # about 1 s alone; room for a busy machine


# ----------------------------------------------------------------------------- cases drawn at grade time
def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("13", check), "<check>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_grade_runs_checkpoints_fails_the_next():
    """A reader that logs what the reference read in one grade run, keyed by what the folder holds (names and
    sizes), and answers from that table in the next, fails: the names, sizes and steps are drawn again."""
    import os

    ns = solution_namespace("13")
    real, table = ns["latest_checkpoint"], {}

    def key(folder):
        return tuple(sorted((os.path.relpath(os.path.join(d, f), folder), os.path.getsize(os.path.join(d, f)))
                            for d, _, fs in os.walk(folder) for f in fs))  # fmt: skip

    def logging(folder):
        table[key(folder)] = out = real(folder)
        return out

    ns["latest_checkpoint"] = logging
    _run(ns, "check_commit_checkpoint")
    assert len(table) > 10
    ns["latest_checkpoint"] = lambda folder: table.get(key(folder))
    with pytest.raises(AssertionError, match="latest_checkpoint"):
        _run(ns, "check_commit_checkpoint")


def test_a_sampler_replaying_one_run_fails_the_next():
    ns = solution_namespace("13")
    real, table = ns["Sampler"], {}

    class Logging(real):
        def take(self, k):
            out = super().take(k)
            table.setdefault((self.n, self.seed, self.rank, self.world_size), []).append(out)
            return out

    ns["Sampler"] = Logging
    _run(ns, "check_elastic_sampler")

    class Replaying:
        def __init__(self, n, seed, rank, world_size):
            self.key, self.i = (n, seed, rank, world_size), 0

        def take(self, k):
            runs = table.get(self.key, [])
            out = runs[self.i] if self.i < len(runs) else [(0, 0)] * k
            self.i += 1
            return out

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, state):
            self.i = state["i"]

    ns["Sampler"] = Replaying
    with pytest.raises(AssertionError, match="expected"):
        _run(ns, "check_elastic_sampler")


def test_a_table_of_one_grade_runs_intervals_fails_the_next():
    table_cheat_fails("13", "best_interval", "check_best_interval", 1.0, match="must come within 1%")


# ----------------------------------------------------------------------------- the optimum is the optimum
def test_the_exact_interval_is_the_minimum_of_the_expected_time():
    """The check's optimum against a brute-force minimum of the expected wall time per second of work,
    (M + R)(e^((T+C)/M) - 1) / T, on a fine grid; and that model against `simulate_goodput`."""
    from parallel_lab.grading.checks.resilience import _exact_interval
    from parallel_lab.resilience import simulate_goodput

    for c, m in [(90.0, 1800.0), (600.0, 1200.0), (1200.0, 1000.0), (2400.0, 1200.0), (3.0, 3600.0)]:
        cost = [(math.exp((t + c) / m) - 1) / t for t in (m * i / 100000 for i in range(1, 100000))]
        grid = m * (1 + min(range(len(cost)), key=cost.__getitem__)) / 100000
        assert abs(_exact_interval(c, m) / grid - 1) < 2e-4, (c, m)
    c, m, r = 500.0, 1000.0, 1500.0
    for t in (0.6 * _exact_interval(c, m), _exact_interval(c, m), 1.5 * _exact_interval(c, m)):
        runs = [simulate_goodput(t, c, r, m, work=5000 * m, seed=s) for s in range(2)]
        measured = sum(x.wall for x in runs) / (10000 * m)
        assert abs(measured / ((m + r) * (math.exp((t + c) / m) - 1) / t) - 1) < 0.02, t


def test_the_restart_cost_does_not_move_the_simulated_optimum():
    """Measured on the simulation: the best of a few intervals is the same with and without a restart cost."""
    from parallel_lab.grading.checks.resilience import _exact_interval
    from parallel_lab.resilience import simulate_goodput

    c, m = 600.0, 1200.0
    best = _exact_interval(c, m)
    ts = [best * f for f in (0.6, 0.8, 1.0, 1.25, 1.6)]
    for r in (0.0, 3 * c):
        walls = [sum(simulate_goodput(t, c, r, m, work=3000 * m, seed=s).wall for s in range(3)) for t in ts]
        assert min(range(len(ts)), key=walls.__getitem__) == 2, (r, walls)


def test_the_drawn_regimes_defeat_the_published_approximations():
    """Young's sqrt(2 C M) misses by more than 1% everywhere the check draws; Daly's higher-order estimate
    where C/M is 0.8 or more, which two drawn regimes and two fixed ones always are."""
    from parallel_lab.grading.checks.resilience import _daly, _exact_interval, _young

    for i in range(200):
        x = 1 / 20 * (40 ** (i / 199))  # C/M from 1/20 to 2
        assert abs(_young(x, 1.0) / _exact_interval(x, 1.0) - 1) > 0.1
        if x >= 0.8:
            assert abs(_daly(x, 1.0) / _exact_interval(x, 1.0) - 1) > 0.01, x
    # Daly 2006's own example (M = 15 min, dump time 5 min): his estimate is 9.1 minutes
    assert round(_daly(5.0, 15.0), 1) == 9.1


# ----------------------------------------------------------------------------- torch's own versions
# Names of torch's functions and classes that write checkpoints or files atomically, or split an epoch's
# samples over ranks. Abstract interfaces (`StorageWriter`, with only abstract methods) are included too:
# switching them off costs nothing.
JOB = re.compile(
    r"^[ \t]*(?:class|def) (_?\w*(?:DistributedSampler|ElasticSampler|StatefulSampler|ResumableSampler"
    r"|atomic_write|write_atomic|CheckpointWriter|StorageWriter|FileSystemWriter|FsspecWriter"
    r"|checkpoint_interval)\w*)",
    re.M,
)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's functions that do an exercise's job (found by name in torch's source) are all in the checks'
    switched-off lists: a new torch that adds one fails here, not in a learner's notebook."""

    from parallel_lab.grading.checks import resilience

    off = {**resilience.CHECKPOINT_FORBIDDEN, **resilience.SAMPLER_FORBIDDEN, **resilience.INTERVAL_FORBIDDEN}
    found = functions_doing(JOB)
    assert "torch.utils.data.distributed" in found, "the search finds nothing: torch's layout changed"
    missing = not_switched_off(found, off)
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"


@pytest.mark.parametrize(
    ("check", "source"),
    [
        (
            "check_commit_checkpoint",
            "def latest_checkpoint(folder):\n    raise NotImplementedError('todo')\n",
        ),
        (
            "check_commit_checkpoint",
            "def commit_checkpoint(folder, step, files):\n    raise NotImplementedError('todo')\n",
        ),
        (
            "check_elastic_sampler",
            "class Sampler:\n    def __init__(self, *a):\n        raise NotImplementedError('todo')\n",
        ),
        ("check_best_interval", "def best_interval(c, r, m):\n    raise NotImplementedError('todo')\n"),
    ],
)
def test_an_unfinished_exercise_stays_not_implemented(check, source):
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("13", check, source)

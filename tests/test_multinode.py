"""More machines: two torchrun agents on this host play two nodes (c10d rendezvous on 127.0.0.1).

Each script's result on 2 nodes x 2 ranks must equal the same script on one node x 4 ranks (the
same world size, so the same numbers: only the way the ranks met differs). A node that dies (its
agent and its ranks killed at once, as when a machine goes away) makes the other node fail within
seconds, with the lab's one-line explanation, and no process of the job is left. The Slurm batch
scripts in slurm/ parse, cover every lesson script, call only torchrun from this environment (and
Slurm's own srun and scontrol), and hand each script arguments it accepts.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SLURM = sorted((REPO / "slurm").glob("*.sbatch"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _agent(port: int, run_id: str, args: list[str], nproc: int = 2, nnodes: int = 2) -> subprocess.Popen:
    cmd = [str(BIN / "torchrun"), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
           "--local-addr", "127.0.0.1", "-m", *args]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _stable(out: str) -> list[str]:
    """The lines of a script's report that do not depend on timing."""
    keep = []
    for line in out.splitlines():
        line = re.sub(r"median step [\d.]+ ms \(slowest rank\), ", "", line)
        if any(w in line for w in ("hidden", "bubble", "trace written", " ms", "spans")):
            continue
        keep.append(line)
    return keep


def _job_processes(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(p.info["cmdline"] or []):
                out.append(p)
    return out


# HSDP with a replica per node covers what a DDP case would: ZeRO-3's gathers and reduce-scatters inside
# each node, and one all-reduce between the nodes (lesson 20)
CASES = {
    "hsdp": ("parallel_lab.scripts.zero --stage 3 --replicate 2 --steps 2 --d-model 32 --layers 2".split(),
             "identical weights on every rank; bytes equal the formulas"),
    "pipeline": (["parallel_lab.scripts.pipeline", "--schedule", "1f1b", "--steps", "2"],
                 "losses match single-process training"),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_nodes_give_what_one_node_gives(case, tmp_path):
    args, ok_line = CASES[case]
    port = _port()
    agents = [
        _agent(port, f"{case}-{port}", [*args, "--trace", str(tmp_path / "two.json")]) for _ in range(2)
    ]
    outs = [a.communicate(timeout=240) for a in agents]
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, (out + err)[-4000:]
    (two,) = [out for out, _ in outs if ok_line in out]  # the node that holds rank 0 prints the report
    single = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node", "4", "-m", *args,
                             "--trace", str(tmp_path / "one.json")], cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert single.returncode == 0, (single.stdout + single.stderr)[-4000:]
    assert _stable(two) == _stable(single.stdout)
    assert "4 ranks" in two or " 4 " in two


@pytest.mark.slow
def test_a_dead_node_stops_the_other_cleanly(tmp_path):
    root = tmp_path / "ckpt"
    marker = str(tmp_path)  # every process of this job has it on its command line
    args = ["parallel_lab.scripts.resilience", "--steps", "5000", "--every", "20", "--root", str(root),
            "--trace", str(tmp_path / "t.json")]  # fmt: skip
    port = _port()
    agents = [_agent(port, f"fault-{port}", args) for _ in range(2)]
    try:
        deadline = time.monotonic() + 180
        while not list(root.glob("step-*")):  # training is under way: a checkpoint was written
            assert time.monotonic() < deadline, "the two-node job never started training"
            assert all(a.poll() is None for a in agents), [a.communicate() for a in agents]
            time.sleep(0.2)
        victim = psutil.Process(agents[1].pid)
        for p in [victim, *victim.children(recursive=True)]:  # the whole node at once
            with contextlib.suppress(psutil.Error):
                p.kill()
        start = time.monotonic()
        out, err = agents[0].communicate(timeout=120)
        took = time.monotonic() - start
        assert agents[0].returncode != 0
        assert took < 60, f"the surviving node took {took:.0f} s to stop"
        assert re.search(r"parallel_lab: rank \d of 4 \(node \d, local rank \d\) lost a peer", err), err[
            -4000:
        ]
        agents[1].wait(timeout=30)
        time.sleep(1.0)
        left = _job_processes(marker)
        assert not left, [" ".join(p.cmdline()) for p in left]
    finally:
        for p in _job_processes(marker):
            with contextlib.suppress(psutil.Error):
                p.kill()


# ----------------------------------------------------------------------------- Slurm scripts
def test_there_is_a_slurm_script_for_every_lesson_script():
    scripts = {p.stem for p in (REPO / "parallel_lab" / "scripts").glob("*.py") if p.stem != "__init__"}
    assert {p.stem for p in SLURM} == scripts


@pytest.mark.parametrize("path", SLURM, ids=lambda p: p.name)
def test_slurm_script_parses_and_calls_what_exists(path, monkeypatch, tmp_path):
    text = path.read_text()
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (BIN / "torchrun").exists()
    body = " ".join(
        line.rstrip("\\").strip() for line in text.splitlines() if not line.lstrip().startswith("#")
    )
    commands = {m.group(1) for m in re.finditer(r"(?:^|;|\$\(|&&|\|)\s*([\w./-]+)", body)} - {"set", "mkdir"}
    assert "srun .venv/bin/torchrun" in body and "scontrol show hostnames" in body
    unknown = {
        c for c in commands if c not in {"srun", "scontrol", "head", ".venv/bin/torchrun"} and "=" not in c
    }
    assert not unknown, f"{path.name} calls {unknown}"
    # the script's own arguments, as the ranks would parse them (Slurm's variables given values)
    m = re.search(r"-m (parallel_lab\.scripts\.\w+)(.*)$", body)
    assert m, "no `-m parallel_lab.scripts.<name>` in the torchrun line"
    args = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", m.group(2))  # ${VAR:-default}: the default
    argv = shlex.split(args.replace("$SLURM_JOB_ID", "123").replace('"', ""))
    argv = [a.replace("runs/", f"{tmp_path}/") for a in argv]
    mod = importlib.import_module(m.group(1))
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "1")  # a rank other than 0: the script returns after the run
    monkeypatch.setenv("LOCAL_RANK", "1")
    for name in ("run_script", "run_from_env"):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, lambda *a, **k: None)
    monkeypatch.setattr("parallel_lab.runtime.from_env.run_from_env", lambda *a, **k: None)
    assert mod.main(argv) == 0
    if "--replicate" in argv:  # the HSDP run (REPLICATE=2 sbatch ...): 2 replicas of the 8 ranks parse too
        argv[argv.index("--replicate") + 1] = "2"
        assert mod.main(argv) == 0

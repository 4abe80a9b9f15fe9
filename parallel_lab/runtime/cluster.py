"""A lesson script as a cluster job: submitted with submitit, run by torchrun's environment, read back.

Lesson 16. The lab never launches across machines itself: torchrun (torch elastic), accelerate and
Slurm do. From a notebook, submitit (an established library that submits Python callables to
Slurm, or runs them as local processes on a laptop with the same API) sends `ScriptJob` to the
cluster; every task turns submitit's job environment into the variables torchrun would have set
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and runs the script's `main`, whose rank 0
writes the trace `RunResult.load` reads into the same plots as a local run.

Invariant: a `ScriptJob` runs exactly the script a launcher would run, with the same arguments.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["ScriptJob", "node_devices", "run_local_nodes", "submit_script"]


class ScriptJob:
    """A picklable callable: `python -m <module> <argv...>` inside one task of a submitit job."""

    def __init__(self, module: str, argv: list[str]) -> None:
        if not module.startswith("parallel_lab.scripts."):
            raise ValueError(
                f"module must be one of the lab's scripts (parallel_lab.scripts.<name>), got {module!r}"
            )
        self.module, self.argv = module, list(argv)

    def __call__(self) -> int:
        import submitit

        # RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from Slurm's (or the local executor's) variables
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        return importlib.import_module(self.module).main(self.argv)


def submit_script(module: str, argv: list[str], folder: str, nodes: int = 1, tasks_per_node: int = 2,
                  cluster: str | None = None, timeout_min: int = 10, **slurm: Any):  # fmt: skip
    """Submit a lesson script as a job of `nodes` x `tasks_per_node` ranks; returns the submitit job.

    `cluster=None` lets submitit choose (Slurm when `sbatch` is there, else an error); "local" runs the
    tasks as processes on this machine; `slurm` keyword arguments (e.g. `slurm_partition`,
    `gpus_per_node`) go to `update_parameters`.
    """
    import submitit

    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    executor.update_parameters(nodes=nodes, tasks_per_node=tasks_per_node, timeout_min=timeout_min, **slurm)
    return executor.submit(ScriptJob(module, argv))


def node_devices(node: int, nodes: int, nproc_per_node: int) -> dict[str, str]:
    """What agent `node` of a one-machine "cluster" may use: its own slice of the GPUs when every
    rank of every agent can have one (each agent numbers its ranks' GPUs from 0, so two agents
    shown the same GPUs would put two ranks on one, which NCCL refuses), else the CPU (gloo)."""
    from parallel_lab.runtime import device as dev

    gpus = dev.gpu_count()
    if gpus == 0 or dev.wants_cpu():
        return {}
    if gpus < nodes * nproc_per_node:
        return {"ACCELERATE_USE_CPU": "true"}
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in shown.split(",")] if shown else [str(i) for i in range(gpus)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[node * nproc_per_node : (node + 1) * nproc_per_node])}


def run_local_nodes(module: str, argv: list[str], nodes: int = 2, nproc_per_node: int = 2,
                    timeout: float = 300.0) -> list[subprocess.CompletedProcess]:  # fmt: skip
    """Start `nodes` torchrun agents on this machine, as if each were a machine of its own: they meet
    through a c10d rendezvous on 127.0.0.1 (every address stays on loopback), each starts
    `nproc_per_node` ranks. Returns each agent's completed process (stdout and stderr as text)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--nnodes", str(nodes), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"local-{port}", "--local-addr", "127.0.0.1",
           "-m", module, *argv]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, env={**env, **node_devices(i, nodes, nproc_per_node)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(nodes)]  # fmt: skip
    out = []
    try:
        for a in agents:
            stdout, stderr = a.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(cmd, a.returncode, stdout, stderr))
    finally:  # a node that did not finish goes with its ranks (torchrun starts each in its own session)
        import psutil

        for a in agents:
            if a.poll() is None:
                procs = [psutil.Process(a.pid), *psutil.Process(a.pid).children(recursive=True)]
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
    return out

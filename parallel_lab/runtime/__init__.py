"""The runtime: how one function runs on N real processes, and what it records.

Every lesson starts here (lesson 00 tours it). `launch` forks (or starts from a forkserver) one process per
rank from a notebook cell, sets up a torch.distributed process group (gloo on CPU, NCCL with
one GPU per rank), hands each rank a `Context`, and returns a `RunResult` with every rank's
return value, the merged timeline and the memory samples. `run_from_env` is the same thing
for a rank started by torchrun or accelerate launch (torchelastic's environment variables).
The memory tracker measures live tensor storages by category (the "model states plus
activations" accounting of Rajbhandari et al. 2020, ZeRO, section 3).

Read in this order:
  device.py        backend and device choice, the one place that talks to torch.cuda
  trace.py         Recorder: spans, memory samples, byte counts per rank
  context.py       Context (what a rank receives) and the launch errors
  launch.py        launch(): ranks from a notebook cell; processes.py: draining, blame, reaping
  forkserver_init.py  the forkserver's first preload: the server dies with the notebook
  from_env.py      run_from_env / run_script: the torchrun / accelerate side
  result.py        RunResult and its Chrome/Perfetto trace file
  alloc_hook.py    torch's CPU allocator wrapped in C++ (alloc_hook.cpp): every CPU allocation, no Python per op
  alloc_mode.py    the TorchDispatchMode that sees every op's new storages (any device; the fallback)
  memory.py        MemoryTracker: live bytes by category, through one of the two
  memory_state.py  model-state bytes measured by one real step (also on `meta`)
  overlap.py       per-layer backward spans and the share of communication hidden under them
  cluster.py       a lesson script as a submitit job (Slurm, or local processes): lesson 16
  parallel_dims.py ParallelDims: a DP x TP x PP mesh of ranks and its process groups (pipelines
                   and 3D runs are handed one; lesson 10 explains it)

Dependencies point one way: runtime <- comms <- techniques <- lessons. The runtime imports
no technique; `RunResult.plot_*` and `launch(live=True)` reach `plots`, which reads only the
runtime's records. This `__init__` imports nothing, so reading one record module (`trace`)
does not start the launcher: `parallel_lab` (the package's door) exports the public names.
"""

"""The launcher: results, streaming, failure modes, bad input, no leftover processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import parallel_lab as pl
from parallel_lab.runtime.launch import MAX_WORLD_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shared_helper(c: psutil.Process) -> bool:
    """multiprocessing's own helpers, by pid (a rank forked by the forkserver shares its command line)."""
    from multiprocessing import forkserver, resource_tracker

    return c.pid in (forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid)


def children() -> list[psutil.Process]:
    """Live child processes, except multiprocessing's shared helpers, started once per process: the
    resource tracker (spawn) and the forkserver (both exit with this process)."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and not _shared_helper(c):
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    left = children()
    assert not left, f"launch left processes behind: {[c.pid for c in left]}"


def _sum_ranks(ctx, scale):
    t = torch.full((3,), float(ctx.rank))
    with ctx.span("all_reduce", "comm"):
        dist.all_reduce(t)
    ctx.print("rank-0 says hi")
    return {"rank": ctx.rank, "sum": t[0].item() * scale, "threads": torch.get_num_threads()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_values_timeline_and_prints(world_size, capsys):
    res = pl.launch(_sum_ranks, world_size, 2.0)
    assert [v["rank"] for v in res.values] == list(range(world_size))
    expect = 2.0 * sum(range(world_size))
    assert all(v["sum"] == expect for v in res.values)
    spans = res.spans(kind="comm")
    assert sorted(e["rank"] for e in spans) == list(range(world_size))
    assert all(0 <= e["start"] <= e["end"] <= res.wall_time for e in spans)
    assert capsys.readouterr().out.count("rank-0 says hi") == 1
    assert all(v["threads"] == 1 for v in res.values)  # forked ranks stay single-threaded (OpenMP)


def test_kwargs_seed_and_threads():
    def f(ctx, a, b=0):
        return (a + b, ctx.seed, torch.get_num_threads(), torch.randn(1).item())

    res = pl.launch(f, 2, 1, b=2, seed=7, threads=1)  # threads=1 keeps fork
    assert [v[:3] for v in res.values] == [(3, 7, 1), (3, 7, 1)]
    torch.manual_seed(7)
    assert res.values[0][3] == res.values[1][3] == torch.randn(1).item()  # replicated init shares the seed


def test_fork_after_threaded_math_does_not_hang():
    """GNU OpenMP's pool does not survive fork: forked ranks must compute single-threaded."""
    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    for _ in range(3):
        a = a @ a / 256  # the parent's thread pool is now live

    def f(ctx):
        x = torch.randn(128, 128)
        return (x @ x).shape[0], torch.get_num_threads()

    assert pl.launch(f, 1, timeout=20).values == [(128, 1)]
    with pytest.raises(ValueError, match="threads=2 needs start_method='forkserver'"):
        pl.launch(f, 1, threads=2, start_method="fork")


def test_tensors_come_back_by_value():
    def f(ctx):
        return {"t": torch.arange(5) * (ctx.rank + 1), "big": torch.ones(100_000)}

    res = pl.launch(f, 2)
    assert res.values[1]["t"].tolist() == [0, 2, 4, 6, 8] and res.values[0]["big"].sum().item() == 100_000


def test_spawn_ships_closures_by_value():
    offset = 10
    res = pl.launch(lambda ctx: ctx.rank + offset, 2, start_method="spawn", timeout=60)
    assert res.values == [10, 11]


def test_forkserver_ranks_see_the_notebook_as_it_is_now(tmp_path, monkeypatch):
    """The forkserver starts once; a later launch's ranks still get this process's environment,
    working directory and closures, and run a backward after the parent ran one."""
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()  # the parent's own backward (on a GPU machine, autograd's threads)
    offset = 10

    def f(ctx):
        y = torch.ones(3, requires_grad=True)
        (y * ctx.rank).sum().backward()
        return ctx.rank + offset, float(y.grad.sum()), os.environ.get("PL_FORKSERVER_TEST"), os.getcwd()

    first = pl.launch(f, 2, start_method="forkserver", timeout=60)  # may start the server
    monkeypatch.setenv("PL_FORKSERVER_TEST", "later")
    monkeypatch.chdir(tmp_path)
    later = pl.launch(f, 2, start_method="forkserver", timeout=60)  # the same server
    assert [v[:2] for v in first.values] == [(10, 0.0), (11, 3.0)]
    assert later.values == [(10, 0.0, "later", str(tmp_path)), (11, 3.0, "later", str(tmp_path))]


def test_forkserver_ranks_die_with_the_notebook(tmp_path):
    """A kernel killed outright: its ranks (children of the forkserver, not of the kernel) die, through the
    server's own death signal and their watch on the kernel, and the server exits too."""
    script = tmp_path / "kernel.py"
    script.write_text(
        "import os, time\n"
        "import parallel_lab as pl\n"
        "def f(ctx):\n"
        f"    open(os.path.join({str(tmp_path)!r}, f'rank{{ctx.rank}}'), 'w').write(f'{{os.getpid()}} {{os.getppid()}}')\n"
        "    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    pl.launch(f, 2, start_method='forkserver', timeout=300)\n"
    )
    kernel = subprocess.Popen([sys.executable, str(script)], cwd=ROOT)
    try:
        deadline = time.time() + 60
        while not all((tmp_path / f"rank{r}").exists() for r in range(2)) and time.time() < deadline:
            time.sleep(0.1)
        pids = [int((tmp_path / f"rank{r}").read_text().split()[0]) for r in range(2)]
        pids.append(int((tmp_path / "rank0").read_text().split()[1]))  # the forkserver
        kernel.kill()
        kernel.wait(timeout=10)
        deadline = time.time() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            assert time.time() < deadline, f"ranks and server {pids} outlived the killed kernel"
            time.sleep(0.1)
    finally:
        kernel.kill()


def test_rank_that_raises_names_rank_quickly():
    def f(ctx):
        if ctx.rank == 2:
            raise ValueError("bad shard on purpose")
        dist.barrier()  # the others wait for rank 2, which never comes

    timeout = 120
    t = time.perf_counter()
    with pytest.raises(pl.RankError) as ei:
        pl.launch(f, 4, timeout=timeout)
    # Named as soon as rank 2 fails, not when the launch times out (idle: ~0.3 s; the margin is
    # for a loaded machine, the rule is "long before the timeout").
    assert time.perf_counter() - t < timeout / 4
    e = ei.value
    assert e.rank == 2 and e.exc_type == "ValueError"
    assert "rank 2 raised ValueError: bad shard on purpose" in str(e)
    assert "in f" in e.remote_traceback and "parallel_lab/runtime/launch.py" not in e.remote_traceback


def test_hang_reports_stuck_ranks_and_last_collective():
    def f(ctx):
        if ctx.rank != 0:  # rank 0 never joins: a mismatched collective
            with ctx.span("all_reduce", "comm"):
                dist.all_reduce(torch.ones(2))
        return ctx.rank

    # The timeout counts from the launch, so the stuck ranks must have entered their collective
    # before it: 10 s leaves room for a slow start on a loaded machine (an idle one needs ~0.1 s).
    timeout = 10.0
    t = time.perf_counter()
    with pytest.raises(pl.LaunchTimeout) as ei:
        pl.launch(f, 3, timeout=timeout)
    assert time.perf_counter() - t < timeout + 20  # stopped at the timeout, not left hanging
    assert ei.value.stuck == {1: "all_reduce", 2: "all_reduce"}
    assert "rank 1 was inside all_reduce; rank 2 was inside all_reduce." in str(ei.value)


def test_hang_report_says_a_rank_runs_its_own_code_without_guessing_why():
    """A rank that finished its collectives and then sleeps is not "in a mismatched collective"."""

    def f(ctx):
        from parallel_lab import comms as C

        C.dist_barrier(ctx)
        if ctx.rank == 0:
            time.sleep(120)  # its own code, long
        C.dist_all_reduce(ctx, torch.ones(2))

    with pytest.raises(pl.LaunchTimeout) as ei:
        pl.launch(f, 2, timeout=10)
    e = ei.value
    assert e.inside == {0: [], 1: ["all_reduce"]}
    msg = str(e)
    assert "rank 0 was running its own code (its last traced collective, barrier, had finished)" in msg
    assert "rank 1 was inside all_reduce" in msg
    assert "mismatch" not in msg


def test_sys_exit_during_a_collective_is_blamed_not_its_peer():
    def f(ctx):
        dist.barrier()
        if ctx.rank == 1:
            sys.exit(3)
        dist.all_reduce(torch.ones(1000))

    for _ in range(2):
        with pytest.raises(pl.RankError) as ei:
            pl.launch(f, 3, timeout=60)
        assert ei.value.rank == 1 and ei.value.exc_type == "SystemExit", str(ei.value)
        assert "called sys.exit(3)" in str(ei.value)


def test_rank_killed_by_a_signal_during_a_collective_is_blamed():
    def f(ctx):
        import signal

        dist.barrier()
        if ctx.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1000))
        dist.all_reduce(torch.ones(1000))

    for _ in range(2):
        with pytest.raises(pl.RankError, match="rank 2 raised ProcessDied: exited with code -9"):
            pl.launch(f, 3, timeout=60)


def test_launch_inside_a_launched_function_is_refused_clearly():
    def inner(ctx):
        return ctx.rank

    def outer(ctx):
        return pl.launch(inner, 2)

    with pytest.raises(pl.RankError, match="launch was called inside a launched function") as ei:
        pl.launch(outer, 2, timeout=60)
    assert ei.value.exc_type == "RuntimeError"


def test_an_unpicklable_return_value_is_named_as_the_cause():
    def f(ctx):
        return (x for x in range(3))  # a generator cannot be pickled

    with pytest.raises(pl.RankError, match=r"the value fn returned \(generator\) cannot be sent back"):
        pl.launch(f, 2, timeout=60)


def _with_seed(ctx, seed):
    return seed


def _with_seed_default(ctx, seed=5):
    return seed


def test_a_launch_keyword_that_fn_also_takes_is_refused():
    with pytest.raises(TypeError, match="seed=3 is taken by launch itself, but fn '_with_seed' also has"):
        pl.launch(_with_seed, 2, seed=3)
    with pytest.raises(TypeError, match="seed=3 is taken by launch itself, but fn '_with_seed_default'"):
        pl.launch(_with_seed_default, 2, timeout=30, seed=3)  # seed differs from launch's default
    # positionally it reaches fn; left at launch's default with fn's own default, nothing is ambiguous
    assert pl.launch(_with_seed, 2, 7).values == [7, 7]
    assert pl.launch(_with_seed_default, 2).values == [5, 5]


@pytest.mark.parametrize("code", [0, 1, 3])
def test_rank_killed_without_traceback(code):
    def f(ctx):
        if ctx.rank == 1:
            os._exit(code)
        dist.barrier()

    with pytest.raises(pl.RankError, match=f"rank 1 raised ProcessDied: exited with code {code}"):
        pl.launch(f, 2, timeout=30)


@pytest.mark.parametrize("code", [0, 1])
def test_rank_leaving_during_a_collective_is_blamed_not_its_peer(code):
    """The peer's error ("connection closed") comes first in the queue; the rank that left is the cause."""

    def f(ctx):
        dist.barrier()
        if ctx.rank == 2:
            os._exit(code)
        dist.all_reduce(torch.ones(1000))
        dist.all_reduce(torch.ones(1000))

    for _ in range(3):
        with pytest.raises(pl.RankError, match=f"rank 2 raised ProcessDied: exited with code {code}") as ei:
            pl.launch(f, 3, timeout=60)
        first_line = str(ei.value).splitlines()[0]
        assert "rank 2 failed as a consequence" not in first_line, first_line


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"world_size": 0}, ValueError, "world_size must be between 1 and"),
        ({"world_size": -2}, ValueError, "world_size must be between 1 and"),
        ({"world_size": MAX_WORLD_SIZE + 1}, ValueError, "world_size must be between 1 and"),
        ({"world_size": 2.0}, TypeError, "world_size must be an int"),
        ({"world_size": "2"}, TypeError, "world_size must be an int"),
        ({"world_size": True}, TypeError, "world_size must be an int"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"timeout": -1.5}, ValueError, "timeout must be a positive number"),
        ({"backend": "mpi"}, ValueError, "backend must be one of"),
        ({"start_method": "fork-server"}, ValueError, "start_method must be one of"),
        ({"threads": 0}, ValueError, "threads must be None or an int >= 1"),
        ({"fn": "not a function"}, TypeError, "fn must be callable"),
    ],
)
def test_bad_input(kwargs, exc, match):
    args = {"fn": _sum_ranks, "world_size": 2, **kwargs}
    fn, ws = args.pop("fn"), args.pop("world_size")
    with pytest.raises(exc, match=match):
        pl.launch(fn, ws, 1.0, **args)


def test_nccl_without_gpus_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")  # the CPU-only rule cannot be observed here
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank"):
        pl.launch(_sum_ranks, 2, 1.0, backend="nccl")


def test_chrome_trace_round_trip(tmp_path):
    res = pl.launch(_sum_ranks, 2, 1.0)
    path = res.save_chrome_trace(str(tmp_path / "run.json"))
    data = json.load(open(path))
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(res.timeline) and {e["pid"] for e in xs} == {0, 1}
    assert all(e["tid"] == 2 for e in xs if e["cat"] == "comm")  # comm lane
    back = pl.RunResult.load(path)
    assert back.timeline == res.timeline and back.world_size == 2 and back.values == res.values


NOTEBOOK_LIKE = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    import parallel_lab as pl

    def f(ctx):  # defined in __main__, as in a notebook cell
        t = torch.ones(1) * (ctx.rank + 1)
        dist.all_reduce(t)
        return t.item()

    print(pl.launch(f, 3).values)
    """
)


def test_two_concurrent_launches_from_separate_processes():
    """Two notebooks (kernels) launching at once must not collide on ports."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", NOTEBOOK_LIKE], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()
        assert out.decode().strip() == "[6.0, 6.0, 6.0]"


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


def test_torchrun_script_writes_loadable_trace(tmp_path):
    trace = str(tmp_path / "tour.json")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = _run([torchrun, "--nproc-per-node", "2", "-m", "parallel_lab.scripts.tour", "--trace", trace])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "identical weights on all ranks: True" in r.stdout
    res = pl.RunResult.load(trace)
    assert res.world_size == 2 and {e["rank"] for e in res.timeline} == {0, 1}
    # the same function through launch() gives the same numbers
    from parallel_lab.scripts.tour import tour_steps

    assert pl.launch(tour_steps, 2).values == res.values


_NO_THREADS_LEFT = """
import os, sys, torch
from parallel_lab.runtime.from_env import run_from_env

def build_optimizer(ctx):  # the first optimizer imports torch._dynamo
    torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    return ctx.rank

run_from_env(build_optimizer)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
# one file per rank: ranks that share one stdout pipe interleave their lines
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w") as f:
    f.write(repr(sorted(n for n in names if "gloo" in n)))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from /proc (Linux)")
def test_torchrun_rank_leaves_no_gloo_thread_behind(tmp_path):
    """A gloo worker thread alive at interpreter shutdown can free a finished op's tensors after
    Python is gone and abort the rank (SIGABRT after the script's last line). run_from_env must
    leave none, even when the function imported torch._dynamo while the process group existed."""
    script = tmp_path / "threads.py"
    script.write_text(_NO_THREADS_LEFT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = tmp_path / "left"
    out.mkdir()
    r = _run(
        [torchrun, "--nproc-per-node", "2", str(script), str(out)],
        env={"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    left = {p.name: p.read_text() for p in out.iterdir()}
    assert left == {"rank0": "[]", "rank1": "[]"}, left


def test_accelerate_launch_with_cpu_config(tmp_path):
    trace = str(tmp_path / "tour.json")
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    cfg = os.path.join(ROOT, "parallel_lab", "configs", "accelerate_cpu.yaml")
    r = _run(
        [
            accelerate,
            "launch",
            "--config_file",
            cfg,
            "--num_processes",
            "2",
            "-m",
            "parallel_lab.scripts.tour",
            "--trace",
            trace,
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 ranks, 3 steps, identical weights on all ranks: True" in r.stdout
    assert pl.RunResult.load(trace).world_size == 2


def test_recorder_reset_drops_streamed_warmup():
    def f(ctx):
        with ctx.span("warm-up", "comm"):
            dist.barrier()
        ctx.recorder.reset()
        with ctx.span("measured", "compute"):
            pass
        return ctx.recorder.comm_totals()["sent"]

    res = pl.launch(f, 2)
    assert [e["name"] for e in res.timeline] == ["measured", "measured"]


def _tcp_addresses(ctx):
    import psutil
    import torch.distributed as dist

    t = torch.ones(3)
    dist.all_reduce(t)  # gloo's connections are open now
    return sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")})


def test_a_local_launch_listens_on_loopback_only():
    """Every socket a rank opens (gloo's pairs) is on 127.0.0.1, whatever the hostname resolves to."""
    from parallel_lab.runtime.launch import loopback_interface

    assert loopback_interface() in ("lo", "lo0")
    for addrs in pl.launch(_tcp_addresses, 3).values:
        assert addrs and all(a.startswith("127.") or a == "::1" for a in addrs), addrs

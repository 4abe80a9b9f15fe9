"""Lesson 13: failure arithmetic, the resumable sampler, atomic checkpoints, restart and resume.

The resume tests compare against runs that were never interrupted (bit for bit on the same
world size) and against one process training on the same batches (on another world size)."""

from __future__ import annotations

import json
import math
import os
import signal
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch

from parallel_lab import RankError, launch
from parallel_lab.models import build_model
from parallel_lab.resilience import (
    CheckpointError,
    FlashAgent,
    ResilientConfig,
    ResumableSampler,
    checkpoint,
    failures,
    latest,
    leaked_segments,
    overlaps,
    read_shard,
    reshard,
    run_with_restarts,
    train_resilient,
    verify,
)


def _helpers() -> tuple:
    """multiprocessing's shared helpers, by pid (a rank forked by the forkserver shares its command line)."""
    from multiprocessing import forkserver, resource_tracker

    return (forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid)


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    left = [c for c in psutil.Process().children(recursive=True)
            if c.status() != psutil.STATUS_ZOMBIE and c.pid not in _helpers()]  # fmt: skip
    assert not left, f"processes left behind: {[c.pid for c in left]}"


# ----------------------------------------------------------------------------- arithmetic
def test_failure_arithmetic_reproduces_the_cluster_figures():
    assert round(failures.job_failure_probability(0.01, 128), 4) == 0.7237  # 1% per node, 128 nodes
    daily = failures.per_period_rate(0.08, 30)  # 8% a month
    assert round(daily * 100, 2) == 0.28
    assert round(failures.job_failure_probability(0.0027, 1000), 2) == 0.93  # 1,000 cards, one day
    assert failures.job_failure_probability(0.0, 10**6) == 0.0
    assert failures.job_failure_probability(0.01, 1, periods=2) == pytest.approx(1 - 0.99**2)
    assert failures.mtbf(0.0027, 1000, period=86400) == pytest.approx(86400 / (-1000 * math.log1p(-0.0027)))


def test_young_daly_interval_is_near_the_simulated_optimum():
    c, r, m = 60.0, 120.0, 4 * 3600.0
    t_star = failures.young_daly_interval(c, m)
    assert t_star == pytest.approx(math.sqrt(2 * c * m))
    grid = [t_star * f for f in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)]
    good = {
        t: sum(failures.simulate_goodput(t, c, r, m, work=2e6, seed=s).goodput for s in range(4)) / 4
        for t in grid
    }
    best = max(good, key=good.get)
    assert 0.5 * t_star <= best <= 2.0 * t_star, good
    assert good[t_star] > good[grid[0]] and good[t_star] > good[grid[-1]]  # both ends lose
    # the first-order formula agrees with the simulation to a few percent at the optimum
    assert failures.expected_goodput(t_star, c, r, m) == pytest.approx(good[t_star], rel=0.03)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: failures.job_failure_probability(1.5, 3), "p must be a probability"),
        (lambda: failures.job_failure_probability(float("nan"), 3), "p must be a probability"),
        (lambda: failures.job_failure_probability(0.1, 0), "n must be a positive int"),
        (lambda: failures.young_daly_interval(0, 10), "checkpoint_cost must be a positive"),
        (lambda: failures.young_daly_interval(1, float("inf")), "mtbf_seconds must be a positive finite"),
        (lambda: failures.simulate_goodput(1, 1, -1, 10, 10), "restart_cost must be a finite number >= 0"),
        (lambda: ResumableSampler(0), "n_samples must be an int >= 1"),
        (lambda: ResumableSampler(4).take(0), "global_batch must be a positive int"),
        (lambda: ResumableSampler(4).rank_slice([1, 2, 3], 0, 2), "world_size 2 must divide the global batch"),
        (lambda: ResilientConfig(steps=0), "steps must be a positive int"),
        (lambda: ResilientConfig(spike=0.5), "spike must be None or a number > 1"),
        (lambda: overlaps(10, 2, 3, 3), r"rank must be in \[0, 3\)"),
        (lambda: run_with_restarts(train_resilient, 2, max_restarts=-1), "max_restarts must be an int >= 0"),
    ],
)  # fmt: skip
def test_bad_inputs_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- sampler and re-sharding
def test_sampler_uses_every_sample_once_per_epoch_across_world_size_changes():
    s = ResumableSampler(30, seed=3)
    seen: Counter = Counter()
    for world in (2, 2, 3, 3, 1, 6, 6, 2, 3, 1):  # the world changes between steps; state goes through a dict
        batch = s.take(6)
        got = [p for r in range(world) for p in s.rank_slice(batch, r, world)]
        assert got == batch  # the ranks' slices, in rank order, are the step's batch
        seen.update(got)
        state = json.loads(json.dumps(s.state_dict()))
        s = ResumableSampler(30, seed=3)
        s.load_state_dict(state)
    assert set(seen.values()) == {1} and len(seen) == 60  # two full epochs, nothing twice
    assert sorted(i for e, i in seen if e == 0) == list(range(30))
    with pytest.raises(ValueError, match="state is for a sampler over 30 samples"):
        ResumableSampler(31, seed=3).load_state_dict(state)


@pytest.mark.parametrize("numel", [1, 7, 12, 13, 50])
def test_resharding_keeps_the_flat_order(numel):
    full = torch.arange(numel, dtype=torch.float32) + 1
    for old in range(1, 7):
        s_old = math.ceil(numel / old)
        shards = [torch.zeros(s_old) for _ in range(old)]
        for k in range(old):
            piece = full[k * s_old : (k + 1) * s_old]
            shards[k][: piece.numel()] = piece
        for new in range(1, 7):
            s_new = math.ceil(numel / new)
            out = [reshard(numel, old, new, r, lambda k, shards=shards: {"m": shards[k]}, {"m": torch.zeros(s_new)})["m"]
                   for r in range(new)]  # fmt: skip
            assert torch.equal(torch.cat(out)[:numel], full)
            assert all((o[max(0, numel - r * s_new) :] == 0).all() for r, o in enumerate(out))  # padding zero


# ----------------------------------------------------------------------------- atomic checkpoints
def _two_saves(ctx, root, point, victim):
    def fault(where):
        if where == point and ctx.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.save(ctx, root, 1, {"w": torch.full((4,), 1.0 + ctx.rank)}, {"note": "first"})
    checkpoint.save(ctx, root, 2, {"w": torch.full((4,), 2.0 + ctx.rank)}, {"note": "second"}, fault=fault)


@pytest.mark.parametrize("point, victim", [("written", 1), ("renamed", 1), ("written", 0), ("shards", 0),
                                           ("manifest", 0)])  # fmt: skip
def test_a_crash_inside_a_checkpoint_write_leaves_the_previous_one(tmp_path, point, victim):
    with pytest.raises(RankError, match=f"rank {victim} raised ProcessDied"):
        launch(_two_saves, 2, str(tmp_path), point, victim, timeout=60)
    d, manifest, skipped = latest(tmp_path)
    if point == "manifest":  # the manifest was on disk before the crash: the new checkpoint is complete
        assert manifest["meta"]["note"] == "second" and not skipped
        return
    assert manifest["meta"]["note"] == "first" and d.name == "step-000001"
    assert [Path(e.path).name for e in skipped] == ["step-000002"] and "torn" in str(skipped[0])
    assert torch.equal(read_shard(d, 1, manifest)["w"], torch.full((4,), 2.0))


def _one_save(ctx, root):
    model = build_model(ResilientConfig().mlp, seed=0)
    checkpoint.save(ctx, root, 3, {"w": torch.arange(1000.0) + ctx.rank},
                    {"model": checkpoint.model_signature(model)})  # fmt: skip


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "truncated or padded: 10 bytes"),
    ("flip", "wrong checksum"),
    ("delete", "missing: the manifest lists it"),
    ("manifest", "not a readable manifest"),
])  # fmt: skip
def test_a_damaged_checkpoint_is_named_with_its_reason(tmp_path, damage, reason):
    launch(_one_save, 2, str(tmp_path), timeout=60)
    d = tmp_path / "step-000003"
    victim = d / ("MANIFEST.json" if damage == "manifest" else "rank-00001-of-00002.pt")
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[:10])
    elif damage == "flip":
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "delete":
        victim.unlink()
    else:
        victim.write_text("{not json")
    with pytest.raises(CheckpointError, match=reason) as info:
        verify(d)
    assert info.value.path == str(victim)
    assert latest(tmp_path)[0] is None  # nothing else to fall back on, and it says so


def test_another_models_checkpoint_is_refused(tmp_path):
    launch(_one_save, 2, str(tmp_path), timeout=60)
    cfg = ResilientConfig(root=str(tmp_path))
    cfg.mlp.hidden = 16  # another model
    with pytest.raises(
        RankError, match=r"made for another model: parameter 'layers.0.weight' has shape \(32, 8\)"
    ):
        launch(train_resilient, 2, cfg, timeout=60)


# ----------------------------------------------------------------------------- restart and resume
@pytest.mark.slow
def test_a_killed_rank_resumes_bit_identical_at_ten_different_steps(tmp_path):
    """SIGKILL one rank at the start of step k; restart; resume from the newest checkpoint: the losses
    of every step equal the uninterrupted run's exactly (weights, Adam slices, sampler and each rank's
    RNG restored; the input noise makes the RNG matter)."""
    cfg = dict(steps=12, noise=0.01, checkpoint_every=3)
    base = launch(train_resilient, 2, ResilientConfig(root=str(tmp_path / "base"), **cfg)).values[0]
    for k in range(1, 11):
        run = run_with_restarts(train_resilient, 2, ResilientConfig(root=str(tmp_path / f"k{k}"), kill=(k % 2, k),
                                                                    **cfg), max_restarts=1)  # fmt: skip
        assert run.restarts == 1 and "exited with code -9" in run.attempts[0].error
        assert run.attempts[0].failed_rank == k % 2
        assert run.values[0]["loss"] == base["loss"], k
        assert run.values[0]["batches"] == base["batches"]
        kinds = {e["name"] for e in run.timeline()}
        assert f"rank {k % 2} failed" in kinds and "restart and resume" in kinds


def _reference(cfg: ResilientConfig) -> tuple[list[float], dict]:
    """One process, the whole global batch of every step, torch.optim.Adam."""
    from parallel_lab.models import synthetic_batch

    x_all, y_all = synthetic_batch("regression", cfg.n_samples, in_dim=cfg.mlp.in_dim, out_dim=cfg.mlp.out_dim,
                                   seed=cfg.seed + 1)  # fmt: skip
    model = build_model(cfg.mlp, seed=cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    s = ResumableSampler(cfg.n_samples, seed=cfg.seed)
    losses = []
    for _ in range(cfg.steps):
        idx = [i for _, i in s.take(cfg.global_batch)]
        loss = torch.nn.functional.mse_loss(model(x_all[idx]), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_four_ranks_shrink_to_three_and_match_one_process(tmp_path):
    cfg = ResilientConfig(root=str(tmp_path), steps=12, kill=(2, 7))
    run = run_with_restarts(train_resilient, 4, cfg, shrink=True, max_restarts=1)
    assert [a.world_size for a in run.attempts] == [4, 3]
    hist = run.values[0]
    seen = Counter(tuple(p) for b in hist["batches"] for p in b)
    assert set(seen.values()) == {1} and len(seen) == 12 * 12  # every sample once per epoch, 3 epochs
    losses, params = _reference(cfg)
    assert hist["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    d, manifest, _ = latest(tmp_path)
    assert manifest["world_size"] == 3 and manifest["step"] == 12
    mine = read_shard(d, 0, manifest)["model"]
    for n, p in params.items():
        torch.testing.assert_close(mine[n], p, rtol=1e-5, atol=1e-6)


def test_a_loss_spike_is_rolled_back_and_its_batch_skipped(tmp_path):
    cfg = ResilientConfig(root=str(tmp_path), steps=10, spike=3.0, spike_at=6, checkpoint_every=2)
    hist = launch(train_resilient, 2, cfg, timeout=120).values[0]
    assert hist["rolled_back"] == [6] and len(hist["skipped"]) == 1
    assert len(hist["loss"]) == 10 and max(hist["loss"]) < 1.0  # the spike never entered the history
    used = {tuple(p) for b in hist["batches"] for p in b}
    # the batch at the skipped position was drawn once, blamed, and never trained on
    s = ResumableSampler(cfg.n_samples, seed=cfg.seed)
    s.load_state_dict({**s.state_dict(), "epoch": hist["skipped"][0][0], "offset": hist["skipped"][0][1]})
    assert not used & {tuple(p) for p in s.take(cfg.global_batch)}


# ----------------------------------------------------------------------------- flash checkpoint
def test_flash_restart_resumes_from_memory_bit_identical_and_leaves_nothing(tmp_path):
    cfg = dict(steps=12, noise=0.01, checkpoint_every=2)
    base = launch(train_resilient, 2, ResilientConfig(root=str(tmp_path / "base"), **cfg)).values[0]
    with FlashAgent(2, 1 << 20, tmp_path / "flash", persist_every=4) as agent:
        run = run_with_restarts(train_resilient, 2, ResilientConfig(root=str(tmp_path / "flash"), kill=(1, 7),
                                                                    flash=agent.spec, **cfg), max_restarts=1)  # fmt: skip
        assert run.values[0]["loss"] == base["loss"]
        resumed = {e["name"] for e in run.timeline() if e["name"].startswith("resumed")}
        assert resumed == {"resumed from step 6 (memory)"}  # the machine survived: no disk read
        assert agent.persisted and all(s % 4 == 0 for s in agent.persisted)
        names = agent.spec.names
        assert all(Path("/dev/shm", n).exists() for n in names)
    assert not any(Path("/dev/shm", n).exists() for n in names) and leaked_segments() == []
    d, manifest, _ = latest(tmp_path / "flash")  # what the agent wrote in the background verifies
    assert manifest["step"] == max(agent.persisted) and manifest["world_size"] == 2


def test_a_torn_flash_copy_falls_back_to_disk(tmp_path):
    """A rank that died in the middle of its copy leaves its segment marked "writing": the restart
    ignores the memory copy and reads the newest complete checkpoint on disk."""
    from parallel_lab.resilience import flash

    cfg = dict(steps=8, noise=0.01, checkpoint_every=2)
    base = launch(train_resilient, 2, ResilientConfig(root=str(tmp_path / "base"), **cfg)).values[0]
    with FlashAgent(2, 1 << 20, tmp_path / "f", persist_every=2) as agent:
        first = ResilientConfig(root=str(tmp_path / "f"), flash=agent.spec, **{**cfg, "steps": 6})
        launch(train_resilient, 2, first)
        agent.persist_now()  # (the agent's thread may have written it already)
        assert 6 in agent.persisted
        seg = flash._open(agent.spec.name(1))
        flash._HEADER.pack_into(seg.buf, 0, flash._MAGIC, flash._WRITING, -1, 0, 0)  # torn mid-copy
        seg.close()
        assert flash.ready_snapshot(agent.spec) is None
        res = launch(train_resilient, 2, ResilientConfig(root=str(tmp_path / "f"), flash=agent.spec, **cfg))
        assert res.values[0]["loss"] == base["loss"]
        assert any(e["name"] == "resumed from step 6 (disk)" for e in res.timeline)
    assert leaked_segments() == []


def test_flash_snapshot_refuses_a_state_larger_than_its_segment(tmp_path):
    from parallel_lab.resilience import snapshot

    with FlashAgent(1, 4096, tmp_path) as agent:
        with pytest.raises(
            ValueError, match="the flash segment holds 4,096: give FlashAgent a larger capacity"
        ):
            snapshot(agent.spec, 0, 1, {"w": torch.zeros(10_000)}, 1)


# ----------------------------------------------------------------------------- the script under launchers
def _script(cmd: list[str], tmp_path: Path) -> str:
    import subprocess
    import sys

    bin_dir = Path(sys.executable).parent
    exe = {"torchrun": str(bin_dir / "torchrun"), "accelerate": str(bin_dir / "accelerate"),
           "python": sys.executable}[cmd[0]]  # fmt: skip
    args = [*cmd[1:], "--root", str(tmp_path / "ck"), "--trace", str(tmp_path / "trace.json")]
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_the_script_is_restarted_by_the_launchers_agent_and_resumes(launcher, tmp_path):
    """torchrun --max-restarts (accelerate passes --max_restarts to it) restarts both ranks after one is
    killed; they resume from the checkpoint and the losses match one process."""
    from parallel_lab import RunResult

    script = ["-m", "parallel_lab.scripts.resilience", "--kill", "1:5"]
    if launcher == "torchrun":
        cmd = ["torchrun", "--nproc-per-node", "2", "--max-restarts", "1", *script]
    else:
        cfg = Path(__file__).resolve().parents[1] / "parallel_lab" / "configs" / "accelerate_cpu.yaml"
        cmd = ["accelerate", "launch", "--config_file", str(cfg), "--num_processes", "2", "--max_restarts", "1",
               *script]  # fmt: skip
    out = _script(cmd, tmp_path)
    assert (
        "restarts: 1; resumed from step 3 (disk)" in out and "losses match single-process training" in out
    ), out
    assert RunResult.load(str(tmp_path / "trace.json")).world_size == 2


@pytest.mark.slow
def test_the_script_without_a_launcher_shrinks_four_to_three(tmp_path):
    out = _script(["python", "-m", "parallel_lab.scripts.resilience", "--nproc", "4", "--shrink", "--kill", "2:7"],
                  tmp_path)  # fmt: skip
    assert "attempt on 4 ranks failed: rank 2 raised ProcessDied" in out
    assert "3 ranks (gloo)" in out and "last checkpoint: step 12 on 3 ranks" in out
    assert "losses match single-process training" in out, out


# ----------------------------------------------------------------------------- detection
def _stuck_rank(ctx, folder):
    import time

    from parallel_lab import comms
    from parallel_lab.resilience import Heartbeat

    hb = Heartbeat(ctx, folder)
    for step in range(100):
        if ctx.rank == 2 and step == 3:
            time.sleep(120)  # its own code, stuck
        comms.dist_all_reduce(ctx, torch.ones(4))
        hb.beat(step)


def test_stacks_name_the_rank_that_is_not_where_the_others_are(tmp_path):
    from parallel_lab import LaunchTimeout
    from parallel_lab.resilience import HangWatcher, format_report

    with HangWatcher(tmp_path, 4, deadline=4.0) as watcher:  # 4 s without a beat: not a busy machine's stall
        with pytest.raises(LaunchTimeout):
            launch(_stuck_rank, 4, str(tmp_path), timeout=14)  # the watcher reports after its 4 s
    rep = watcher.report
    assert rep is not None and rep["culprits"] == [2], rep
    assert rep["where"][2].startswith("_stuck_rank") and "all_reduce" in rep["majority"]
    assert rep["steps"] == {0: 2, 1: 2, 2: 2, 3: 2}
    assert "rank 2 is not where the others are" in format_report(rep)


@pytest.mark.parametrize("slow, wrong, faulty", [({3: 0.8}, None, [3]), (None, {1}, [1]), (None, None, [])])
def test_pairwise_tests_find_the_faulty_rank(slow, wrong, faulty):
    from parallel_lab.resilience import find_faulty

    res = launch(find_faulty, 4, 128, slow, wrong, timeout=120).values
    assert all(r["faulty"] == faulty for r in res), res[0]  # every rank reaches the same verdict

"""Script defaults divide evenly at 8 and 16 ranks, or adapt and say what they chose.

Each script's `main` runs under a launcher's environment (WORLD_SIZE set) with the launch
replaced by a probe that records what the rank would run; the test checks the divisibility
rules each family needs (heads and tokens by TP ranks, experts by EP ranks, layers by
pipeline stages, batch by DP ranks) on those values.
"""

from __future__ import annotations

import importlib

import pytest

WORLDS = [2, 4, 8, 16]


def _probe(monkeypatch, script: str, world: int, argv: list[str]) -> tuple[tuple, dict]:
    mod = importlib.import_module(f"parallel_lab.scripts.{script}")
    seen: dict = {}

    def fake_run_script(fn, *args, **kw):
        seen["args"], seen["kw"] = args, kw
        return None  # what a non-zero rank gets: main prints nothing more

    monkeypatch.setattr(mod, "run_script", fake_run_script)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert mod.main(argv) == 0
    return seen["args"], seen["kw"]


@pytest.mark.parametrize("world", WORLDS)
def test_tensor_parallel_defaults(monkeypatch, capsys, world):
    _, kw = _probe(monkeypatch, "tensor_parallel", world, ["--sequence-parallel"])
    assert kw["heads"] % world == 0 and kw["seq"] % world == 0 and kw["d_model"] % kw["heads"] == 0
    said = capsys.readouterr().out
    assert ("the default scaled to" in said) == (world > 4), said


@pytest.mark.parametrize("world", WORLDS)
def test_moe_defaults(monkeypatch, world):
    _, kw = _probe(monkeypatch, "moe", world, [])
    assert kw["num_experts"] % world == 0 and kw["num_experts"] >= 8


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipeline_defaults(monkeypatch, world, schedule):
    (cfg, dims), _ = _probe(monkeypatch, "pipeline", world, ["--schedule", schedule])
    assert cfg.layers % (dims.pp * cfg.chunks) == 0, (cfg.layers, dims.pp, cfg.chunks)
    assert cfg.batch % (dims.dp * cfg.microbatches) == 0


@pytest.mark.parametrize("world", WORLDS)
def test_data_parallel_and_quantization_defaults(monkeypatch, world):
    (cfg,), _ = _probe(monkeypatch, "ddp", world, ["--accumulation", "2"])
    assert cfg.batch % (world * cfg.accumulation_steps) == 0
    _, kw = _probe(monkeypatch, "quantization", world, [])
    assert kw["batch"] >= world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_inference_defaults(monkeypatch, world, mode):
    (m, heads, kv_heads, layers, prompt, _, micro), _ = _probe(
        monkeypatch, "inference", world, ["--mode", mode]
    )
    assert heads % kv_heads == 0
    if mode == "tp":
        assert heads % world == 0 and kv_heads % world == 0
    else:
        assert layers % world == 0 and prompt.shape[0] % micro == 0


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_long_sequences_defaults(monkeypatch, world, method):
    (cfg, batches, dp, cp, m, zigzag, _), _ = _probe(
        monkeypatch, "long_sequences", world, ["--method", method]
    )
    assert dp * cp == world and cfg.seq_len % (2 * cp if zigzag else cp) == 0
    assert method == "ring" or cfg.n_heads % cp == 0


@pytest.mark.parametrize("world", [8, 16])
def test_three_d_takes_data_parallel_from_the_launcher(monkeypatch, world):
    (cfg, dims), _ = _probe(monkeypatch, "three_d", world, [])
    assert (dims.dp, dims.tp, dims.pp) == (world // 4, 2, 2)
    assert cfg.batch % (dims.dp * cfg.microbatches) == 0


def test_a_flag_the_learner_sets_is_kept(monkeypatch):
    _, kw = _probe(monkeypatch, "moe", 2, ["--experts", "6"])
    assert kw["num_experts"] == 6

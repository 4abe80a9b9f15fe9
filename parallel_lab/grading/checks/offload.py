"""Checks for lesson 05 (offload): an offloaded optimizer step.

`check_offloaded_step(fn)`: `fn(params, masters, optimizer, to_host, to_device)` runs one
ZeRO-Offload step. `params` are the device's bf16 working weights with their bf16
`.grad`; `masters` are the host's fp32 master copies, which `optimizer` (Adam) steps;
`to_host(t)` / `to_device(t)` return a copy of `t` on the other side and count the bytes
that crossed. The step must leave the masters where one fp32 Adam step on the bf16
gradients puts them, the device weights equal to the masters rounded to bf16, and move
exactly 2 bytes per parameter each way: the 16-bit gradient down, the 16-bit weight up
(casts happen on the side where the fp32 copy lives).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable, uneven_vocab

FORBIDDEN = family("parallel_lab.offload.host_optimizer", "parallel_lab.offload.streaming")

__all__ = ["check_offload_bytes", "check_offloaded_step"]

_SHAPES = ((7, 5), (5,), (3, 7), (11,))  # 35 + 5 + 21 + 11 = 72 parameters
_STEPS = 3


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    masters = [torch.randn(s, generator=g).requires_grad_() for s in _SHAPES]  # host: fp32
    params = [m.detach().to(torch.bfloat16) for m in masters]  # device: bf16 copies
    return params, masters, g


def check_offloaded_step(fn: Callable) -> None:
    """`fn(params, masters, optimizer, to_host, to_device)`: gradients down, host Adam, weights up."""
    require_callable(fn)
    seed = draw_seed()  # weights and gradients drawn afresh every grade run
    params, masters, g = _case(seed)
    opt = torch.optim.Adam(masters, lr=0.05)
    _, ref_masters, _ = _case(seed)
    ref_opt = torch.optim.Adam(ref_masters, lr=0.05)
    moved = {"d2h": 0, "h2d": 0}

    def to_host(t: torch.Tensor) -> torch.Tensor:
        moved["d2h"] += t.numel() * t.element_size()
        return t.detach().clone()

    def to_device(t: torch.Tensor) -> torch.Tensor:
        moved["h2d"] += t.numel() * t.element_size()
        return t.detach().clone()

    n = sum(m.numel() for m in masters)
    for step in range(_STEPS):
        grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in _SHAPES]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()  # what backward left on the device
        for m, gr in zip(ref_masters, grads):
            m.grad = gr.float()
        ref_opt.step()
        moved.update(d2h=0, h2d=0)
        where = f"step {step}"
        try:
            guarded(fn, FORBIDDEN, "this exercise (offloaded_step)")(params, masters, opt, to_host, to_device)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{where}: your function raised {type(e).__name__}: {e}") from e
        assert opt.state and all(m in opt.state for m in masters), (
            f"{where}: call optimizer.step() with every master's .grad set (the fp32 gradient on the host)"
        )
        for i, (m, r) in enumerate(zip(masters, ref_masters)):
            d = (m.detach() - r.detach()).abs().max().item()
            assert d <= 1e-6, (
                f"{where}: master {i} differs from one fp32 Adam step on the bf16 gradients by {d:.3g} "
                "(set master.grad = the gradient, cast to fp32 on the host, before optimizer.step())"
            )
        for i, (p, r) in enumerate(zip(params, ref_masters)):
            assert p.dtype == torch.bfloat16, (
                f"{where}: parameter {i} must stay bf16 on the device, got {p.dtype}"
            )
            want = r.detach().to(torch.bfloat16)
            d = (p.detach().float() - want.float()).abs().max().item()
            assert d == 0, (
                f"{where}: device parameter {i} differs from its updated master rounded to bf16 by {d:.3g}: copy "
                "the masters back after the step (p.copy_(...) or p.data = ...)"
            )
        assert moved["d2h"] == 2 * n, (
            f"{where}: {moved['d2h']} bytes went to the host; the bf16 gradients are {2 * n} bytes: send them "
            "as they are (to_host(p.grad)) and cast to fp32 on the host"
            + (" (each once)" if moved["d2h"] else "")
        )
        assert moved["h2d"] == 2 * n, (
            f"{where}: {moved['h2d']} bytes went to the device; the bf16 weights are {2 * n} bytes: round the "
            "masters to bf16 on the host, then to_device(...) them"
        )
    passed("check_offloaded_step", f"{_STEPS} steps, {n} parameters, 2 bytes per parameter each way")


# ----------------------------------------------------------------------------- predict, then measure
_SMALL = dict(
    vocab=35, seq_len=8, d_model=16, n_heads=2, n_layers=2
)  # 7,280 parameters: 3 does not divide it


def _measure_offload(ctx, vocab: int) -> dict:
    """One ZeRO-Offload step (mixed precision) of a small GPT: bytes that crossed, bytes the host holds."""
    from parallel_lab.models import GPTConfig, build_model, compute_loss, synthetic_batch
    from parallel_lab.offload import ZeroOffload

    model = build_model(GPTConfig(**{**_SMALL, "vocab": vocab}), seed=0, device=ctx.device)
    zero = ZeroOffload(ctx, model, optimizer="adam", precision="mixed", lr=1e-2)
    x, y = synthetic_batch("tokens", 1, seq_len=_SMALL["seq_len"], vocab=vocab, seed=1 + ctx.rank,
                           device=ctx.device)  # fmt: skip
    compute_loss(model, x, y).backward()
    zero.step()
    zero.zero_grad()
    host = zero.host.tracker.snapshot() if zero.host.tracker is not None else {}
    return {"numel": zero.layout.numel, **zero.transfer_bytes,
            "host": sum(host.get(k, 0) for k in ("param", "grad", "optim"))}  # fmt: skip


def check_offload_bytes(fn: Callable) -> None:
    """`fn(numel, world_size)` -> {"d2h", "h2d", "host"}: per rank and step of ZeRO-Offload in mixed
    precision (16-bit weights on the device, Adam in fp32 on the host), the bytes sent to the host, the
    bytes sent back, and the model-state bytes the host keeps; predicted, then measured (exactly)."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (offload_bytes)")
    from parallel_lab.runtime.launch import launch

    cases = 0
    vocabs = {
        1: _SMALL["vocab"],
        2: _SMALL["vocab"],
        3: uneven_vocab(_SMALL, 3),
    }  # 3 ranks: a size drawn per run
    for p in (1, 2, 3):
        for r, got in enumerate(
            launch(_measure_offload, p, vocabs[p], track_memory=True, timeout=60.0).values
        ):
            said = fn(got["numel"], p)
            where = f"numel={got['numel']:,}, world_size={p}, rank {r}"
            assert isinstance(said, dict) and all(k in said for k in ("d2h", "h2d", "host")), (
                f"{where}: return a dict with 'd2h', 'h2d' and 'host' bytes, got {said!r:.80}"
            )
            for k, what in (
                ("d2h", "sent to the host"),
                ("h2d", "sent back to the device"),
                ("host", "kept on the host"),
            ):
                assert said[k] == got[k], (
                    f"{where}: you predict {said[k]:,} bytes {what}, measured {got[k]:,}"
                )
            cases += 1
    passed("check_offload_bytes", f"{cases} ranks on 1, 2 and 3 ranks measured as predicted")

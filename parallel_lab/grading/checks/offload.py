"""Checks for lesson 05 (offload): ZeRO-Offload's one-step delayed parameter update, and the bytes of an
offloaded step under gradient accumulation and other optimizers.

`check_delayed_offloaded_step(fn)`: `fn(params, masters, optimizer, to_host, to_device, pending, delayed)`
is the host's work in one training step with the one-step delayed parameter update (DPU) of Ren et al.
2021 ("ZeRO-Offload", section "One-Step Delayed Parameter Update"). `params` are the device's bf16
working weights with the bf16 gradients of this step; `masters` the host's fp32 copies, which `optimizer`
(Adam) steps; `to_host(t)` / `to_device(t)` copy across and count the bytes; `pending` is a list the
caller keeps from one call to the next; `delayed` is False for the warm-up steps and True from step N on.
Compared after every call with a reference that applies, from step N on, each step's gradients one step
late: masters within 1e-6, device weights bit-exact, and the bytes that crossed each way exactly.

`check_offload_bytes(fn)`: `fn(numel, world_size, micro_batches, optimizer)` predicts, per rank and
optimizer step of the lab's `ZeroOffload` in mixed precision, the bytes sent to the host, the bytes sent
back and the model-state bytes the host keeps; measured on 1, 2 and 3 ranks with the micro-batch count,
the optimizer and (on 3 ranks) the model size drawn afresh every grade run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable, uneven_vocab

# The lab's offload code, and torch's helpers that move gradients or optimizer state to the host
# (torch's activation offloading and checkpoint staging copy other things: tests/test_exercises_05.py).
FORBIDDEN = {
    **family("parallel_lab.offload.host_optimizer", "parallel_lab.offload.streaming"),
    **{
        f"parallel_lab.costmodel.formulas.{f}": ""
        for f in ("bytes_per_param", "model_state_bytes", "shard_numel")
    },
    "torch.distributed.fsdp._runtime_utils._offload_grad": "",
    "torch.distributed._state_dict_utils._offload_state_dict_to_cpu": "",
}

__all__ = ["check_delayed_offloaded_step", "check_offload_bytes"]


# ----------------------------------------------------------------------------- exercise 1: DPU
def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [tuple(int(d) for d in torch.randint(2, 9, (int(torch.randint(1, 3, (1,), generator=g)),),
                                                  generator=g)) for _ in range(4)]  # fmt: skip
    masters = [torch.randn(s, generator=g).requires_grad_() for s in shapes]  # host: fp32
    return shapes, masters, g


def _reference(masters: list[torch.Tensor], grads: list[list[torch.Tensor]], first_delayed: int) -> list:
    """The masters after each call: synchronous before `first_delayed`, then each gradient one call late."""
    opt = torch.optim.Adam(masters, lr=0.05)
    out = []
    for call, gs in enumerate(grads, start=1):
        use = gs if call < first_delayed else (grads[call - 2] if call > first_delayed else None)
        if use is not None:
            for m, gr in zip(masters, use):
                m.grad = gr.float()
            opt.step()
        out.append([m.detach().clone() for m in masters])
    return out


def check_delayed_offloaded_step(fn: Callable) -> None:
    """`fn(params, masters, optimizer, to_host, to_device, pending, delayed)`: ZeRO-Offload with DPU."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (delayed_offloaded_step)")
    moved = {"d2h": 0, "h2d": 0}

    def to_host(t: torch.Tensor) -> torch.Tensor:
        moved["d2h"] += t.numel() * t.element_size()
        return t.detach().clone()

    def to_device(t: torch.Tensor) -> torch.Tensor:
        moved["h2d"] += t.numel() * t.element_size()
        return t.detach().clone()

    runs = 0
    for first_delayed in (1, 2, 3):
        # two independent runs of the same schedule, called in turn: state kept anywhere but in each run's
        # `pending` mixes them up
        streams = []
        for _ in range(2):
            shapes, masters, g = _tensors(draw_seed())  # sizes, weights and gradients drawn afresh every run
            ref_masters = [m.detach().clone().requires_grad_() for m in masters]
            calls = first_delayed + 3
            grads = [[torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes] for _ in range(calls)]
            streams.append({
                "shapes": shapes, "masters": masters, "grads": grads, "calls": calls, "pending": [],
                "params": [m.detach().to(torch.bfloat16) for m in masters],  # device: bf16 copies
                "opt": torch.optim.Adam(masters, lr=0.05), "want": _reference(ref_masters, grads, first_delayed),
                "n": sum(m.numel() for m in masters),
            })  # fmt: skip
        for call in range(1, streams[0]["calls"] + 1):
            for which, st in enumerate(streams):
                delayed = call >= first_delayed
                for p, gr in zip(st["params"], st["grads"][call - 1]):
                    p.grad = gr.clone()  # what this step's backward left on the device
                moved.update(d2h=0, h2d=0)
                where = (
                    f"run {'AB'[which]}, call {call} of {st['calls']} (delayed={delayed}; the delay starts at call "
                    f"{first_delayed}; {len(st['shapes'])} tensors, {st['n']} parameters; two runs called in turn)"
                )
                try:
                    fn(st["params"], st["masters"], st["opt"], to_host, to_device, st["pending"], delayed)
                except NotImplementedError:
                    raise
                except Exception as e:
                    raise AssertionError(f"{where}: your function raised {type(e).__name__}: {e}") from e
                for i, (m, r) in enumerate(zip(st["masters"], st["want"][call - 1])):
                    d = (m.detach() - r).abs().max().item()
                    assert d <= 1e-6, (
                        f"{where}: master {i} differs from the reference by {d:.3g}: which step's gradients "
                        "did this call's optimizer step use (or did it step when it should not)? Keep what a run "
                        "holds between calls in its own `pending`"
                    )
                for i, (p, r) in enumerate(zip(st["params"], st["want"][call - 1])):
                    assert p.dtype == torch.bfloat16, (
                        f"{where}: parameter {i} must stay bf16 on the device, got {p.dtype}"
                    )
                    d = (p.detach().float() - r.to(torch.bfloat16).float()).abs().max().item()
                    assert d == 0, (
                        f"{where}: device parameter {i} differs from its master rounded to bf16 by {d:.3g} "
                        "after this call"
                    )
                d2h, h2d = 2 * st["n"], (0 if call == first_delayed else 2 * st["n"])
                assert moved["d2h"] == d2h, (
                    f"{where}: {moved['d2h']} bytes went to the host; this step's bf16 gradients are {d2h} "
                    "bytes, and each must cross once, as it is"
                )
                assert moved["h2d"] == h2d, (
                    f"{where}: {moved['h2d']} bytes went to the device, expected {h2d}"
                    + ("" if h2d else ": nothing changed on the host, so nothing needs to come back")
                )
        runs += 2
    passed(
        "check_delayed_offloaded_step",
        f"{runs} runs in pairs, the delay starting at steps 1, 2 and 3, checked after every call",
    )


# ----------------------------------------------------------------------------- exercise 2: bytes
_SMALL = dict(
    vocab=35, seq_len=8, d_model=16, n_heads=2, n_layers=2
)  # 7,280 parameters: 3 does not divide it
OPTIMIZERS = ("sgd", "momentum", "adam")


def _measure_offload(ctx, vocab: int, micro_batches: int, optimizer: str) -> dict:
    """One optimizer step of ZeroOffload (mixed precision) of a small GPT over `micro_batches` backward
    passes: bytes that crossed, model-state bytes the host holds."""
    from parallel_lab.models import GPTConfig, build_model, compute_loss, synthetic_batch
    from parallel_lab.offload import ZeroOffload

    model = build_model(GPTConfig(**{**_SMALL, "vocab": vocab}), seed=0, device=ctx.device)
    kwargs = {"momentum": 0.9} if optimizer == "momentum" else {}
    name = "sgd" if optimizer == "momentum" else optimizer
    zero = ZeroOffload(ctx, model, optimizer=name, precision="mixed", lr=1e-2, **kwargs)
    for i in range(micro_batches):  # gradient accumulation: backward k times, one optimizer step
        x, y = synthetic_batch("tokens", 1, seq_len=_SMALL["seq_len"], vocab=vocab, seed=1 + 10 * ctx.rank + i,
                               device=ctx.device)  # fmt: skip
        compute_loss(model, x, y).backward()
    zero.step()
    zero.zero_grad()
    host = zero.host.tracker.snapshot() if zero.host.tracker is not None else {}
    return {"numel": zero.layout.numel, **zero.transfer_bytes,
            "host": sum(host.get(k, 0) for k in ("param", "grad", "optim"))}  # fmt: skip


def check_offload_bytes(fn: Callable) -> None:
    """`fn(numel, world_size, micro_batches, optimizer)` -> {"d2h", "h2d", "host"}: per rank and optimizer
    step of ZeRO-Offload in mixed precision (16-bit weights on the device, the optimizer in fp32 on the
    host) over `micro_batches` backward passes; predicted, then measured exactly."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (offload_bytes)")
    from parallel_lab.runtime.launch import launch

    g = torch.Generator().manual_seed(draw_seed())
    order = [OPTIMIZERS[int(i)] for i in torch.randperm(3, generator=g)]  # every optimizer, once per run
    cases = 0
    for p, optimizer in zip((1, 2, 3), order):
        k = int(torch.randint(1, 4, (1,), generator=g))  # 1-3 micro-batches, drawn
        # 2 and 3 ranks: a size drawn per run (on 3, one that 3 does not divide: the padded slice)
        vocab = {
            1: _SMALL["vocab"],
            2: int(torch.randint(20, 80, (1,), generator=g)),
            3: uneven_vocab(_SMALL, 3),
        }[p]
        for r, got in enumerate(
            launch(_measure_offload, p, vocab, k, optimizer, track_memory=True, timeout=60.0).values
        ):
            where = f"offload_bytes(numel={got['numel']:,}, world_size={p}, micro_batches={k}, optimizer={optimizer!r}), rank {r}"
            said = fn(got["numel"], p, k, optimizer)
            assert isinstance(said, dict) and all(key in said for key in ("d2h", "h2d", "host")), (
                f"{where}: return a dict with 'd2h', 'h2d' and 'host' bytes, got {said!r:.80}"
            )
            for key, what in (("d2h", "sent to the host"), ("h2d", "sent back to the device"),
                              ("host", "kept on the host")):  # fmt: skip
                assert said[key] == got[key], (
                    f"{where}: you predict {said[key]:,} bytes {what}, measured {got[key]:,}"
                )
            cases += 1
    passed(
        "check_offload_bytes",
        f"{cases} rank results from runs on 1, 2 and 3 ranks, every optimizer, measured as predicted",
    )

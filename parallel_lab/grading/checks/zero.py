"""Checks for lesson 04 (ZeRO): a ZeRO-1 sharded optimizer step, and ZeRO-3 gather/free hooks.

`check_zero1_step(fn)`: `fn(ctx, flat_param, flat_grad, shard, optimizer)` runs one ZeRO-1
step on every rank. It is run for 3 Adam steps on 1 to 4 ranks with a parameter count no
rank count divides (the buffers are padded), and must leave every rank with the
parameters of one process running Adam on the averaged gradients, while moving exactly
a ring all-reduce's bytes through `parallel_lab.comms`.

`check_zero3_hooks(fn)`: `fn(ctx, layer, shard, shapes)` installs forward hooks so that
`layer`'s parameters exist only while it runs. A 3-layer MLP whose parameters were
replaced by empty placeholders must give the full model's output bit for bit, with at
most one layer's parameters gathered at any time and all of them freed afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from parallel_lab.grading.checks import (
    draw_seed,
    family,
    guarded,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
    uneven_vocab,
)

__all__ = ["check_zero1_step", "check_zero3_hooks", "check_zero_state_bytes"]

WORLD_SIZES = (1, 2, 3, 4)
# The lab's ZeRO and torch's sharded optimizers, switched off on the ranks while a check runs
# (parallel_lab.comms' ring collectives stay: the exercises are built from them).
FORBIDDEN = {
    **family("parallel_lab.zero.optimizer", "parallel_lab.zero.stage3", "parallel_lab.zero.comm"),
    "torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer.__init__": "",
    "torch.distributed.fsdp.fully_shard": "",
}
_NUMEL = 1_001  # 7 x 11 x 13: no world size 2..4 divides it
_STEPS = 3


def _fail(e: Exception, what: str, limit: float) -> None:
    """A rank's AssertionError (our verdict) -> its message; a timeout -> a hint; else unchanged."""
    if getattr(e, "exc_type", None) in ("AssertionError", "WriteItYourself"):
        raise rank_verdict(e) from None
    if type(e).__name__ == "LaunchTimeout":
        raise AssertionError(
            f"{what}: the ranks did not finish in {limit:g} s (a collective some rank skipped?)"
        )
    raise e


# ----------------------------------------------------------------------------- ZeRO-1
def _zero1_case(ctx, fn: Callable, seed: int) -> str:
    from parallel_lab import comms

    p, r = ctx.world_size, ctx.rank
    shard_n = -(-_NUMEL // p)
    padded = shard_n * p
    g = torch.Generator().manual_seed(seed)  # drawn per grade run: the same weights on every rank
    init = torch.randn(_NUMEL, generator=g)
    flat_param = torch.cat([init, torch.zeros(padded - _NUMEL)])  # (P,) padded
    flat_grad = torch.zeros(padded)
    # seeded on the CPU, then on the rank's device (the learner's collectives run there)
    flat_param, flat_grad = flat_param.to(ctx.device), flat_grad.to(ctx.device)
    shard = flat_param.view(p, shard_n)[r].detach().requires_grad_()  # (S,) a view: updating it updates flat
    opt = torch.optim.Adam([shard], lr=0.05)
    ref = init.clone().requires_grad_()  # one process, averaged gradients
    ref_opt = torch.optim.Adam([ref], lr=0.05)
    where = f"world_size={p}, rank {r}, {_NUMEL} parameters padded to {padded}"
    seen: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append(shard.grad.detach().cpu() if shard.grad is not None else None)
    )
    for step in range(_STEPS):
        grads = [
            torch.randn(_NUMEL, generator=torch.Generator().manual_seed(seed + 100 * step + k + 1))
            for k in range(p)
        ]
        flat_grad.zero_()
        flat_grad[:_NUMEL] = grads[r]  # this rank's own gradient
        ref.grad = torch.stack(grads).mean(0)
        ref_opt.step()
        before = ctx.recorder.comm_totals()["sent"]
        try:
            fn(ctx, flat_param, flat_grad, shard, opt)
        except NotImplementedError:
            raise
        except AssertionError as e:
            raise AssertionError(
                f"{where}, step {step}: {e or 'an assert in your function failed'}"
            ) from None
        except Exception as e:
            raise AssertionError(f"{where}, step {step}: your function raised {type(e).__name__}: {e}") from e
        sent = ctx.recorder.comm_totals()["sent"] - before
        assert len(seen) == step + 1 and seen[-1] is not None, (
            f"{where}, step {step}: call optimizer.step() once, with shard.grad set to your slice of the gradient"
        )
        mean = torch.cat([ref.grad, ref.grad.new_zeros(padded - _NUMEL)]).view(p, shard_n)[r]  # (S,)
        gdiff = (seen[-1] - mean).abs().max().item()
        assert gdiff <= 1e-5, (
            f"{where}, step {step}: the gradient the optimizer stepped with differs from the average over ranks "
            f"of this rank's slice by up to {gdiff:.3g}" + (" (the reduce-scatter sums: divide by the world size)"
            if torch.allclose(seen[-1], mean * p, atol=1e-4) and p > 1 else "")
        )  # fmt: skip
        want = comms.ring_bytes_per_rank(padded, p, 4, "all_reduce")[r][0]
        assert sent == want, (
            f"{where}, step {step}: your step sent {sent:,} bytes through parallel_lab.comms; ZeRO-1 sends "
            f"exactly a ring all-reduce's {want:,}: comms.ring_reduce_scatter of the gradients, then "
            "comms.ring_all_gather of the updated slice" + (" (nothing was counted: use parallel_lab.comms, "
            "not torch.distributed directly)" if sent == 0 else "")
        )  # fmt: skip
        diff = (flat_param[:_NUMEL].cpu() - ref.detach()).abs().max().item()
        assert diff <= 1e-5, (
            f"{where}, step {step}: parameters differ from one process running Adam on the averaged gradients "
            f"by up to {diff:.3g}" + (" (did you divide the summed gradient by the world size?)" if diff > 1e-3 else "")
        )  # fmt: skip
        state = opt.state.get(shard, {})
        assert state and state["exp_avg"].numel() == shard_n, (
            f"{where}: the optimizer must step this rank's slice (shard), keeping Adam's state for {shard_n} "
            "elements only"
        )
        assert torch.equal(flat_param[_NUMEL:].cpu(), torch.zeros(padded - _NUMEL)), (
            f"{where}, step {step}: the padding must stay zero (its gradient is zero: reduce the padded buffer)"
        )
    return flat_param[:_NUMEL].sum().item()


def check_zero1_step(fn: Callable) -> None:
    """`fn(ctx, flat_param, flat_grad, shard, optimizer)`: reduce-scatter, update this rank's slice, all-gather."""
    require_callable(fn)
    seed = draw_seed() % 2**40  # weights and gradients drawn afresh every grade run
    for p in WORLD_SIZES:
        try:
            res = launch_learner(
                guarded(_zero1_case, FORBIDDEN, "this exercise (zero1_step)"), p, fn, seed, timeout=60.0
            )
        except NotImplementedError:
            raise
        except Exception as e:
            _fail(e, f"world_size={p}", 60.0)
        sums = set(res.values)
        assert len(sums) == 1, f"world_size={p}: the ranks ended with different parameters ({sorted(sums)})"
    passed(
        "check_zero1_step", f"{_STEPS} Adam steps on 1-4 ranks, {_NUMEL} parameters, ring all-reduce bytes"
    )


# ----------------------------------------------------------------------------- ZeRO-3 hooks
_DIMS = (5, 7, 6, 3)  # Linear(5, 7), Linear(7, 6), Linear(6, 3): 42, 48 and 21 parameters


def _zero3_case(ctx, fn: Callable, seed: int) -> list[float]:
    from parallel_lab.runtime.memory import MemoryTracker

    p, r = ctx.world_size, ctx.rank
    torch.manual_seed(seed)  # weights and input drawn afresh every grade run
    layers = [nn.Linear(a, b) for a, b in zip(_DIMS[:-1], _DIMS[1:])]
    full = nn.Sequential(layers[0], nn.GELU(), layers[1], nn.GELU(), layers[2])
    x = torch.randn(4, _DIMS[0], generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        want = full(x)  # (4, 3) the unsharded model's output
    full.to(ctx.device)  # the layers, in place: sharded and gathered on this rank's device
    x = x.to(ctx.device)
    sizes, handles = [], []
    for i, layer in enumerate(layers):
        shapes = [q.shape for q in layer.parameters()]
        flat = torch.cat([q.detach().reshape(-1) for q in layer.parameters()])
        n = -(-flat.numel() // p)
        flat = torch.cat([flat, flat.new_zeros(n * p - flat.numel())])  # (N*S,) padded
        shard = flat.view(p, n)[r].clone()  # (S,) all this rank keeps
        for q in layer.parameters():
            q.data = torch.empty(0, device=ctx.device)
        sizes.append(sum(s.numel() for s in shapes) * 4)
        try:
            out = fn(ctx, layer, shard, shapes)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(
                f"world_size={p}, layer {i}: your function raised {type(e).__name__}: {e}"
            ) from e
        handles.append(out)
    where = f"world_size={p}, rank {r}"
    peak_params = []
    mem = MemoryTracker()
    with mem:
        for layer in layers:
            mem.register_module(layer)
        # Runs after the learner's pre-forward hook (registered later): the layer is gathered now.
        sample = lambda m, a: peak_params.append(mem.snapshot()["param"])  # noqa: E731
        probes = [lay.register_forward_pre_hook(sample) for lay in layers]
        with torch.no_grad():
            try:
                got = full(x)
            except NotImplementedError:
                raise
            except Exception as e:
                raise AssertionError(f"{where}: the forward pass raised {type(e).__name__}: {e}") from e
        for h in probes:
            h.remove()
        live = mem.snapshot()["param"]
    got = got.cpu()
    assert got.shape == want.shape and torch.equal(got, want), (
        f"{where}: output differs from the unsharded model by up to {(got - want).abs().max().item():.3g}"
        if got.shape == want.shape else f"{where}: output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    )  # fmt: skip
    for i, layer in enumerate(layers):
        left = sum(q.numel() for q in layer.parameters())
        assert left == 0, (
            f"{where}: after the forward pass layer {i} still holds {left} parameter elements: the post-forward "
            "hook must free them (set each parameter's .data to an empty tensor)"
        )
    assert live == 0, f"{where}: {live} bytes of gathered parameters are still alive after the forward pass"
    assert len(peak_params) == len(layers)
    # While layer i runs: its own parameters (plus < N padding elements), nothing of the others.
    over = [(i, b) for i, b in enumerate(peak_params) if b > sizes[i] + 4 * p or b < sizes[i]]
    assert not over, (
        f"{where}: while layer {over[0][0]} ran, {over[0][1]} bytes of parameters were alive; the layer needs "
        f"{sizes[over[0][0]]}: gather all of its parameters before it runs and free every layer's when it is done"
    )
    return got.reshape(-1).tolist()


def check_zero3_hooks(fn: Callable) -> None:
    """`fn(ctx, layer, shard, shapes)` registers hooks on `layer`: all-gather before forward, free after."""
    require_callable(fn)
    seed = draw_seed() % 2**40
    for p in WORLD_SIZES:
        try:
            res = launch_learner(
                guarded(_zero3_case, FORBIDDEN, "this exercise (zero3_hooks)"), p, fn, seed, timeout=60.0
            )
        except NotImplementedError:
            raise
        except Exception as e:
            _fail(e, f"world_size={p}", 60.0)
        assert all(v == res.values[0] for v in res.values), (
            f"world_size={p}: ranks computed different outputs"
        )
    passed("check_zero3_hooks", "3 layers on 1-4 ranks, output bit-exact, one layer gathered at a time")


# ----------------------------------------------------------------------------- predict, then measure
_SMALL = dict(
    vocab=35, seq_len=8, d_model=16, n_heads=2, n_layers=2
)  # 7,280 parameters: 3 does not divide it


def _measure_state_bytes(ctx, stage: int, vocab: int) -> dict:
    """One ZeRO training step of a small GPT under the memory tracker; the model states it leaves."""
    from parallel_lab.models import GPTConfig, build_model, compute_loss, synthetic_batch
    from parallel_lab.zero import ZeRO

    model = build_model(GPTConfig(**{**_SMALL, "vocab": vocab}), seed=0, device=ctx.device)
    zero = ZeRO(ctx, model, stage=stage, optimizer="adam", precision="fp32", lr=1e-2)
    x, y = synthetic_batch("tokens", 1, seq_len=_SMALL["seq_len"], vocab=vocab, seed=1 + ctx.rank,
                           device=ctx.device)  # fmt: skip
    compute_loss(model, x, y).backward()
    zero.step()
    zero.zero_grad()
    live = ctx.memory.snapshot()
    return {"numel": zero.layout.numel, **{k: live[k] for k in ("param", "grad", "optim")}}


def check_zero_state_bytes(fn: Callable) -> None:
    """`fn(numel, world_size, stage)` -> {"param", "grad", "optim"}: the bytes one rank keeps after a
    step of fp32 Adam under ZeRO stage 0-3, predicted, then compared with the memory tracker's count
    of a real run on 2 and 3 ranks (exactly)."""
    require_callable(fn)
    fn = guarded(fn, {**FORBIDDEN, **family("parallel_lab.zero.meta", "parallel_lab.zero.layout")},
                 "this exercise (zero_state_bytes)")  # fmt: skip
    cases = 0
    vocabs = {
        2: _SMALL["vocab"],
        3: uneven_vocab(_SMALL, 3),
    }  # the 3-rank model's size is drawn every grade run
    for p in (2, 3):
        for stage in range(4):
            try:
                res = launch_learner(
                    _measure_state_bytes, p, stage, vocabs[p], track_memory=True, timeout=60.0
                )
            except Exception as e:
                _fail(e, f"stage {stage} on {p} ranks", 60.0)
            got = res.values[0]
            said = fn(got["numel"], p, stage)
            where = f"numel={got['numel']:,}, world_size={p}, stage={stage}"
            assert isinstance(said, dict) and all(k in said for k in ("param", "grad", "optim")), (
                f"{where}: return a dict with 'param', 'grad' and 'optim' bytes, got {said!r:.80}"
            )
            for k in ("param", "grad", "optim"):
                hint = ""
                if stage in (1, 2) and k == "param" and said[k] == 4 * got["numel"]:
                    hint = " (the flat buffer is padded so that it splits into equal shards)"
                assert said[k] == got[k], (
                    f"{where}: you predict {said[k]:,} bytes of {k} on a rank, the tracker measured {got[k]:,}{hint}"
                )
            cases += 1
    passed("check_zero_state_bytes", f"{cases} runs (stages 0-3 on 2 and 3 ranks) measured as predicted")

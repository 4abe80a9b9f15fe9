"""Lesson 12 as a script: data-parallel INT8 inference with outlier features, checked against one process.

    torchrun --nproc-per-node 2 -m parallel_lab.scripts.quantization
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 -m parallel_lab.scripts.quantization
    python -m parallel_lab.scripts.quantization        # no launcher: 2 local ranks via parallel_lab.runtime.launch

Every rank builds the same seeded tiny GPT with planted outlier features (LayerNorm
gains of two features x40, as in the notebook), quantizes its block linears to int8
three ways (one absmax scale per tensor; vector-wise scales, one per token and per
output feature; LLM.int8's mixed-precision decomposition, Dettmers et al. 2022) and
runs its own rows of the batch through the fp32 model and each int8 copy. The
squared errors and norms are all-reduced, so the relative error is over the whole
batch. Rank 0 recomputes it in one process and prints one row per scheme with the
weight bytes (int8 vs fp32: the 4x of BMInf's int8 linears); `--trace` (default
runs/quantization.json) is the timeline `RunResult.load` reads back.

Activations are quantized on the fly, per forward pass: the absmax scale and LLM.int8's
outlier columns are taken over the rows that pass sees, so those two schemes depend on
how the batch is cut. The reference therefore runs the rows as the ranks cut them; the
"one forward" column runs all rows at once, which vector-wise (per-token scales) must
match too.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn as nn

from parallel_lab import comms
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.quantization import METHODS, Int8Linear, plant_outliers, quantize_linears, relative_error
from parallel_lab.runtime.from_env import run_script, scaled_default, script_world
from parallel_lab.runtime.memory_state import count_bytes

# the notebook's tiny GPT and planted features
MODEL = GPTConfig(vocab=64, seq_len=32, d_model=64, n_heads=4, n_layers=2, tie_weights=False)
OUTLIERS = (3, 17)
TOL = 1e-5  # relative: float32 sums of squares taken in another order


def single_process(model: nn.Module, quantized: dict[str, nn.Module], x: torch.Tensor, p: int) -> dict:
    """Errors over all rows in one process: the rows run as p ranks cut them, and as one forward."""
    ref = model(x)  # (B, T, V)
    parts = x.tensor_split(p)  # [(B_r, T)] the ranks' rows
    split = {s: relative_error(torch.cat([q(c) for c in parts]), ref) for s, q in quantized.items()}
    whole = {s: relative_error(q(x), ref) for s, q in quantized.items()}
    return {"reference": split, "one_forward": whole}


def run_quantized_inference(
    ctx, schemes: tuple[str, ...] = METHODS, batch: int = 8, magnitude: float = 40.0
) -> dict:
    """This rank's rows through the fp32 model and one int8 copy per scheme; the errors over all ranks' rows
    (and on rank 0 the single-process reference and the weight bytes)."""
    p, r = ctx.world_size, ctx.rank
    if batch < p:
        raise ValueError(f"batch ({batch}) must be at least the number of ranks ({p}): each rank needs a row")
    if not schemes or not set(schemes) <= set(METHODS):
        raise ValueError(f"schemes must be a non-empty subset of {METHODS}, got {schemes!r}")
    model = plant_outliers(build_model(MODEL, seed=ctx.seed), OUTLIERS, magnitude).eval().to(ctx.device)
    x, _ = synthetic_batch("tokens", batch, seq_len=MODEL.seq_len, vocab=MODEL.vocab)  # (B, T)
    x = x.to(ctx.device)
    xs = x.tensor_split(p)[r]  # (B_r, T) this rank's rows: sizes differ by at most one
    quantized = {}
    for s in schemes:
        with ctx.span(f"quantize {s}", "compute"):
            quantized[s] = quantize_linears(copy.deepcopy(model), s)  # block linears int8, lm_head fp32
    sums = torch.zeros(len(schemes) + 1, device=ctx.device)  # (S + 1,) squared errors, then ||fp32||^2
    with torch.no_grad():
        with ctx.span("fp32 forward", "compute"):
            ref = model(xs)  # (B_r, T, V)
        for i, s in enumerate(schemes):
            with ctx.span(f"{s} forward", "compute"):
                sums[i] = (quantized[s](xs) - ref).pow(2).sum()
        sums[-1] = ref.pow(2).sum()
    comms.dist_all_reduce(ctx, sums)  # sums over every rank's rows: the error of the whole batch
    errors = {s: (sums[i] / sums[-1]).sqrt().item() for i, s in enumerate(schemes)}
    out = {"rows": xs.shape[0], "errors": errors}
    if r == 0:
        with ctx.span("single-process reference", "compute"), torch.no_grad():
            out.update(single_process(model, quantized, x, p))
        linears = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
        out["fp32_bytes"] = sum(count_bytes(m.weight) for m in linears)
        out["bytes"] = {
            s: [sum(count_bytes(getattr(m, k)) for m in q.modules() if isinstance(m, Int8Linear))
                for k in ("qweight", "scale")]
            for s, q in quantized.items()
        }  # fmt: skip
    return out


def report(values: list[dict]) -> tuple[str, bool]:
    """One row per scheme: distributed error, the single-process ones, weight bytes; and whether they match."""
    v0 = values[0]
    lines = [
        f"{'scheme':<11} {'rel. error':>10} {'single-process':>14} {'one forward':>11} "
        f"{'int8 B':>8} {'scales B':>8} {'fp32 B':>8} {'fp32/int8':>9}"
    ]
    ok = True
    for s, err in v0["errors"].items():
        ref, whole = v0["reference"][s], v0["one_forward"][s]
        same = all(v["errors"][s] == err for v in values)  # every rank got the same all-reduced sums
        good = same and abs(err - ref) <= TOL * ref and (s != "vectorwise" or abs(err - whole) <= TOL * whole)
        ok &= good
        w8, sc = v0["bytes"][s]
        lines.append(
            f"{s:<11} {err:>10.6f} {ref:>14.6f} {whole:>11.6f} {w8:>8,} {sc:>8,} {v0['fp32_bytes']:>8,} "
            f"{v0['fp32_bytes'] / w8:>8.2f}x" + ("" if good else "  <- MISMATCH")
        )
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=list(METHODS), choices=METHODS, help="schemes to compare")
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences in the whole batch, split over the ranks (default 8)",
    )
    ap.add_argument("--magnitude", type=float, default=40.0, help="how much larger the planted outliers are")
    ap.add_argument("--trace", default="runs/quantization.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    world = script_world(args.nproc)
    args.batch = scaled_default("--batch", args.batch, world, lambda w: max(8, w))
    if "RANK" not in os.environ and args.nproc < 1:
        ap.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.batch < world:
        ap.error(f"--batch ({args.batch}) must be at least the number of ranks ({world})")
    if not args.magnitude > 0:
        ap.error(f"--magnitude must be > 0, got {args.magnitude}")
    kw = dict(schemes=tuple(args.schemes), batch=args.batch, magnitude=args.magnitude)
    result = run_script(run_quantized_inference, nproc=args.nproc, trace_path=args.trace, **kw)
    if result is None:  # not rank 0
        return 0
    table, ok = report(result.values)
    rows = "/".join(str(v["rows"]) for v in result.values)
    print(
        f"{result.world_size} ranks ({result.backend}), tiny GPT d={MODEL.d_model}, features {OUTLIERS} "
        f"x{args.magnitude:g}, {args.batch} sequences x {MODEL.seq_len} tokens split {rows}"
    )
    print(table)
    print(("matches" if ok else "DIFFERS from") + " single-process quantized inference")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

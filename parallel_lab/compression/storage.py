"""What a compressed model weighs on disk: sparse weights as values + indices, quantized ones as codes.

A pruned weight saved densely weighs what it did; the saving exists only if the zeros are not
stored (compressed sparse rows: the kept values, their column indices, and where each row starts).
Each kept weight then costs its value and its index, b_v + b_i bytes, against b_v for every weight
stored densely: sparse pays only once the density (kept / all) is below b_v / (b_v + b_i), 2/3 for
fp32 values and 2-byte indices, 1/3 for int8 codes, 1/5 for 4-bit codes (`sparse_pays`, which also
counts the row offsets).
A `bits`-bit weight is its integer codes (two 4-bit codes per byte) and one fp32 scale per row.
`pack` writes both, `unpack` reads them back into a model of the same shape, and `packed_bytes`
measures the file `torch.save` writes. Parameters used twice (a tied head, shared blocks) are
stored once.

Invariant: `unpack(pack(model), like)` gives a model whose outputs equal `model`'s (test).
"""

from __future__ import annotations

import copy
import io

import torch
import torch.nn as nn

from parallel_lab.compression.qat import QATLinear, channel_scale

__all__ = ["deployed", "pack", "packed_bytes", "sparse_pays", "unpack"]

INDEX_BYTES = 2  # int16 column indices
OFFSET_BYTES = 4  # int32 row offsets


def _codes(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = channel_scale(w, bits)  # (out, 1)
    qmax = 2 ** (bits - 1) - 1
    return torch.round(w / scale).clamp(-qmax, qmax).to(torch.int8), scale


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] -> uint8 bytes holding two codes each."""
    u = (codes.flatten().to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_zeros(1)])
    return u[0::2] | (u[1::2] << 4)


def _unpack4(b: torch.Tensor, n: int) -> torch.Tensor:
    lo, hi = (b & 15).to(torch.int16) - 8, (b >> 4).to(torch.int16) - 8
    return torch.stack([lo, hi], dim=1).flatten()[:n].to(torch.int8)


def sparse_pays(shape: tuple[int, int], kept: int, value_bits: int) -> bool:
    """True when `kept` of the weights of a (rows, cols) matrix stored as CSR (values, int16 column
    indices, int32 row offsets) take fewer bytes than all of them stored densely at `value_bits` bits:
    kept · (b_v + b_i) + (rows + 1) · 4 < rows · cols · b_v, about density < b_v / (b_v + b_i)."""
    rows, cols = shape
    b_v = value_bits / 8
    return kept * (b_v + INDEX_BYTES) + (rows + 1) * OFFSET_BYTES < rows * cols * b_v


def pack(model: nn.Module) -> dict:
    """{name: entry} for every distinct parameter; block Linears carry their sparsity and bit width."""
    out: dict = {}
    seen: dict[int, str] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if id(p) in seen:
                out[name] = {"same_as": seen[id(p)]}
                continue
            seen[id(p)] = name
            w = p.detach()
            bits = getattr(module, "_compression_bits", None) if pname == "weight" else None
            mask = getattr(module, "_compression_mask", None) if pname == "weight" else None
            entry: dict = {"shape": tuple(w.shape)}
            if bits is not None:
                codes, scale = _codes(w, bits)
                entry["scale"], entry["bits"] = scale, bits
                w = codes
            value_bits = bits or 8 * w.element_size()
            if mask is not None and sparse_pays(tuple(w.shape), int(mask.sum()), value_bits):
                rows, cols = mask.nonzero(as_tuple=True)
                entry["crow"] = torch.cat([torch.zeros(1, dtype=torch.int32),
                                           torch.bincount(rows, minlength=w.shape[0]).cumsum(0).to(torch.int32)])  # fmt: skip
                entry["col"] = cols.to(torch.int16)
                w = w[mask]
            entry["values"] = _pack4(w) if bits == 4 else w
            entry["n"] = w.numel()
            out[name] = entry
    return out


def unpack(packed: dict, like: nn.Module) -> nn.Module:
    """Load `packed` into `like` (a model of the same architecture), dense fp32 weights."""
    params = dict(like.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, entry in packed.items():
            if "same_as" in entry:
                continue
            vals = entry["values"]
            if entry.get("bits") == 4:
                vals = _unpack4(vals, entry["n"])
            if "crow" in entry:
                rows = torch.repeat_interleave(
                    torch.arange(len(entry["crow"]) - 1), entry["crow"].diff().long()
                )
                dense = torch.zeros(entry["shape"], dtype=vals.dtype)
                dense[rows, entry["col"].long()] = vals
                vals = dense
            vals = vals.reshape(entry["shape"]).float()
            if "scale" in entry:
                vals = vals * entry["scale"]
            params[name].copy_(vals)
    return like


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the file `torch.save(pack(model))` writes (measured, headers included)."""
    buf = io.BytesIO()
    torch.save(pack(model), buf)
    return buf.getbuffer().nbytes


def deployed(model: nn.Module) -> nn.Module:
    """The model as it is served: read back from its packed form into plain Linears (no fake
    quantization left in the forward pass), weights dense in fp32."""
    like = copy.deepcopy(model)
    for m in like.modules():
        if isinstance(m, QATLinear):
            m.__class__ = nn.Linear
    return unpack(pack(model), like)

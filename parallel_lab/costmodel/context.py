"""Context parallelism (lesson 17): what splitting the sequence costs in bytes and saves in memory.

Ring attention (Liu et al. 2023) passes every key/value block once around the ring in forward,
and again in backward with its float32 dK, dV accumulators, which go one step further to get
home; all-to-all sequence parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses) exchanges q, k, v
and the output once each way. S = batch * heads * seq_local * head_dim elements per tensor.

Invariant: the byte counts equal what the lab's `context_parallel` attentions send per rank
(tests compare them with the comms layer's counters, exactly).
"""

from __future__ import annotations

from parallel_lab.costmodel.formulas import _int


def _elements(batch: int, heads: int, seq_local: int, head_dim: int) -> int:
    b, h, t, d = (_int(n, v, 1) for n, v in (("batch", batch), ("heads", heads), ("seq_local", seq_local),
                                              ("head_dim", head_dim)))  # fmt: skip
    return b * h * t * d


def ring_attention_bytes(batch: int, heads: int, seq_local: int, head_dim: int, cp: int,
                         itemsize: int = 4) -> dict[str, int]:  # fmt: skip
    """Bytes one rank sends in one ring-attention call: {"forward", "backward"}.

    forward (cp-1) * 2S * itemsize (k and v, one block per step); backward the same for the blocks
    plus cp * 2S * 4 for the float32 dK, dV accumulators (they travel with their block, then home)."""
    s, n = _elements(batch, heads, seq_local, head_dim), _int("cp", cp, 1)
    e = _int("itemsize", itemsize, 1)
    blocks = (n - 1) * 2 * s * e
    return {"forward": blocks, "backward": blocks + (n * 2 * s * 4 if n > 1 else 0)}


def ulysses_attention_bytes(batch: int, heads: int, seq_local: int, head_dim: int, cp: int,
                            itemsize: int = 4) -> dict[str, int]:  # fmt: skip
    """Bytes one rank sends in one all-to-all attention call: {"forward", "backward"}.

    Each all-to-all keeps 1/cp of its input and sends the rest: q, k, v in (3S) and the output back (S),
    so 4S(cp-1)/cp * itemsize each way. Needs heads divisible by cp."""
    s, n = _elements(batch, heads, seq_local, head_dim), _int("cp", cp, 1)
    e = _int("itemsize", itemsize, 1)
    if heads % n:
        raise ValueError(f"heads ({heads}) must be divisible by cp ({n}) for all-to-all attention")
    one_way = 4 * s * (n - 1) // n * e
    return {"forward": one_way, "backward": one_way}


__all__ = ["cp_activation_bytes", "ring_attention_bytes", "ulysses_attention_bytes"]


def cp_activation_bytes(batch: int, seq: int, hidden: int, layers: int, heads: int = 4, vocab: int = 64,
                        cp: int = 1, dtype_bytes: int = 4) -> int:  # fmt: skip
    """Bytes one rank's TinyGPT forward saves for backward when attention is ring (or tiled) attention.

    Every per-token tensor of `formulas.activation_bytes` at seq/cp tokens, without the two terms that
    grow with the square of the sequence (the (B, a, T, T) softmax output and the (T, T) mask: the
    tiled attention recomputes its scores in backward instead), plus what that backward needs in their
    place: the float32 output (B·T/cp·C·4) and log-sum-exp per query and head (B·a·T/cp·4). Linear in
    the sequence, and divided by cp."""
    from parallel_lab.costmodel.formulas import activation_bytes

    n, t = _int("cp", cp, 1), _int("seq", seq, 1)
    if t % n:
        raise ValueError(f"seq ({t}) must be divisible by cp ({n})")
    tl, d = t // n, _int("dtype_bytes", dtype_bytes, 1)
    full = activation_bytes(batch, tl, hidden, layers, heads, vocab, dtype_bytes=d)
    squares = layers * (heads * batch * tl * tl * d + tl * tl)
    return full - squares + layers * batch * tl * (hidden + heads) * 4

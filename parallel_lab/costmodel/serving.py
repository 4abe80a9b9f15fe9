"""What serving a model costs: FLOPs per token, KV-cache bytes, and the memory budget of a server.

Lesson 14. Kaplan et al. 2020 (table 1): a forward pass costs about 2N FLOPs per token for N
parameters (one multiply and one add per weight), so generating a token costs 2N. Every layer
keeps the keys and values of every past token so that a new token does not recompute them (the KV
cache of Pope et al. 2022, "Efficiently Scaling Transformer Inference"): 2 (K and V) x layers x
kv_heads x head_dim numbers per token. Grouped-query attention (Ainslie et al. 2023) shares one
key/value head among n_heads / kv_heads query heads and shrinks the cache by that factor;
multi-query attention (Shazeer 2019) is kv_heads = 1.

Invariant: every function is exact integer arithmetic on the arguments it is given; the model
shapes below are published configurations (Touvron et al. 2023, Llama 2, table 1 and section 2.2),
and every assumption the lesson adds (batch, context, bytes per number) is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_lab.costmodel.formulas import _int

__all__ = [
    "SERVING_MODELS",
    "ServingModel",
    "inference_flops_per_token",
    "kv_cache_bytes",
    "serving_memory",
    "tokens_for_cache",
]


def inference_flops_per_token(num_params: float) -> float:
    """2N: one multiply-add per parameter for each generated token (Kaplan et al. 2020)."""
    return 2.0 * _int("num_params", num_params, 1)


def kv_cache_bytes(
    layers: int, kv_heads: int, head_dim: int, tokens: int, batch: int = 1, itemsize: int = 2
) -> int:
    """2 · layers · kv_heads · head_dim · tokens · batch · itemsize: keys and values of every cached token."""
    return (
        2
        * _int("layers", layers, 1)
        * _int("kv_heads", kv_heads, 1)
        * _int("head_dim", head_dim, 1)
        * _int("tokens", tokens)
        * _int("batch", batch, 1)
        * _int("itemsize", itemsize, 1)
    )


@dataclass(frozen=True)
class ServingModel:
    """The shapes that set a served model's memory: parameters, layers, heads, hidden size."""

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, itemsize: int = 2, kv_heads: int | None = None) -> int:
        kvh = self.kv_heads if kv_heads is None else kv_heads
        return kv_cache_bytes(self.layers, kvh, self.head_dim, 1, 1, itemsize)


#: Llama 2 (Touvron et al. 2023): 7B and 13B use multi-head attention, 70B grouped-query with 8 KV heads;
#: GPT-3 175B (Brown et al. 2020, table 2.1) multi-head.
SERVING_MODELS = {
    "7B": ServingModel("7B", 6.74e9, 32, 4096, 32, 32),
    "13B": ServingModel("13B", 13.0e9, 40, 5120, 40, 40),
    "70B": ServingModel("70B", 68.98e9, 80, 8192, 64, 8),
    "175B": ServingModel("175B", 175e9, 96, 12288, 96, 96),
}


def serving_memory(model: ServingModel, batch: int, context: int, itemsize: int = 2,
                   kv_heads: int | None = None) -> dict[str, float]:  # fmt: skip
    """Bytes a server holds for `batch` sequences of `context` tokens: weights, KV cache, activations.

    "activations" counts the residual stream of one layer only, batch · context · hidden · itemsize
    (the layer's input, which its output replaces): a forward pass at inference keeps nothing for
    backward, so only the layer being computed is live. Not counted are the larger intermediates
    inside that layer. The MLP's are the biggest: a SwiGLU MLP holds its gate and up projections,
    each batch · context · ffn wide, and in Llama 2 70B ffn = 28,672 = 3.5 · hidden, so at prefill
    the two are 7 times the residual stream. The attention scores are not counted either: a fused,
    FlashAttention-style kernel never stores them.
    """
    _int("batch", batch, 1), _int("context", context, 1)
    return {
        "weights": model.params * itemsize,
        "kv_cache": float(
            kv_cache_bytes(
                model.layers,
                model.kv_heads if kv_heads is None else kv_heads,
                model.head_dim,
                context,
                batch,
                itemsize,
            )
        ),  # fmt: skip
        "activations": float(batch * context * model.hidden * itemsize),
    }


def tokens_for_cache(
    cache_bytes: float, model: ServingModel, itemsize: int = 2, kv_heads: int | None = None
) -> float:
    """How many cached tokens (batch x context) fill `cache_bytes`."""
    return cache_bytes / model.kv_bytes_per_token(itemsize, kv_heads)

"""``ne.attention``: plain attention with FlexAttention-style hooks, written in the DSL.

The builder only *writes the plain computation* (QKᵀ·scale → score_mod → mask → max →
exp → sum → P·V → divide); fusion is left to the rules.  Captured tensors work in both
hooks: index any ``ne.placeholder`` inside them and it becomes an input of the kernel.
"""
from __future__ import annotations

import math

from . import dsl as ne
from .ir import MASKED


NEG = MASKED  # masked score: a large finite negative, never -inf


def attention(b: int, hq: int, s_q: int, s_kv: int, d: int, dtype: str = "float16", *,
                   kv_heads: int | None = None, scale: float | None = None,
                   score_mod=None, mask_mod=None) -> ne.Tensor:
    """Plain attention with FlexAttention-style hooks, written in the DSL.

    ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites a score, ``mask_mod(b, h, q_idx,
    kv_idx)`` says which keys a query sees; ``kv_heads`` < ``hq`` is GQA (query head h
    reads KV head h // (hq // kv_heads)).  Masked keys get weight 0, and a row with no
    visible key returns 0 (as FlexAttention does), never NaN."""
    kv_heads = kv_heads or hq
    if hq % kv_heads:
        raise ne.ProgramError(f"Expected q heads ({hq}) to be a multiple of kv heads "
                              f"({kv_heads}) for GQA.")
    group = hq // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = ne.placeholder((b, hq, s_q, d), dtype, "q")
    k = ne.placeholder((b, kv_heads, s_kv, d), dtype, "k")
    v = ne.placeholder((b, kv_heads, s_kv, d), dtype, "v")
    for n, t in enumerate((q, k, v)):  # the kernel takes q, k, v first, then captured tensors
        t._order = n - 3
    dd = ne.reduce_axis(d, "d")

    def kvh(h):
        return h // group if group > 1 else h

    def score(z, y, i, j):
        s = ne.sum(q[z, y, i, dd] * k[z, kvh(y), j, dd], axis=dd) * scale
        return score_mod(s, z, y, i, j) if score_mod else s

    def visible(z, y, i, j):
        return mask_mod(z, y, i, j) if mask_mod else None

    s = ne.compute((b, hq, s_q, s_kv), lambda z, y, i, j: (
        score(z, y, i, j) if mask_mod is None
        else ne.where(visible(z, y, i, j), score(z, y, i, j), NEG)), "s")
    j = ne.reduce_axis(s_kv, "j")
    mx = ne.compute((b, hq, s_q), lambda z, y, i: ne.max(s[z, y, i, j], axis=j), "mx")

    def weight(z, y, i, jj):
        p = ne.exp(s[z, y, i, jj] - mx[z, y, i])
        return p if mask_mod is None else ne.where(visible(z, y, i, jj), p, 0.0)

    jl = ne.reduce_axis(s_kv, "jl")
    den = ne.compute((b, hq, s_q), lambda z, y, i: ne.sum(weight(z, y, i, jl), axis=jl), "den")
    jo = ne.reduce_axis(s_kv, "jo")
    if mask_mod is None:
        return ne.compute((b, hq, s_q, d), lambda z, y, i, e: ne.sum(
            weight(z, y, i, jo) * v[z, kvh(y), jo, e], axis=jo) / den[z, y, i], "o")
    return ne.compute((b, hq, s_q, d), lambda z, y, i, e: ne.where(
        den[z, y, i] > 0.0,
        ne.sum(weight(z, y, i, jo) * v[z, kvh(y), jo, e], axis=jo) / ne.maximum(den[z, y, i], 1e-30),
        0.0), "o")

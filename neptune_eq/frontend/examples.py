"""Plain programs written in the DSL, as a user would write them (no fusion by hand).

They are used by the demo, the tests and the benchmarks; the fused forms are derived
from them by the rules."""
from __future__ import annotations

import math

from . import dsl as ne


def softmax(n: int, m: int, dtype: str = "float32") -> ne.Tensor:
    """y[i, c] = exp(x[i, c] - max_j x[i, j]) / sum_k exp(x[i, k] - max_j x[i, j])."""
    x = ne.placeholder((n, m), dtype, "x")
    j = ne.reduce_axis(m, "j")
    mx = ne.compute((n,), lambda i: ne.max(x[i, j], axis=j), "mx")
    k = ne.reduce_axis(m, "k")
    den = ne.compute((n,), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k), "den")
    return ne.compute((n, m), lambda i, c: ne.exp(x[i, c] - mx[i]) / den[i], "y")


def attention(b: int, h: int, s_q: int, s_kv: int, d: int, dtype: str = "float16",
              scale: float | None = None) -> ne.Tensor:
    """Plain attention: S = QKᵀ·scale, m = max S, l = Σ exp(S − m), O = Σ exp(S − m)·V / l."""
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = ne.placeholder((b, h, s_q, d), dtype, "q")
    k = ne.placeholder((b, h, s_kv, d), dtype, "k")
    v = ne.placeholder((b, h, s_kv, d), dtype, "v")
    dd = ne.reduce_axis(d, "d")
    s = ne.compute((b, h, s_q, s_kv),
                   lambda z, y, i, j: ne.sum(q[z, y, i, dd] * k[z, y, j, dd], axis=dd) * scale, "s")
    j = ne.reduce_axis(s_kv, "j")
    mx = ne.compute((b, h, s_q), lambda z, y, i: ne.max(s[z, y, i, j], axis=j), "mx")
    jl = ne.reduce_axis(s_kv, "jl")
    den = ne.compute((b, h, s_q),
                     lambda z, y, i: ne.sum(ne.exp(s[z, y, i, jl] - mx[z, y, i]), axis=jl), "den")
    jo = ne.reduce_axis(s_kv, "jo")
    return ne.compute((b, h, s_q, d), lambda z, y, i, e: ne.sum(
        ne.exp(s[z, y, i, jo] - mx[z, y, i]) * v[z, y, jo, e], axis=jo) / den[z, y, i], "o")


CHAINS = ["log-sum-exp", "two-producers", "rms-matmul", "normalised", "centered", "max-consumer"]


def reduction_chain(name: str, N: int, M: int, E: int, dtype: str = "float32") -> ne.Tensor:
    """The reduction chains the rule system must fuse (issue 3), written plainly."""
    x = ne.placeholder((N, M), dtype, "x")
    v = ne.placeholder((M, E), dtype, "v")
    j = ne.reduce_axis(M, "j")
    mx = ne.compute((N,), lambda i: ne.max(x[i, j], axis=j), "mx")
    k = ne.reduce_axis(M, "k")
    if name == "log-sum-exp":
        return ne.compute((N,), lambda i: mx[i] + ne.log(ne.sum(ne.exp(x[i, k] - mx[i]), axis=k)), "lse")
    if name == "two-producers":  # Σ exp(c − m)·v / l
        den = ne.compute((N,), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k), "den")
        l = ne.reduce_axis(M, "l")
        return ne.compute((N, E), lambda i, e: ne.sum(ne.exp(x[i, l] - mx[i]) * v[l, e] / den[i], axis=l), "o")
    if name == "rms-matmul":  # Σ c·w / √s
        ss = ne.compute((N,), lambda i: ne.sum(x[i, k] * x[i, k], axis=k), "ss")
        b = ne.reduce_axis(M, "b")
        return ne.compute((N, E), lambda i, e: ne.sum(x[i, b] * v[b, e] / ne.sqrt(ss[i]), axis=b), "y")
    if name == "normalised":  # Σ (c/s)·v
        s = ne.compute((N,), lambda i: ne.sum(ne.exp(x[i, k]), axis=k), "s")
        d = ne.reduce_axis(M, "d")
        return ne.compute((N, E), lambda i, e: ne.sum((ne.exp(x[i, d]) / s[i]) * v[d, e], axis=d), "y")
    if name == "centered":  # Σ (c − m)·w, rejected by Neptune's solver
        f = ne.reduce_axis(M, "f")
        return ne.compute((N, E), lambda i, e: ne.sum((x[i, f] - mx[i]) * v[f, e], axis=f), "y")
    if name == "max-consumer":  # max_j (c − Σc): rolling with ⊕ = max, ⊙ = +
        tot = ne.compute((N,), lambda i: ne.sum(x[i, k], axis=k), "tot")
        g = ne.reduce_axis(M, "g")
        return ne.compute((N,), lambda i: ne.max(x[i, g] - tot[i], axis=g), "mm")
    raise KeyError(name)


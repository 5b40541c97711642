"""``ne.attention``: plain attention with FlexAttention-style hooks, written in the DSL.

The builder only *writes the plain computation* (QKᵀ·scale → score_mod → mask → max →
exp → sum → P·V → divide); fusion is left to the rules.  Captured tensors work in both
hooks: index any ``ne.placeholder`` inside them and it becomes an input of the kernel.

Mods written for ``torch.nn.attention.flex_attention`` run unchanged: torch functions and
tensor methods on the expressions are translated (``neptune_eq.torch_mods``), and torch
tensors the mods index become kernel inputs too, listed in ``out.captured``.
"""
from __future__ import annotations

import inspect
import math

from . import dsl as ne
from ..ir import MASKED, Term, substitute, var


NEG = MASKED  # masked score: a large finite negative, never -inf


def attention(b: int, hq: int, s_q: int, s_kv: int, d: int, dtype: str = "float16", *,
              kv_heads: int | None = None, scale: float | None = None,
              score_mod=None, mask_mod=None, dv: int | None = None) -> ne.Tensor:
    """Plain attention with FlexAttention-style hooks, written in the DSL.

    ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites a score, ``mask_mod(b, h, q_idx,
    kv_idx)`` says which keys a query sees; ``kv_heads`` < ``hq`` is GQA (query head h
    reads KV head h // (hq // kv_heads)).  Masked keys get weight 0, and a row with no
    visible key returns 0 (as FlexAttention does), never NaN -- also when the masking is
    a score_mod's ``torch.where(cond, score, float("-inf"))``.

    The mods may be FlexAttention mods written against torch (``torch.where``,
    ``torch.tanh``, ``and_masks``, ...).  Torch tensors they index become kernel inputs:
    ``out.captured`` maps each placeholder name to its tensor, in the order the kernel
    takes them after q, k, v and any ``ne.placeholder`` declared earlier, so
    ``kern(q, k, v, *out.captured.values())`` or ``kern(q=q, k=k, v=v, **out.captured)``
    runs it on the tensors the mods captured.

    ``dv`` is the value head dim when it differs from ``d`` (v is (b, kv_heads, s_kv, dv)
    and the output (b, hq, s_q, dv)), as FlexAttention's Ev."""
    from . import torch_mods  # on first use: `import neptune_eq` stays light
    for name, n in (("hq", hq), ("d", d), ("kv_heads", kv_heads), ("dv", dv)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ne.ProgramError(f"Expected {name} to be a positive int (heads and head "
                                  f"dims are fixed; batch and lengths may be named sizes), "
                                  f"got {n!r}.")
    check_mods(score_mod, mask_mod)
    kv_heads = kv_heads or hq
    if hq % kv_heads:
        raise ne.ProgramError(f"Expected q heads ({hq}) to be a multiple of kv heads "
                              f"({kv_heads}) for GQA.")
    with torch_mods.capturing(score_mod, mask_mod) as session:
        out = _build(b, hq, s_q, s_kv, d, dtype, hq // kv_heads, kv_heads,
                     1.0 / math.sqrt(d) if scale is None else scale, score_mod, mask_mod,
                     dv=dv)
    out.captured = session.captured
    return out


def check_mods(score_mod, mask_mod) -> None:
    """Mods that cannot be called as FlexAttention calls them, as errors naming the form --
    not Python's TypeError from deep inside the trace.  Checked once per trace, never per
    call (``inspect.signature`` costs more than a replayed call)."""
    _check_mod(score_mod, "score_mod", "(score, b, h, q_idx, kv_idx)")
    _check_mod(mask_mod, "mask_mod", "(b, h, q_idx, kv_idx)")


def _check_mod(fn, name: str, form: str) -> None:
    if fn is None:
        return
    if not callable(fn):
        raise ValueError(f"Expected {name} to be a function {name}{form}, got "
                         f"{type(fn).__name__}.")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the call will tell
        return
    try:
        sig.bind(*range(form.count(",") + 1))
    except TypeError:
        raise ValueError(f"Expected {name} to take {form.count(',') + 1} positional arguments "
                         f"{form}, got a function with signature {sig}.") from None


def _build(b, hq, s_q, s_kv, d, dtype, group, kv_heads, scale, score_mod, mask_mod,
           dv=None) -> ne.Tensor:
    from . import torch_mods  # on first use: `import neptune_eq` stays light
    dv = d if dv is None else dv  # value head dim (FlexAttention's Ev)
    q = ne.placeholder((b, hq, s_q, d), dtype, "q")
    k = ne.placeholder((b, kv_heads, s_kv, d), dtype, "k")
    v = ne.placeholder((b, kv_heads, s_kv, dv), dtype, "v")
    for n, t in enumerate((q, k, v)):  # the kernel takes q, k, v first, then captured tensors
        t._order = n - 3
    dd = ne.reduce_axis(d, "d")
    # What tracing the score_mod found (filled while `s` is built, read by the reductions):
    # the condition of a top-level where(cond, score, -inf), over the key axis "j", and
    # whether any other -inf is left in the score.
    found: dict = {"cond": None, "guard": False}

    def kvh(h):
        return h // group if group > 1 else h

    traced: dict = {}

    def mask(z, y, i, jj) -> Term | None:
        """mask_mod's condition at key axis ``jj``: traced once, at the score's key axis
        ``j``, and renamed for the reductions' key axes.  Traced again per use, a mod that
        computes a tensor from a captured one (``(doc > 0)[q_idx]``) would make a new
        tensor -- a separate kernel input -- per use, and the uses would no longer be one
        mask (its folds' passes would each get their own key ranges)."""
        if mask_mod is None:
            return None
        if "term" not in traced:  # (the first call: s's body, key axis "j")
            traced["term"] = _term(torch_mods.condition(mask_mod(z, y, i, jj), "mask_mod"))
            return traced["term"]
        term = traced["term"]  # (None: a mask that is always true)
        return None if term is None else substitute(term, {"j": var(jj.name)})

    def s_body(z, y, i, j):
        sc = ne.sum(q[z, y, i, dd] * k[z, kvh(y), j, dd], axis=dd) * scale
        if score_mod is not None:
            sc = torch_mods.value(score_mod(sc, z, y, i, j), "score_mod")
        body, cond = torch_mods.split_masked(sc.term)
        found["cond"] = cond
        found["guard"] = any(torch_mods.is_masked_const(n) for n in body.walk())
        vis = _and(mask(z, y, i, j), cond)
        return ne.Expr(body) if vis is None else ne.where(ne.Expr(vis), ne.Expr(body), NEG)

    def visible(z, y, i, jj) -> Term | None:
        """The mask at key axis ``jj``: mask_mod traced again, the score_mod's condition
        renamed from ``j``; with a -inf left inside the score, a key whose score is still
        ~MASKED counts as masked (so a row masked that way returns 0, as in torch)."""
        cond = found["cond"]
        vis = _and(mask(z, y, i, jj), None if cond is None else substitute(cond, {"j": var(jj.name)}))
        if found["guard"]:
            vis = _and(vis, (s[z, y, i, jj] > NEG * 0.5).term)
        return vis

    s = ne.compute((b, hq, s_q, s_kv), s_body, "s")
    j = ne.reduce_axis(s_kv, "j")
    mx = ne.compute((b, hq, s_q), lambda z, y, i: ne.max(s[z, y, i, j], axis=j), "mx")
    masked = mask_mod is not None or found["cond"] is not None or found["guard"]

    def weight(z, y, i, jj):
        p = ne.exp(s[z, y, i, jj] - mx[z, y, i])
        vis = visible(z, y, i, jj)
        return p if vis is None else ne.where(ne.Expr(vis), p, 0.0)

    jl = ne.reduce_axis(s_kv, "jl")
    den = ne.compute((b, hq, s_q), lambda z, y, i: ne.sum(weight(z, y, i, jl), axis=jl), "den")
    jo = ne.reduce_axis(s_kv, "jo")
    if not masked:
        return ne.compute((b, hq, s_q, dv), lambda z, y, i, e: ne.sum(
            weight(z, y, i, jo) * v[z, kvh(y), jo, e], axis=jo) / den[z, y, i], "o")
    return ne.compute((b, hq, s_q, dv), lambda z, y, i, e: ne.where(
        den[z, y, i] > 0.0,
        ne.sum(weight(z, y, i, jo) * v[z, kvh(y), jo, e], axis=jo) / ne.maximum(den[z, y, i], 1e-30),
        0.0), "o")


def _term(e) -> Term | None:
    return None if e is None else e.term


def _and(a: Term | None, b: Term | None) -> Term | None:
    if a is None or b is None:
        return b if a is None else a
    return Term("and", (a, b))

"""Integer index arithmetic that meets float math, computed in fp32 without a per-score
conversion.

A score mod such as ALiBi's ``s + slope[h]·(j − i)`` mixes an integer index expression
into the float scores.  Emitted as written, ``j − i`` is an int tile over the score tile
and the multiply converts it element by element: one ``I2F`` per score.  On sm_90 that
conversion issues on the XU pipe, the same quarter-rate pipe (16 per clock per SM) as
the ``exp2`` the softmax is bound by -- so the mod halved the block math's throughput
budget for its one add.

Here the expression is rebuilt in fp32 from fp32 offsets instead: the key loop's
``offsf_L = colsf + l0`` (``colsf``, the block's column numbers in fp32, is made once
before the loops; per block that is one add per column, on the FMA pipe), row offsets
converted once per program, and ``+ − ·literal`` as fp32 ops.  **Exact**: every value is
an integer of magnitude below 2^24, which fp32 holds exactly, so each fp32 add, subtract
and product by an integer literal rounds nothing and equals the int result converted.
The bound is checked on the axis extents (for a symbolic size that check is a guard of
the kernel's size bucket); an expression outside it keeps the int form.

``FLOAT_INDEX`` is the A/B switch (environment ``NEPTUNE_EQ_FLOAT_INDEX=0`` keeps the
int form); it is part of the disk cache key (``choosing.cache.lowering_switches``).
"""
from __future__ import annotations

import os

from ..ir import Term

FLOAT_INDEX = os.environ.get("NEPTUNE_EQ_FLOAT_INDEX", "1") != "0"
EXACT_BELOW = 2 ** 24          # fp32 holds every integer of smaller magnitude
_PAD = 1024                    # offsets of padding lanes run past the extent by < a block
_OPS = ("add", "sub", "neg", "mul")


def magnitude(t: Term, extent_of) -> "int | None":
    """A bound on |t| over every index value (and padding lane) for an index expression
    of axis variables, integer literals, + − and products by a literal; None for anything
    else (a division, a load, a float).  ``extent_of(var)``: the variable's extent."""
    if t.op == "var":
        n = extent_of(t.val)
        return None if n is None else n + _PAD
    if t.op == "int":
        return abs(int(t.val))
    if t.op not in _OPS:
        return None
    if t.op == "mul" and not any(a.op == "int" for a in t.args):
        return None  # a product of two indices may leave the exact range fast: not here
    parts = [magnitude(a, extent_of) for a in t.args]
    if any(p is None for p in parts):
        return None
    if t.op == "mul":
        return parts[0] * parts[1]
    return sum(parts)


def spans_loop(em, t: Term, loop: str) -> bool:
    """Whether ``t`` reads the variable bound to the key loop's axis (it varies per score
    or per column of a block: where a conversion would be paid per block)."""
    return any(n.op == "var" and em.env.get(n.val) == loop for n in t.walk())


def wanted(em, t: Term, loop: str) -> bool:
    """Whether the int expression ``t``, about to meet a float, is rebuilt in fp32."""
    if not FLOAT_INDEX or not spans_loop(em, t, loop):
        return False
    extents = em.p.extents
    # the key loop's variable (renamed per pass) runs over one of the program's axes:
    # their sum bounds it without comparing symbolic sizes (a comparison is a guard)
    loop_extent = sum(extents.values())

    def extent_of(v: str):
        return extents.get(v, loop_extent if em.env.get(v) == loop else None)
    bound = magnitude(t, extent_of)
    return bound is not None and bound < EXACT_BELOW  # (records a guard on a symbolic size)


def emit(em, t: Term, loop: str, arange: str):
    """``t`` (an index expression ``wanted`` accepted) as an fp32 Tile; ``arange``: the
    code of the key block's column numbers (``tl.arange(0, B_L)``, Gluon's ``cols``)."""
    from .codegen import Tile
    if t.op == "int":
        return Tile(repr(float(t.val)), (), "f32")
    if t.op == "var":
        role = em.env.get(t.val)
        if role == loop:
            return _loop_offsets(em, loop, arange)
        return em.float_of(em.expr(t))  # a row's or a program's index: converted once
    args = [emit(em, a, loop, arange) for a in t.args]
    if t.op in ("add", "sub") and args[1].code == "0.0":
        return args[0]  # (i + 0: a mod's offset of zero)
    scope = em._scope_for(t)
    if t.op == "neg":
        return em.bind(f"-({args[0].code})", args[0].axes, "f32", scope)
    axes = em.canon(args[0].axes + args[1].axes)
    sym = {"add": "+", "sub": "-", "mul": "*"}[t.op]
    code = f"{em.bcast(args[0], axes)} {sym} {em.bcast(args[1], axes)}"
    return em.bind(code, axes, "f32", scope)


def _loop_offsets(em, loop: str, arange: str):
    """fp32 offsets of the key block: the column numbers converted once, before the loops,
    plus the block's start (``l0``, a scalar: one conversion per block)."""
    from .codegen import Tile
    first = em.scopes[0][1]
    if ("colsf", loop) not in first:
        em.emit(f"colsf_{loop} = ({arange}).to(tl.float32)", 0)
        first[("colsf", loop)] = True
    cache = em.scopes[-1][1]
    key = ("offsf", loop)
    if key not in cache:
        em.emit(f"offsf_{loop} = colsf_{loop} + l0  # = offs_{loop} in fp32, exactly")
        cache[key] = Tile(f"offsf_{loop}", (loop,), "f32")
    return cache[key]

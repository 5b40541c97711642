"""A score term linear in the key index, split into a loop-invariant tile and a shift
per key block that leaves the score tile.

ALiBi's bias ``a·(j − i)`` (``a`` free of the key index ``j``; ``i`` the row) costs the
block math, per score, an integer subtract, a conversion and a multiply before the add
(sm_90 SASS of the Gluon prefill: 695 instructions per thread and 64-score block against
global attention's 470; bench/results/README.md, session 35).  With the key index as the
block's start plus the lane's column, ``j = l0 + c``, and the row as the row tile's start
plus its lane row, ``i = m0 + r``:

    a·(j − i) = a·c + a·(l0 − m0 − r)       (``a`` one value per program: ALiBi's slope)
    a·(j − i) = a·(c − r) + a·(l0 − m0)     (``a`` one value per row)

The first term is the same for every key block: it is made once, before the loops -- a
vector along the keys where it can be (session 38: a [rows, keys] tile kept 64 more
registers a thread live in the Gluon loop; ALiBi 562 -> 614 TFLOP/s at S=8192 without
it).  The second is one value per row and per block: a **shift**, carried beside the
score tile instead of added to every score, because the block math it meets passes it
on exactly in real arithmetic --

* x + y, x − y, x·c and where(p, x, d): onto the other operand's row values, where
  those do not vary along the key block (y − t, d − t, t·c), else into the tile;
* a row max or min: max_j(x + t) = max_j(x) + t, one add per row;
* anything else (exp2, a sum, a product's operand, a store): the tile and the shift are
  added there, one add per score -- no more than before.

So softmax's exp2((s − m)·log2 e) becomes one fused multiply-add per score on the
invariant-plus-scores tile, with (t − m)·log2 e per row.  The terms stay small where the
weight is (|c − r| is under two blocks), so the rounding is that of the unsplit form's
magnitudes.  The split needs the axes' offsets as start + lane numbers, which each kernel
form registers (``Emitter.aranges``: the ``tl`` kernels and the Gluon consumers); packed
GQA rows (a row is a head and a query) keep the plain form, and so does a plan with no
row max to take the shift (``active``: a backward's).

``ENABLED`` is the A/B switch (environment ``NEPTUNE_EQ_BLOCK_SHIFT=0`` keeps the plain
form); a plan records it when made (``TilePlan.shift_split``: its kernels and its
``explain`` agree however the switch moves later), and it is part of the disk cache key.
"""
from __future__ import annotations

import os

from ..ir import Term
from .tile import Tile

ENABLED = os.environ.get("NEPTUNE_EQ_BLOCK_SHIFT", "1") != "0"
_LINEAR = ("add", "sub", "neg", "mul", "var", "int")


def active(plan) -> bool:
    """Whether ``plan``'s kernels split: where a row max takes the shift (the forward's
    softmax and its split-k decode: +3-6% in one process).  A backward's passes hold only
    sums, where the lane tile's registers cost more than the adds it saves: the ALiBi
    backward alone ran at 458-463 TFLOP/s with the split against 485 without (bf16 S=8192,
    H200, two processes each, same fwd+bwd time against Flex; session 35)."""
    return plan.shift_split and any(f.op in ("max", "rollmax", "min")
                                    for p in plan.passes for f in p.folds)


def linear(t: Term) -> "tuple[dict[str, int], int] | None":
    """``t`` as Σ coef·var + const over index variables, or None."""
    if t.op == "var":
        return {t.val: 1}, 0
    if t.op == "int":
        return {}, int(t.val)
    if t.op not in _LINEAR:
        return None
    if t.op == "neg":
        inner = linear(t.args[0])
        return None if inner is None else ({v: -c for v, c in inner[0].items()}, -inner[1])
    a, b = (linear(x) for x in t.args)
    if a is None or b is None:
        return None
    if t.op == "mul":  # only a product by a literal stays linear
        if not a[0]:
            a, b = b, a
        if b[0]:
            return None
        return {v: c * b[1] for v, c in a[0].items()}, a[1] * b[1]
    sign = 1 if t.op == "add" else -1
    coefs = dict(a[0])
    for v, c in b[0].items():
        coefs[v] = coefs.get(v, 0) + sign * c
    return {v: c for v, c in coefs.items() if c}, a[1] + sign * b[1]


def sloped(t: Term, is_key, is_row, is_scalar):
    """(a, σ, whether the row appears, [(program axis, coef)], k) where ``t`` = a·idx (or
    idx·a) with ``idx`` = σ·(j − i) + Σ coef·axis + k or σ·j + ... (σ = ±1; ``is_key``,
    ``is_row``, ``is_scalar``: which variables are the key index, the row, program axes)
    and ``a`` reads neither the key index nor a fold state; else None."""
    if t.op != "mul":
        return None
    factors = _factors(t)
    for at, idx in enumerate(factors):
        rest = factors[:at] + factors[at + 1:]
        form = linear(idx)
        if form is None or all(f.op in ("int", "var") for f in rest):
            continue
        a_term = rest[0]
        for f in rest[1:]:  # (idx·b)·c = idx·(b·c): the factors but the index, as one a
            a_term = Term("mul", (a_term, f))
        coefs, k = form
        jv = [v for v in coefs if is_key(v)]
        if len(jv) != 1 or coefs[jv[0]] not in (1, -1):
            continue
        sigma = coefs.pop(jv[0])
        iv = [v for v in coefs if is_row(v)]
        if iv and coefs[iv[0]] != -sigma:
            continue
        for v in iv:
            coefs.pop(v)
        if not all(is_scalar(v) for v in coefs):
            continue
        if any(x.kind == "access" and x.op != "load" for x in a_term.walk()) or \
                any(is_key(x.val) for x in a_term.walk() if x.op == "var"):
            continue
        return a_term, sigma, bool(iv), list(coefs.items()), k
    return None


def _factors(t: Term) -> list[Term]:
    return [*_factors(t.args[0]), *_factors(t.args[1])] if t.op == "mul" else [t]


def source(em, t: Term, loop: str):
    """``t`` = a·idx split into (the invariant tile, its shift) -- ``sloped``, where the
    kernel form registered its key and row offsets (``em.aranges``) and ``a`` is a float
    per row or per program -- or None."""
    if not em.shift_active or loop not in em.aranges:
        return None
    ba = em.plan.block_axis
    form = sloped(t, lambda v: em.env.get(v) == loop, lambda v: em.env.get(v) == ba,
                  lambda v: isinstance(em.env.get(v), str) and em.env.get(v) not in em.order)
    if form is None or (form[2] and ba not in em.aranges):
        return None
    a_term, sigma, rows, scalars, k = form
    a = em.f32(em.expr(a_term))
    if a.kind != "f32" or not set(a.axes) <= {ba}:
        return None
    return _split(em, a, sigma, rows, scalars, k, loop)


def in_plan(plan, term: Term, key: str) -> bool:
    """Whether a fold body ``term`` over key variable ``key`` holds a term the kernels
    split (for the plan's description; the emitter decides on the same ``sloped``)."""
    if not active(plan) or plan.packed:
        return False
    for n in term.walk():
        form = sloped(n, lambda v: v == key, lambda v: v == plan.block_axis,
                      lambda v: v in plan.grid_axes)
        if form is not None and _is_float(form[0], plan.program):
            return True
    return False


# ops whose result codegen makes fp32 whatever their operands (a division of ints too)
_FLOAT_OPS = ("flt", "div", "exp", "exp2", "log", "sqrt", "rsqrt", "tanh", "sin", "cos", "erf")


def _is_float(t: Term, program) -> bool:
    """Whether ``t`` computes in floats, as the emitter types it (a float literal, input,
    cast or float-valued op in it): an integer ``a`` keeps the plain form (the emitter's
    test is the tile's kind)."""
    return any(n.op in _FLOAT_OPS
               or (n.op == "load" and program.dtype_of(n.val).startswith(("float", "bfloat")))
               or (n.op == "cast" and str(n.val).startswith(("float", "bfloat"))) for n in t.walk())


def _split(em, a, sigma: int, rows: bool, scalars, k: int, loop: str):
    ba = em.plan.block_axis
    (l0, cols), (m0, lanes) = em.aranges[loop], em.aranges.get(ba, (None, None))
    sgn = "" if sigma == 1 else "-"
    extra = "".join(f" + {c} * {em.env[v]}" for v, c in scalars) + (f" + {k}" if k else "")
    # With ``a`` one value per program (ALiBi's slope per head), the row's lane goes to the
    # shift too -- a·(c − r) + a·(l0 − m0) = a·c + a·(l0 − m0 − r) -- so the invariant is
    # one vector along the key block, not a [rows, keys] tile kept live across the loop
    # beside the accumulators (64 registers a thread in the Gluon consumer): ALiBi bf16
    # B=1 H=32 D=128 on an H200, 562 -> 592 TFLOP/s at S=8192 and 585 -> 606 at 32768
    # (bench/gluon_probe/alibi_bias.py, session 38).  The shift becomes one value per row
    # and block, which the row max and the exp2's row term take as before.
    lane_row = rows and not a.axes
    if lane_row:
        axes, lane_diff = (loop,), f"({cols})"
        start, shift_axes = f"({l0}) - ({m0}) - ({lanes})", (ba,)
    else:
        axes = em.canon((ba, loop) if rows else (loop,))
        lane_diff = f"({cols})[None, :] - ({lanes})[:, None]" if rows else f"({cols})"
        start, shift_axes = (f"({l0}) - ({m0})" if rows else f"({l0})"), a.axes
    inv_axes = em.canon(a.axes + axes)
    code = f"{em.bcast(a, inv_axes)} * ({sgn}({lane_diff})).to(tl.float32)"
    first = em.scopes[0][1]  # made once before the loops, shared by every key loop
    if ("invariant", code) not in first:
        first[("invariant", code)] = em.bind(code, inv_axes, "f32", 0)
    inv = first[("invariant", code)]
    to_f32 = ".to(tl.float32)" if lane_row else ""  # (lanes are ints: fp32, as the tile)
    shift = em.bind(f"{a.code} * ({sgn}({start}){extra}){to_f32}", shift_axes, "f32", -1)
    return Tile(inv.code, inv.axes, "f32", shift)


def spans(tile, loop: str) -> bool:
    return loop in tile.axes


def combine(em, op: str, a, b, loop: str, scope: int):
    """``a op b`` (+, −, ·) where either carries a shift; None where the result cannot
    carry one (a product with a tile along the key block)."""
    if op == "mul":
        if a.shift is None:
            a, b = b, a
        if b.shift is not None or spans(b, loop):
            return None
        base = Tile(a.code, a.axes, "f32")
        tile = em.bind(_bin(em, base, b, "*"), em.canon(a.axes + b.axes), "f32", scope)
        shift = em.bind(_bin(em, a.shift, b, "*"), em.canon(a.shift.axes + b.axes), "f32", -1)
        return Tile(tile.code, tile.axes, "f32", shift)
    sym = "+" if op == "add" else "-"
    ta, tb = Tile(a.code, a.axes, "f32"), Tile(b.code, b.axes, "f32")
    if b.shift is None and not spans(tb, loop):   # (x + t) ± y = x + (t ± y)
        return Tile(ta.code, ta.axes, "f32", _join(em, a.shift, tb, sym))
    if a.shift is None and not spans(ta, loop):   # y ± (x + t) = ±x + (y ± t)
        shift = _join(em, ta, b.shift, sym)
        base = tb if op == "add" else em.bind(f"-({tb.code})", tb.axes, "f32", scope)
        return Tile(base.code, base.axes, "f32", shift)
    # both along the key block: the tiles combine per score, the shifts per row
    if a.shift is None:
        shift = b.shift if op == "add" else em.bind(f"-({b.shift.code})", b.shift.axes, "f32", -1)
    elif b.shift is None:
        shift = a.shift
    else:
        shift = _join(em, a.shift, b.shift, sym)
    tile = em.bind(_bin(em, ta, tb, sym), em.canon(ta.axes + tb.axes), "f32", scope)
    return Tile(tile.code, tile.axes, "f32", shift)


def _join(em, x, y, sym: str):
    return em.bind(_bin(em, x, y, sym), em.canon(x.axes + y.axes), "f32", -1)


def _bin(em, x, y, sym: str) -> str:
    axes = em.canon(x.axes + y.axes)
    return f"{em.bcast(x, axes)} {sym} {em.bcast(y, axes)}"


def where(em, p, x, d, loop: str, scope: int):
    """where(p, x + t, d) = where(p, x, d − t) + t, for ``d`` not along the key block."""
    if x.shift is None or spans(d, loop):
        return None
    fill = _join(em, Tile(d.code, d.axes, "f32"), x.shift, "-")
    axes = em.canon(p.axes + x.axes + fill.axes)
    code = (f"tl.where({em.bcast(p, axes)}, {em.bcast(Tile(x.code, x.axes, 'f32'), axes)}, "
            f"{em.bcast(fill, axes)})")
    tile = em.bind(code, axes, "f32", scope)
    return Tile(tile.code, tile.axes, "f32", x.shift)

"""Outputs at a computed index: each term added where its index points (a scatter-add).

The gradient of a table read at a computed index -- a relative-position bias
``rel[q − kv + n]``, T5's buckets ``rel[min(|q − kv|, n)]`` -- comes out of autodiff as

    d[m] = Σ_rows Σ_j [f(rows, j) = m] · X[rows, j]

(``p[m, rows] = Σ_j where(f == m, X, 0)`` summed over the rows by the output).  Tiled as
written, every table entry ``m`` is a program of its own that recomputes all of ``X``:
work ∝ table length × L × S.  The sifting identity reads the same sum the other way round:

    Σ_m d[m]·e_m = Σ_{rows, j} X[rows, j] · e_{f(rows, j)}

so one pass over the (rows, j) tiles -- the plan of ``X``, rows blocked and a loop over
``j`` -- computes each ``X`` tile once and adds it into ``d`` at ``f``, with atomic adds
(the adds collide where ``f`` repeats: along a diagonal for ``q − kv``).  Pairs whose
``f`` falls outside ``d`` never met an ``m`` and are dropped; so are masked pairs.
FlexAttention's backward adds a captured buffer's gradient the same way.

Where every index reads the rows and ``j`` only through their difference -- ``f = g(i −
j)``, as a relative table's and T5's do -- the terms of one [rows × keys] tile are summed
along its diagonals first (``IndexScattered.diagonal``; ``scatter_code``), by the same identity one
level down:

    Σ_{i,j} [g(i − j) = m]·X[i, j] = Σ_δ [g(δ) = m] · Σ_{i − j = δ} X[i, j]

so a tile makes one add per diagonal (rows + keys of them) instead of one per term.

``find`` recognises the form from the program alone (no attention names): an output
``d[a…] = Σ_{s…} Σ_j where(c, X, 0)`` -- or ``Σ_{s…} p[…]`` over such a ``p`` that only
it reads -- where one conjunct of ``c`` is ``f == m`` with ``m`` an axis of ``d`` that
appears nowhere else and ``f`` moving with ``j``; the other axes are the plan's rows.
The fp32 adds arrive in no fixed order (not bitwise deterministic), like ``scatter``'s.
"""
from __future__ import annotations

import os
from functools import lru_cache

from ..ir import Program, Term, fmt, free_axes
from .scatter import AddedOutput


class IndexScattered(AddedOutput):
    """Output ``name`` = Σ over ``state_axes`` (the plan's rows) and the loop axis
    ``term.val`` of ``term.args[0]``, each term added where ``at`` points: output axis ->
    its index (the first moves with the loop; others -- a replica picked by the row,
    ``flex_backward``'s spreading of few entries -- need not); the output's other axes
    are state axes (``axes`` names them all in the output's order, in the state axes'
    names); ``extents``: each computed axis's length (an index past it adds nothing)."""

    def __init__(self, name: str, term: Term, state_axes: tuple[str, ...], axes: tuple[str, ...],
                 at: dict[str, Term], extents: dict[str, object]):
        self.name, self.term, self.state_axes, self.axes = name, term, state_axes, axes
        self.at, self.extents = at, extents
        self.owner, self.pass_index, self.loop_axis = name, 0, None

    def diagonal(self) -> str | None:
        """The row axis ``r`` through which, with the loop axis ``j``, every computed
        index reads the two only as ``r − j`` -- each index unchanged when both move by
        one -- and no index reads data; else None.  Proved in sympy (``_diagonal_row``):
        with ``r = δ + j`` substituted, ``j`` cancels from each index's arithmetic, every
        other operation (abs, log, min, a cast) kept as an uninterpreted function of its
        arguments, which reads ``j`` only if an argument does."""
        if not DIAGONALS:
            return None
        return _diagonal_row(tuple(self.at.values()), self.axis, tuple(self.state_axes))

    def entry_sums(self) -> tuple[str, int] | None:
        """(axis, length) where a tile summed along its diagonals is summed per entry too
        before its adds: the output's one computed axis, of at most ``ENTRY_SUMS_UP_TO``
        entries (T5's 32 buckets, which most far diagonals share: their adds would meet
        one address ~R + K times a tile); else None."""
        if not ENTRY_SUMS or len(self.at) != 1 or self.diagonal() is None:
            return None
        ((axis, n),) = self.extents.items()
        return (axis, n) if isinstance(n, int) and 0 < n <= ENTRY_SUMS_UP_TO else None

    def describe(self) -> str:
        where = ", ".join(f"{a} = {fmt(f)}" for a, f in self.at.items())
        row = self.diagonal()
        per = self.entry_sums()
        how = ("each tile's terms summed along its diagonals first"
               + (f", then per entry of {per[0]}: one atomic add per entry at {where}"
                  if per else f", one atomic add per diagonal at {where}")
               + f" (it reads {row} and {self.axis} only as {row} − {self.axis})" if row else
               f"each (row, {self.axis}) term added atomically at {where}")
        return (f"  + {self.name}[{', '.join(self.axes)}]: {how} ([f = m]·X holds for one m "
                "per term: one pass over the terms, not one per entry)")


def allowed() -> bool:
    """Whether the form may be taken: not under ``torch.use_deterministic_algorithms``
    (where several terms meet one entry, fp32 adds in no fixed order are not bitwise
    reproducible); the lowering then keeps the row-wise form."""
    import torch  # (the user's switch; read when a plan is made)
    return not torch.are_deterministic_algorithms_enabled()


def find(program: Program) -> list[tuple[IndexScattered, str | None]]:
    """[(scattered output, the definition it absorbs or None)] of ``program``: an output
    ``d[a…] = Σ_{s…} Σ_j where(c, X, 0)`` (as extracted: one definition), or
    ``d[a…] = Σ_{s…} p[…]`` over ``p[b…] = Σ_j where(c, X, 0)`` read by it alone (as
    autodiff writes it; the rows then take ``p``'s axis names, which the definitions
    ``X`` reads -- a row statistic -- have too)."""
    if not allowed():
        return []
    uses: dict[str, int] = {}
    for d in program.defs:
        for n in d.body.walk():
            if n.op in ("ref", "run", "prev"):
                uses[n.val] = uses.get(n.val, 0) + 1
    out = []
    for name in program.outputs:
        d = program.definition(name)
        if program.dtype_of(name) != "float32":
            continue  # (atomics accumulate in fp32)
        body, summed = d.body, []
        while body.op == "sum":
            summed.append(body.val)
            body = body.args[0]
        if body.op == "where" and summed:  # one definition: the innermost sum is the loop
            got = _bind(program, name, d.axes, tuple(d.axes) + tuple(summed[:-1]),
                        list(d.axes) + summed[:-1], summed[-1], body)
            if got is not None:
                out.append((got, None))
            continue
        if body.op != "ref" or body.val in program.outputs or uses.get(body.val) != 1:
            continue
        p = next((x for x in program.defs if x.name == body.val), None)
        args = body.args
        if p is None or p.body.op != "sum" or any(a.op != "var" for a in args) or \
                len({a.val for a in args}) != len(args) or len(args) != len(p.axes):
            continue
        names = [a.val for a in args]
        if set(names) != set(d.axes) | set(summed):
            continue
        got = _bind(program, name, d.axes, p.axes, names, p.body.val, p.body.args[0])
        if got is not None:
            out.append((got, p.name))
    return out


def _bind(program: Program, name: str, out_axes, axes, names, loop: str,
          inner: Term) -> IndexScattered | None:
    """The scattered view of output ``name[out_axes]`` = Σ over the ``axes`` that are not
    its own and Σ_loop of ``inner``; ``names[k]``: what the output calls ``axes[k]``
    (its own axis, or one it sums).  None if ``inner`` is not ``where(… & f == m & …, X,
    0)`` with ``m`` one of the output's axes that only that conjunct reads and ``f``
    moving with the loop (an index fixed along the loop -- a per-head slope's
    ``where(h == m)`` -- is a row-wise sum: no adds needed).  Further conjuncts
    ``g == r`` of the same kind (``r`` another output axis) are computed axes too."""
    if inner.op != "where" or inner.args[2] != Term("flt", (), 0.0):
        return None
    conds = _conjuncts(inner.args[0])
    own = {a for a in axes if names[axes.index(a)] in out_axes}

    def sifting(c: Term, moving: bool):
        """(axis, index) of conjunct ``c`` read as ``index == axis``, or None."""
        if c.op != "eq":
            return None
        for side, f in ((c.args[1], c.args[0]), (c.args[0], c.args[1])):
            if side.op == "var" and side.val in own and side.val not in free_axes(f) and (
                    loop in free_axes(f) or not moving):
                return side.val, f
        return None
    first = next(((k, got) for k, c in enumerate(conds) for got in [sifting(c, True)] if got),
                 None)
    if first is None:
        return None
    at = dict([first[1]])
    rest = conds[:first[0]] + conds[first[0] + 1:]
    for c in list(rest):
        got = sifting(c, False)
        if got and got[0] not in at:
            at[got[0]] = got[1]
            rest.remove(c)
    body = inner.args[1]
    for r in reversed(rest):
        body = Term("where", (r, body, Term("flt", (), 0.0)))
    read = free_axes(body).union(*(free_axes(f) for f in at.values()))
    if set(at) & read:
        return None  # a computed axis read beside its equation: not one entry per term
    rows = tuple(a for a in axes if a not in at)
    return IndexScattered(name, Term("sum", (body,), loop), rows,
                          tuple(axes[names.index(a)] for a in out_axes), at,
                          {a: program.extents[a] for a in at})


def _conjuncts(c: Term) -> list[Term]:
    return _conjuncts(c.args[0]) + _conjuncts(c.args[1]) if c.op == "and" else [c]


# NEPTUNE_EQ_DIAGONAL_ADDS=0: one add per term even where the diagonals could be summed
# first (for A/B runs: ``bench/probe/table_grad_gpu.py``; in the cache key).
DIAGONALS = os.environ.get("NEPTUNE_EQ_DIAGONAL_ADDS", "1") != "0"
# NEPTUNE_EQ_ENTRY_SUMS=0: a small table's diagonal sums added one per diagonal, not
# summed per entry first (A/B as above; in the cache key).  The per-entry sum costs a
# [keys × entries] select a q-level, so only tables up to this length take it.
ENTRY_SUMS = os.environ.get("NEPTUNE_EQ_ENTRY_SUMS", "1") != "0"
ENTRY_SUMS_UP_TO = 64


@lru_cache(maxsize=256)
def _diagonal_row(indices: tuple, loop: str, rows: tuple) -> str | None:
    if any(n.op == "load" for f in indices for n in f.walk()):
        # an index read from data (``rel[bucket[i − j + n]]``): emitted on the diagonals'
        # lanes its load would take the key lanes' mask (a wrong kernel, which translation
        # validation refused, when it was tried); one add per pair, spread, there
        return None
    import sympy  # (here: a warm call that loads a cached kernel never needs it)
    j, d = sympy.Symbol(loop), sympy.Symbol("delta_")
    for r in rows:
        try:
            moved = [_symbolic(f, {r: d + j}) for f in indices]
        except _NotIndex:
            return None
        if all(j not in e.free_symbols for e in moved) and any(d in e.free_symbols for e in moved):
            return r
    return None


class _NotIndex(Exception):
    pass


_ARITHMETIC = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b,
               "mul": lambda a, b: a * b, "neg": lambda a: -a}


def _symbolic(t: Term, subst: dict):
    """``t`` in sympy, integer arithmetic expanded (so ``(δ + j) − j`` cancels), any
    other operation an undefined function of its arguments."""
    import sympy
    if t.op == "var":
        return subst.get(t.val, sympy.Symbol(str(t.val)))
    if t.op in ("int", "flt"):
        return sympy.Integer(t.val) if t.op == "int" else sympy.Float(t.val)
    if t.kind in ("reduce", "fold"):
        raise _NotIndex(t.op)  # (an index summing over something: not this form's)
    args = [_symbolic(a, subst) for a in t.args]
    if t.op in _ARITHMETIC:
        return sympy.expand(_ARITHMETIC[t.op](*args))
    name = f"{t.op}_{t.val}" if t.val is not None else t.op
    return sympy.Function(name)(*args)

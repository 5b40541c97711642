"""Block predicates: interval reasoning that bounds a mask over a whole tile.

For a query block I and a key block J, every index variable ranges over an interval
(``i`` in I, ``j`` in J, a grid axis is one value).  Bounding each sub-expression of a
mask over those intervals gives two facts about the block:

* ``may``  -- some pair of the block *can* be visible (false: skip the block);
* ``must`` -- every pair of the block *is* visible (true: drop the elementwise mask).

A captured tensor read with a tile-varying index (``doc[kv]``) is bounded by a per-block
``[min, max]`` summary of the tensor along that dimension; any other read (nested
indexing ``offsets[doc[q]]``, computed indices) is bounded by the tensor's global
``[min, max]``.  Both are sound, so the analysis composes over ``&``, ``|``, ``~``,
affine terms, ``where`` and nested reads -- ``doc[q] == doc[kv]`` is just ``eq`` of two
intervals, not a special case.

The analysis is written once over an abstract scalar algebra (``Ops``): ``PyOps``
evaluates it on Python numbers (the property tests, and host-side checks), the
kernel generator evaluates it with an ``Ops`` that emits Triton scalar code.  An
interval is ``(lo, hi)`` or ``None`` for "unknown" (no bound: e.g. a score); unknown is
decided statically, so it never reaches generated code.

Booleans are intervals in {0, 1}: a comparison's interval is ``[must, may]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from ..ir import COMPARISONS, Term

Bounds = tuple  # (lo, hi) of backend scalars, or None when unknown


class Ops(Protocol):
    """Scalar algebra the analysis runs on (numbers, or code of a kernel)."""

    def binary(self, op: str, a, b): ...          # add sub mul min max lt le eq and or
    def floordiv(self, a, c: int): ...             # a // c for a static int c != 0
    def mod(self, a, c: int): ...                  # a % c for a static int c > 0
    def select(self, c, a, b): ...                 # c ? a : b
    def not_(self, a): ...


class PyOps:
    """The algebra on Python numbers (floor division, as the reference interpreter)."""

    def binary(self, op, a, b):
        return {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
                "min": lambda: min(a, b), "max": lambda: max(a, b),
                "lt": lambda: a < b, "le": lambda: a <= b, "eq": lambda: a == b,
                "and": lambda: bool(a) and bool(b), "or": lambda: bool(a) or bool(b)}[op]()

    def floordiv(self, a, c):
        return a // c

    def mod(self, a, c):
        return a % c

    def select(self, c, a, b):
        return a if c else b

    def not_(self, a):
        return not a


class Analysis:
    """Bounds of terms over one block.

    ``axis(name)``: bounds of an index variable (None: unknown).
    ``load(term, index_bounds)``: bounds of a tensor read, given its index bounds.
    ``exact(term)``: bounds of a read known as a whole (the kernel's own values of it),
    or None; asked first, so a read it answers bounds none of its indices."""

    def __init__(self, ops: Ops, axis: Callable[[str], Bounds],
                 load: Callable[[Term, list], Bounds],
                 exact: Callable[[Term], Bounds] | None = None):
        self.o, self.axis, self.load, self.exact = ops, axis, load, exact
        self.memo: dict[Term, Bounds] = {}
        self.tmemo: dict[Term, tuple] = {}

    # -- entry points ----------------------------------------------------------------
    def truth(self, cond: Term):
        """(may, must) of a condition over the block; statically (True, False) when the
        condition cannot be bounded."""
        if cond.op in ("and", "or", "not") or cond.op in COMPARISONS:
            if cond not in self.tmemo:
                self.tmemo[cond] = self._logic(cond)
            return self.tmemo[cond]
        b = self.bounds(cond)
        if b is None:
            return True, False
        lo, hi = b
        if _is_bool(cond):  # 0/1: may = hi >= 1, must = lo >= 1
            return self.o.binary("le", 1, hi), self.o.binary("le", 1, lo)
        o = self.o  # a number used as a condition: true where != 0
        zero_lo, zero_hi = o.binary("eq", lo, 0), o.binary("eq", hi, 0)
        return (o.not_(o.binary("and", zero_lo, zero_hi)),
                o.binary("or", o.binary("lt", 0, lo), o.binary("lt", hi, 0)))

    def bounds(self, t: Term) -> Bounds:
        if t not in self.memo:
            self.memo[t] = self._bounds(t)
        return self.memo[t]

    # -- the rules, one per op -------------------------------------------------------
    def _bounds(self, t: Term) -> Bounds:
        o, op = self.o, t.op
        if op in ("int", "flt"):
            return t.val, t.val
        if op == "var":
            return self.axis(t.val)
        if op == "load":
            whole = self.exact(t) if self.exact is not None else None
            if whole is not None:
                return whole
            idx = [self.bounds(a) for a in t.args]
            return self.load(t, idx)
        if t.kind in ("access", "reduce", "fold"):  # scores, running states: unbounded
            return None
        if op in ("and", "or", "not") or op in COMPARISONS:
            may, must = self.truth(t)
            return self._from_truth(may, must)
        args = [self.bounds(a) for a in t.args]
        if op == "where":
            return self._where(t, args)
        if any(a is None for a in args):
            return None
        if op in INCREASING or op == "div":
            return self._computed(op, args)
        if op == "neg":
            (lo, hi), = args
            return o.binary("sub", 0, hi), o.binary("sub", 0, lo)
        if op == "abs":
            (lo, hi), = args
            nonneg, nonpos = o.binary("le", 0, lo), o.binary("le", hi, 0)
            nlo, nhi = o.binary("sub", 0, hi), o.binary("sub", 0, lo)
            return (o.select(nonneg, lo, o.select(nonpos, nlo, 0)),
                    o.select(nonneg, hi, o.select(nonpos, nhi, o.binary("max", nhi, hi))))
        if op == "cast":
            # int <-> int and int -> float keep the value; a float -> int cast truncates,
            # which is monotone: its ends bound it.  bool: 0/1 of a truthiness.
            if t.val == "bool":
                may, must = self.truth(t.args[0])
                return self._from_truth(may, must)
            if t.val in ("int32", "int64") and _maybe_float(t.args[0]):
                return self._computed("trunc", args)
            return args[0]
        (al, ah), (bl, bh) = args if len(args) == 2 else (args[0], (None, None))
        if op == "add":
            return o.binary("add", al, bl), o.binary("add", ah, bh)
        if op == "sub":
            return o.binary("sub", al, bh), o.binary("sub", ah, bl)
        if op in ("maximum", "minimum"):
            f = "max" if op == "maximum" else "min"
            return o.binary(f, al, bl), o.binary(f, ah, bh)
        if op == "mul":
            ps = [o.binary("mul", x, y) for x in (al, ah) for y in (bl, bh)]
            return _fold(o, "min", ps), _fold(o, "max", ps)
        c = _static_int(t.args[1])
        if op == "floordiv" and c:  # monotone in a for a fixed divisor (floor or trunc)
            lo, hi = o.floordiv(al, c), o.floordiv(ah, c)
            return (lo, hi) if c > 0 else (hi, lo)
        if op == "mod" and c and c > 0:
            # One period, a >= 0: a % c is monotone there.  Otherwise any remainder
            # (floor mod: [0, c-1]; trunc mod of a negative: down to -(c-1)).
            nonneg = o.binary("le", 0, al)
            same = o.binary("and", nonneg, o.binary("eq", o.floordiv(al, c), o.floordiv(ah, c)))
            return (o.select(same, o.mod(al, c), o.select(nonneg, 0, -(c - 1))),
                    o.select(same, o.mod(ah, c), c - 1))
        return None  # bit ops, tanh, ...: no bound (sound: block kept, masked)

    def _computed(self, op: str, args) -> Bounds:
        """Bounds through an op a kernel's block test never evaluates -- an increasing
        function (log, exp, sqrt), a division by a positive constant, a float -> int cast
        (truncation: monotone) -- each end mapped on its own.  Only where the algebra offers
        ``monotone(op, x, upper)`` (``saturated_index.IndexOps``: on the host, each end
        widened past the device's fp32 rounding); None (no bound) elsewhere, as before."""
        o = self.o
        if not hasattr(o, "monotone"):
            return None
        (lo, hi) = args[0]
        if op == "div":
            (cl, ch) = args[1]
            if cl != ch or not isinstance(cl, (int, float)) or cl <= 0:
                return None
            lo, hi = lo / cl, hi / cl  # (x / c for a constant c > 0 is increasing)
            op = "id"
        a, b = o.monotone(op, lo, False), o.monotone(op, hi, True)
        return None if a is None or b is None else (a, b)

    def _where(self, t: Term, args) -> Bounds:
        o = self.o
        may, must = self.truth(t.args[0])
        a, b = args[1], args[2]
        if must is True:
            return a
        if may is False:
            return b
        if a is None or b is None:
            return None
        # must: a's bounds; cannot be true: b's; either: the hull of both
        lo = o.select(must, a[0], o.select(may, o.binary("min", a[0], b[0]), b[0]))
        hi = o.select(must, a[1], o.select(may, o.binary("max", a[1], b[1]), b[1]))
        return lo, hi

    def _logic(self, t: Term) -> tuple:
        """(may, must) of a comparison or a logical op."""
        o, op = self.o, t.op
        if op == "not":
            may, must = self.truth(t.args[0])
            return _not(o, must), _not(o, may)
        if op in ("and", "or"):
            (ma, sa), (mb, sb) = self.truth(t.args[0]), self.truth(t.args[1])
            if op == "and":
                return _and(o, ma, mb), _and(o, sa, sb)
            return _or(o, ma, mb), _or(o, sa, sb)
        a, b = (self.bounds(x) for x in t.args)
        if a is None or b is None:
            return True, False
        (al, ah), (bl, bh) = a, b
        if op in ("gt", "ge"):  # a > b is b < a
            (al, ah), (bl, bh) = (bl, bh), (al, ah)
        if op in ("lt", "gt"):
            return o.binary("lt", al, bh), o.binary("lt", ah, bl)
        if op in ("le", "ge"):
            return o.binary("le", al, bh), o.binary("le", ah, bl)
        overlap = o.binary("and", o.binary("le", al, bh), o.binary("le", bl, ah))
        point = o.binary("and", o.binary("and", o.binary("eq", al, ah), o.binary("eq", bl, bh)),
                         o.binary("eq", al, bl))
        if op == "eq":
            return overlap, point
        return _not(o, point), _not(o, overlap)  # ne

    def _from_truth(self, may, must) -> Bounds:
        o = self.o
        return (1 if must is True else 0 if must is False else o.select(must, 1, 0),
                1 if may is True else 0 if may is False else o.select(may, 1, 0))


# increasing functions of one argument: an interval's ends bound them (``_computed``)
INCREASING = ("log", "exp", "exp2", "sqrt")


def _and(o: Ops, a, b):
    if a is False or b is False:
        return False
    if a is True:
        return b
    if b is True:
        return a
    return o.binary("and", a, b)


def _not(o: Ops, a):
    return (not a) if isinstance(a, bool) else o.not_(a)


def _or(o: Ops, a, b):
    if a is True or b is True:
        return True
    if a is False:
        return b
    if b is False:
        return a
    return o.binary("or", a, b)


def _fold(o: Ops, f: str, xs: list):
    out = xs[0]
    for x in xs[1:]:
        out = o.binary(f, out, x)
    return out


def _static_int(t: Term) -> int | None:
    if t.op == "int" and int(t.val) != 0:
        return int(t.val)
    return None


def _is_bool(t: Term) -> bool:
    return t.op in COMPARISONS or (t.op == "cast" and t.val == "bool")


def _maybe_float(t: Term) -> bool:
    return any(n.op == "flt" or n.op in ("div", "exp", "log", "sqrt") for n in t.walk())


def block_truth(cond: Term, ops: Ops, axis: Callable[[str], Bounds],
                load: Callable[[Term, list], Bounds],
                exact: Callable[[Term], Bounds] | None = None):
    """(may, must) of ``cond`` over one block: may is false only if no pair of the block
    satisfies it, must is true only if every pair does (``Analysis`` for the callables)."""
    return Analysis(ops, axis, load, exact).truth(cond)


# ----------------------------------------------------------------------------------
# Which summary bounds a read
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SummarySpec:
    """One summary input of a kernel: ``name`` is its kernel parameter (``<name>_ptr``),
    ``tensor`` the captured tensor, ``dim`` the summarised dimension (None: global), and
    ``block`` the constexpr holding its block length (``B_i`` or ``B_L``)."""
    name: str
    tensor: str
    dim: int | None
    block: str | None

    def rank(self, program) -> int:
        """Dims of the summary tensor: the tensor's (the summarised one counted in blocks)
        and a trailing [min, max]; a global summary is one dim, [min, max, nondecreasing]."""
        return 1 if self.dim is None else len(program.shape_of(self.tensor)) + 1


def summary_dim(load: Term, tiled: dict[str, str], scalar_axes: set[str]) -> tuple[int | None, str] | None:
    """How a kernel bounds a read of a captured tensor over a block:

    * ``(dim, role)`` -- exactly one index is a bare tiled variable (``tiled``: variable ->
      role, e.g. ``{"i": "row", "j": "loop"}``) and every other index is one value per
      program (depends only on ``scalar_axes``): the per-block summary along ``dim``;
    * ``(None, "scalar")`` -- every index is one value per program: the element itself;
    * ``None`` -- anything else (nested or computed indices): the global summary."""
    hit = None
    for k, ix in enumerate(load.args):
        if ix.op == "var" and ix.val in tiled:
            if hit is not None:
                return None
            hit = (k, tiled[ix.val])
        elif not _free_vars(ix) <= scalar_axes or any(n.op == "load" for n in ix.walk()):
            return None
    return hit or (None, "scalar")


def _free_vars(t: Term) -> set[str]:
    return {n.val for n in t.walk() if n.op == "var"}

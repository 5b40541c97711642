"""A computed index that stops moving far from the diagonal: the key blocks past it read
one table entry.

T5's relative buckets read a table at ``g(i − j)``: exact up to 16, log-spaced up to
``max_distance``, then clamped to the last bucket -- so for ``|i − j|`` past about 113 every
pair reads ``t[h, 31]``.  Elementwise, each pair of each score tile still pays the bucket
(an fp32 log, a cast, a select) and a gathered load, in the forward and in each backward
pass that recomputes the scores; on an H200 that made T5's training step 3x a relative
table's (bench/results/README.md, session 61).  The identity used here:

    δ = i − j ≥ D₊  ⟹  g(δ) = c₊        (and δ ≤ −D₋ ⟹ g(δ) = c₋)

is found by interval reasoning (``block_predicate.Analysis`` over δ-intervals, with the
host algebra ``IndexOps``): the smallest ``D₊`` whose interval ``[D₊, 2³¹)`` bounds ``g``
to the single value ``c₊``.  Nothing here names T5: any index that reads rows and keys
only through their difference (``index_scatter`` proves that in sympy) and saturates --
a clamped relative table ``rel[clamp(i − j, −128, 128) + 128]`` too -- takes it.  The
kernel (``kernelgen``) then cuts its main key loop where a row block's keys all lie past
``D₊`` (or ``D₋``): those loops read ``t[…, c₊]`` once per program instead of a tile of
gathered loads, and a table gradient adds each of their tiles into one entry (one atomic
add, ``scatter_code``).

Soundness on the device: the kernel evaluates ``g`` in fp32 (and its own log), the host
here in float64.  ``IndexOps`` widens every transcendental, division and float -> int
cast outward by a relative 1e-4 (thousands of fp32 roundings) before truncating, so a
pair whose value sits near an integer boundary is never claimed constant.  Comparisons
on floats are not bounded at all (the analysis then finds no saturation).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

from ..ir import Term, free_axes, rename_axis
from .block_predicate import Analysis, PyOps

# NEPTUNE_EQ_FAR_INDEX=0: every key block computes its index per pair (A/B runs:
# ``bench/probe/far_index_gpu.py``; in the kernel cache key).
ENABLED = os.environ.get("NEPTUNE_EQ_FAR_INDEX", "1") != "0"
WIDEN = 1e-4          # relative margin for the device's fp32 evaluation (module docstring)
FAR = 2 ** 31 - 1     # δ past every extent a kernel addresses (int32 offsets)
MAX_DISTANCE = 1 << 20  # past this the far loops would never run: not worth a loop cut
ROW, KEY = "@r", "@j"  # the row and key variables of a stored index term


class IndexOps(PyOps):
    """``block_predicate``'s algebra on Python numbers with the monotone ops a computed
    index uses (``Analysis._computed``), each end widened outward by ``WIDEN``."""

    def monotone(self, op: str, x, upper: bool):
        try:
            v = {"id": lambda: x, "trunc": lambda: x, "log": lambda: math.log(x) if x > 0
                 else (-math.inf if x == 0 else None), "exp": lambda: math.exp(min(x, 700.0)),
                 "exp2": lambda: 2.0 ** min(x, 1000.0),
                 "sqrt": lambda: math.sqrt(x) if x >= 0 else None}[op]()
        except (OverflowError, ValueError):
            return None
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return None
        if isinstance(v, float) and math.isfinite(v):
            v += (1 if upper else -1) * WIDEN * (abs(v) + 1.0)
        if op == "trunc":
            if not math.isfinite(v):
                return None
            return math.trunc(v)
        return v

    def binary(self, op, a, b):
        if op in ("lt", "le", "eq") and (isinstance(a, float) or isinstance(b, float)):
            raise _FloatComparison()  # (its outcome may flip under fp32 rounding)
        return super().binary(op, a, b)


class _FloatComparison(Exception):
    pass


@dataclass(frozen=True)
class FarSide:
    """Keys with ``sign·(i − j) ≥ distance`` from every row of the block: there each
    index in ``values`` (a term over ``ROW`` and ``KEY``) is that constant."""
    sign: int
    distance: int
    values: tuple  # ((index term, int), ...)

    def substitute(self, t: Term, row: str, key: str) -> Term:
        """``t`` (rows named ``row``, keys ``key``) with each saturated index replaced by
        its constant."""
        table = {rename_axis(rename_axis(f, ROW, row), KEY, key): Term("int", (), c)
                 for f, c in self.values}
        return _replace(t, table)


def _replace(t: Term, table: dict) -> Term:
    if t in table:
        return table[t]
    return t.map_args(lambda a: _replace(a, table))


def saturation(index: Term) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """((D₊, c₊) or None, (D₋, c₋) or None) of an index over ``ROW`` and ``KEY``: the
    least D with the index the constant c for every ±(row − key) >= D, on each side."""
    return _saturation(index)


@lru_cache(maxsize=256)
def _saturation(index: Term):
    def at(lo: int, hi: int):
        """The index's bounds over δ = i − j in [lo, hi] (i moves, j = 0)."""
        box = {ROW: (lo, hi), KEY: (0, 0)}
        try:
            return Analysis(IndexOps(), box.get, lambda t, idx: None).bounds(index)
        except (_FloatComparison, ZeroDivisionError, OverflowError, TypeError):
            return None

    def side(sign: int):
        far = at(*sorted((sign * MAX_DISTANCE, sign * FAR)))
        if far is None or far[0] != far[1]:
            return None
        # least D with [D, FAR] one value (inclusion: monotone); D may be negative -- a
        # decode's q_idx + 299 is one bucket for every key up to 276 past the query
        lo, hi = -MAX_DISTANCE, MAX_DISTANCE
        while lo < hi:
            mid = (lo + hi) // 2
            b = at(*sorted((sign * mid, sign * FAR)))
            if b is not None and b[0] == b[1]:
                hi = mid
            else:
                lo = mid + 1
        return lo, int(far[0])
    return side(+1), side(-1)


def far_sides(plan, k: int) -> tuple[FarSide, ...]:
    """The far sides of pass ``k`` of ``plan``: every table read (and table gradient)
    whose index moves with the keys only through ``i − j`` and saturates on that side
    (the largest distance of them).  Empty when off, or with no such index."""
    if not ENABLED:
        return ()
    from .index_scatter import IndexScattered, _diagonal_row
    ps = plan.passes[k]
    row = plan.block_axis

    def named(t: Term, key: str) -> Term:
        return rename_axis(rename_axis(t, key, KEY), row, ROW)
    candidates = [a for f in ps.folds for a in _load_indices(named(f.term, f.axis))]
    for sc in ps.scattered:  # a table gradient: where its adds land
        if isinstance(sc, IndexScattered) and sc.diagonal() == row:
            candidates += [named(f, sc.term.val) for f in sc.at.values()]
            candidates += _load_indices(named(sc.term.args[0], sc.term.val))
    found: dict[Term, tuple] = {}
    for ix in candidates:
        if ix not in found and free_axes(ix) == {ROW, KEY} and \
                _diagonal_row((ix,), KEY, (ROW,)) == ROW:
            found[ix] = saturation(ix)
    out = []
    for n, sign in enumerate((+1, -1)):
        hits = [(ix, s[n]) for ix, s in found.items() if s[n] is not None]
        if hits:
            out.append(FarSide(sign, max(d for _, (d, _) in hits),
                               tuple((ix, c) for ix, (_, c) in hits)))
    return tuple(out)


def _load_indices(t: Term) -> list[Term]:
    """The index arguments of ``t``'s loads that compute something (a bare axis or a
    constant reads a tile of its own: nothing to save)."""
    return [a for n in t.walk() if n.op == "load" for a in n.args
            if a.op not in ("var", "int", "flt")]


def far_distance(program) -> tuple[int, tuple[str, str]] | None:
    """(distance, (row, key) axes) of the index in ``program`` with the largest far
    distance (over any two axes it reads only through their difference), or None:
    translation validation checks a kernel at sizes past it, so its far loops run."""
    if not ENABLED:
        return None
    from .index_scatter import _diagonal_row
    best = None
    for d in program.defs:
        for a in _load_indices(d.body):
            axes = sorted(free_axes(a))
            if len(axes) != 2:
                continue
            for r, j in (axes, axes[::-1]):
                if _diagonal_row((a,), j, (r,)) == r:
                    for hit in saturation(rename_axis(rename_axis(a, r, ROW), j, KEY)):
                        if hit is not None and (best is None or hit[0] > best[0]):
                            best = (hit[0], (r, j))
    return best

"""Data masks as loop bounds: the key blocks a row block may see, and those it sees whole,
as two ranges -- no per-block test inside the loop.

A mask atom ``K cmp E`` (``cmp`` one of < <= > >= ==) whose key side ``K`` is the key
index ``j`` or a 1-D captured tensor read at it (``doc[j]``), and whose other side ``E``
does not move with the key (bounded over the row block by ``block_predicate``:
``doc[i]``, ``offsets[doc[i]]``, ``prefix[b]``, ``i``), holds on the key blocks of one
interval when ``K`` is nondecreasing in ``j`` -- always for ``j``; for ``X[j]`` it is
enough that the key blocks' minima and maxima are (checked on the data each call, in the
same pass over X's key-block summary that counts the ranges).  For every atom
that gives two key ranges: ``may`` (outside it no pair is visible: skipped) and ``must``
(block-aligned; every pair of a block inside is visible: no elementwise mask).  They
compose over ``&`` (intersection) and ``|`` (hull for may; union for must when the two
touch, else the longer one -- a subset of the truth, so still sound).

A pass whose data atoms all have that form runs, when the flag holds,

    for l0 in range(a, c):  masked    # boundary blocks (document starts ...)
    for l0 in range(c, d):  unmasked  # inside every range: no mask at all
    for l0 in range(d, b):  masked    # boundary blocks (the diagonal, document ends)

with no ``if`` in any loop body (a branch around the loads keeps Triton from pipelining
them), and the per-block test form of ``block_skip`` otherwise (unsorted ids).  Keys
``j`` never need the flag: prefix-LM (``j < prefix[b] | j <= i``) and jagged sequences
(``j >= offsets[doc[i]]``) are loop bounds outright.  This is a lowering choice derived
from the mask's terms, nothing document-specific.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Term
from .block_predicate import Analysis, _maybe_float, summary_dim
from .block_skip import (_count_failing, _key_side, _roles, _row_bounds, data_atoms,
                         inline_summaries)
from .codegen import LOOP, Emitter
from .lower import Pass

_CMP = ("lt", "le", "gt", "ge", "eq")
# The ``tl`` form's three loops each fill and drain Triton's software pipeline, which a
# row block whose ranges are a few blocks long (documents of ~128 keys) pays three times
# over; one loop with the mask on every block pays the mask instead.  Which is faster
# depends on the data (H200, fp16 H=16 D=128, 64x64 tiles: 64 documents in 8192 keys
# 0.094 -> 0.080 ms with one loop; 13 documents 0.149 -> 0.151, at 32768 1.35 -> 1.63),
# so it is a launch constant, ``ONE_LOOP``, of a timed config
# (``TileConfig.one_loop``).  Choosing per row block at run time compiled both loop sets
# into one kernel and ran every case 1.5-1.7x slower (bench/results/README.md, session 36).
ONE_LOOP_FLAG = "ONE_LOOP"
# The key, in a ``bounds`` dict, of where the counts of the calls that share it emit their
# first loads (``block_skip._first_loads``): one round trip for all of them.
_FIRST_LOADS = "(first loads)"


@dataclass(frozen=True)
class DataRanges:
    """Key ranges (code, ``[lo, hi)``) of one pass's data atoms over the current row block;
    ``mono``: code of the runtime condition they need (None: always valid)."""
    may: tuple[str, str]
    must: tuple[str, str]
    mono: str | None
    atoms: frozenset


class _Static:
    """``block_predicate``'s algebra on placeholders: does a term have bounds at all?"""

    def binary(self, op, a, b):
        return "x"

    def floordiv(self, a, c):
        return "x"

    def mod(self, a, c):
        return "x"

    def select(self, c, a, b):
        return "x"

    def not_(self, a):
        return "x"


def _boundable(plan, e: Term) -> bool:
    """``e`` has bounds over a row block (as ``block_skip._row_bounds`` reads them)."""
    known = {plan.block_axis, *plan.grid_axes}

    def load(t, idx):
        hit = summary_dim(t, {plan.block_axis: "row"}, set(plan.grid_axes))
        if hit is None:  # the global summary
            return "x", "x"
        need = [b for q, b in enumerate(idx) if q != hit[0]]  # the element / a row's summary
        return None if any(b is None for b in need) else ("x", "x")
    return Analysis(_Static(), lambda a: ("x", "x") if a in known else None,
                    load).bounds(e) is not None


def _int_valued(plan, e: Term) -> bool:
    """``e`` is an integer (a key index compares with it exactly at block ends)."""
    if _maybe_float(e):
        return False
    return all(plan.program.dtype_of(n.val) in ("int32", "int64", "bool")
               for n in e.walk() if n.op == "load")


def _rangeable(plan, t: Term) -> bool:
    if t.op in ("and", "or"):
        return all(_rangeable(plan, a) for a in t.args)
    if t.op not in _CMP:
        return False
    form = _key_side(t, _roles(plan, "@j"), set(plan.grid_axes), inline_summaries(plan))
    if form is None:
        return False
    key, _, other = form
    if key.op == "var" and not _int_valued(plan, other):
        return False
    return _boundable(plan, other)


def data_range_form(plan, ps: Pass) -> bool:
    """Whether every data atom of the pass has the range form (true when there are none):
    its loops then need no per-block test."""
    return all(_rangeable(plan, a) for a in data_atoms(plan, ps))


def data_ranges(em: Emitter, ps: Pass, k: int, split: bool = False,
                sampled: bool = False, bounds: dict | None = None) -> DataRanges | None:
    """The key ranges of pass ``k``'s data atoms (emitted in the pass's scope), or None
    when some data atom has no range form (the per-block test is used then); ``split``:
    a split-k partial's (its ranges are clipped to its chunk); ``sampled``: a decode's
    whole-cache ranges from a sample of its ids, unchecked (``split_share``).
    ``bounds``: the row-side bounds already emitted in this scope (term -> code), shared
    by calls that emit into the same scope so each row-side read is loaded once."""
    plan = em.plan
    atoms = data_atoms(plan, ps)
    if not atoms or not all(_rangeable(plan, a) for a in atoms):
        return None
    ctx = _Ctx(em, ps, k, "sampled" if sampled else "chunk" if split else "all",
               {} if bounds is None else bounds)
    may, must = ctx.of(atoms[0])
    for a in atoms[1:]:
        may2, must2 = ctx.of(a)
        may, must = ctx.meet(may, may2), ctx.meet(must, must2)
    may_lo, may_hi = (ctx.name(f"j_may_lo{k}", may[0]), ctx.name(f"j_may_hi{k}", may[1]))
    must_lo, must_hi = (ctx.name(f"j_must_lo{k}", must[0]), ctx.name(f"j_must_hi{k}", must[1]))
    mono = None
    if ctx.flags:
        mono = ctx.name(f"mono{k}", " & ".join(f"({f})" for f in dict.fromkeys(ctx.flags)))
    return DataRanges((may_lo, may_hi), (must_lo, must_hi), mono, frozenset(atoms))


class _Ctx:
    """Emits the ranges of atoms: code in key positions (``B_L``-aligned where noted)."""

    def __init__(self, em: Emitter, ps: Pass, k: int, scope: str, bounds: dict):
        self.em, self.ps, self.k, self.scope, self.bounds = em, ps, k, scope, bounds
        self.ext = str(ps.extent)
        self.flags: list[str] = []

    def name(self, prefix: str, code: str) -> str:
        v = self.em.new(prefix + "_")
        if code.lstrip("-").isdigit():  # a tensor, not a constexpr: tl ops then take it as one
            code = f"row_first * 0 + ({code})"
        self.em.emit(f"{v} = {code}")
        return v

    def meet(self, r, s):
        return _fold("maximum", r[0], s[0]), _fold("minimum", r[1], s[1])

    def of(self, t: Term):
        """(may, must) key ranges of a range-able atom."""
        if t.op == "and":
            (ma, sa), (mb, sb) = self.of(t.args[0]), self.of(t.args[1])
            return self.meet(ma, mb), self.meet(sa, sb)
        if t.op == "or":
            (ma, sa), (mb, sb) = self.of(t.args[0]), self.of(t.args[1])
            may = _fold("minimum", ma[0], mb[0]), _fold("maximum", ma[1], mb[1])
            a_lo, b_lo = self.name("sr", sa[0]), self.name("sr", sb[0])
            a_hi = self.name("sr", f"tl.maximum({sa[1]}, {a_lo})")  # empty: (x, x)
            b_hi = self.name("sr", f"tl.maximum({sb[1]}, {b_lo})")
            touch = self.name("sr", f"tl.maximum({a_lo}, {b_lo}) <= tl.minimum({a_hi}, {b_hi})")
            longer = self.name("sr", f"{a_hi} - {a_lo} >= {b_hi} - {b_lo}")
            lo = (f"tl.where({touch}, tl.minimum({a_lo}, {b_lo}), "
                  f"tl.where({longer}, {a_lo}, {b_lo}))")
            hi = (f"tl.where({touch}, tl.maximum({a_hi}, {b_hi}), "
                  f"tl.where({longer}, {a_hi}, {b_hi}))")
            return may, (lo, hi)
        plan = self.em.plan
        key, cmp, other = _key_side(t, _roles(plan, "@j"), set(plan.grid_axes),
                                    inline_summaries(plan))
        if str(other) not in self.bounds:
            self.bounds[str(other)] = tuple(
                e if isinstance(e, str) else self.name("e", f"row_first * 0 + ({e})")
                for e in _row_bounds(self.em, other, const_ok=True))
        elo, ehi = self.bounds[str(other)]
        if key.op == "var":
            return self._index(cmp, elo, ehi)
        return self._search(key, cmp, elo, ehi)

    def _index(self, cmp: str, elo, ehi):
        """``j cmp E``, E an integer in [elo, ehi]: block ends compare exactly."""
        B, ext = f"B_{LOOP}", self.ext

        def up(x):  # first block start >= x
            return f"((tl.maximum({x}, 0) + {B} - 1) // {B}) * {B}"

        def down(x):  # last block start <= x ... as an end: blocks ending at or before x
            return f"(tl.maximum({x}, 0) // {B}) * {B}"
        if cmp == "gt":
            cmp, elo, ehi = "ge", f"({elo}) + 1", f"({ehi}) + 1"
        if cmp == "lt":
            cmp, elo, ehi = "le", f"({elo}) - 1", f"({ehi}) - 1"
        if cmp == "ge":   # keys >= elo may, block starts >= ehi must
            return (f"tl.maximum({elo}, 0)", ext), (up(ehi), ext)
        if cmp == "le":   # keys <= ehi may, blocks whose last key <= elo must
            return ("0", f"({ehi}) + 1"), ("0", down(f"({elo}) + 1"))
        return (f"tl.maximum({elo}, 0)", f"({ehi}) + 1"), (up(ehi), down(f"({elo}) + 1"))

    def _search(self, key: Term, cmp: str, elo, ehi):
        """``X[j] cmp E``: first blocks by counting over X's key-block summary ([min, max]
        per block), right where both columns are nondecreasing -- the flag the count
        pass returns, which the ranges then need (``mono``)."""
        em = self.em
        mx, mn = "max", "min"
        ext = self.ext
        # (may, must) as [lo, hi) with search queries (field, op, target) in their places;
        # the queries of the atom run in one counting pass over the summary
        if cmp == "ge":
            form = (((mx, ">=", elo), ext), ((mn, ">=", ehi), ext))
        elif cmp == "gt":
            form = (((mx, ">", elo), ext), ((mn, ">", ehi), ext))
        elif cmp == "le":
            form = (("0", (mn, ">", ehi)), ("0", (mx, ">", elo)))
        elif cmp == "lt":
            form = (("0", (mn, ">=", ehi)), ("0", (mx, ">=", elo)))
        else:
            form = (((mx, ">=", elo), (mn, ">", ehi)), ((mn, ">=", ehi), (mx, ">", elo)))
        queries = [x for rng in form for x in rng if isinstance(x, tuple)]
        counts, ordered = _count_failing(em, key, self.ext, queries, self.scope,
                                         self.bounds.setdefault(_FIRST_LOADS, [None, 0]))
        self.flags.append(ordered)  # the counts hold where the blocks' [min, max] are ordered
        found = iter(counts)
        return tuple(tuple(f"{next(found)} * B_{LOOP}" if isinstance(x, tuple) else x
                           for x in rng) for rng in form)


def _fold(fn: str, a: str, b: str) -> str:
    """``tl.<fn>(a, b)``, computed here when both are integer literals."""
    if a.lstrip("-").isdigit() and b.lstrip("-").isdigit():
        return str((max if fn == "maximum" else min)(int(a), int(b)))
    return f"tl.{fn}({a}, {b})"


def range_bounds(em: Emitter, k: int, lo: str, hi: str, split: bool, rng: DataRanges,
                 unordered: tuple[str, str] | None = None) -> tuple[str, str, str, str]:
    """Emit the key blocks [a, b) of [lo, hi) (the affine bounds) that may hold a visible
    pair, and [c, d) inside it whose every pair is visible (no elementwise mask); names
    (a, b, c, d).  ``split``: clipped to this program's chunk.  ``unordered``: [u0, u1)
    (block-aligned), what they are where the data is not ordered (``rng.mono`` false):
    all of it masked -- [a, c) = [u0, u1), the rest empty."""
    ps = em.plan.passes[k]
    B = f"B_{LOOP}"
    a, b = f"j_ra{k}", f"j_rb{k}"
    em.emit(f"{a} = (tl.maximum({lo}, {rng.may[0]}) // {B}) * {B}")
    em.emit(f"{b} = tl.maximum(tl.minimum({hi}, {rng.may[1]}), {a})")
    if split:  # this program's chunk (CHUNK is a multiple of B_L)
        em.emit(f"{a} = tl.maximum({a}, pid_split * CHUNK)")
        em.emit(f"{b} = tl.maximum(tl.minimum({b}, pid_split * CHUNK + CHUNK), {a})")
    c, d = f"j_rc{k}", f"j_rd{k}"
    ai, bi = a, b  # the affine mask's interior (causal: keys before the row block's first)
    if ps.lo_offset is not None:
        ai = f"((row_last + ({ps.lo_offset}) + {B} - 1) // {B}) * {B}"
    if ps.hi_offset is not None:
        bi = f"((row_first + ({ps.hi_offset})) // {B}) * {B}"
    em.emit(f"{c} = tl.minimum(tl.maximum(tl.maximum({ai}, {rng.must[0]}), {a}), {b})")
    em.emit(f"{d} = tl.maximum(tl.minimum(tl.minimum({bi}, {rng.must[1]}), {b}), {c})")
    if rng.mono is not None and unordered is not None:
        u0, u1 = unordered
        for v, other in ((c, u1), (d, u1), (a, u0), (b, u1)):
            em.emit(f"{v} = tl.where({rng.mono}, {v}, {other})")
    return a, b, c, d


def range_loops(em: Emitter, k: int, lo: str, hi: str, split: bool, rng: DataRanges,
                loop, fallback) -> None:
    """The pass's loops over [lo, hi) (the affine bounds) cut by the data ranges
    (``range_bounds``): masked, unmasked, masked -- under ``if mono:`` with ``fallback()``
    (the per-block test form) in the ``else`` when the ranges need ordered key-block
    summaries.  ``loop(em, k, lo, hi, known, test)`` emits one loop."""
    ps = em.plan.passes[k]
    outer = em.scopes[-1][2]
    if rng.mono is not None:
        em.emit(f"if {rng.mono}:  # ordered data: the visible keys are one range")
        em.push(outer + "    ")
    a, b, c, d = range_bounds(em, k, lo, hi, split, rng)
    at = em.scopes[-1][2]
    em.one_loop_form = True
    em.emit(f"if {ONE_LOOP_FLAG}:  # (a config's constant) one pipelined loop, every block masked")
    em.push(at + "    ")
    loop(em, k, a, b, frozenset(), False)
    em.scopes[-2][0].extend(em.pop())
    em.emit("else:  # masked edge, unmasked interior, masked edge")
    em.push(at + "    ")
    loop(em, k, a, c, frozenset(), False)
    loop(em, k, c, d, ps.bound_atoms | rng.atoms, False)
    loop(em, k, d, b, frozenset(), False)
    em.scopes[-2][0].extend(em.pop())
    if rng.mono is not None:
        em.scopes[-2][0].extend(em.pop())
        em.emit("else:  # unsorted: test each key block")
        em.push(outer + "    ")
        fallback()
        em.scopes[-2][0].extend(em.pop())

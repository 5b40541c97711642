"""Lowering: an extracted program -> a tile plan (grid, blocks, loops, folds, epilogue).

The plan is derived from the IR, never from a per-operator template:

* every *loop-level* reduction (the outermost ``sum``/``max``/``min``/``rollsum`` of a
  definition) becomes a fold with a state tile; its free axes are its state axes;
* the **row axes** are the axes every fold keeps (e.g. ``b, h, i``); the last one is
  split into blocks of ``BLOCK_<axis>``, the others are one program each;
* axes a fold keeps beyond the rows are **column** axes held whole in registers
  (the head dimension of an attention accumulator);
* folds are grouped into **passes**: a fold that reads a producer by name (``ref``)
  needs it complete and goes one pass later; a fold that reads running values
  (``run``/``prev``) shares its producer's pass -- that is what rolling update buys;
* outputs that are not folds form the **epilogue**, computed after the last pass, in
  one more pass over any column axis not already held in registers (softmax's
  normalisation);
* a pass holding a ``splitk`` fold is **split**: its loop is cut into chunks run by
  parallel programs that store partial states, and a second kernel combines them with
  the folds' own corrections (FlashDecoding, derived -- see ``codegen``); only the first
  pass splits, a later one runs whole in the combine (``split_plan``);
* **head-group packing** (GQA): when every load that moves with the loop reads a head
  axis ``y`` only as ``y // G``, the ``G`` query heads of a group are packed into the
  row block, so they share each K/V tile instead of loading it ``G`` times.  Chosen
  when the row axis is short (decode), where the block would otherwise be mostly padding.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..ir import (MASKED, Program, ProgramError, Term, accessed, free_axes, positive_scale,
                  rename_axis)
from . import block_shift, index_scatter, scatter
from .inline import loop_level, inline_derived
from .split_plan import why_not_splittable

MAX_WHOLE_AXIS = 256  # widest axis held whole in registers (head dim, inner contraction)
INNER_CHUNK = 64      # chunk of a wider inner contraction, looped inside the pass
PACK_ROWS_BELOW = 64  # pack GQA head groups into the row block when rows are this short
# A max/min fold of a scaled body reduces the unscaled body and scales each row once
# (``ir.positive_scale``; emitted by ``codegen``).  The switch is for A/B runs:
# NEPTUNE_EQ_MAX_BEFORE_SCALE=0 emits the scale per element.
MAX_BEFORE_SCALE = os.environ.get("NEPTUNE_EQ_MAX_BEFORE_SCALE", "1") != "0"


def max_before_scale(op: str, body: Term) -> tuple[Term, float] | None:
    """(unscaled body, c) where a ``op`` fold of ``body`` is reduced before its scale."""
    if not MAX_BEFORE_SCALE or op not in ("max", "rollmax", "min"):
        return None
    return positive_scale(body)


class LoweringError(ProgramError):
    """The program has a shape this lowering does not handle (yet)."""


def next_pow2(n: int, floor: int = 16) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


@dataclass
class Fold:
    """A loop-level reduction with a state tile: ``state = op_{axis} body``."""
    name: str              # state variable; the definition's name for a top-level fold
    term: Term             # the reduce/rollsum term
    state_axes: tuple[str, ...]
    owner: str             # definition it belongs to
    pass_index: int = 0

    @property
    def op(self) -> str:
        return self.term.op

    @property
    def axis(self) -> str:
        return self.term.val


@dataclass
class Pass:
    """One loop over the reduced extent, updating several folds per block.

    ``lo_offset``/``hi_offset``: when every fold is gated by an affine mask on
    ``j`` vs the block axis ``i`` (causal ``j <= i``, window ``i - j < W``), the loop only
    visits ``j`` in ``[i + lo_offset, i + hi_offset)`` over the block's rows; blocks
    outside are skipped (their contribution is the fold's identity)."""
    extent: int
    folds: list[Fold]
    lo_offset: int | None = None
    hi_offset: int | None = None
    bound_atoms: frozenset = frozenset()  # mask atoms (fold axis named "@j") the bounds encode
    gate_atoms: frozenset = frozenset()   # every atom gating all folds (data masks included)
    scattered: list = field(default_factory=list)  # scatter.Scattered outputs added per block


@dataclass
class EpilogueItem:
    """An output computed after the passes: ``expr`` with folds replaced by states."""
    name: str
    axes: tuple[str, ...]
    expr: Term
    loop_axes: tuple[str, ...]   # column axes not held in registers: one more pass


@dataclass
class TilePlan:
    program: Program
    row_axes: tuple[str, ...]
    block_axis: str
    grid_axes: tuple[str, ...]            # row axes with one program each
    passes: list[Pass]
    epilogue: list[EpilogueItem]
    fold_outputs: list[Fold]              # folds that are outputs themselves
    whole_axes: dict[str, int] = field(default_factory=dict)  # axis -> padded block
    state_of: dict[Term, str] = field(default_factory=dict)   # fold term -> state var
    packed: tuple[str, int] | None = None  # (head axis y, group G): rows are (y % G, i)
    # inner contraction axes too wide for registers: looped over in chunks of
    # whole_axes[axis] inside the pass that needs them (logits x·W over K per tile of V)
    chunked: frozenset = frozenset()
    shift_split: bool = field(default_factory=lambda: block_shift.ENABLED)  # as planned

    @property
    def split(self) -> bool:
        """True when the (single) pass is split-k: partial kernel + combine kernel."""
        return any(f.op == "splitk" for p in self.passes for f in p.folds)

    @property
    def row_extent(self) -> int:
        """Rows covered by the blocked axis (times the group when heads are packed)."""
        n = self.program.extents[self.block_axis]
        return n * self.packed[1] if self.packed else n

    def grid_extent(self, axis: str) -> int:
        n = self.program.extents[axis]
        return n // self.packed[1] if self.packed and axis == self.packed[0] else n

    @property
    def block_rebase(self) -> bool:
        """Re-base each key block's rolling sums on the block's own max (see
        ``kernelgen._loop``): one exactly-represented p = 1 per block and row, as FlashDecoding
        gets per split, for the price of one multiply of the block's [rows x width] product.
        Worth it where that product is one row block of a memory-bound kernel (decode);
        in prefill the extra pass over a 128-row accumulator competes with the tensor cores."""
        return self.row_extent <= 16

    @property
    def launches(self) -> int:
        return 2 if self.split else 1

    @property
    def n_passes(self) -> int:
        return len(self.passes) + (1 if any(e.loop_axes for e in self.epilogue) else 0)

    def describe(self) -> str:
        lines = [f"grid: rows {list(self.row_axes)} (blocked: {self.block_axis}, one program per "
                 f"{list(self.grid_axes) or 'nothing else'})"]
        if self.packed:
            y, g = self.packed
            lines.append(f"head-group packing: the {g} heads of {y} sharing a K/V head ({y} // {g}) "
                         f"are rows of one block and share its loads")
        for k, p in enumerate(self.passes):
            fs = ", ".join(f"{f.name}:{f.op}{list(f.state_axes)}" for f in p.folds)
            skip = ""
            if p.lo_offset is not None or p.hi_offset is not None:
                lo = f"i{p.lo_offset:+d}" if p.lo_offset is not None else "0"
                hi = f"i{p.hi_offset:+d}" if p.hi_offset is not None else "end"
                skip = (f" (mask -> loop bounds: j in [{lo}, {hi}), other blocks skipped; "
                        "blocks fully inside evaluate no mask, only boundary blocks do)")
            how = (" split into parallel chunks (partials kernel), then a combine kernel "
                   "re-bases the partials with the folds' corrections" if self.split else "")
            rebase = (" (each key block's rolling sums taken at the block's own max, then "
                      "re-based by the fold's correction)" if self.block_rebase and any(
                          f.op in ("rollsum", "splitk") for f in p.folds) else "")
            lines.append(f"pass {k + 1}: loop over {p.extent}{skip}{how}{rebase} -> {fs}")
            raw = [f.name for f in p.folds if max_before_scale(f.op, f.term.args[0])]
            if raw:
                lines.append(f"  {', '.join(raw)}: each block's max/min over the unscaled body, "
                             "scaled once per row (max_j(s·c) = c·max_j(s), c > 0)")
            if any(block_shift.in_plan(self, f.term.args[0], f.axis) for f in p.folds):
                lines.append("  a·(j − i) in the scores: the key lanes' term made once, a shift per "
                             "row and block that joins the row max (a·(j − i) = a·c + "
                             "a·(l0 − m0 − r); with a per row, a lane tile a·(c − r))")
            lines += [sc.describe() for sc in p.scattered]
        for a in sorted(self.chunked):
            lines.append(f"inner contraction over {a} ({self.program.extents[a]}): a loop of "
                         f"its own in chunks of {self.whole_axes[a]}, inside the pass reading it")
        for e in self.epilogue:
            how = f"pass over {list(e.loop_axes)}" if e.loop_axes else "from registers"
            lines.append(f"epilogue: {e.name}[{', '.join(e.axes)}] ({how})")
        return "\n".join(lines)


def plan(program: Program, pack_heads: bool | None = None) -> TilePlan:
    """The tile plan of ``program``; ``pack_heads=False`` disables GQA head packing."""
    # A definition others read that is arithmetic over reductions: its reductions become
    # folds of their own and the rest is recomputed where it is read.
    try:
        program = inline_derived(program)
    except LoweringError:
        raise
    except ProgramError as e:
        raise LoweringError(str(e)) from None
    defs = {d.name: d for d in program.defs}
    folds: list[Fold] = []
    state_of: dict[Term, str] = {}
    # outputs at a computed index (a table's gradient, ``index_scatter``): each one and
    # the definition it sums ride in a pass as atomic adds, not as folds of their own
    at_index = index_scatter.find(program)
    absorbed = {n for sc, p in at_index for n in (sc.name, p) if n}
    at_index = [sc for sc, _ in at_index]
    for d in program.defs:
        if d.name in absorbed:
            continue
        top = list(loop_level(d.body))
        if d.body.kind in ("reduce", "fold"):
            f = Fold(d.name, d.body, d.axes, d.name)
            folds.append(f)
            state_of[d.body] = d.name
            continue
        if d.name not in program.outputs:
            raise LoweringError(f"{d.name}: a non-output definition must be a reduction here.")
        for k, t in enumerate(top):
            if t in state_of:
                continue
            axes = tuple(a for a in d.axes if a in free_axes(t))
            extra = free_axes(t) - set(axes)
            if extra:
                raise LoweringError(f"{d.name}: reduction depends on {sorted(extra)} which are "
                                    "not axes of the definition.")
            name = f"{d.name}_f{k}"
            folds.append(Fold(name, t, axes, d.name))
            state_of[t] = name
    if not folds and not at_index:
        raise LoweringError("The program has no reduction; neptune_eq targets chains of "
                            "reductions (use torch for purely elementwise code).")
    # An output reducing over the rows the first output keeps (dQ beside dK) may be
    # accumulated across programs instead (``scatter``): rows come from the others.
    g, maybe = scatter.candidates(program, folds)
    scattered = []
    if maybe:
        # (a candidate may stand for a fold it rewrites: ``scatter._scaled_fold``)
        originals = [getattr(m, "replaces", m) for m in maybe]
        rest = [f for f in folds if all(f is not m for m in originals)]
        try:
            rows = _row_axes(program, rest)
        except LoweringError:
            rows = ()
        bound = [scatter.bind(program, g, f, rows[-1], rows[:-1], MAX_WHOLE_AXIS) if rows
                 else None for f in maybe]
        kept = rest + [f for f, b in zip(originals, bound) if b is None]
        if any(bound) and _row_axes(program, kept) == rows:
            folds, row_axes = kept, rows  # (a candidate that did not bind stays a fold)
            scattered = [b for b in bound if b is not None]
    if not scattered:
        row_axes = _row_axes(program, folds + at_index)
    for f in folds:
        for a in f.state_axes:
            if a not in row_axes:
                _whole(program, a, f"column axis of {f.name}")
    whole: dict[str, int] = {}
    chunked: set[str] = set()
    for f in folds + scattered + at_index:
        for a in f.state_axes:
            if a not in row_axes and a != getattr(f, "loop_axis", None):
                whole[a] = next_pow2(program.extents[a])
        for n in f.term.args[0].walk():
            if n.kind in ("reduce", "fold"):  # inner contraction: whole in registers ...
                if program.extents[n.val] <= MAX_WHOLE_AXIS:
                    whole[n.val] = next_pow2(program.extents[n.val])
                elif n.kind == "reduce":  # ... or, too wide, a loop of its own inside the pass
                    whole[n.val] = INNER_CHUNK
                    chunked.add(n.val)
                else:
                    _whole(program, n.val, f"inner fold in {f.name}")
    _assign_passes(program, folds + at_index, state_of)
    passes: list[Pass] = []
    for k in range(max(f.pass_index for f in folds + at_index) + 1):
        # Folds ready at the same time but reducing over different extents (a contraction
        # over K beside a log-sum-exp over V) cannot share a loop: each extent gets a loop
        # of its own, one after the other.  Folds that read running values share their
        # producer's axis, so a rolling group never splits.
        level = [f for f in folds + at_index if f.pass_index == k]
        for extent in dict.fromkeys(program.extents[f.axis] for f in level):
            members = [f for f in level if program.extents[f.axis] == extent]
            # a scattered output rides in its first output's pass; it must vanish
            # wherever the loop skips (the bounds and block tests count it as a member)
            riding = scattered if any(f is g for f in members) else []
            riding = riding + [f for f in members if f in at_index]
            members = [f for f in members if f not in at_index]
            lo, hi, atoms = loop_bounds(members + riding, row_axes[-1])
            passes.append(Pass(extent, members, lo, hi, atoms, common_gates(members + riding),
                               riding))
    for n, p in enumerate(passes):
        for f in p.folds + p.scattered:
            f.pass_index = n
    fold_names = {f.name for f in folds}
    epilogue, fold_outputs = [], []
    for name in program.outputs:
        d = defs[name]
        if any(s.name == name for s in scattered + at_index):
            continue
        if name in fold_names:
            fold_outputs.append(next(f for f in folds if f.name == name))
            continue
        covered = set(row_axes) | set(whole)
        loop_axes = tuple(a for a in d.axes if a not in covered)
        epilogue.append(EpilogueItem(name, d.axes, d.body, loop_axes))
    tp = TilePlan(program, row_axes, row_axes[-1], row_axes[:-1], passes, epilogue,
                  fold_outputs, whole, state_of, chunked=frozenset(chunked))
    if tp.split:
        why = why_not_splittable(tp)
        if why:
            raise LoweringError(why)
        if scattered or at_index:
            raise LoweringError("A scattered output accumulates per row block; split-k "
                                "partials of the same pass are not combined with it.")
    if pack_heads is not False and program.extents[tp.block_axis] < PACK_ROWS_BELOW and \
            not at_index:  # (its atomic adds address the head axis of the grid)
        tp.packed = _packable_head_axis(tp)
    return tp


def _row_axes(program: Program, folds: list[Fold]) -> tuple[str, ...]:
    """Row axes: kept by every fold that has the first output's leading axis, in the
    order of the output's axes.  A fold without it (Σ_j w[j, e] in a centered matmul)
    must fit in registers and is recomputed by every program."""
    order = list(program.definition(program.outputs[0]).axes) + [
        a for d in program.defs for a in d.axes] + [a for f in folds for a in f.state_axes]
    lead = order[0]
    rowed = [f for f in folds if lead in f.state_axes] or folds
    common = set.intersection(*(set(f.state_axes) for f in rowed))
    row_axes = tuple(dict.fromkeys(a for a in order if a in common))
    if not row_axes:
        raise LoweringError("The folds share no spatial axis to parallelise over; expected "
                            "e.g. a row axis i shared by every reduction.")
    return _contraction_columns_out(program, folds, row_axes)


def _contraction_columns_out(program: Program, folds: list[Fold],
                             row_axes: tuple[str, ...]) -> tuple[str, ...]:
    """Row axes minus trailing ones that are the output columns of a contraction.

    ``dK[j, e] = Σ_i dS[i, j] · q[i, e]``: every fold keeps ``e``, so ``e`` is a row axis,
    yet blocking it (one program per ``j``, a strip of ``e``) reads each ``q[i, :]`` row
    once per key and leaves no matrix product.  An axis that every fold keeping it reads
    only through loads moving with the fold's own loop (``q[i, e]`` under ``Σ_i``) is the
    N side of a product: held whole (<= MAX_WHOLE_AXIS), the row block on the axis before
    it turns the fold into ``tl.dot([rows, i], [i, e])``, as ``O = Σ_j P·V`` is in the
    forward."""
    rows = list(row_axes)
    while len(rows) > 1:
        a = rows[-1]
        n = program.extents[a]
        if not isinstance(n, int) or n > MAX_WHOLE_AXIS:
            break
        ok = True
        for f in folds:
            if a not in f.state_axes:
                continue
            for t in f.term.args[0].walk():
                if t.op == "load" and a in free_axes(t) and f.axis not in free_axes(t):
                    ok = False
            if not any(t.op == "load" and a in free_axes(t) for t in f.term.args[0].walk()):
                ok = False
        if not ok:
            break
        rows.pop()
    return tuple(rows)


def _packable_head_axis(tp: TilePlan) -> tuple[str, int] | None:
    """A grid axis ``y`` that every loop-moving load reads only as ``y // G`` (G > 1)."""
    loop_axes = {f.axis for p in tp.passes for f in p.folds}
    for y in tp.grid_axes:
        groups, ok = set(), True
        for p in tp.passes:
            for f in p.folds:
                for n in f.term.walk():
                    if n.op != "load" or not (free_axes(n) & loop_axes) or y not in free_axes(n):
                        continue
                    for idx in n.args:
                        if y not in free_axes(idx):
                            continue
                        if (idx.op == "floordiv" and idx.args[0] == Term("var", (), y)
                                and idx.args[1].op == "int"):
                            groups.add(int(idx.args[1].val))
                        else:
                            ok = False
        if ok and len(groups) == 1:
            g = groups.pop()
            if g > 1 and tp.program.extents[y] % g == 0:
                return y, g
    return None


def _whole(program: Program, axis: str, what: str) -> int:
    n = program.extents[axis]
    if n > MAX_WHOLE_AXIS:
        raise LoweringError(f"The {what} ({axis}, extent {n}) must fit in registers "
                            f"(<= {MAX_WHOLE_AXIS}); split it or reorder the reduction.")
    return n


def _assign_passes(program: Program, folds: list[Fold], state_of: dict[Term, str]) -> None:
    """pass(f) = max over producers p it reads: pass(p) + 1 for ``ref``, pass(p) for
    ``run``/``prev``.  Folds read in order, so a simple fixpoint suffices."""
    owner_fold = {f.owner: f for f in folds if f.name == f.owner}
    for _ in range(len(folds) + 1):
        changed = False
        for f in folds:
            want = 0
            body_refs = accessed(f.term, ("ref",))
            running = accessed(f.term, ("run", "prev"))
            for r in body_refs:
                if r in owner_fold:
                    want = max(want, owner_fold[r].pass_index + 1)
            for r in running:
                if r not in owner_fold:
                    raise LoweringError(f"{f.name} reads the running value of {r!r}, which is "
                                        "not a fold.")
                want = max(want, owner_fold[r].pass_index)
            if want != f.pass_index:
                f.pass_index, changed = want, True
        if not changed:
            return
    raise LoweringError("Cyclic dependency between folds.")  # pragma: no cover


# ----------------------------------------------------------------------------------
# Affine mask -> loop bounds
# ----------------------------------------------------------------------------------
_IDENTITY_OF = {"sum": 0.0, "rollsum": 0.0, "splitk": 0.0, "max": MASKED, "rollmax": MASKED}


def _atoms(c: Term) -> set[Term]:
    if c.op == "and":
        return _atoms(c.args[0]) | _atoms(c.args[1])
    return {c}


def _gates(t: Term, ident: float) -> set[Term]:
    """Conditions outside of which ``t`` equals the fold identity."""
    if t.op == "where" and t.args[2].op in ("flt", "int") and float(t.args[2].val) == ident:
        return _atoms(t.args[0]) | _gates(t.args[1], ident)
    if t.op == "mul" and ident == 0.0:
        return _gates(t.args[0], ident) | _gates(t.args[1], ident)
    if t.op == "mul":  # x·k equals the identity where x equals identity/k (rule
        for x, k in (t.args, t.args[::-1]):  # scale-out-of-where moves k out of the select)
            if k.op in ("flt", "int") and float(k.val) != 0.0:
                return _gates(x, ident / float(k.val))
    return set()


def _linear(t: Term) -> tuple[dict[str, int], int] | None:
    """``t`` as Σ coef·var + c with integer coefficients and constant, else None."""
    if t.op == "var":
        return {t.val: 1}, 0
    if t.op in ("int", "flt"):
        return ({}, int(t.val)) if float(t.val).is_integer() else None
    if t.op == "neg":
        a = _linear(t.args[0])
        return None if a is None else ({v: -c for v, c in a[0].items()}, -a[1])
    if t.op in ("add", "sub"):
        a, b = _linear(t.args[0]), _linear(t.args[1])
        if a is None or b is None:
            return None
        sign = 1 if t.op == "add" else -1
        coef = dict(a[0])
        for v, c in b[0].items():
            coef[v] = coef.get(v, 0) + sign * c
        return {v: c for v, c in coef.items() if c}, a[1] + sign * b[1]
    if t.op == "mul":
        a, b = _linear(t.args[0]), _linear(t.args[1])
        if a is None or b is None:
            return None
        if not a[0]:
            a, b = b, a
        if b[0]:  # a product of two index expressions: not affine
            return None
        return {v: c * b[1] for v, c in a[0].items() if c * b[1]}, a[1] * b[1]
    return None


def _bound(atom: Term, i: str, j: str) -> tuple[int | None, int | None]:
    """(lo, hi) offsets with ``i + lo <= j < i + hi`` implied by one atom.

    Any affine comparison of the row index ``i`` and the loop index ``j`` with unit
    coefficients counts, written either way round: ``i >= j`` (causal), ``i - j < W`` and
    ``j >= i - W`` (a window seen from the query side), ``j - i < W`` (the same window seen
    from the key side, as the dK/dV loop over query blocks meets it), ``i == j``."""
    if atom.op not in ("lt", "le", "gt", "ge", "eq") or len(atom.args) != 2:
        return None, None
    a, b = _linear(atom.args[0]), _linear(atom.args[1])
    if a is None or b is None:
        return None, None
    coef = dict(a[0])  # a - b  REL  0
    for v, c in b[0].items():
        coef[v] = coef.get(v, 0) - c
    coef = {v: c for v, c in coef.items() if c}
    const, op = a[1] - b[1], atom.op
    if set(coef) != {i, j} or coef[j] not in (1, -1) or coef[i] != -coef[j]:
        return None, None
    if coef[j] == -1:  # -(j - i) + c REL 0  ->  j - i - c flip(REL) 0
        const, op = -const, {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}[op]
    # j - i + const REL 0, i.e. j REL i - const
    return {"lt": (None, -const), "le": (None, -const + 1), "gt": (-const + 1, None),
            "ge": (-const, None), "eq": (-const, -const + 1)}[op]


def common_gates(folds: list[Fold]) -> frozenset:
    """Condition atoms that gate *every* fold of a pass (outside them each fold adds its
    identity), with the fold axis named ``@j``."""
    common: set[Term] | None = None
    for f in folds:
        ident = _IDENTITY_OF.get(f.op)
        if ident is None:
            return frozenset()
        # Alpha-rename the fold's axis so conditions of different folds compare equal.
        gates = {rename_axis(g, f.axis, "@j") for g in _gates(f.term.args[0], ident)}
        common = gates if common is None else common & gates
    return frozenset(common or ())


def loop_bounds(folds: list[Fold], i: str) -> tuple[int | None, int | None, frozenset]:
    """Offsets bounding the loop for conditions that gate *every* fold of a pass, and
    the condition atoms they encode (with the fold axis named ``@j``)."""
    common = common_gates(folds)
    lo = hi = None
    used = set()
    for atom in common or ():
        l, h = _bound(atom, i, "@j")
        if l is not None or h is not None:
            used.add(atom)
        lo = l if l is not None and (lo is None or l > lo) else lo
        hi = h if h is not None and (hi is None or h < hi) else hi
    return lo, hi, frozenset(used)


def drop_atoms(t: Term, atoms: frozenset) -> Term:
    """``t`` where the condition atoms ``atoms`` are known true (a block fully inside the
    visible region): ``where(c, a, b) -> a`` when every atom of ``c`` is known."""
    if not atoms:
        return t
    if t.op == "where":
        c = _simplify_cond(t.args[0], atoms)
        if c is None:
            return drop_atoms(t.args[1], atoms)
        return Term("where", (c, drop_atoms(t.args[1], atoms), drop_atoms(t.args[2], atoms)))
    return t.map_args(lambda a: drop_atoms(a, atoms))


def _simplify_cond(c: Term, atoms: frozenset) -> Term | None:
    """The condition with known-true atoms removed; None when nothing is left."""
    if c in atoms:
        return None
    if c.op == "and":
        a, b = (_simplify_cond(x, atoms) for x in c.args)
        if a is None or b is None:
            return b if a is None else a
        return Term("and", (a, b))
    return c


def replace_folds(t: Term, state_of: dict[Term, str]) -> Term:
    if t in state_of:
        return Term("ref", (), state_of[t])
    return t.map_args(lambda a: replace_folds(a, state_of))


def combine_width_axis(plan: TilePlan) -> str | None:
    """The one column axis of the fold states (the head dim of attention's output), if
    the combine may spread it over programs: every wide state and every epilogue value
    built from one is pointwise in it.  A decode has few rows, so without this a handful
    of programs would fold every partial serially."""
    folds = plan.passes[0].folds
    wide = {a for f in folds for a in f.state_axes if a != plan.block_axis and a in plan.whole_axes}
    if len(wide) != 1:
        return None
    (w,) = wide
    wide_folds = {f.name for f in folds if w in f.state_axes}
    for f in folds:  # a narrow fold must not read a wide one (that would reduce over w)
        if w not in f.state_axes and accessed(f.term, ("run", "prev")) & wide_folds:
            return None
    for item in plan.epilogue:
        reads = accessed(replace_folds(item.expr, plan.state_of), ("ref",))
        if item.loop_axes or (w not in item.axes and reads & wide_folds):
            return None
    return w

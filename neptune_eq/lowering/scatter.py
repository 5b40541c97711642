"""Scattered outputs: a reduction over the row axis, accumulated across programs.

A tile plan gives each program a block of rows and loops over the reduced axis.  Some
programs have a second output that reduces over the *row* axis instead: the attention
backward's ``dQ[i, e] = Σ_j dS[i, j] · K[j, e]`` beside ``dK[j, e] = Σ_i dS[i, j] · Q[i, e]``.
With rows ``j`` and the loop over ``i``, each program holds, for the query block of the
current step, exactly the ``dS`` tile and the ``K`` rows that dQ's partial sum over its
own key block needs:

    Σ_j dS[i, j]·K[j, e]  =  Σ_{J row block} ( Σ_{j ∈ J} dS[i, j]·K[j, e] )

so the program adds its block's term, one ``tl.dot`` of tiles already in registers, into
the output with an atomic add (FlashAttention-2's dQ).  The alternative -- a second kernel
with rows ``i`` that loops over ``j`` -- recomputes ``S``, ``P`` and ``dP``: two more
products per block pair.  The price of the scattered form is that fp32 adds arrive in
no fixed order (not bitwise deterministic) and the output starts at zero (the launcher
zeroes it per call).

``candidates`` and ``bind`` decide it from the program alone: an output ``f = Σ_x body``
is scattered in the plan of the first output ``g = Σ_a body_g`` when ``x`` runs over the
row block axis of ``g``'s plan and one of ``f``'s own axes plays ``a``'s role: under
the renaming ``x -> row axis``, ``axis -> a`` every index ``f`` reads is a grid, row,
loop or whole axis and every tile it streams with the loop is one the pass loads anyway
(same tensor, same index pattern); of such choices the one sharing the most tiles is
taken.  Loop-invariant tiles of its own (the row block's K) are loaded beside them.  Nothing here names
attention.
"""
from __future__ import annotations

from ..ir import Program, Term, accessed, rename_axis

def candidates(program: Program, folds: list) -> tuple[object, list]:
    """(g, [f ...]): the first output's fold and the output folds that may be scattered
    in its plan (shape checks only; ``bind`` checks them against the row axis)."""
    first = program.outputs[0]
    # (the first output may be its fold scaled after the loop, ``c · Σ_i …``: dK)
    g = next((f for f in folds if f.owner == first and (
        f.name == first or _scaled_fold(program, f) is not None)), None)
    if g is None:
        return None, []
    out = []
    for f in folds:
        if f is not g and f.name != f.owner:
            f = _scaled_fold(program, f) or f
        if f is g or f.name != f.owner or f.name not in program.outputs or f.op != "sum":
            continue
        ext = program.extents
        if ext[f.axis] not in {ext[a] for a in g.state_axes} or ext[g.axis] not in {
                ext[a] for a in f.state_axes}:
            continue  # its sum must run over g's rows, and it must keep g's loop axis
        if program.dtype_of(f.name) != "float32":
            continue  # atomics accumulate in fp32: a narrower output is not scattered
        if accessed(f.term) or any(n.kind == "fold" for n in f.term.walk()):
            continue  # it must read inputs only: no producer is complete inside the pass
        if any(f.owner in accessed(h.term) for h in folds):
            continue
        out.append(f)
    return g, out


def _scaled_fold(program: Program, f):
    """An output ``c · Σ_j a·b`` (a constant scale pulled out of the sum, so that a fold
    kept in registers is scaled once, after its loop) as the fold ``Σ_j (a·c)·b`` again:
    added atomically per block, the output has no after-the-loop to scale in, so each
    block's term carries the scale (on its left factor, where it was: the product stays
    one ``tl.dot``).  The fold it replaces is its ``replaces``; None if ``f`` is not so."""
    d = program.definition(f.owner)
    if d.body.op != "mul" or f.term.args[0].op != "mul":
        return None
    a, b = d.body.args
    scale = b if a == f.term else a if b == f.term else None
    if scale is None or scale.op not in ("flt", "int"):
        return None
    left, right = f.term.args[0].args
    body = Term("mul", (Term("mul", (left, scale)), right))
    scaled = type(f)(f.owner, Term("sum", (body,), f.term.val), f.state_axes, f.owner)
    scaled.replaces = f
    return scaled


def bind(program: Program, g, f, block_axis: str, grid_axes: tuple[str, ...], max_whole: int):
    """The scattered view of output fold ``f`` in the plan whose rows end in
    ``block_axis`` and whose pass runs ``g``'s loop: a fold over ``g``'s loop axis of
    ``f``'s body with its reduced axis renamed to the row axis (so its gates compare with
    the pass's and its subterms with ``g``'s), with the loop axis of ``f``'s own output
    named in ``loop_axis``.  None when ``f`` does not fit this plan.  ``max_whole``: the
    widest axis the plan holds whole (its other axes must be)."""
    if program.extents[f.axis] != program.extents[block_axis] or set(grid_axes) - set(
            f.state_axes):
        return None  # (every program's grid index must address the output)
    want = _load_patterns(g.term.args[0], block_axis, g.axis, grid_axes, program, max_whole) or set()
    best = None
    body = rename_axis(f.term.args[0], f.axis, "@sum")  # fresh names first: f may use
    for a in f.state_axes:                              # the plan's names in other roles
        if a in grid_axes or program.extents[a] != program.extents[g.axis]:
            continue
        others = [b for b in f.state_axes if b not in grid_axes and b != a]
        if any(b in (block_axis, g.axis) or not isinstance(program.extents[b], int)
               or program.extents[b] > max_whole for b in others):
            continue
        moved = rename_axis(rename_axis(rename_axis(body, a, "@loop"), "@sum", block_axis),
                            "@loop", g.axis)
        loads = _load_patterns(moved, block_axis, g.axis, grid_axes, program, max_whole)
        if loads is None:
            continue  # an index this plan has no axis for (a wrong choice of loop axis)
        if any("@loop" in roles and (t, roles) not in want for t, roles in loads):
            continue  # a tile streamed by the loop that the pass does not load: the
            # renaming reads f's sum "the wrong way round" (dV beside dK when L = S)
        # the loop axis the most of whose tiles the pass loads anyway (the two sides of
        # one shared product); tiles of its own are loaded beside them
        score = len(loads & want)
        if best is None or score > best[0]:
            best = (score, Scattered(f.name, Term("sum", (moved,), g.axis), f.state_axes, a))
    return best[1] if best else None


class AddedOutput:
    """An output added into atomically from a pass's loop (the plan's fold protocol:
    ``name``, ``term`` = Σ over the loop axis ``axis``, ``op``, ``state_axes``, ``owner``,
    ``pass_index``; and ``describe()``, its line of the plan)."""
    term: Term

    @property
    def op(self) -> str:
        return "sum"

    @property
    def axis(self) -> str:
        return self.term.val


class Scattered(AddedOutput):
    """A scattered output: ``term`` = Σ over the pass's loop axis (``term.val``) of a body
    whose row axis is the plan's; ``axes`` the output's own axes, ``loop_axis`` the one
    of them the pass loops over (it reads ``term.val`` there)."""

    def __init__(self, name: str, term: Term, axes: tuple[str, ...], loop_axis: str):
        self.name, self.term, self.axes, self.loop_axis = name, term, axes, loop_axis
        self.owner, self.state_axes = name, axes
        self.pass_index = 0

    def describe(self) -> str:
        return (f"  + {self.name}[{', '.join(self.axes)}]: a sum over the rows; each program "
                f"adds its row block's term atomically per step of the loop, which runs over "
                f"its {self.loop_axis} (no second kernel)")


def _load_patterns(t: Term, row: str, loop: str, grid: tuple[str, ...], program: Program,
                   max_whole: int):
    """Each load of ``t`` as (tensor, index roles): grid axes by name, the row axis,
    the loop axis, anything else a whole axis (held in registers); None when an index
    is none of these (an axis too long to hold whole)."""
    def role(a: Term):
        if a.op != "var":
            return str(a)  # an index expression (y // G): compared as written
        if a.val in grid:
            return a.val
        if a.val in (row, loop):
            return "@row" if a.val == row else "@loop"
        n = program.extents.get(a.val)
        return "@whole" if isinstance(n, int) and n <= max_whole else None
    out = set()
    for n in t.walk():
        if n.op == "load":
            roles = tuple(role(a) for a in n.args)
            if None in roles:
                return None
            out.add((n.val, roles))
    return out

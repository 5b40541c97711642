"""The per-block fold updates and the epilogue of a pass: the code every kernel form shares.

``kernelgen`` (the ``tl`` kernels) and ``gluon_ws`` (the warp-specialised Gluon form for
Hopper) both emit a key block's fold updates and the final stores from the plan's terms
through these functions, so a score mod, mask or correction the rules derive reaches every
form the same way.
"""
from __future__ import annotations

from .codegen import _TL_DTYPE, ECOL, LOOP, Emitter, Tile
from ..ir import Term, accessed, rename_axis
from .index_scatter import IndexScattered
from .saturated_index import FarSide
from .scatter_code import emit_index_scattered, emit_scattered
from .lower import Fold, LoweringError, drop_atoms, replace_folds


def fold_order(folds: list[Fold]) -> list[Fold]:
    """Producers before the folds that read their running values."""
    names = {f.name for f in folds}
    done: list[Fold] = []
    pending = list(folds)
    while pending:
        for f in pending:
            deps = {n.val for n in f.term.walk() if n.op in ("run", "prev")} & names
            if deps <= {d.name for d in done} | {f.name}:
                done.append(f)
                pending.remove(f)
                break
        else:
            raise LoweringError("Folds read each other's running values in a cycle.")
    return done


def loop_body(em: Emitter, k: int, loop_var: str, known: frozenset) -> None:
    """Every fold of pass ``k`` updated by the current key block; ``known``: mask atoms
    that hold on the whole block (dropped from the body), and the far side of a
    computed index the block lies on (``saturated_index.FarSide``: the index is its
    constant)."""
    ps = em.plan.passes[k]
    em.env[loop_var] = LOOP
    far = [s for s in known if isinstance(s, FarSide)]
    atoms = frozenset(rename_axis(t, "@j", loop_var) for t in known if isinstance(t, Term))

    def on_block(t: Term) -> Term:
        for side in far:
            t = side.substitute(t, em.plan.block_axis, loop_var)
        return drop_atoms(t, atoms)
    folds = [Fold(f.name, on_block(rename_axis(f.term, f.axis, loop_var)), f.state_axes,
                  f.owner, f.pass_index) for f in ps.folds]
    ordered = fold_order(folds)
    for f in ordered:
        em.running[f.name] = (f.name, f"{f.name}_new")
    blk: dict[str, str] = {}  # plain fold -> its value over this block alone
    for f in ordered:
        st = em.states[f.name]
        local = block_local(em, f, blk)
        body = at_block(f.term.args[0], local, "run") if local else f.term.args[0]
        part = em.reduce_tile(f.op, body, f.axis, LOOP, -1, ps.extent)
        partc = em.bcast(part, st.axes)
        if f.op in ("max", "min") and em.plan.block_rebase:
            blk[f.name] = f"{f.name}_blk"
            em.emit(f"{f.name}_blk = {partc}")
            em.states[f"{f.name}_blk"] = Tile(f"{f.name}_blk", st.axes, "f32")
            partc = f"{f.name}_blk"
        rebase = None
        if f.op == "rollmax":
            rebase = em.bcast(em.f32(em.expr(f.term.args[1])), st.axes)
        elif f.op not in ("max", "min", "sum"):  # rollsum / splitk
            corr = em.f32(em.expr(f.term.args[1]))
            if not set(corr.axes) <= set(st.axes):
                raise LoweringError(f"The correction of {f.name} depends on the loop axis.")
            if local:  # ... + h(R_blk→R')·Σ_block g(R_blk): the split-k combine, per block
                rb = em.f32(em.expr(at_block(f.term.args[1], local, "prev")))
                partc = f"{partc} * {em.bcast(rb, st.axes)}"
            rebase = em.bcast(corr, st.axes)
        em.emit(f"{f.name}_new = {fold_update(f.op, f.name, partc, rebase)}")
    for sc in ps.scattered:  # outputs summed over the rows: this block's term, atomically
        if isinstance(sc, IndexScattered):  # ... or each pair's term at its own index
            emit_index_scattered(em, sc, loop_var, atoms, far)
        else:
            emit_scattered(em, sc, loop_var, atoms)
    for f in ordered:
        em.emit(f"{f.name} = {f.name}_new")
    em.env.pop(loop_var, None)
    for f in ps.folds:
        em.running.pop(f.name, None)


def fold_update(op: str, state: str, part: str, rebase: str | None) -> str:
    """A fold's state after one more part (a key block's, or a combine step's partials,
    already reduced): ``max``/``min``/``sum`` by their operator; a rolling state re-based
    from its producers' old values to the new ones first (``rebase`` = h(R→R')):
    t' = max(t + h, part) for ``rollmax``, t' = t·h + part for ``rollsum`` / ``splitk``."""
    if op == "max":
        return f"tl.maximum({state}, {part})"
    if op == "min":
        return f"tl.minimum({state}, {part})"
    if op == "sum":
        return f"{state} + {part}"
    if op == "rollmax":
        return f"tl.maximum({state} + {rebase}, {part})"
    return f"{state} * {rebase} + {part}"


def block_local(em: Emitter, f: Fold, blk: dict[str, str]) -> dict[str, str]:
    """Producers of rolling sum ``f`` whose block value stands in for their running one
    (``TilePlan.block_rebase``): plain max/min folds of this pass -- a block's own value is
    self-contained and, like the running one, a stabiliser (exp(s − m_blk) ≤ 1).  A sum's
    block value is neither (1/√0 on a padded block), so its readers keep the running one.
    Empty: update ``f`` the usual way."""
    if not (em.plan.block_rebase and f.op in ("rollsum", "splitk")):
        return {}
    prods = accessed(f.term, ("run", "prev"))
    if not prods or not prods <= set(blk):
        return {}
    return {p: blk[p] for p in prods}


def at_block(t: Term, local: dict[str, str], op: str) -> Term:
    """``t`` with each ``op`` access (run / prev) of a producer in ``local`` reading the
    producer's block value instead.  exp(s − m_blk) is exactly 1 at the block's max: the
    fp16 P fed to the P·V dot then rounds one term per block and row exactly, as
    FlashDecoding's splits do (measurably lower RMS error in decode)."""
    if t.op == op and t.val in local:
        return Term("ref", (), local[t.val])
    return t.map_args(lambda a: at_block(a, local, op))


def epilogue(em: Emitter) -> None:
    plan, p = em.plan, em.p
    for item in plan.epilogue:
        expr = replace_folds(item.expr, plan.state_of)
        for a in item.axes:
            em.env.setdefault(a, a)
        if len(item.loop_axes) > 1:
            raise LoweringError(f"{item.name}: more than one column axis to loop over.")
        if item.loop_axes:
            (ca,) = item.loop_axes
            em.env[ca] = ECOL
            ext = p.extents[ca]
            em.emit(f"# epilogue pass over {ca} for {item.name}")
            em.emit(f"for c0 in range(0, {ext}, B_{ECOL}):")
            em.push(em.scopes[0][2] + "    ")
            em.emit(f"offs_{ECOL} = c0 + tl.arange(0, B_{ECOL})")
            em.emit(f"mask_{ECOL} = (offs_{ECOL} < {ext}) | EVEN_{ECOL}")
            em.ranges[ECOL] = ("c0", f"{ext}")
            store(em, item.name, em.expr(expr), item.axes)
            em.scopes[1][0].extend(em.pop())
            em.env.pop(ca)
            em.ranges.pop(ECOL)
        else:
            store(em, item.name, em.expr(expr), item.axes)
    for f in plan.fold_outputs:
        store(em, f.owner, em.states[f.name], f.state_axes)


def store(em: Emitter, name: str, tile: Tile, axes: tuple[str, ...]) -> None:
    p = em.p
    idx = [em.expr(Term("var", (), a)) for a in axes]
    taxes = em.canon(sum((i.axes for i in idx), ()))
    off = " + ".join(f"{em.bcast(i, taxes)} * {name}_s{k}" for k, i in enumerate(idx)) or "0"
    val = em.f32(tile)
    code = em.bcast(val, taxes)
    if set(val.axes) != set(taxes):
        code = f"({code} + tl.zeros({em.shape(taxes)}, tl.float32))"
    dt = _TL_DTYPE[p.dtype_of(name)]
    m = em.mask(taxes)
    line = f"tl.store({name}_ptr + {off}, ({code}).to({dt}){', mask=' + m if m else ''})"
    if not em.store_tile(name, idx, taxes, f"({code}).to({dt})", line):
        em.emit(line)

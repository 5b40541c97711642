"""Code for scattered outputs (``scatter``): each key block's term added atomically.

Inside the pass loop of a program with row block ``J``, a scattered output
``f[…, i, …] = Σ_j body`` gets ``Σ_{j ∈ J} body`` for the loop's block of ``i``: a
reduction over the *row* axis of a tile the pass already holds (one ``tl.dot`` when the
body is a product, as ``dS ᵀ· K`` is), added into ``f`` with ``tl.atomic_add``.  The adds
are relaxed: the output is read only after the kernel ends.
"""
from __future__ import annotations

from ..ir import Term, rename_axis
from .codegen import LOOP, Emitter, Tile
from .lower import drop_atoms


def emit_scattered(em: Emitter, sc, loop_var: str, known: frozenset) -> None:
    """Add this block's term of scattered output ``sc`` (``scatter.Scattered``) into it;
    ``known``: mask atoms true on the whole block, with the loop axis named ``loop_var``."""
    plan = em.plan
    body = drop_atoms(rename_axis(sc.term.args[0], sc.term.val, loop_var), known)
    part = em.reduce_tile("sum", body, plan.block_axis, plan.block_axis, -1, plan.row_extent)
    # the output's own loop axis may share its name with the plan's row axis (dQ[i] in
    # a plan whose rows are keys named i): it is addressed by the loop's offsets
    idx = [Tile(f"offs_{LOOP}", (LOOP,), "int") if a == sc.loop_axis
           else em.expr(Term("var", (), a)) for a in sc.axes]
    taxes = em.canon(sum((i.axes for i in idx), ()))
    if set(part.axes) - set(taxes):
        raise AssertionError(f"{sc.name}: its block term has axes {part.axes} beyond the "
                             f"output's {taxes}")  # bind() admits only whole / loop axes
    off = " + ".join(f"{em.bcast(i, taxes)} * {sc.name}_s{k}" for k, i in enumerate(idx))
    code = em.bcast(em.f32(part), taxes)
    if set(part.axes) != set(taxes):
        code = f"({code} + tl.zeros({em.shape(taxes)}, tl.float32))"
    m = em.mask(taxes)
    line = (f"tl.atomic_add({sc.name}_ptr + {off}, {code}{', mask=' + m if m else ''}, "
            "sem='relaxed')")
    # (the bulk engine's reduce -- a descriptor's ``atomic_add`` per tile -- is how
    # FlashAttention-3 adds dQ.  Not used: on an H100 it ran right but did not pay,
    # 6.86 ms against 6.74 for per-element adds at S=8192 (bench/backward_probe.py,
    # session 13); session 12's fault, first blamed on it, was warp specialisation's)
    em.emit(line)


def emit_index_scattered(em: Emitter, sc, loop_var: str, known: frozenset) -> None:
    """Add this block's terms of ``sc`` (``index_scatter.IndexScattered``) into its
    output, each at its computed indices: one atomic add per (row, key) pair of the tile.
    A pair whose index falls outside the output, or outside the rows and keys, adds
    nothing (``where(f == m)`` held for no ``m``)."""
    plan = em.plan
    j = sc.term.val
    val = em.f32(em.expr(drop_atoms(rename_axis(sc.term.args[0], j, loop_var), known)))
    taxes = em.canon((plan.block_axis, LOOP))
    if set(val.axes) - set(taxes):
        raise AssertionError(f"{sc.name}: a term beyond the [rows x keys] tile")  # find()
    idx, inside, covered = {}, [], set()
    for a in sc.axes:
        at = em.expr(rename_axis(sc.at[a], j, loop_var) if a in sc.at else Term("var", (), a))
        if set(at.axes) - set(taxes):
            raise AssertionError(f"{sc.name}: an index beyond the [rows x keys] tile")
        covered |= set(at.axes)
        idx[a] = f"({em.bcast(at, taxes)})"
        if a in sc.at:
            inside.append(f"({idx[a]} >= 0) & ({idx[a]} < {sc.extents[a]})")
    off = " + ".join(f"{idx[a]} * {sc.name}_s{k}" for k, a in enumerate(sc.axes))
    if covered != set(taxes):  # (atomics broadcast the value to the pointers' shape)
        off = f"{off} + tl.zeros({em.shape(taxes)}, tl.int32)"
    m = " & ".join([em.mask(taxes)] + inside)
    code = em.bcast(val, taxes)
    if set(val.axes) != set(taxes):  # (every pair adds its own term: a full tile)
        code = f"({code} + tl.zeros({em.shape(taxes)}, tl.float32))"
    em.emit(f"tl.atomic_add({sc.name}_ptr + {off}, {code}, mask={m}, sem='relaxed')")

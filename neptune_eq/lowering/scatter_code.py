"""Code for scattered outputs (``scatter``): each key block's term added atomically.

Inside the pass loop of a program with row block ``J``, a scattered output
``f[…, i, …] = Σ_j body`` gets ``Σ_{j ∈ J} body`` for the loop's block of ``i``: a
reduction over the *row* axis of a tile the pass already holds (one ``tl.dot`` when the
body is a product, as ``dS ᵀ· K`` is), added into ``f`` with ``tl.atomic_add``.  The adds
are relaxed: the output is read only after the kernel ends.
"""
from __future__ import annotations

from ..ir import Term, free_axes, rename_axis
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


def emit_index_scattered(em: Emitter, sc, loop_var: str, known: frozenset,
                         far: list = ()) -> None:
    """Add this block's terms of ``sc`` (``index_scatter.IndexScattered``) into its
    output, each at its computed indices: one atomic add per (row, key) pair of the tile,
    or per diagonal where the indices read rows and keys only through their difference
    (``_along_diagonals``), or one for the whole tile where the block lies on a far side
    of its index (``far``: ``saturated_index.FarSide``, the index a constant there).  A
    pair whose index falls outside the output, or outside the rows and keys, adds
    nothing (``where(f == m)`` held for no ``m``)."""
    plan = em.plan
    j = sc.term.val

    def on_block(t: Term) -> Term:
        t = rename_axis(t, j, loop_var)
        for side in far:
            t = side.substitute(t, plan.block_axis, loop_var)
        return t
    val = em.f32(em.expr(drop_atoms(on_block(sc.term.args[0]), known)))
    taxes = em.canon((plan.block_axis, LOOP))
    if set(val.axes) - set(taxes):
        raise AssertionError(f"{sc.name}: a term beyond the [rows x keys] tile")  # find()
    if far and _one_add(em, sc, val, taxes, on_block):
        return
    if _along_diagonals(em, sc, val, taxes):
        return
    idx, inside, covered = {}, [], set()
    for a in sc.axes:
        at = em.expr(on_block(sc.at[a]) if a in sc.at else Term("var", (), a))
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


def _one_add(em: Emitter, sc, val: Tile, taxes: tuple, on_block) -> bool:
    """Where every index of ``sc`` is one value over the tile (a far side made each
    computed one a constant; the rest are the program's), the tile's terms summed and
    added once; False, with nothing emitted, elsewhere."""
    idx = [em.expr(on_block(sc.at[a]) if a in sc.at else Term("var", (), a)) for a in sc.axes]
    if any(i.axes for i in idx):
        return False
    inside = [f"(({i.code}) >= 0) & (({i.code}) < {sc.extents[a]})"
              for a, i in zip(sc.axes, idx) if a in sc.at]
    full = em.bcast(val, taxes)
    if set(val.axes) != set(taxes):
        full = f"({full} + tl.zeros({em.shape(taxes)}, tl.float32))"
    total = em.new("far_sum")
    em.emit(f"{total} = tl.sum(tl.sum(tl.where({em.mask(taxes)}, {full}, 0.0), 1), 0)")
    off = " + ".join(f"({i.code}) * {sc.name}_s{k}" for k, i in enumerate(idx))
    m = " & ".join([f"({total} != 0.0)"] + inside)
    em.emit(f"tl.atomic_add({sc.name}_ptr + {off}, {total}, mask={m}, sem='relaxed')")
    return True


def _along_diagonals(em: Emitter, sc, val: Tile, taxes: tuple) -> bool:
    """Emit ``sc``'s adds one per diagonal of the tile, where every index is ``g(r − j)``
    (``IndexScattered.diagonal``) for the row axis ``r`` the row block tiles; False,
    with nothing emitted, elsewhere.

    The tile ``x[R, K]`` is skewed by ``tl.gather`` -- ``y[r, t] = x[r, (r − t) mod K]``
    -- so its column ``t`` holds the diagonals ``r − c = t + qK``, one per ``q =
    ⌊(r − t)/K⌋`` (``q`` from −1 to ⌊(R − 1)/K⌋): each masked column sum is one
    diagonal's total, added at ``g`` of its ``r − j``, computed on the K diagonals'
    differences with ``r`` bound to them and ``j`` to 0.  A 64 × 64 tile makes 128 adds,
    not 4096.  Where the output has one computed axis of few entries (``entry_sums``:
    T5's 32 buckets), the diagonals are summed per entry too and the tile adds once per
    entry."""
    ba = em.plan.block_axis
    row = sc.diagonal()
    if row is None or em.env.get(row) != ba or ba not in em.aranges or LOOP not in em.aranges \
            or taxes != (ba, LOOP):
        return False
    scalars = {a for f in sc.at.values() for a in free_axes(f)} - {row, sc.term.val}
    scalars |= {a for a in sc.axes if a not in sc.at}
    if any(not isinstance(em.env.get(a), str) or em.env.get(a) in em.order for a in scalars):
        return False  # (an index or output axis that moves within the tile)
    R, K = em.block(ba), em.block(LOOP)
    x = em.new("dg_x")
    full = em.bcast(val, taxes)
    if set(val.axes) != set(taxes):
        full = f"({full} + tl.zeros({em.shape(taxes)}, tl.float32))"
    em.emit(f"{x} = tl.where({em.mask(taxes)}, {full}, 0.0)")
    u = em.new("dg_u")  # r − t + K: at least 1, so // and % round as floor does
    em.emit(f"{u} = tl.arange(0, {R})[:, None] - tl.arange(0, {K})[None, :] + {K}")
    y = em.new("dg_y")
    em.emit(f"{y} = tl.gather({x}, {u} % {K}, 1)")
    entries = sc.entry_sums()  # (computed axis, its length) or None
    if entries:
        ent, acc = em.new("dg_entry"), em.new("dg_acc")
        width = 1 << (entries[1] - 1).bit_length()
        em.emit(f"{ent} = tl.arange(0, {width})")
        em.emit(f"{acc} = tl.zeros([{width}], tl.float32)")
    q = em.new("dg_q")
    em.emit(f"for {q} in tl.static_range(({R} - 1) // {K} + 2):  # q + 1 = ⌊(r − t)/K⌋ + 1")
    em.push(em.scopes[-1][2] + "    ")
    total = em.new("dg_sum")
    em.emit(f"{total} = tl.sum(tl.where({u} // {K} == {q}, {y}, 0.0), 0)")
    (row0, _), (l0, _) = em.aranges[ba], em.aranges[LOOP]
    diff = Tile(f"({row0} - {l0} + tl.arange(0, {K}) + ({q} - 1) * {K})", (LOOP,), "int")
    r_name, j_name = f"{row}_diag_{q}", f"{sc.term.val}_diag_{q}"
    em.env[r_name], em.env[j_name] = diff, Tile("0", (), "int")
    idx, inside = {}, []
    for a in sc.axes:
        f = sc.at.get(a, Term("var", (), a))
        at = em.expr(rename_axis(rename_axis(f, row, r_name), sc.term.val, j_name))
        idx[a] = f"({em.bcast(at, (LOOP,))})"
        if a in sc.at:
            inside.append(f"({idx[a]} >= 0) & ({idx[a]} < {sc.extents[a]})")
    if entries:  # Σ_t [g_t = e]·sum_t for every entry e: an index past the table meets none
        hit = f"(({idx[entries[0]]} + tl.zeros([{K}], tl.int32))[:, None] == {ent}[None, :])"
        em.emit(f"{acc} += tl.sum(tl.where({hit}, {total}[:, None], 0.0), 0)")
    else:
        off = " + ".join(f"{idx[a]} * {sc.name}_s{k}" for k, a in enumerate(sc.axes))
        off = f"{off} + tl.zeros([{K}], tl.int32)"  # (the pointers take the sums' shape)
        m = " & ".join([f"({total} != 0.0)"] + inside)  # (a diagonal no term reached adds 0)
        em.emit(f"tl.atomic_add({sc.name}_ptr + {off}, {total}, mask={m}, sem='relaxed')")
    em.scopes[-2][0].extend(em.pop())  # (its cache goes with it: its bindings are q's)
    em.env.pop(r_name), em.env.pop(j_name)
    if entries:  # the other axes are the program's (a head): one add per entry of its row
        off = " + ".join(f"{ent if a == entries[0] else em.expr(Term('var', (), a)).code}"
                         f" * {sc.name}_s{k}" for k, a in enumerate(sc.axes))
        m = f"({ent} < {entries[1]}) & ({acc} != 0.0)"
        em.emit(f"tl.atomic_add({sc.name}_ptr + {off}, {acc}, mask={m}, sem='relaxed')")
    return True

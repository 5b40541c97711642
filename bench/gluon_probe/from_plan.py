"""Prototype: the warp-specialised Gluon form of fa_hopper.py, emitted from a neptune_eq
tile plan instead of written by hand (issue 16's "derive, don't template").

The skeleton is the lowering of one shape of pass, decided from the plan's folds: a pass
whose folds read one contraction ``Σ_d a[.., row, d]·b[.., key, d]`` of two 16-bit inputs
(a producer warp streams ``b``'s tiles by TMA) and whose one column-carrying rolling sum
adds ``Σ_key P·c[.., key, e]`` (the second wgmma, deferred one block so that the next
block's math overlaps it).  Everything between -- the score mods, masks, the max and sum
folds and their corrections -- is emitted by the package's own ``Emitter`` from the plan's
terms, with ``tl`` calls rewritten for Gluon and tiles laid out as the wgmma accumulator.
Nothing here names attention.

Scope of the prototype: one pass, no split-k, no packed heads, no data-derived block
tests; the key block equals the column width (64 or 128); inputs contiguous.
"""
from __future__ import annotations

import re

from neptune_eq.ir import Term
from neptune_eq.lowering.codegen import LOOP, Emitter, Tile, grid_decode, init_fill
from neptune_eq.lowering.kernelgen import _epilogue, _loop_body  # the package's emission
from neptune_eq.lowering.lower import LoweringError, TilePlan

ROWS = 64  # rows per consumer warpgroup (one wgmma M)


class GluonEmitter(Emitter):
    """The package's tile-expression emitter, with the two contractions taken over by the
    warp-specialised skeleton.  Loads and stores stay pointer ones: no kernel axis has a
    descriptor range here (``ranges`` is empty), so ``descriptors`` emits no TMA branch."""

    def __init__(self, plan: TilePlan, name: str):
        super().__init__(plan, name)
        self.qk: tuple[Term, Term] | None = None   # the loads of the first contraction
        self.pv: Term | None = None                # the load of the second one's right side

    def _try_dot(self, t: Term, kaxis: str, scope: int):
        a, b = t.args
        if kaxis in self.plan.whole_axes and a.op == "load" and b.op == "load":
            if self.qk is not None and (a, b) != self.qk and \
                    (a.val, b.val) != (self.qk[0].val, self.qk[1].val):
                raise LoweringError("Two different first contractions in one pass.")
            self.qk = self.qk or (a, b)
            return Tile("qk", self.canon((self.plan.block_axis, LOOP)), "f32")
        if kaxis == LOOP and b.op == "load":
            p = self.f32(self.expr(a))
            if self.canon(p.axes) != (self.plan.block_axis, LOOP):
                raise LoweringError("The second contraction's left side is not a score tile.")
            self.pv = b
            masked = f"tl.where(mask_{LOOP}[None, :], {p.code}, 0.0)"
            self.emit(f"p_op = tl.convert_layout(({masked}).to(DTYPE), P_LAYOUT)")
            col = next(x for x in self.expr_axes(b) if x != LOOP)
            return Tile("0.0", self.canon((self.plan.block_axis, col)), "f32")
        raise LoweringError("A contraction this skeleton does not issue as a wgmma.")

    def expr_axes(self, load: Term) -> tuple[str, ...]:
        out = []
        for a in load.args:
            if a.op == "var":
                role = self.env.get(a.val)
                if isinstance(role, str) and role in self.order:
                    out.append(role)
        return tuple(out)

    def _expr(self, t: Term, scope: int) -> Tile:
        if t.op == "tanh":  # Gluon has no sigmoid: tanh x = 1 − 2/(e^{2x} + 1)
            a = self.float_of(self.expr(t.args[0]))
            return self.bind(f"(1.0 - 2.0 / (tl.exp(2.0 * ({a.code})) + 1.0))", a.axes, "f32", scope)
        return super()._expr(t, scope)


def _gl(lines: list[str]) -> list[str]:
    return [re.sub(r"\btl\.", "gl.", ln) for ln in lines]


def _row_base(em: GluonEmitter, load: Term) -> str:
    """Row of the flattened (…, rows, cols) view where this load's tile starts, minus the
    tile's own row index: Σ_k idx_k·stride_k / row_stride over the program-constant
    positions (inputs are contiguous, so every batch/head stride is a multiple)."""
    n = len(load.args)
    parts = []
    for k, a in enumerate(load.args[:n - 2]):
        parts.append(f"({em.expr(a).code}) * {load.val}_s{k}")
    return f"({' + '.join(parts) or '0'}) // {load.val}_s{n - 2}"


def generate(plan: TilePlan, name: str = "neptune_ws") -> str:
    if plan.split or plan.packed or len(plan.passes) != 1:
        raise LoweringError("The warp-specialised skeleton takes one unsplit, unpacked pass.")
    ps = plan.passes[0]
    p = plan.program
    ba = plan.block_axis
    em = GluonEmitter(plan, name)
    tensors = [ph.name for ph in p.inputs] + list(p.outputs)
    strides = [f"{t}_s{k}" for t in tensors for k in range(len(p.shape_of(t)))]
    args = [f"{t}_ptr" for t in tensors] + strides

    # consumer prologue (scope 0) and body scopes ------------------------------------------
    if plan.fold_outputs or any(item.loop_axes for item in plan.epilogue):
        raise LoweringError("Row statistics and epilogue column loops are outside the prototype.")
    em.push("    ")
    for ln in grid_decode(plan):
        em.emit(ln)
    for a in plan.grid_axes:
        em.env[a] = f"ax_{a}"
    em.env[ba] = ba
    em.emit(f"offs_{ba} = my_first + gl.arange(0, {ROWS}, S_ROWS)")
    em.emit(f"mask_{ba} = offs_{ba} < {plan.row_extent}")
    for a, n in plan.whole_axes.items():
        em.env.setdefault(a, a)
        em.emit(f"offs_{a} = gl.arange(0, {n}, S_COLS)")
        em.emit(f"mask_{a} = offs_{a} < {p.extents[a]}")
    em.push("    ")
    for f in ps.folds:
        axes = em.canon(a for a in f.state_axes if a not in plan.grid_axes)
        fill = init_fill(f.op)
        shape = "[" + ", ".join(str(ROWS) if a == ba else str(plan.whole_axes[a]) for a in axes) + "]"
        lay = "S_ROWS" if len(axes) == 1 else "S_LAYOUT"
        em.emit(f"{f.name} = gl.full({shape}, {fill}, gl.float32, {lay})")
        em.states[f.name] = Tile(f.name, axes, "f32")
    prologue_tail = em.pop()

    def fragment(known: frozenset, indent: str) -> list[str]:
        em.push(indent)
        em.emit(f"offs_{LOOP} = l0 + cols")
        em.emit(f"mask_{LOOP} = offs_{LOOP} < {ps.extent}")
        _loop_body(em, 0, "loop0", known)
        return em.pop()

    ind = "        "
    interior_test = []
    if ps.lo_offset is not None:
        interior_test.append(f"(l0 >= my_first + {ROWS - 1} + ({ps.lo_offset}))")
    if ps.hi_offset is not None:
        interior_test.append(f"(l0 + B_L - 1 < my_first + ({ps.hi_offset}))")
    bodies = {}
    if ps.bound_atoms:
        bodies["in"] = fragment(ps.bound_atoms, ind + "    ")
        bodies["edge"] = fragment(frozenset(), ind + "    ")
    else:
        bodies["all"] = fragment(frozenset(), ind)
    pv_fold = next((f.name for f in ps.folds if len(f.state_axes) > len(plan.grid_axes) + 1), None)
    if em.qk is None or em.pv is None or pv_fold is None:
        raise LoweringError("The pass has no pair of contractions for the skeleton.")

    def with_wait(lines: list[str], wait: bool) -> list[str]:
        out = []
        for ln in lines:
            if wait and ln.strip().startswith(f"{pv_fold}_new ="):
                pad = ln[:len(ln) - len(ln.lstrip())]
                out.append(f"{pad}{pv_fold} = warpgroup_mma_wait(0, deps=({pv_fold}, ))")
                out.append(f"{pad}mbarrier.arrive(c_empty.index(prev), count=1)")
            out.append(ln)
        return out

    # Block j > 0 issues its first contraction and block j-1's deferred P·c, waits for the
    # former only, and runs the block's math while the latter is on the tensor cores.  The
    # issue sits inside each branch: an in-flight accumulator cannot cross an if/else.
    issue = ["mbarrier.wait(b_ready.index(st), ph)",
             "qk = warpgroup_mma(q_tile, b_bufs.index(st).permute((1, 0)), zero_s, "
             "use_acc=False, is_async=True)",
             "mbarrier.wait(c_ready.index(prev), ((jb - 1) // STAGES) & 1)",
             f"{pv_fold} = warpgroup_mma(p_op, c_bufs.index(prev), {pv_fold}, is_async=True)",
             "qk = warpgroup_mma_wait(1, deps=(qk, ))",
             "mbarrier.arrive(b_empty.index(st), count=1)"]

    def block_code(wait: bool) -> list[str]:
        if "all" in bodies:
            pre = [ind + ln for ln in issue] if wait else []
            return pre + with_wait(bodies["all"], wait)
        test = " & ".join(interior_test)
        pre = [ind + "    " + ln for ln in issue] if wait else []
        return ([f"{ind}if {test}:"] + pre + with_wait(bodies["in"], wait) + [f"{ind}else:"]
                + pre + with_wait(bodies["edge"], wait))

    # epilogue: the deferred last P·c, then the plan's epilogue expressions, stored
    em.push("    ")
    _epilogue(em)
    epilogue = em.pop()
    prologue = em.pop()

    a_load, b_load = em.qk
    c_load = em.pv
    # loop range over keys: the affine bounds of the pass, for the CTA's 2·ROWS rows
    rng = [f"row_first = row_block * {2 * ROWS}", f"row_last = row_first + {2 * ROWS - 1}",
           "j_lo = 0", f"j_hi = {ps.extent}"]
    if ps.lo_offset is not None:
        rng.append(f"j_lo = (gl.maximum(row_first + ({ps.lo_offset}), 0) // B_L) * B_L")
    if ps.hi_offset is not None:
        rng.append(f"j_hi = gl.minimum(row_last + ({ps.hi_offset}), {ps.extent})")
    rng.append("n_blocks = gl.maximum(gl.cdiv(j_hi - j_lo, B_L), 1)")
    # bases of the three streamed tensors' tiles in their flattened 2-D views
    em.push("    ")
    a_row = _row_base(em, a_load)
    b_row = _row_base(em, b_load)
    c_row = _row_base(em, c_load)
    bases = em.pop()

    sig = ", ".join(["a_desc", "b_desc", "c_desc"] + args)
    shared = ", ".join(["a_smem", "b_bufs", "c_bufs", "a_bar", "b_ready", "b_empty", "c_ready",
                        "c_empty", "pid_grid", "row_block", "j_lo", "n_blocks"] + args)
    src = [
        "# generated from a neptune_eq tile plan by bench/gluon_probe/from_plan.py",
        *[f"#   {ln}" for ln in str(p).splitlines()],
        "from triton.experimental import gluon",
        "from triton.experimental.gluon import language as gl",
        "from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, "
        "warpgroup_mma, warpgroup_mma_wait",
        "", "",
        "@gluon.jit",
        "def _producer(a_desc, b_desc, c_desc, a_smem, b_bufs, c_bufs, a_bar, b_ready, b_empty, "
        "c_ready, c_empty, a_row, b_row, c_row, j_lo, n_blocks, B_L: gl.constexpr):",
        "    STAGES: gl.constexpr = b_bufs.type.shape[0]",
        "    mbarrier.expect(a_bar, 2 * a_desc.block_type.nbytes)",
        "    tma.async_copy_global_to_shared(a_desc, [a_row, 0], a_bar, a_smem.index(0))",
        f"    tma.async_copy_global_to_shared(a_desc, [a_row + {ROWS}, 0], a_bar, a_smem.index(1))",
        "    for jb in range(n_blocks):",
        "        s = jb % STAGES",
        "        ph = (jb // STAGES) & 1",
        "        mbarrier.wait(b_empty.index(s), ph ^ 1)",
        "        mbarrier.expect(b_ready.index(s), b_desc.block_type.nbytes)",
        "        tma.async_copy_global_to_shared(b_desc, [b_row + j_lo + jb * B_L, 0], b_ready.index(s), b_bufs.index(s))",
        "        mbarrier.wait(c_empty.index(s), ph ^ 1)",
        "        mbarrier.expect(c_ready.index(s), c_desc.block_type.nbytes)",
        "        tma.async_copy_global_to_shared(c_desc, [c_row + j_lo + jb * B_L, 0], c_ready.index(s), c_bufs.index(s))",
        "", "",
        "@gluon.jit",
        f"def _consumer(a_smem, b_bufs, c_bufs, a_bar, b_ready, b_empty, c_ready, c_empty, "
        f"pid_grid, row_block, j_lo, n_blocks, {', '.join(args)}, WHICH: gl.constexpr, "
        f"B_L: gl.constexpr, DTYPE: gl.constexpr):",
        "    STAGES: gl.constexpr = b_bufs.type.shape[0]",
        "    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], "
        "warps_per_cta=[4, 1], instr_shape=[16, B_L, 16])",
        "    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT, k_width=2)",
        "    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)",
        "    S_COLS: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)",
        f"    my_first = row_block * {2 * ROWS} + WHICH * {ROWS}",
        "    cols = gl.arange(0, B_L, S_COLS)",
        f"    zero_s = gl.zeros([{ROWS}, B_L], gl.float32, S_LAYOUT)",
        *_gl(prologue), *_gl(prologue_tail),
        "    q_tile = a_smem.index(WHICH)",
        "    mbarrier.wait(a_bar, 0)",
        "    # block 0: the first contraction and the block's math; its P·c is issued next block",
        "    l0 = j_lo",
        "    mbarrier.wait(b_ready.index(0), 0)",
        "    qk = warpgroup_mma(q_tile, b_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)",
        "    qk = warpgroup_mma_wait(0, deps=(qk, ))",
        "    mbarrier.arrive(b_empty.index(0), count=1)",
        *[ln[4:] for ln in _gl(block_code(False))],
        "    for jb in range(1, n_blocks):",
        "        l0 = j_lo + jb * B_L",
        "        st = jb % STAGES",
        "        ph = (jb // STAGES) & 1",
        "        prev = (jb - 1) % STAGES",
        *_gl(block_code(True)),
        "    last = (n_blocks - 1) % STAGES",
        "    mbarrier.wait(c_ready.index(last), ((n_blocks - 1) // STAGES) & 1)",
        f"    {pv_fold} = warpgroup_mma(p_op, c_bufs.index(last), {pv_fold}, is_async=True)",
        f"    {pv_fold} = warpgroup_mma_wait(0, deps=({pv_fold}, ))",
        "    mbarrier.arrive(c_empty.index(last), count=1)",
        *_gl(epilogue),
        "", "",
        "@gluon.jit",
        f"def {name}({sig}, B_L: gl.constexpr, STAGES: gl.constexpr):",
        "    DTYPE: gl.constexpr = a_desc.dtype",
        "    D: gl.constexpr = a_desc.block_type.shape[1]",
        "    row_block = gl.num_programs(0) - 1 - gl.program_id(0)  # long rows first",
        "    pid_grid = gl.program_id(1)",
        *["    " + ln for ln in rng],
        *["    " + ln for ln in grid_decode(plan)], *_gl(bases),
        f"    a_row = {a_row} + row_first",
        f"    b_row = {b_row}",
        f"    c_row = {c_row}",
        f"    a_smem = gl.allocate_shared_memory(DTYPE, [2, {ROWS}, D], a_desc.layout)",
        "    b_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, B_L, D], b_desc.layout)",
        "    c_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, B_L, c_desc.block_type.shape[1]], c_desc.layout)",
        "    a_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())",
        *[f"    {b} = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())"
          for b in ("b_ready", "b_empty", "c_ready", "c_empty")],
        "    mbarrier.init(a_bar, count=1)",
        "    for i in gl.static_range(STAGES):",
        "        mbarrier.init(b_ready.index(i), count=1)",
        "        mbarrier.init(c_ready.index(i), count=1)",
        "        mbarrier.init(b_empty.index(i), count=2)  # both consumers read every tile",
        "        mbarrier.init(c_empty.index(i), count=2)",
        "    gl.warp_specialize([",
        f"        (_consumer, ({shared}, 0, B_L, DTYPE)),",
        f"        (_consumer, ({shared}, 1, B_L, DTYPE)),",
        "        (_producer, (a_desc, b_desc, c_desc, a_smem, b_bufs, c_bufs, a_bar, b_ready, b_empty, "
        "c_ready, c_empty, a_row, b_row, c_row, j_lo, n_blocks, B_L)),",
        "    ], [4, 1], [232, 24])",
    ]
    return "\n".join(src) + "\n"


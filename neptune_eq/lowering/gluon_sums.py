"""The warp-specialised Gluon form of a pass of plain sums over two streamed inputs (sm_90).

``gluon_ws`` lowers the rolling-softmax pass (the forward).  This module lowers the other
shape the rules derive: a pass whose every fold is a plain sum ``Σ_L X[row, L]·c[L, col]``
of a score-like tile ``X`` and a streamed input ``c``, where ``X`` is built elementwise
from whole-axis contractions ``Σ_d a[row, d]·b[L, d]`` of a *row-resident* input ``a``
with a streamed ``b``.  FlashAttention-2's dK/dV loop is that shape, derived from the
plain backward program (``frontend.autodiff``, ``rules/backward.egg``): rows are keys,
``Sᵀ = K·Qᵀ`` and ``dPᵀ = V·dOᵀ`` the whole-axis contractions, ``dV = Σ Pᵀ·dO`` and
``dK = Σ dSᵀ·Q`` the sums -- and each streamed tile (Q, dO) feeds both kinds of product.
Nothing here names attention; a pair of any such products lowers the same way.

The skeleton is ``gluon_ws``'s: one producer warp streams each block of every streamed
input by TMA into a ring of its own (mbarrier ready/empty pairs), two consumer
warpgroups of 64 rows each hold their rows of the resident inputs in shared memory and
issue their own wgmma.  Per block a consumer issues every whole-axis contraction at once
(async), waits for each only where the block math first reads it, accumulates the sums
in registers with wgmma (the left operand from registers, as FlashAttention-3's), and
frees the ring slots when its last product is done.  The overlap is between the two
warpgroups: while one computes its exps the other's products run.

The block math between the products -- the recomputed P, masks, dS -- is the package's
``Emitter``/``fold_body`` code from the plan's terms, rewritten for Gluon as in
``gluon_ws``; an affine mask cuts the loop into edge / interior / edge loops the same way.

An output summed over the rows (the fused backward's ``dQ = Σ_keys dS·K``) is a third
product: each warpgroup stores its ``Xᵀ`` tile to shared memory and reads tiles back as
the wgmma's transposed left operand against resident rows, then adds the result
atomically.  At width 128 the two warpgroups split the columns, as FlashAttention-3 does
(both halves of ``Xᵀ`` behind a full/free mbarrier pair, a 64×64 accumulator each).  It
is right but slower than the ``tl`` fused form (``generate`` has the measurements), so
it is built and not offered to the timer.

A mask over captured tensors (document ids) bounds each program's block range from the
per-call summaries, as in ``gluon_ws``: the producer streams only the blocks some row may
see, and the blocks every row sees whole run the body without the mask.

Programs walk the 128-row tiles as the forward's do (``walk_mode``, ``gluon_tiles.walk``):
persistent, one per SM, where each tile's work is known on the host -- the producer loads
the next tile's resident rows once both consumers have read the last tile's, so a tile's
epilogue overlaps the next one's first blocks -- and the launcher may still run the same
kernel one program per tile (``TileConfig.per_tile``, timed beside it).

Scope: one unsplit, unpacked pass of sums only; one column axis; widths 64 or 128.  Plans
outside it raise ``LoweringError`` and keep the ``tl`` forms.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..ir import Term
from .block_skip import data_atoms, summary_specs
from .codegen import LOOP, Tile, grid_decode, init_fill
from .fold_body import epilogue
from .gluon_tiles import (CTA_ROWS, ROWS, affine_walk, gl_main, interior_loops, key_range,
                          persistent_place, tile_lines, walk)
from .gluon_form import GluonForm
from .gluon_ws import (GluonEmitter, _gl, _row_base, block_fragment, check_scope, consumer_axes,
                       source_header)
from .lower import LoweringError, TilePlan


PERSISTENT = True  # tiles walked by one program per SM where their work is known (walk_mode)


def walk_mode(ps, data: bool, scattered: bool) -> str:
    """How the pass's programs walk their 128-row tiles (``gluon_tiles.walk``), as in
    ``gluon_ws``: persistent -- one program per SM, the producer loading the next tile's
    resident rows and first blocks while the consumers store the last tile's sums -- in
    round robin where every tile has the same work, in the launcher's balanced order
    (``runtime.tile_order``) where an affine mask makes it unequal (causal: key block j
    of dK/dV sees the query blocks from j on).  One program per tile for a data mask
    (its work is known only on the device) and for the fused form's sums over the rows
    (not offered to the timer)."""
    return "single" if not PERSISTENT or data or scattered else affine_walk(ps)


@dataclass
class GluonSumsForm(GluonForm):
    """A ``GluonForm`` with any number of resident and streamed inputs: descriptors
    ``r0_desc``.. (64 rows of a resident input) then ``s0_desc``.. (one block of a
    streamed one), in that order before the pointer parameters."""
    resident: tuple[str, ...] = ()
    streams: tuple[str, ...] = ()
    in_widths: dict = field(default_factory=dict)   # input -> its contraction/column width
    transposed: int = 0   # sums over the rows: a [2, 64, B_L] buffer of Xᵀ each

    @property
    def default_key_block(self) -> int:
        return self.key_blocks[0] if self.key_blocks else 64  # (not offered: as measured)

    @property
    def descs(self) -> tuple[str, ...]:
        return (tuple(f"r{k}_desc" for k in range(len(self.resident)))
                + tuple(f"s{k}_desc" for k in range(len(self.streams))))

    def tiles(self, key_block: int) -> list[tuple[str, int, int]]:
        return ([(r, ROWS, self.in_widths[r]) for r in self.resident]
                + [(s, key_block, self.in_widths[s]) for s in self.streams])

    def ring_bytes(self, key_block: int, stages: int) -> int:
        rows = sum(CTA_ROWS * self.in_widths[r] for r in self.resident)
        ring = sum(stages * key_block * self.in_widths[s] for s in self.streams)
        return 2 * (rows + ring + self.transposed * CTA_ROWS * key_block)  # 16-bit tiles

    def rings(self, key_block: int) -> tuple[int, ...]:
        return (2,)  # the depth measured; each Gluon config costs seconds of cold compile


class SumsEmitter(GluonEmitter):
    """Takes over the pass's contractions: whole-axis ones of a resident and a streamed
    load become named wgmma results the skeleton issues at the block's start; loop-axis
    ones become placeholders ``ACC<n>`` that the skeleton turns into a wgmma accumulating
    into the fold's state."""

    def __init__(self, plan: TilePlan, name: str, col: str):
        super().__init__(plan, name, col)
        self.first: list[tuple[str, str, str]] = []   # (result, resident, streamed)
        self.acc: list[tuple[str, str]] = []          # (operand var, streamed input)
        self.loads: dict[str, Term] = {}              # input -> its one load (signature)
        self.scattered: list[str] = []                # resident input of each sum over rows
        self.frag_scattered: list[str] = []           # ... in the body being emitted
        # a sum over the rows 128 wide: the two warpgroups split its columns
        self.split = plan.whole_axes.get(col, 0) == 128

    def _role(self, load: Term) -> str:
        """'resident' (over the row block and a whole axis), 'streamed' (the loop axis and
        a whole axis), else raise; each input is always loaded at the same place."""
        axes = set(self.load_axes(load))
        wide = axes & set(self.plan.whole_axes)
        role = ("resident" if axes - wide == {self.plan.block_axis} else
                "streamed" if axes - wide == {LOOP} else None)
        if role is None or len(wide) != 1 or len(load.args) < 2:
            raise LoweringError(f"A load of {load.val} the skeleton cannot stream or keep "
                                "resident.")
        sig = self._load_signature(load)
        seen = self.loads.setdefault(load.val, load)
        if self._load_signature(seen) != sig:
            raise LoweringError(f"{load.val} is loaded at two places in one block.")
        return role

    def _tile_times_load(self, a: Term, b: Term, role: str, what: str) -> tuple[Term, Tile]:
        """(the load, the (row, loop) tile) of a product of the two, the load's input in
        ``role``; else raise, naming the product as ``what``."""
        load, other = (b, a) if b.op == "load" else (a, b)
        if load.op != "load" or self._role(load) != role:
            raise LoweringError(f"{what} without a {role} right side.")
        x = self.f32(self.expr(other))
        if self.canon(x.axes) != (self.plan.block_axis, LOOP):
            raise LoweringError(f"{what} whose left side is not a (row, loop) tile.")
        return load, x

    def _try_dot(self, t: Term, kaxis: str, scope: int):
        a, b = t.args
        if kaxis in self.plan.whole_axes and a.op == "load" and b.op == "load":
            roles = {self._role(a): a, self._role(b): b}
            if set(roles) != {"resident", "streamed"}:
                raise LoweringError("A whole-axis contraction not of a resident and a "
                                    "streamed input.")
            key = (roles["resident"].val, roles["streamed"].val)
            for res, r, s in self.first:
                if (r, s) == key:
                    return Tile(res, self.canon((self.plan.block_axis, LOOP)), "f32")
            res = f"mma{len(self.first)}"
            self.first.append((res, *key))
            return Tile(res, self.canon((self.plan.block_axis, LOOP)), "f32")
        if kaxis == LOOP:
            load, x = self._tile_times_load(a, b, "streamed", "A loop-axis contraction")
            col = next(x for x in self.load_axes(load) if x != LOOP)
            if col != self.col:
                raise LoweringError("A sum whose columns are not the pass's column axis.")
            n = len(self.acc)
            masked = f"tl.where(mask_{LOOP}[None, :], {x.code}, 0.0)"
            self.emit(f"op{n} = tl.convert_layout(({masked}).to(DTYPE), P_LAYOUT)")
            self.acc.append((f"op{n}", load.val))
            return Tile(f"ACC{n}", self.canon((self.plan.block_axis, col)), "f32")
        if kaxis == self.plan.block_axis:
            # a scattered output's block term Σ_{rows} X[row, L]·a[row, w] (dQ = dS·K):
            # Xᵀ goes through shared memory (the wgmma's left operand, read transposed),
            # ``a``'s resident rows are the right one; the result is added atomically
            load, x = self._tile_times_load(a, b, "resident", "A sum over the rows")
            w = next(x for x in self.load_axes(load) if x != self.plan.block_axis)
            if self.plan.whole_axes[w] != self.plan.whole_axes[self.col]:
                raise LoweringError("A scattered output narrower or wider than the sums.")
            n = len(self.frag_scattered)  # its buffer: the n-th of this block's body
            self.frag_scattered.append(load.val)
            if n == len(self.scattered):
                self.scattered.append(load.val)
            if self.split:  # the other warpgroup has read the last block's tile
                self.emit(f"mbarrier.wait(tfree{n}, (g & 1) ^ 1)")
            self.emit(f"tbuf{n}.index(WHICH).store(tl.where(mask_{self.plan.block_axis}[:, None], "
                      f"{x.code}, 0.0).to(DTYPE))")
            self.emit("fence_async_shared()")
            if not self.split:  # this warpgroup's rows, every column
                self.emit(f"sc{n} = warpgroup_mma(tbuf{n}.index(WHICH).permute((1, 0)), "
                          f"__rows0_{load.val}__, zero_h, use_acc=False, is_async=True)")
                return Tile(f"sc{n}", self.canon((LOOP, w)), "f32")
            # FlashAttention-3's layout: both warpgroups' rows, this warpgroup's half of the
            # columns (a 64×64 accumulator, not 64×128), once both halves of Xᵀ are in
            self.emit(f"mbarrier.arrive(tfull{n}, count=1)")
            self.emit(f"mbarrier.wait(tfull{n}, g & 1)")
            for h in (0, 1):
                acc = "zero_h, use_acc=False" if h == 0 else f"sc{n}"
                self.emit(f"sc{n} = warpgroup_mma(tbuf{n}.index({h}).permute((1, 0)), "
                          f"__rows{h}_{load.val}__, {acc}, is_async=True)")
            return Tile(f"sc{n}", self.canon((LOOP, w)), "f32")
        raise LoweringError("A contraction the sums skeleton does not issue as a wgmma.")

    def bcast(self, t: Tile, axes: tuple[str, ...]) -> str:
        # a scattered output's tile (loop axis, whole axis) is a wgmma accumulator over the
        # loop's rows: its offsets and masks take that layout's row and column slices
        if len(axes) == 2 and axes[0] == LOOP and self.plan.block_axis not in axes and len(t.axes) == 1:
            (a,) = t.axes
            if a == LOOP:
                return f"tl.convert_layout({t.code}, H_ROWS)[:, None]"
            if not self.split:
                return f"tl.convert_layout({t.code}, H_COLS)[None, :]"
            half = self.plan.whole_axes[a] // 2  # this warpgroup's half of the columns
            cols = f"(WHICH * {half} + tl.arange(0, {half}, H_COLS))"
            if t.code == f"offs_{a}":
                return f"{cols}[None, :]"
            if t.code == f"mask_{a}":
                return f"({cols} < {self.p.extents[a]})[None, :]"
            raise LoweringError("A scattered output's column term other than its offsets.")
        return super().bcast(t, axes)


def _scheduled_body(lines: list[str], em: SumsEmitter, folds: set[str], bufs: dict) -> list[str]:
    """A block's fragment with the wgmma issue and waits: each fold's ``X_new = X + ACCn``
    becomes ``X = warpgroup_mma(opn, <ring slot>, X)`` (async), its ``X = X_new`` goes, and
    before the first line reading a result still in flight the consumer waits for it
    (and everything issued before it: wgmma groups complete in order)."""
    pending = [res for res, _, _ in em.first]
    out: list[str] = []
    issued = set()
    for ln in lines:
        m = re.match(r"(\s*)(\w+)_new = (\2) \+ ACC(\d+)$", ln)
        if m and m.group(2) in folds:
            pad, f, n = m.group(1), m.group(2), int(m.group(4))
            op, stream = em.acc[n]
            out.append(f"{pad}{f} = warpgroup_mma({op}, {bufs[stream]}.index(st), {f}, "
                       "is_async=True)")
            pending.append(f)
            issued.add(f)
            continue
        m = re.match(r"\s*(sc\d+) = warpgroup_mma\(", ln)
        if m:  # a scattered output's product(s): in flight until its atomic add reads it
            out.append(ln)
            if m.group(1) not in pending:
                pending.append(m.group(1))
            continue
        m = re.match(r"\s*(\w+) = (\w+)_new$", ln)
        if m and m.group(1) == m.group(2) and m.group(1) in issued:
            continue
        if re.search(r"\bACC\d+\b", ln) or any(re.search(rf"\b{f}_new\b", ln) for f in issued):
            raise LoweringError("A sum's block term is used other than added to its state.")
        used = [k for k, name in enumerate(pending) if re.search(rf"\b{name}\b", ln)]
        if used:
            done, pending = pending[:used[-1] + 1], pending[used[-1] + 1:]
            out.append(_wait(ln[:len(ln) - len(ln.lstrip())], done, len(pending)))
        out.append(ln)
    if issued != folds:
        raise LoweringError("A sum of the pass is not a loop-axis contraction.")
    pad = "        "
    if pending:
        out.append(_wait(pad, pending, 0))
    out += [f"{pad}mbarrier.arrive(empty{k}.index(st), count=1)" for k in range(len(bufs))]
    if em.split:  # this warpgroup is done with both halves of each Xᵀ tile
        out += [f"{pad}mbarrier.arrive(tfree{k}, count=1)" for k in range(len(em.frag_scattered))]
    return out


def _hoisted_loads(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the block's loads of its key positions' row vectors -- the lse, the row dots --
    with the offsets and mask they read, the rest): issued before the ring waits, their
    latency hides behind the wait and the products instead of stalling the exps that
    read them (H100, dK/dV plain S=8192: 3.89 -> 3.40 ms).  A load reading anything the
    block computes stays where it is."""
    fixed = (f"offs_{LOOP} = ", f"mask_{LOOP} = ")
    made: set[str] = set()
    hoisted, rest = [], []
    for ln in lines:
        s = ln.strip()
        m = re.match(r"(\w+) = tl\.load\((.*)\)$", s)
        reads = set(re.findall(r"\b[A-Za-z_]\w*\b", m.group(2))) if m else set()
        if s.startswith(fixed) or (m and not reads & made):
            hoisted.append(ln)
            continue
        rest.append(ln)
        lhs = re.match(r"\s*(\w+(?:\s*,\s*\w+)*)\s*=(?!=)", ln)
        if lhs:
            made.update(n.strip() for n in lhs.group(1).split(","))
    return hoisted, rest


def _wait(pad: str, names: list[str], outstanding: int) -> str:
    """Wait until at most ``outstanding`` wgmma groups are in flight; ``names`` (the
    results now complete) pass through the wait, as Gluon requires before they are read."""
    lhs = names[0] if len(names) == 1 else ", ".join(names)
    return (f"{pad}{lhs} = warpgroup_mma_wait({outstanding}, deps=({', '.join(names)}, ))")


def generate(plan: TilePlan, name: str = "neptune_ws") -> GluonSumsForm:
    """The Gluon module for ``plan``, or ``LoweringError`` when it is out of scope."""
    check_scope(plan, scattered_ok=True)
    ps = plan.passes[0]
    p = plan.program
    ba = plan.block_axis
    atoms = data_atoms(plan, ps)  # a mask's atoms over captured tensors (document ids)
    data = bool(atoms)
    if not ps.folds or any(f.op != "sum" for f in ps.folds):
        raise LoweringError("The sums skeleton takes a pass of plain sums only.")
    cols = {a for f in ps.folds for a in f.state_axes if a in plan.whole_axes}
    if len(cols) != 1 or any(len(f.state_axes) != len(plan.grid_axes) + 2 for f in ps.folds):
        raise LoweringError("The sums skeleton takes sums over (rows, one column axis).")
    (col,) = cols
    em = SumsEmitter(plan, name, col)

    consumer_axes(em)
    em.push("    ")
    for f in ps.folds:
        em.emit(f"{f.name} = gl.full([{ROWS}, {plan.whole_axes[col]}], {init_fill(f.op)}, "
                "gl.float32, O_LAYOUT)")
        em.states[f.name] = Tile(f.name, em.canon((ba, col)), "f32")
    prologue_tail = em.pop()

    def fragment(known: frozenset, whole: bool = False) -> list[str]:
        em.frag_scattered = []  # (the edge and interior bodies reuse the Xᵀ buffers)
        return block_fragment(em, known, whole)

    body_edge = fragment(frozenset())
    known_in = ps.bound_atoms | frozenset(atoms)
    body_in = fragment(known_in, whole=True)
    body_ew = fragment(frozenset(), whole=True)  # edge blocks inside the key extent
    if not em.first or not em.acc:
        raise LoweringError("The pass has no products for the sums skeleton.")
    resident = tuple(dict.fromkeys([r for _, r, _ in em.first] + em.scattered))
    streams = tuple(dict.fromkeys([s for _, _, s in em.first] + [s for _, s in em.acc]))
    dts = {p.dtype_of(t) for t in resident + streams}
    if len(dts) != 1 or not dts <= {"float16", "bfloat16"}:
        raise LoweringError(f"The inputs {resident + streams} must share one 16-bit dtype, "
                            f"got {sorted(dts)}.")
    widths = {}
    for t in resident + streams:
        (w,) = [a for a in em.load_axes(em.loads[t]) if a in plan.whole_axes]
        widths[t] = plan.whole_axes[w]
    bufs = {s: f"ring{k}" for k, s in enumerate(streams)}
    folds = {f.name for f in ps.folds}

    row_tile = {r: f"rows{k}.index(WHICH)" for k, r in enumerate(resident)}

    def rows_of(name: str, h: int) -> str:
        """The resident rows a sum over the rows reads: this warpgroup's, or (columns
        split) warpgroup ``h``'s rows at this warpgroup's half of the columns."""
        if not em.split:
            return row_tile[name]
        half = widths[name] // 2
        return f"rows{resident.index(name)}.index({h}).slice(WHICH * {half}, {half}, dim=1)"

    issue = [f"mbarrier.wait(ready{k}.index(st), ph)" for k in range(len(streams))]
    issue += [f"{res} = warpgroup_mma({row_tile[r]}, {bufs[s]}.index(st).permute((1, 0)), "
              "zero_s, use_acc=False, is_async=True)" for res, r, s in em.first]

    def with_wait(lines: list[str], _wait: bool) -> list[str]:
        """A block: its row-vector loads, the ring waits and first products, the math."""
        lines = [re.sub(r"__rows(\d)_(\w+)__", lambda m: rows_of(m.group(2), int(m.group(1))), ln)
                 for ln in lines]
        early, rest = _hoisted_loads(lines)
        return [*early, *["        " + ln for ln in issue], *_scheduled_body(rest, em, folds, bufs)]

    em.push("    ")
    epilogue(em)
    epi = em.pop()
    prologue = em.pop()

    rng = gl_main(key_range(plan, name, data))
    em.push("    ")
    bases = {t: _row_base(em, em.loads[t]) for t in resident + streams}
    base_lines = [*_gl(em.pop()),
                  *[f"    rbase{k} = {bases[r]} + row_first" for k, r in enumerate(resident)],
                  *[f"    sbase{k} = {bases[s]}" for k, s in enumerate(streams)]]
    mode = walk_mode(ps, data, bool(em.scattered))
    persistent, scheduled = mode != "single", mode == "scheduled"
    if persistent:
        place = persistent_place(plan)
    else:
        # the rows that see the most blocks go first: the last row blocks under a range
        # bounded above (j < i + hi), the first under one bounded below (j >= i + lo)
        first_heavy = ps.lo_offset is not None and ps.hi_offset is None
        place = [("    row_block = gl.program_id(0)" if first_heavy else
                  "    row_block = gl.num_programs(0) - 1 - gl.program_id(0)")
                 + "  # long rows first",
                 "    pid_grid = gl.program_id(1)",
                 *["    " + ln for ln in _gl(grid_decode(plan))],
                 *["    " + ln for ln in rng], *base_lines]

    tensors = [ph.name for ph in p.inputs] + list(p.outputs)
    strides = [f"{t}_s{k}" for t in tensors for k in range(len(p.shape_of(t)))]
    for sp in summary_specs(plan):  # the data mask's per-call summaries, as the tl form's
        tensors.append(sp.name)
        strides += [f"{sp.name}_s{k}" for k in range(sp.rank(p))]
    if scheduled:  # [first entry of each program (programs + 1)..., tile ids...]
        tensors.append("tile_order")
        strides.append("tile_order_s0")
    sizes = [f"n_{s}" for s in p.meta.get("size_params", ())]
    args = [f"{t}_ptr" for t in tensors] + strides + sizes
    nr, ns = len(resident), len(streams)
    rdescs = [f"r{k}_desc" for k in range(nr)]
    sdescs = [f"s{k}_desc" for k in range(ns)]
    rows = [f"rows{k}" for k in range(nr)]
    rings = [f"ring{k}" for k in range(ns)]
    bars = ["rows_bar"] + [f"{b}{k}" for k in range(ns) for b in ("ready", "empty")]
    bars += ["rows_empty"] if persistent else []  # the consumers release a tile's rows
    tbufs = [f"tbuf{k}" for k in range(len(em.scattered))]  # Xᵀ of each sum over the rows
    tbars = [f"{b}{k}" for k in range(len(tbufs)) for b in ("tfull", "tfree")] if em.split else []
    hw = plan.whole_axes[col] // (2 if em.split else 1)
    dm = ["dm_lo", "dm_hi"] if data else []  # the keys every row sees whole (data mask)
    # a walk places each tile itself; one program per tile is told its place
    tiles = ["num_tiles", "n_rb"] if persistent else ["j_lo", "n_blocks"]
    tile_args = "" if persistent else "row_block, pid_grid, "
    shared = ", ".join([*rows, *rings, *tbufs, *tbars, *bars, *tiles, *dm, *args])
    producer_args = ", ".join([*rdescs, *sdescs, *rows, *rings, *bars, *(
        [*tiles, *args] if persistent else
        [*[f"rbase{k}" for k in range(nr)], *[f"sbase{k}" for k in range(ns)], *tiles])])
    row_bytes = " + ".join(f"{d}.block_type.nbytes" for d in rdescs)
    # (a persistent walk loads a tile's rows once the consumers are done with the last
    # tile's; its ring positions run on across tiles from ``base``)
    producer = (["    mbarrier.wait(rows_empty, (it & 1) ^ 1)"] if persistent else []) + [
        f"    mbarrier.expect(rows_bar, 2 * ({row_bytes}))"]
    for k in range(nr):
        producer += [f"    tma_load(r{k}_desc, [rbase{k}, 0], rows_bar, rows{k}.index(0))",
                     f"    tma_load(r{k}_desc, [rbase{k} + {ROWS}, 0], rows_bar, rows{k}.index(1))"]
    producer += ["    for jb in range(n_blocks):",
                 "        s = (base + jb) % STAGES",
                 "        ph = ((base + jb) // STAGES) & 1"]
    for k in range(ns):
        producer += [f"        mbarrier.wait(empty{k}.index(s), ph ^ 1)",
                     f"        mbarrier.expect(ready{k}.index(s), s{k}_desc.block_type.nbytes)",
                     f"        tma_load(s{k}_desc, [sbase{k} + j_lo + jb * B_L, 0], ready{k}.index(s), "
                     f"ring{k}.index(s))"]
    loops = interior_loops(ps, body_edge, body_in, body_ew, [], with_wait, data, first=0)
    consumer = [
        "    # one warpgroup: 64 rows, its own wgmma issue, the block math between products",
        "    STAGES: gl.constexpr = ring0.type.shape[0]",
        "    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], "
        "warps_per_cta=[4, 1], instr_shape=[16, B_L, 16])",
        "    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)",
        "    S_COLS: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)",
        "    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], "
        f"warps_per_cta=[4, 1], instr_shape=[16, {plan.whole_axes[col]}, 16])",
        "    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)",
        "    O_COLS: gl.constexpr = gl.SliceLayout(0, O_LAYOUT)",
        "    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)",
        "    cols = gl.arange(0, B_L, S_COLS)",
        f"    zero_s = gl.zeros([{ROWS}, B_L], gl.float32, S_LAYOUT)",
        # a sum over the rows: its accumulator, this warpgroup's columns (all, or half)
        "    H_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], "
        f"warps_per_cta=[4, 1], instr_shape=[16, {hw}, 16])",
        "    H_ROWS: gl.constexpr = gl.SliceLayout(1, H_LAYOUT)",
        "    H_COLS: gl.constexpr = gl.SliceLayout(0, H_LAYOUT)",
        f"    zero_h = gl.zeros([{ROWS}, {hw}], gl.float32, H_LAYOUT)"]
    per_tile = [
        f"    my_first = row_block * {CTA_ROWS} + WHICH * {ROWS}",
        *_gl(prologue), *_gl(prologue_tail),
        "    mbarrier.wait(rows_bar, it & 1)",
        *_gl(loops),
        *(["    mbarrier.arrive(rows_empty, count=1)  # the rows are read: the next tile's "
           "may load"] if persistent else []),
        *_gl(epi)]
    tile = tile_lines(mode, rng)
    src = [
        *source_header("lowering/gluon_sums.py", p, ", fence_async_shared"),
        "", "",
        "@gluon.jit",
        f"def _producer({producer_args}, B_L: gl.constexpr):",
        "    # one warp: each tile's resident rows, then each streamed block through its ring",
        "    STAGES: gl.constexpr = ring0.type.shape[0]",
        *walk(mode, "producer", producer, [*tile, *_gl(grid_decode(plan)),
                                            *[ln[4:] for ln in base_lines]]),
        "", "",
        "@gluon.jit",
        f"def _consumer({shared}, {tile_args}WHICH: gl.constexpr, B_L: gl.constexpr, "
        "DTYPE: gl.constexpr, EVEN_L: gl.constexpr):",
        *consumer,
        *walk(mode, "consumer", per_tile, tile),
        "", "",
        "@gluon.jit",
        f"def {name}({', '.join(rdescs + sdescs + args)}, B_L: gl.constexpr, "
        "STAGES: gl.constexpr, EVEN_L: gl.constexpr):",
        "    DTYPE: gl.constexpr = r0_desc.dtype",
        "    R1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])",
        *place,
        *[f"    rows{k} = gl.allocate_shared_memory(DTYPE, [2, {ROWS}, r{k}_desc.block_type.shape[1]], "
          f"r{k}_desc.layout)" for k in range(nr)],
        *[f"    ring{k} = gl.allocate_shared_memory(DTYPE, [STAGES, B_L, s{k}_desc.block_type.shape[1]], "
          f"s{k}_desc.layout)" for k in range(ns)],
        *[f"    tbuf{k} = gl.allocate_shared_memory(DTYPE, [2, {ROWS}, B_L], gl.NVMMASharedLayout("
          "swizzle_byte_width=128, element_bitwidth=16, rank=2))" for k in range(len(tbufs))],
        "    rows_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())",
        "    mbarrier.init(rows_bar, count=1)",
        *[ln for b in tbars for ln in (
            f"    {b} = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())",
            f"    mbarrier.init({b}, count=2)  # both consumer warpgroups")],
        *(["    rows_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())",
           "    mbarrier.init(rows_empty, count=2)  # both consumers release the rows"]
          if persistent else []),
        *[f"    {b}{k} = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())"
          for k in range(ns) for b in ("ready", "empty")],
        "    for i in gl.static_range(STAGES):",
        *[ln for k in range(ns) for ln in (
            f"        mbarrier.init(ready{k}.index(i), count=1)",
            f"        mbarrier.init(empty{k}.index(i), count=2)  # both consumers read every block")],
        "    gl.warp_specialize([",
        *[f"        (_consumer, ({shared}, {tile_args}{w}, B_L, DTYPE, EVEN_L)),"
          for w in (0, 1)],
        f"        (_producer, ({producer_args}, B_L)),",
        # 240 registers per consumer thread (was 232): fewer spills of the two 64×128 sums
        # and two 64×B_L tiles (ptxas); 2·4·240 + 24 warps' worth still fits 64K
        "    ], [4, 1], [240, 24])",
    ]
    # What the timer is offered (H100, bf16 B=2 H=16 D=128, against the tl forms in one
    # process; bench/results/gluon_backward_s21/validate_and_time_h100.json): with the
    # row-vector loads hoisted, the dK/dV pass wins plain S=8192 (3.35 vs 3.82 ms) and
    # causal (1.91 vs 2.10) and loses softcap (3.07 vs 2.76: the tanh's registers); dQ's
    # own kernel (one pass of sums once a row kernel computes its row dots) wins all
    # three (2.37 vs 2.66, 1.30 vs 1.50, 1.56 vs 2.11), so both are timed, at
    # 64-row key blocks (two 64×64 score tiles and two 64×128 sums per warpgroup fill its
    # registers; 128 only at width 64).  With dQ added atomically it stays slower than
    # the tl fused form: per warpgroup over its own 64 keys 1.6x (plain S=8192 10.2 vs
    # 6.5 ms: a third 64×128 accumulator spills), with the columns split between the
    # warpgroups 1.3x (8.4 vs 6.5; causal 4.6 vs 3.5; fused_split_columns_h100.json).
    # The atomic adds are the cost: without them the pass takes 4.4 ms, and wider adds
    # (4 contiguous fp32 per thread, or one red.v4 per 4) still took 7.4-7.6
    # (bench/gluon_probe/backward_variants.py, session 21); the bulk engine's reduce that
    # FlashAttention-3 uses is not in Triton 3.6's Gluon.  Its other half -- the adds
    # moved off the consumers into a worker partition reading dQ's tile from shared
    # memory -- was slower still on an H200 (session 33, S=8192 causal / plain: 4.8 /
    # 10.0 ms against 3.2 / 5.9 for the two kernels; the hand-off alone, adds dropped,
    # 3.6 / 6.9).  Built and checked, not offered.
    key_blocks = () if tbufs else (64, 128) if max(widths.values()) <= 64 else (64,)
    return GluonSumsForm(name, "\n".join(src) + "\n", resident + streams,
                         (widths[resident[0]], plan.whole_axes[col]), dts.pop(),
                         [f"{t}_ptr" for t in tensors], persistent, key_blocks, scheduled,
                         (ps.lo_offset, ps.hi_offset), resident=resident, streams=streams,
                         in_widths=widths, transposed=len(tbufs))

"""Kernel generation: a tile plan -> one Triton module (one or two ``@triton.jit`` kernels).

* A plan without split-k becomes **one kernel**: a prologue (program ids, row offsets,
  hoisted invariants), one loop per pass updating every fold of the pass per block, and
  an epilogue that stores the outputs.
* A plan whose pass holds a ``splitk`` fold becomes **two kernels**, derived from the
  same fold terms (nothing attention-specific):
  ``<name>_partial`` runs the pass loop over one chunk of the reduced axis per program
  (grid axis 2 = chunk) and stores every fold's state to an fp32 scratch buffer;
  ``<name>_combine`` folds the partials, a tile of them a step, in producer order --
  ``max``/``min``/``sum`` states by their own operator, rolling states by
  ``t' = t ⊙ h(R→R') ⊕_p t_p ⊙ h(prev := R_p, run := R')`` with the correction ``h`` the
  rules derived (Neptune Thm 4.4) -- then runs the epilogue (the partials' storage and
  the fold of them: ``split_combine``); ``<name>_fused`` does both in one launch.
  For attention this *is* FlashDecoding; for a plain ``sum`` the correction is 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import descriptors, gluon_sums, gluon_ws
from .codegen import ECOL, LOOP, SPLIT, VDOT_FLAG, Emitter, Tile, grid_decode, init_fill
from .block_ranges import ONE_LOOP_FLAG, data_ranges, range_loops
from .block_skip import data_atoms, data_loop_bounds, emit_block_test, summary_specs
from .fold_body import epilogue, loop_body
from .data_indices import checked_ids
from .dependent_launch import PDL_FLAG, release_first, wait_before_reads
from .summary_kernel import prepass_source
from .split_combine import combine_partials, grid_size, renamed_locals, store_partials
from .split_plan import combine_min_rows
from .split_share import shared_split_loops
from .saturated_index import far_sides
from .lower import Fold, LoweringError, TilePlan, combine_width_axis
from ..ir import Term
from ..sizes import value

# (constexprs) the main key loop covers every block, the ragged last one included: the
# extent is a multiple of the block, or the loop is warp-specialised ...
WHOLE_ALL = f"EVEN_{LOOP} or {descriptors.WS_FLAG}"
# ... and its blocks all lie inside the extent: a multiple, or the ragged one split off
WHOLE_ONLY = f"EVEN_{LOOP} or not {descriptors.WS_FLAG}"


@dataclass
class KernelSource:
    """The generated module and how to launch its kernels."""
    name: str
    source: str
    params: list[str]                 # tensor pointer parameters, in call order
    stride_params: list[tuple[str, int]]
    tunables: dict[str, int]          # constexpr block sizes with defaults
    grid_axes: tuple[str, ...]
    block_axis: str
    even_flags: dict = field(default_factory=dict)  # flag -> (block param, extents it divides)
    row_extent: int = 1               # rows along the blocked axis (x group when packed)
    grid_size: int = 1                # programs along grid axis 1
    split_extent: int = 0             # >0: split-k over this many elements of the loop axis
    scratch: dict[str, int] = field(default_factory=dict)  # buffer -> fp32 elements per row
    combine_width: tuple[str, int] | None = None  # (axis, padded extent) the combine splits
    size_params: list[str] = field(default_factory=list)  # symbolic sizes, runtime ints n_<S>
    summaries: list = field(default_factory=list)  # block_predicate.SummarySpec, built per call
    descriptors: dict = field(default_factory=dict)  # tensor -> row dims of its TMA tiles
    warp_specializable: tuple = ()  # warp counts for warp-specialised configs
    prepass: object = None            # summary_kernel.Prepass: the one launch that builds them
    scattered: tuple = ()             # outputs added into atomically: zeroed before a launch
    gluon: object = None              # gluon_form.GluonForm: the warp-specialised form, if any
    gluon_why: str = ""               # ... else why the plan has none
    vector_dot: bool = False          # its contractions have a CUDA-core form (codegen.VDOT)
    one_loop: bool = False            # its data-mask key range has a one-loop form (ONE_LOOP)
    # >0: the two-launch combine does a row's work beyond folding partials and may take
    # as few rows a program as this, not a row block (``split_plan.combine_min_rows``)
    combine_min_rows: int = 0
    waits_first: bool = False         # a call's first of 2+ launches waits first thing

    def concrete(self, values: dict[str, int]) -> "KernelSource":
        """This kernel's launch facts at the given sizes (row count, grid, split extent and
        the extents EVEN_* flags test are expressions of the symbolic sizes)."""
        if not self.size_params:
            return self
        return replace(self, row_extent=value(self.row_extent, values),
                       grid_size=value(self.grid_size, values),
                       split_extent=value(self.split_extent, values),
                       even_flags={k: (b, [value(n, values) for n in ns])
                                   for k, (b, ns) in self.even_flags.items()})

    @property
    def kernel_names(self) -> list[str]:
        """Every kernel of the module; a split-k module holds both ways to run it: partial +
        combine (two launches), or ``_fused`` (one launch, see ``_fused_combine``)."""
        pre = [self.prepass.kernel] if self.prepass else []  # last: launchers index the others
        if not self.split_extent:
            return [self.name] + pre
        return [f"{self.name}_partial", f"{self.name}_combine", f"{self.name}_fused"] + pre

    def launched(self, fused: bool) -> list[str]:
        """The kernels one call runs, in order (split-k: partial + combine, or ``_fused``)."""
        pre = [self.prepass.kernel] if self.prepass else []  # the summaries come first
        names = self.kernel_names[:len(self.kernel_names) - len(pre)]
        if not self.split_extent:
            return pre + names
        return pre + (names[2:] if fused else names[:2])


def _init(em: Emitter, f: Fold, axes) -> str:
    return f"tl.full({em.shape(axes)}, {init_fill(f.op)}, tl.float32)"


def _prologue(em: Emitter, split_axis: bool, width_axis: str | None = None,
              indent: str = "    ") -> None:
    plan, p = em.plan, em.p
    em.push(indent)  # scope 0: axis set-up and hoisted loop invariants
    em.emit("pid_block = tl.program_id(0)")
    em.emit("pid_grid = tl.program_id(1)")
    if split_axis:
        em.emit("pid_split = tl.program_id(2)")
    if width_axis:
        em.emit("pid_width = tl.program_id(2)")
    for line in grid_decode(plan):
        em.emit(line)
    for a in plan.grid_axes:
        em.env[a] = f"ax_{a}"
    ba = plan.block_axis
    em.env[ba] = ba
    blk = em.block(ba)  # a combine's own row tile may be smaller (``combine_min_rows``)
    em.emit(f"offs_{ba} = pid_block * {blk} + tl.arange(0, {blk})")
    # (EVEN_x, constexpr: the extent is a multiple of the block; the mask folds away)
    em.emit(f"mask_{ba} = (offs_{ba} < {plan.row_extent}) | EVEN_{ba}")
    if not plan.packed:
        em.ranges[ba] = (f"pid_block * {blk}", f"{plan.row_extent}")
        em.aranges[ba] = (f"pid_block * {blk}", f"tl.arange(0, {blk})")
    if plan.packed:  # row r of the block is head (y % G) = r // S, query i = r % S
        y, g = plan.packed
        s = p.extents[ba]
        em.emit(f"rows_{y} = offs_{ba} // {s}")
        em.emit(f"rows_{ba} = offs_{ba} % {s}")
        em.env[f"{y}%"] = Tile(f"rows_{y}", (ba,), "int")
        em.env[y] = Tile(f"(ax_{y} * {g} + rows_{y})", (ba,), "int")
        em.env[ba] = Tile(f"rows_{ba}", (ba,), "int")
        em.emit("row_first = 0")
        em.emit(f"row_last = {s - 1}")
    else:
        em.emit(f"row_first = pid_block * {blk}")
        em.emit(f"row_last = pid_block * {blk} + {blk} - 1")
    for a in plan.whole_axes:
        em.env.setdefault(a, a)
        if a in plan.chunked:  # offsets set per chunk by the inner loop (codegen)
            continue
        if a == width_axis:  # the combine spreads this axis over programs (grid axis 2)
            em.emit(f"offs_{a} = pid_width * B_{a} + tl.arange(0, B_{a})")
            em.emit(f"mask_{a} = offs_{a} < {p.extents[a]}")
            em.ranges[a] = (f"pid_width * B_{a}", f"{p.extents[a]}")
            continue
        em.emit(f"offs_{a} = tl.arange(0, B_{a})")
        em.ranges[a] = ("0", f"{p.extents[a]}")
        full = " | True" if p.extents[a] == plan.whole_axes[a] else ""
        em.emit(f"mask_{a} = (offs_{a} < {p.extents[a]}){full}")
    em.push(indent)  # scope 1: the passes and the epilogue


def _init_states(em: Emitter) -> None:
    for f in (f for ps in em.plan.passes for f in ps.folds):
        axes = em.canon(a for a in f.state_axes if a not in em.plan.grid_axes)
        em.emit(f"{f.name} = {_init(em, f, axes)}")
        em.states[f.name] = Tile(f.name, axes, "f32")


def _pass_loop(em: Emitter, k: int, split: bool) -> None:
    """The loops of pass ``k``: every fold of the pass updated once per block of keys.

    With an affine mask the visible range becomes the loop bounds, and the range is cut
    where blocks stop straddling the mask: blocks fully inside run a body with the mask
    atoms dropped; only the boundary blocks evaluate them."""
    plan = em.plan
    ps = plan.passes[k]
    em.emit(f"# pass {k + 1}: {', '.join(f'{f.name} ({f.op})' for f in ps.folds)}")
    lo, hi = "0", str(ps.extent)
    if ps.lo_offset is not None:  # affine mask -> first visible block of this row block
        em.emit(f"j_lo{k} = tl.maximum(row_first + ({ps.lo_offset}), 0)")
        em.emit(f"j_lo{k} = (j_lo{k} // B_{LOOP}) * B_{LOOP}")
        lo = f"j_lo{k}"
    if ps.hi_offset is not None:  # ... and one past the last visible key
        em.emit(f"j_hi{k} = tl.minimum(row_last + ({ps.hi_offset}), {ps.extent})")
        hi = f"j_hi{k}"
    if split and shared_split_loops(em, k, lo, hi, _loop):  # a decode's: visible keys shared
        return
    rng = data_ranges(em, ps, k, split)  # data atoms as key ranges: no per-block test
    if rng is not None:
        range_loops(em, k, lo, hi, split, rng, _loop, lambda: _tested_loops(em, k, lo, hi, split))
        return
    dlo, dhi = data_loop_bounds(em, ps, k, split)  # monotone data (sorted ids): one key range
    if dlo is not None:
        em.emit(f"j_lo{k}d = tl.maximum({lo}, {dlo})")
        lo = f"j_lo{k}d"
    if dhi is not None:
        em.emit(f"j_hi{k}d = tl.maximum(tl.minimum({hi}, {dhi}), {lo})")
        hi = f"j_hi{k}d"
    _tested_loops(em, k, lo, hi, split)


def _tested_loops(em: Emitter, k: int, lo: str, hi: str, split: bool) -> None:
    """Loops over [lo, hi) cut by the affine mask's interior; a data mask is tested per
    key block inside them (``_loop``)."""
    ps = em.plan.passes[k]
    if split:  # this program's chunk (CHUNK is a multiple of B_L)
        em.emit(f"j_lo{k}s = tl.maximum({lo}, pid_split * CHUNK)")
        em.emit(f"j_hi{k}s = tl.minimum({hi}, pid_split * CHUNK + CHUNK)")
        lo, hi = f"j_lo{k}s", f"j_hi{k}s"
    # Key blocks inside the extent run without its mask: with an extent off the block
    # size (S = 3000) only the last block keeps it (``_ragged_tail``).  Not where the main
    # loop is warp-specialised (WS): a loop beside it fails to compile (``descriptors``),
    # so it keeps the mask on every block.
    whole = f"j_wh{k}"
    em.emit(f"{whole} = {hi} if ({WHOLE_ALL}) else tl.maximum(tl.minimum({hi}, "
            f"({ps.extent} // B_{LOOP}) * B_{LOOP}), {lo})")
    if not ps.bound_atoms:
        _main_loops(em, k, lo, whole, frozenset())
        _ragged_tail(em, k, whole, hi)
        return
    # interior: keys visible to every row of the block, aligned to whole key blocks
    a, b = lo, hi
    if ps.lo_offset is not None:
        em.emit(f"j_in_lo{k} = tl.minimum(tl.maximum(((row_last + ({ps.lo_offset}) + B_{LOOP} - 1) "
                f"// B_{LOOP}) * B_{LOOP}, {lo}), {hi})")
        a = f"j_in_lo{k}"
    if ps.hi_offset is not None:
        em.emit(f"j_in_hi{k} = tl.maximum(tl.minimum(((row_first + ({ps.hi_offset})) // B_{LOOP}) "
                f"* B_{LOOP}, {hi}), {a})")
        b = f"j_in_hi{k}"
    em.emit(f"j_in_wh{k} = tl.maximum(tl.minimum({b}, {whole}), {a})")
    if a != lo:
        _loop(em, k, lo, a, frozenset())
    _main_loops(em, k, a, f"j_in_wh{k}", ps.bound_atoms)
    if b != hi:
        _loop(em, k, f"j_in_wh{k}", hi, frozenset())
    else:  # interior to the end: only a ragged last block is left
        _ragged_tail(em, k, f"j_in_wh{k}", hi)


def _main_loops(em: Emitter, k: int, lo: str, hi: str, known: frozenset) -> None:
    """The main loop over the whole key blocks [lo, hi) -- cut, where a computed index
    stops moving far from the diagonal (``saturated_index``), into the blocks whose
    every pair lies past it on one side, the band between, and those past it on the
    other: the far loops know the index's constant (``FarSide`` in ``known``).  Cut
    points stay on the loop's block grid (from ``lo``), so the blocks are the same.
    All three are main loops: a far side comes with a table's pointer load, which rules
    warp specialisation out (``descriptors.warp_specializable``), so none is."""
    sides = {s.sign: s for s in far_sides(em.plan, k)}
    if not sides:
        _loop(em, k, lo, hi, known, main=True, whole=True)
        return
    a, b = lo, hi
    if +1 in sides:  # blocks whose last key lies D₊ or more below the block's first row
        a = f"j_far_lo{k}"
        em.emit(f"{a} = tl.minimum({lo} + (tl.maximum(row_first - ({sides[1].distance}) + 1 - "
                f"{lo}, 0) // B_{LOOP}) * B_{LOOP}, {hi})")
    if -1 in sides:  # blocks whose first key lies D₋ or more above the block's last row
        b = f"j_far_hi{k}"
        em.emit(f"{b} = tl.minimum({a} + ((tl.maximum(row_last + ({sides[-1].distance}) - "
                f"{a}, 0) + B_{LOOP} - 1) // B_{LOOP}) * B_{LOOP}, {hi})")
    if a != lo:
        em.emit(f"# keys far below the rows: the index is {_consts(sides[1])}")
        _loop(em, k, lo, a, known | {sides[1]}, main=True, whole=True)
    _loop(em, k, a, b, known, main=True, whole=True)
    if b != hi:
        em.emit(f"# keys far above the rows: the index is {_consts(sides[-1])}")
        _loop(em, k, b, hi, known | {sides[-1]}, main=True, whole=True)


def _consts(side) -> str:
    past = "i - j" if side.sign > 0 else "j - i"
    return ", ".join(str(c) for _, c in side.values) + f" where {past} >= {side.distance}"


def _ragged_tail(em: Emitter, k: int, lo: str, hi: str) -> None:
    """The key blocks in [lo, hi) past the last whole one, with the extent mask -- under a
    constexpr ``if``, so a kernel whose extent is a multiple of the block compiles none."""
    em.emit(f"if not ({WHOLE_ALL}):  # the ragged last key block")
    em.push(em.scopes[-1][2] + "    ")
    _loop(em, k, lo, hi, frozenset())
    em.scopes[-2][0].extend(em.pop())


def _loop(em: Emitter, k: int, lo: str, hi: str, known: frozenset, test: bool = True,
          main: bool = False, whole: bool = False) -> None:
    """One key loop; ``known``: atoms true on all its blocks; ``test``: data mask per block;
    ``main``: the pass's main loop (pipelined, warp-specialisable: ``descriptors``);
    ``whole``: every block lies inside the key extent (its mask folds away)."""
    ps = em.plan.passes[k]
    head = descriptors.main_loop_header(lo, hi, f"B_{LOOP}") if main else \
        f"for l0 in range({lo}, {hi}, B_{LOOP}):"
    em.emit(head + ("  # interior: no mask" if any(isinstance(t, Term) for t in known) else ""))
    em.ranges[LOOP] = ("l0", f"{ps.extent}")
    parent = em.scopes[-1]
    inner = parent[2] + "    "
    em.push(inner)
    em.emit(f"offs_{LOOP} = l0 + tl.arange(0, B_{LOOP})")
    em.aranges[LOOP] = ("l0", f"tl.arange(0, B_{LOOP})")
    em.emit(f"mask_{LOOP} = (offs_{LOOP} < {ps.extent}) | "
            + (f"({WHOLE_ONLY})  # whole blocks" if whole else f"EVEN_{LOOP}"))
    # One loop variable for every fold of the pass, so shared subterms (the score
    # tile of attention) are computed once per block.
    loop_var = f"loop{k}"
    atoms = data_atoms(em.plan, ps) if test else []
    if not atoms:
        loop_body(em, k, loop_var, known)
    else:  # a mask over captured tensors: skip / unmask whole blocks by their summaries
        may, must, drop = emit_block_test(em, ps, atoms, loop_var, ps.extent)
        em.emit(f"if {may}:  # some pair of this block may be visible (else: skipped)")
        if must is False:
            _branch(em, k, loop_var, known, inner + "    ")
        else:
            em.emit(f"    if {must}:  # every pair visible: no elementwise mask")
            _branch(em, k, loop_var, known | drop, inner + "        ")
            em.emit("    else:")
            _branch(em, k, loop_var, known, inner + "        ")
    parent[0].extend(em.pop())


def _branch(em: Emitter, k: int, loop_var: str, known: frozenset, indent: str) -> None:
    """The loop body in its own scope (nothing it computes is shared with another branch)."""
    em.push(indent)
    loop_body(em, k, loop_var, known)
    lines = em.pop()
    em.scopes[-1][0].extend(lines)


def _after_split(em: Emitter) -> None:
    """The passes after the split one (``split_plan.why_not_splittable``), whole, in the
    combine: they may read the folded states, which are final here."""
    for k in range(1, len(em.plan.passes)):
        _pass_loop(em, k, split=False)


def _fused_combine(em: Emitter, plan: TilePlan, name: str, bf16_dot_in_fp32: bool, fp32_dot):
    """Split-k in one launch: after storing its partials, each chunk program counts itself
    in on its row block's semaphore; the last to arrive folds all partials and runs the
    epilogue (CUTLASS's serial split-k, FlashDecoding's combine).  It saves the combine
    launch -- host and GPU -- that short decodes are made of.  The barrier + acq_rel
    atomic publish every thread's partial stores before the count; the last program reads
    them past L1 (.cg), and resets the counter so the buffer is zero for the next launch."""
    em.emit("# split-k in one launch: the last chunk of this row block to finish combines")
    em.emit("tl.debug_barrier()")
    em.emit("sem = sem_ptr + pid_grid * tl.num_programs(0) + pid_block")
    em.emit("arrived = tl.atomic_add(sem, 1, sem='acq_rel')")
    em.emit("if arrived == NSPLIT - 1:")
    inner = em.scopes[-1][2] + "    "
    last = Emitter(plan, name, bf16_dot_in_fp32, fp32_dot)
    last.tmp = em.tmp  # fresh names: Triton types every name assigned under the ``if``
    # The combine folds [B_P, rows, width] tiles of partials over the row block's real
    # rows only (COMBINE_ROWS: 1 for a decode's one query, not the tensor core's 16), so
    # B_P is 16x larger and a decode's partials fold in one step of loads, not five
    # (H200, causal decode S=2048, 64 keys x 9 splits in one launch: 0.98 -> 2.40 TB/s
    # with K/V from DRAM, bench/results/decode_s23/).
    last.block_sizes[plan.block_axis] = COMBINE_ROWS
    _prologue(last, split_axis=False, indent=inner)
    last.emit("tl.store(sem, 0)")
    _init_states(last)
    combine_partials(last, cache=", cache_modifier='.cg'", copy="pid_block")
    _after_split(last)
    epilogue(last)
    body = last.pop()
    em.scopes[-1][0].extend(renamed_locals(last.pop() + body, "_c"))
    em.tmp = last.tmp
    return last.desc  # the descriptors the combining program made


# constexpr of the split-k combines: the rows they fold per program (B_<rows> where a
# row block is full; else the next power of two of the row count)
COMBINE_ROWS = "B_IC"


def _gluon_form(plan: TilePlan, name: str):
    """(the plan's warp-specialised Gluon form or None, why not): a lowering choice the
    timer weighs on Hopper (``runtime.gluon_launch``); the ``tl`` form always exists."""
    whys = []
    for skeleton in (gluon_ws, gluon_sums):  # the rolling-softmax pass, the pass of sums
        try:
            return skeleton.generate(plan, f"{name}_ws"), ""
        except LoweringError as e:
            whys.append(f"{skeleton.__name__.rsplit('.', 1)[-1]}: {e}")
        except Exception as e:  # noqa: BLE001 - a gap in a Gluon emitter must not cost the tl form
            whys.append(f"{skeleton.__name__.rsplit('.', 1)[-1]}: the Gluon emitter failed "
                        f"({type(e).__name__}: {e})")
    return None, "; ".join(whys)


def _kernel_text(name: str, sig: list[str], em: Emitter, waits_for: list = (),
                 after_descriptors: bool = False) -> list[str]:
    """The kernel's text; ``waits_for``: what the kernel launched before it wrote (summary
    or scratch names), waited for before its first read (``wait_before_reads``), and
    before its first descriptor where that kernel makes descriptors too."""
    body = em.pop()
    body = wait_before_reads(em.pop() + body, list(waits_for), after_descriptors)
    return ["", "", "@triton.jit", f"def {name}(", *[f"    {s}," for s in sig], "):", *body]


def generate(plan: TilePlan, name: str = "", bf16_dot_in_fp32: bool = False,
             fp32_dot: str = "ieee") -> KernelSource:
    """Emit the Triton module for the plan (one kernel, or partial + combine for split-k).

    ``bf16_dot_in_fp32`` upcasts bf16 contraction operands (the Triton CPU interpreter 3.9
    computes a bf16 ``tl.dot`` wrongly, a 16x16 product off by 3e10); ``codegen.FP32_DOT``
    says what ``fp32_dot`` is."""
    p = plan.program
    name = name or ("neptune_" + "_".join(p.outputs))[:48]  # profiles tell kernels apart
    ba = plan.block_axis
    tensors = [ph.name for ph in p.inputs] + list(p.outputs)
    strides = [(t, k) for t in tensors for k in range(len(p.shape_of(t)))]
    # per-block [min, max] summaries of the captured tensors a data mask reads: a summary
    # has the tensor's dims (the summarised one counted in blocks) plus a trailing [min, max]
    summaries = summary_specs(plan)
    for sp in summaries:
        tensors.append(sp.name)
        strides += [(sp.name, k) for k in range(sp.rank(p))]
    tunables = {f"B_{ba}": 16, f"B_{LOOP}": 16}
    if any(e.loop_axes for e in plan.epilogue):
        tunables[f"B_{ECOL}"] = 16
    fixed = {f"B_{a}": n for a, n in plan.whole_axes.items()}
    even = {f"EVEN_{ba}": (f"B_{ba}", [plan.row_extent]),
            f"EVEN_{LOOP}": (f"B_{LOOP}", [ps.extent for ps in plan.passes])}
    if f"B_{ECOL}" in tunables:
        even[f"EVEN_{ECOL}"] = (f"B_{ECOL}", [p.extents[a] for e in plan.epilogue for a in e.loop_axes])
    flags = [descriptors.TMA_FLAG, descriptors.WS_FLAG, descriptors.STAGES_FLAG,  # per config
             VDOT_FLAG, ONE_LOOP_FLAG] + ([PDL_FLAG] if summaries or plan.split else [])
    consts = [f"{c}: tl.constexpr" for c in list(tunables) + list(fixed) + list(even) + flags]
    ptrs = [f"{t}_ptr" for t in tensors]
    # Symbolic sizes are runtime ints after the strides (Triton specialises == 1 and % 16).
    size_params = list(p.meta.get("size_params", ()))
    stride_args = [f"{t}_s{k}" for t, k in strides] + [f"n_{s}" for s in size_params]
    header = ["# generated by neptune_eq from the program:",
              *[f"#   {line}" for line in str(p).splitlines()],
              "import triton", "import triton.language as tl"]
    pre_text, prepass = "", None
    ids = checked_ids(p)
    # one launch builds every summary, per call (summary_kernel), and asserts the ids that
    # index a table in range -- also where there is nothing to summarise (a score_mod's
    # ``bias[doc[q]]``): on the GPU that launch is the ids' only check
    if summaries or ids:
        pre_text, prepass = prepass_source(name, summaries, p.dtype_of,
                                           lambda t: len(p.shape_of(t)), ids)
    first = prepass is None  # split-k's partials: the call's first launch (release_first)
    common = dict(params=ptrs, stride_params=strides, tunables={**tunables, **fixed},
                  grid_axes=plan.grid_axes, block_axis=ba, even_flags=even,
                  row_extent=plan.row_extent, grid_size=grid_size(plan), size_params=size_params,
                  summaries=summaries, prepass=prepass,
                  waits_first=bool(prepass or plan.split))
    if not plan.split:
        em = Emitter(plan, name, bf16_dot_in_fp32, fp32_dot)
        _prologue(em, split_axis=False)
        _init_states(em)
        for k in range(len(plan.passes)):
            _pass_loop(em, k, split=False)
        epilogue(em)
        text = header + _kernel_text(name, ptrs + stride_args + consts, em,
                                     [sp.name for sp in summaries])
        # warp specialisation was right on Triton 3.6 only around a contraction (descriptors)
        has_dot = any("tl.dot(" in line for line in text)
        scattered = tuple(sc.name for ps in plan.passes for sc in ps.scattered)
        form, why = _gluon_form(plan, name)
        return KernelSource(name, "\n".join(text) + "\n" + pre_text, **common,
                            gluon=form, gluon_why=why, vector_dot=em.vector_dots > 0,
                            one_loop=em.one_loop_form,
                            descriptors=descriptors.collect([em.desc]), scattered=scattered,
                            warp_specializable=() if scattered else descriptors.warp_specializable(
                                em.desc, plan, bool(summaries), has_dot))
    # split-k: the partials kernel runs the pass on one chunk and stores fold states ...
    em = Emitter(plan, name, bf16_dot_in_fp32, fp32_dot)
    _prologue(em, split_axis=True)
    _init_states(em)
    _pass_loop(em, 0, split=True)
    vector_dot = em.vector_dots > 0
    scratch = store_partials(em)
    ws = [f"{w}_ptr" for w in scratch]
    part = release_first(_kernel_text(f"{name}_partial", ptrs + ws + stride_args + ["CHUNK"]
                                      + consts, em, [sp.name for sp in summaries]), wait=first)
    states = [em.desc]
    # ... the combine kernel re-bases and folds them, then runs the epilogue.
    width = combine_width_axis(plan)
    em = Emitter(plan, name, bf16_dot_in_fp32, fp32_dot)
    em.block_sizes[ba] = COMBINE_ROWS  # the real rows only, as in the one-launch combine
    _prologue(em, split_axis=False, width_axis=width)
    _init_states(em)
    combine_partials(em)
    _after_split(em)
    epilogue(em)
    comb = _kernel_text(f"{name}_combine", ptrs + ws + stride_args + ["NSPLIT"] + consts
                        + [f"B_{SPLIT}: tl.constexpr", f"{COMBINE_ROWS}: tl.constexpr"], em,
                        list(scratch),  # launched dependent on the partials, on Hopper
                        after_descriptors=bool(descriptors.collect(states)))
    states.append(em.desc)
    # ... or both in one launch
    em = Emitter(plan, name, bf16_dot_in_fp32, fp32_dot)
    _prologue(em, split_axis=True)
    _init_states(em)
    _pass_loop(em, 0, split=True)
    store_partials(em)
    states += [em.desc, _fused_combine(em, plan, name, bf16_dot_in_fp32, fp32_dot)]
    fused = _kernel_text(f"{name}_fused", ptrs + ws + ["sem_ptr"] + stride_args + ["CHUNK", "NSPLIT"]
                         + consts + [f"B_{SPLIT}: tl.constexpr", f"{COMBINE_ROWS}: tl.constexpr"], em,
                         [sp.name for sp in summaries])
    return KernelSource(name, "\n".join(header + part + comb + fused) + "\n" + pre_text, **common,
                        split_extent=plan.passes[0].extent, scratch=scratch, vector_dot=vector_dot,
                        gluon_why=_gluon_form(plan, name)[1],
                        descriptors=descriptors.collect(states),
                        combine_width=(width, plan.whole_axes[width]) if width else None,
                        combine_min_rows=combine_min_rows(
                            plan, any("tl.dot(" in ln for ln in comb)))

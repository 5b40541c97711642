"""The warp-specialised Gluon form for Hopper (sm_90): a lowering choice of a tile plan.

Triton's ``tl`` kernels stop at ~0.8x cuDNN on Hopper (bench/results/neptune_ops.md);
cuDNN's design -- a producer warp streaming tiles by TMA into an mbarrier ring, two
consumer warpgroups each issuing its own wgmma -- is written in Gluon
(``triton.experimental.gluon``), and at that design a Triton kernel matches cuDNN
(bench/results/gluon_probe_s16).  This module emits that design from a plan:

* The skeleton is the lowering of one *shape* of pass, recognised from the plan's folds:
  a pass whose folds read one contraction ``Σ_d a[.., row, d]·b[.., key, d]`` of two
  16-bit inputs (``b``'s tiles stream through the ring) and whose one column-carrying
  rolling sum adds a second contraction ``Σ_key P·c[.., key, e]`` (``c`` streams too).
* The second contraction is *deferred one block*: ``o' = o·h + P·c`` becomes
  ``a' = (a + P_prev·c_prev)·h``, so block j's math runs while block j-1's P·c is on the
  tensor cores (FlashAttention-3's intra-warpgroup overlap).
* Everything between the contractions -- score mods, masks, the max/sum folds and their
  corrections, the epilogue -- is the package's own ``Emitter`` and ``fold_body`` code
  from the plan's terms, with ``tl`` calls rewritten for Gluon and tiles laid out as the
  wgmma accumulator.  Nothing here names attention.
* An affine mask cuts each warpgroup's key loop into edge / interior / edge loops (the
  interior body has the mask atoms dropped), as ``kernelgen`` does; an in-flight wgmma
  accumulator may cross a loop boundary but not an if/else, so there is no per-block
  branch.
* A mask over captured tensors (``doc[i] == doc[j]``, ``j >= offsets[doc[i]]``) narrows
  the program's key range before the warpgroups start, from the per-block summaries the
  pre-pass builds per call (``block_ranges``: data whose key blocks' [min, max] are in
  order makes a row block's visible keys one range, and the keys it sees whole
  another); the blocks seen whole run the interior body, the others evaluate the mask
  per element.  Unsorted data (checked on the device) keeps the affine range with every
  block masked: right, never skipping.
* Without a data mask the program is persistent: one per SM walks the (row block,
  head) tiles -- round robin where every tile has the same work, else in the balanced
  order the launcher passes (``runtime.tile_order``) -- and the producer fills the ring
  with the next tile's blocks while the consumers finish the last (``generate`` has the
  measurements).  How programs walk tiles, and the dynamic walk a data mask can take
  (measured, off), are in ``gluon_tiles``.
* The key block ``B_L`` (64 or 128) is a launch constant, not tied to the widths: the
  score tile and the rolling state are two wgmma accumulator layouts (``S_LAYOUT`` with
  ``B_L`` columns, ``O_LAYOUT`` with ``c``'s), and a row vector meeting the state is
  converted between their row slices -- the same rows in the same threads, so no data
  moves.  Head dim 64 then runs 64×128 score tiles, and sparse masks at head dim 128
  can take 64-key blocks; the timer chooses.

Scope: one unsplit, unpacked pass; a data mask only in that range form (no per-block
test); no atomically summed outputs, no epilogue column loops; the contraction width and
``c``'s column width are 64 or 128.  Plans outside it raise
``LoweringError`` and keep the ``tl`` forms.  The launcher (``runtime.gluon_launch``)
builds the TMA descriptors.
"""
from __future__ import annotations

import os

from ..ir import Term
from .block_ranges import data_range_form
from .block_skip import data_atoms, summary_specs
from .codegen import LOOP, Emitter, Tile, grid_decode, init_fill
from .fold_body import epilogue, loop_body
from . import gluon_epilogue
from .gluon_epilogue import allocation, program_end, tile_store
from .gluon_form import KEY_BLOCKS, WIDTHS, GluonForm
from .index_scatter import IndexScattered
from .gluon_tiles import (ROWS, affine_walk, consumer_blocks, flat_row, gl_lines as _gl, gl_main,
                          grid_order, interior_loops, key_range, persistent_place,
                          pingpong_turns, ranges_kernel, skipped_blocks, source_header,
                          tile_lines, walk)
from .dependent_launch import WAIT_FOR_PREPASS
from .lower import LoweringError, TilePlan

PERSISTENT = True  # tiles walked by one program per SM (see generate)
# a consumer's release of the tile's rows: after it, a dynamic walk reads the next tile
RELEASE = "    mbarrier.arrive(q_empty, count=1)  # the rows are read: the next tile's may load"
SCHEDULED = True   # ... tiles of unequal work too, in the launcher's balanced order
DYNAMIC = False    # ... tiles of a data mask too, taken from a counter (see generate)
# A data mask's two-consumer form comes with its dynamic walk as a second form the timer
# weighs (``GluonForm.dynamic``, ``TileConfig.dynamic``) when on; see generate.
DYNAMIC_TIMED = os.environ.get("NEPTUNE_EQ_GLUON_DYNAMIC", "1") == "1"
# The key blocks that walk is offered at (see ``_dynamic_form``);
# NEPTUNE_EQ_GLUON_DYNAMIC_KEYS=64,128 offers both (A/B).
DYNAMIC_KEYS = tuple(int(b) for b in os.environ.get("NEPTUNE_EQ_GLUON_DYNAMIC_KEYS", "64").split(","))
# A data mask's form comes with its one-consumer form (see generate) when on.  On since
# session 38: with its products pipelined again (``p_used`` below) it is the fastest
# form on short documents (H200, fp16: jagged S=8192 0.127 ms against the tl form's
# 0.155 and the two-consumer form's 0.141; 64 documents at 32768, 0.553 against 0.616).
# Session 37 measured it off: serialized by ptxas, it won only on jagged sequences.
# NEPTUNE_EQ_GLUON_SOLO=0 turns it off; read when a form is generated.
SOLO = os.environ.get("NEPTUNE_EQ_GLUON_SOLO", "1") == "1"
# The two consumers issue their products in turn (FlashAttention-3's ping-pong): one
# warpgroup's softmax runs while the other's products hold the tensor cores (see
# ``gluon_tiles.pingpong_turns``).  Off: measured never past the best walk without it
# (bench/results/README.md, session 32).  Read when a form is generated;
# NEPTUNE_EQ_PINGPONG=1 turns it on.
PINGPONG = os.environ.get("NEPTUNE_EQ_PINGPONG", "0") == "1"
# A head-dim-64 plan's form comes with a three-consumer form (192-row programs, see
# generate) when on.  NEPTUNE_EQ_GLUON_WIDE=0 turns it off; read when a form is generated.
WIDE = os.environ.get("NEPTUNE_EQ_GLUON_WIDE", "1") == "1"
# Under a bound moving with the rows each consumer computes only the key blocks its own
# rows see, and one past the rows (``gluon_tiles.consumer_blocks``, which has the
# measurements).  NEPTUNE_EQ_GLUON_OWN_BLOCKS=0: every consumer computes every block (A/B);
# NEPTUNE_EQ_GLUON_OWN_TWO=0: only the three-consumer forms skip;
# NEPTUNE_EQ_GLUON_OWN_PAST_ROWS=0: a warpgroup past the rows computes every block.
OWN_BLOCKS = os.environ.get("NEPTUNE_EQ_GLUON_OWN_BLOCKS", "1") == "1"
OWN_CONSUMERS = 2 if os.environ.get("NEPTUNE_EQ_GLUON_OWN_TWO", "1") == "1" else 3
OWN_PAST_ROWS = os.environ.get("NEPTUNE_EQ_GLUON_OWN_PAST_ROWS", "1") == "1"
# setmaxnreg of each worker consumer: three consumers and the producer's warpgroup share
# the SM's 64K registers (3 x 160 + 24, the default partition takes the rest, 168)
CONSUMER_REGS = {1: 232, 2: 232, 3: 160}


class GluonEmitter(Emitter):
    """The package's tile-expression emitter with the two contractions taken over by the
    skeleton.  Loads and stores stay pointer ones: no kernel axis has a descriptor range
    here (``ranges`` is empty), so ``descriptors`` emits no TMA branch."""

    def __init__(self, plan: TilePlan, name: str, col: str):
        super().__init__(plan, name)
        self.qk: tuple[Term, Term] | None = None   # the loads of the first contraction
        self.pv: Term | None = None                # the load of the second one's right side
        self.col = col                             # the rolling state's column axis
        self.stream_dtype: str | None = None       # the streamed inputs' 16-bit dtype
        self.o_store_ok = False                    # the output tile may go by TMA ...
        self.o_store = None                        # ... and does (gluon_epilogue.TileStore)

    def layout(self, axes: tuple[str, ...]) -> str:
        """The layout of a tile over ``axes``: the state's (``O_*``) where its column axis
        is one of them, else the score tile's (``S_*``)."""
        fam = "O" if self.col in axes else "S"
        if len(axes) == 2:
            return f"{fam}_LAYOUT"
        return f"{fam}_ROWS" if axes == (self.plan.block_axis,) else f"{fam}_COLS"

    def bcast(self, t: Tile, axes: tuple[str, ...]) -> str:
        # a row vector (score-tile rows) meeting the state's columns takes the state's row
        # slice: the same rows in the same threads (both are 4-warp wgmma layouts of 64
        # rows), so the conversion moves no data
        if self.col in axes and t.axes == (self.plan.block_axis,) and len(axes) == 2:
            return f"tl.convert_layout({t.code}, O_ROWS)[:, None]"
        return super().bcast(t, axes)

    def _try_dot(self, t: Term, kaxis: str, scope: int):
        a, b = t.args
        if kaxis in self.plan.whole_axes and a.op == "load" and b.op == "load":
            if self.qk is not None and (a.val, b.val) != (self.qk[0].val, self.qk[1].val):
                raise LoweringError("Two different first contractions in one pass.")
            self.qk = self.qk or (a, b)
            return Tile("qk", self.canon((self.plan.block_axis, LOOP)), "f32")
        if kaxis == LOOP and b.op == "load":
            p = self.f32(self.expr(a))
            if self.canon(p.axes) != (self.plan.block_axis, LOOP):
                raise LoweringError("The second contraction's left side is not a score tile.")
            if self.pv is not None and self.pv.val != b.val:
                raise LoweringError("Two different second contractions in one pass.")
            self.pv = b
            masked = f"tl.where(mask_{LOOP}[None, :], {p.code}, 0.0)"
            self.emit(f"p_op = tl.convert_layout(({masked}).to(DTYPE), P_LAYOUT)")
            col = next(x for x in self.load_axes(b) if x != LOOP)
            if col != self.col:
                raise LoweringError("The second contraction's columns are not the rolling "
                                    "state's.")
            return Tile("0.0", self.canon((self.plan.block_axis, col)), "f32")
        raise LoweringError("A contraction the skeleton does not issue as a wgmma.")

    def store_tile(self, name, idx, axes, value_code, pointer_line) -> bool:
        # (the rolling state's output tile by TMA, ``gluon_epilogue``; the rest by pointers)
        done = tile_store(self, name, idx, axes, value_code, pointer_line) \
            if self.o_store_ok else None
        self.o_store = done or self.o_store
        return done is not None

    def load_axes(self, load: Term) -> tuple[str, ...]:
        out = []
        for a in load.args:
            role = self.env.get(a.val) if a.op == "var" else None
            if isinstance(role, str) and role in self.order:
                out.append(role)
        return tuple(out)

    def _expr(self, t: Term, scope: int) -> Tile:
        if t.op == "tanh":  # Gluon has no sigmoid (the tl form's tanh): TANH_FORMS
            a = self.float_of(self.expr(t.args[0]))
            return self.bind(TANH_FORMS[TANH].format(a.code), a.axes, "f32", scope)
        return super()._expr(t, scope)


# tanh in the block math (a softcap's): the special-function unit that computes exp is
# the block math's bottleneck, so each form's count of its ops matters.
TANH_FORMS = {
    # tanh x = 1 − 2/(e^{2x} + 1), IEEE division: exact to fp32 rounding; 2 SFU ops + a
    # long division sequence
    "exp-div": "(1.0 - 2.0 / (tl.exp2(2.8853900817779268 * ({})) + 1.0))",
    # the same with the SFU's reciprocal (div.full, 2 ulp): 2 SFU ops
    "exp-fastdiv": "(1.0 - tl.fdiv(2.0, tl.exp2(2.8853900817779268 * ({})) + 1.0))",
    # the SFU's own tanh (tanh.approx.f32, ~5e-4 relative; FlashAttention-3's softcap): 1
    "approx": "tl.inline_asm_elementwise('tanh.approx.f32 $0, $1;', '=f,f', [{}], "
              "dtype=tl.float32, is_pure=True, pack=1)",
}
# approx: softcap(30) attention at S=8192 ran 429 TFLOP/s against 299 (exp-div) and 303
# (exp-fastdiv), with the same max error as the tl form against an fp32 reference, scores
# x8 (1.17e-3; exp-div 1.10e-3) -- H100, bench/results/gluon_s17/tanh_forms_h100.json
TANH = "approx"


def consumer_axes(em: Emitter) -> None:
    """Open a consumer's prologue scope with its grid axes decoded and the offsets and
    masks of its 64 rows and of each whole axis, in the layouts ``em`` gives them."""
    plan = em.plan
    ba = plan.block_axis
    em.push("    ")
    for ln in grid_decode(plan):
        em.emit(ln)
    for a in plan.grid_axes:
        em.env[a] = f"ax_{a}"
    em.env[ba] = ba
    em.emit(f"offs_{ba} = my_first + gl.arange(0, {ROWS}, S_ROWS)")
    em.aranges[ba] = ("my_first", f"gl.arange(0, {ROWS}, S_ROWS)")
    em.emit(f"mask_{ba} = offs_{ba} < {plan.row_extent}")
    for a, n in plan.whole_axes.items():
        em.env.setdefault(a, a)
        em.emit(f"offs_{a} = gl.arange(0, {n}, {em.layout((a,))})")
        em.emit(f"mask_{a} = offs_{a} < {plan.program.extents[a]}")


def block_fragment(em: Emitter, known: frozenset, whole: bool = False) -> list[str]:
    """One key block's math (the pass's fold updates from the plan's terms), ``known``:
    mask atoms that hold on the whole block; ``whole``: the block lies inside the key
    extent, so the extent mask is true and folds away (as ``EVEN_L`` makes it for every
    block when the extent is a multiple of the block)."""
    em.push("        ")
    em.emit(f"offs_{LOOP} = l0 + cols")
    em.aranges[LOOP] = ("l0", "cols")
    em.emit(f"mask_{LOOP} = (offs_{LOOP} < {em.plan.passes[0].extent}) | "
            + ("True  # a whole block" if whole else "EVEN_L"))
    loop_body(em, 0, "loop0", known)
    return em.pop()


def _row_base(em: GluonEmitter, load: Term) -> str:
    """Row of the flattened view where this load's tile starts (``flat_row``)."""
    return flat_row(load.val, [em.expr(a).code for a in load.args[:-2]])


def check_scope(plan: TilePlan, scattered_ok: bool = False) -> None:
    """Raise ``LoweringError`` (saying why) for a plan outside the skeleton's scope
    (``scattered_ok``: atomically summed outputs are in it, as in ``gluon_sums``)."""
    if plan.split or plan.packed or len(plan.passes) != 1:
        raise LoweringError("The warp-specialised form takes one unsplit, unpacked pass.")
    if plan.passes[0].scattered and not scattered_ok or any(
            isinstance(sc, IndexScattered) for ps in plan.passes for sc in ps.scattered):
        raise LoweringError("Scattered (atomically summed) outputs are not in the "
                            "warp-specialised form.")
    if not data_range_form(plan, plan.passes[0]):
        raise LoweringError("A data mask without a key-range form (it needs a per-block "
                            "test) is not in the warp-specialised form.")
    if any(item.loop_axes for item in plan.epilogue):
        raise LoweringError("Epilogue column loops are not in the warp-specialised form.")
    for a, n in plan.whole_axes.items():
        if n not in WIDTHS or plan.program.extents[a] != n:
            raise LoweringError(f"Axis {a} is {plan.program.extents[a]} wide; the "
                                f"warp-specialised form takes widths {WIDTHS}.")


def generate(plan: TilePlan, name: str = "neptune_ws", consumers: int = 2,
             dynamic: bool | None = None) -> GluonForm:
    """The Gluon module for ``plan``, or ``LoweringError`` when it is out of scope.
    ``dynamic``: a data mask's tiles taken from a counter (default: ``DYNAMIC``).

    ``consumers``: consumer warpgroups per program (2: FlashAttention-3's 128-row program,
    the two sharing each key block; 1: a 64-row program).  With ``SOLO`` a data mask's
    two-consumer form comes with its one-consumer form (``GluonForm.solo``), a lowering
    choice the timer weighs: a 64-row program's ring fits twice in an SM's shared memory,
    so the hardware runs two programs per SM whose tiles are independent -- one's
    pipeline fill and epilogue run under the other's products -- at the price of loading
    each key block once per 64 rows instead of 128.  Tiles of a few key blocks (document masks, narrow windows,
    head dim 64) pay a fixed cost per tile that one 128-row program per SM leaves
    exposed (bench/results/README.md, session 36).  The one-consumer form runs one
    program per tile and leaves the packing to the hardware's block scheduler."""
    if consumers not in (1, 2, 3):
        raise ValueError(f"generate: consumers is 1, 2 or 3, got {consumers}")
    check_scope(plan)
    rows = ROWS * consumers
    ps = plan.passes[0]
    p = plan.program
    ba = plan.block_axis
    pv_fold = next((f for f in ps.folds if len(f.state_axes) > len(plan.grid_axes) + 1), None)
    col = next((a for a in pv_fold.state_axes if a in plan.whole_axes), None) if pv_fold else None
    if col is None:
        raise LoweringError("The pass has no rolling state with columns for the skeleton.")
    pv_fold = pv_fold.name
    em = GluonEmitter(plan, name, col)
    # Persistent programs -- one per SM walking the (row block, head) tiles, the producer
    # loading the next tile's rows and key blocks while the consumers finish the last one
    # (its final P·c, the epilogue's stores) -- where every tile has the same work (no
    # mask moving the key range with the rows, or a range bounded on both sides: a
    # window), round robin.  H200, same process (bench/gluon_validate.py
    # --only-persistence): global S=2048 529 -> 558 TFLOP/s, GQA 64/8 541 -> 561, window
    # +1-11% at 2048, +4-5% at 8192.  Tiles of unequal work (causal) lost to the round
    # robin's imbalance (S=2048 344 -> 276): with ``SCHEDULED`` they walk the order the
    # launcher computes from each tile's key blocks (``runtime.tile_order``: longest
    # first to the least loaded program, heads in L2-sized groups) -- against one
    # program per tile, same process: causal S=2048 339 -> 420, B=2 S=3000 383 -> 418,
    # GQA 64/8 387 -> 449, softcap+causal 279 -> 349, S=8192 519 -> 513.  A data mask's
    # tiles have work known only on the device: one program per tile, and (``DYNAMIC_TIMED``)
    # a second form whose programs take tiles from a counter (``gluon_tiles``, heads first),
    # which the timer weighs at 64-key blocks: against one program per tile heads first,
    # same process, H200 fp16 H=16 D=128 (bench/gluon_validate.py --only-data-persistence,
    # bench/results/s44/): documents 4/13/64 at S=8192 +4/+4/+8%, 13 and 64 documents at
    # 32768 +5/+11%, jagged +0-1%, prefix-LM -3%.  ``DYNAMIC`` makes the walk the only
    # form (the A/B benches' switch).  Neither walk wins everywhere (causal D=128 S=8192:
    # one program per tile 523 vs 497 TFLOP/s, H200, session 29), so a persistent form is also timed launched one program per tile
    # (``TileConfig.per_tile``: the same kernel, ``runtime.tile_order.one_tile_per_program``).
    atoms = data_atoms(plan, ps)  # a mask's atoms over captured tensors
    data = bool(atoms)
    if not PERSISTENT or consumers == 1:
        mode = "single"
    elif data:
        mode = "dynamic" if (DYNAMIC if dynamic is None else dynamic) else "single"
    else:
        mode = affine_walk(ps)
        mode = "single" if mode == "scheduled" and not SCHEDULED else mode
    persistent, scheduled = mode != "single", mode == "scheduled"
    tensors = [ph.name for ph in p.inputs] + list(p.outputs)
    strides = [f"{t}_s{k}" for t in tensors for k in range(len(p.shape_of(t)))]
    for sp in summary_specs(plan):  # the data mask's per-call summaries, as the tl form's
        tensors.append(sp.name)
        strides += [f"{sp.name}_s{k}" for k in range(sp.rank(p))]
    if scheduled:  # [first entry of each program (programs + 1)..., tile ids...]
        tensors.append("tile_order")
        strides.append("tile_order_s0")
    if mode == "dynamic":  # the tile counter, each tile's key range, the mailboxes
        tensors.append("tile_sched")
        strides.append("tile_sched_s0")
    sizes = [f"n_{s}" for s in p.meta.get("size_params", ())]
    args = [f"{t}_ptr" for t in tensors] + strides + sizes

    # consumer prologue (scope 0: axes and hoisted invariants; scope 1: fold states)
    consumer_axes(em)
    em.push("    ")
    for f in ps.folds:
        axes = em.canon(a for a in f.state_axes if a not in plan.grid_axes)
        shape = "[" + ", ".join(str(ROWS) if a == ba else str(plan.whole_axes[a]) for a in axes) + "]"
        em.emit(f"{f.name} = gl.full({shape}, {init_fill(f.op)}, gl.float32, {em.layout(axes)})")
        em.states[f.name] = Tile(f.name, axes, "f32")
    prologue_tail = em.pop()

    body_edge = block_fragment(em, frozenset())
    known_in = ps.bound_atoms | frozenset(atoms)
    body_in = block_fragment(em, known_in, whole=True)
    body_ew = block_fragment(em, frozenset(), whole=True)
    if em.qk is None or em.pv is None:
        raise LoweringError("The pass has no pair of contractions for the skeleton.")
    streamed = (em.qk[0].val, em.qk[1].val, em.pv.val)
    dts = {p.dtype_of(t) for t in streamed}
    if len(dts) != 1 or not dts <= {"float16", "bfloat16"}:
        raise LoweringError(f"The streamed inputs {streamed} must share one 16-bit dtype, "
                            f"got {sorted(dts)}.")
    kax = next(x for x in em.load_axes(em.qk[0]) if x in plan.whole_axes)
    widths = (plan.whole_axes[kax], plan.whole_axes[col])

    def with_wait(lines: list[str], wait: bool) -> list[str]:
        """Before the rolling state's update: wait for the deferred P·c and free its slot."""
        out = []
        for ln in lines:
            if wait and ln.strip().startswith(f"{pv_fold}_new ="):
                pad = ln[:len(ln) - len(ln.lstrip())]
                out.append(f"{pad}{pv_fold}, p_used = warpgroup_mma_wait(0, deps=({pv_fold}, p_used))")
                out.append(f"{pad}mbarrier.arrive(c_empty.index(prev), count=1)")
            out.append(ln)
        return out

    # Block j > 0 issues its first contraction and block j-1's deferred P·c, waits for the
    # former only, and runs the block's math while the latter is on the tensor cores.
    # With ping-pong the block's inputs are waited for before its turn, so a warpgroup
    # holds the turn only while it issues.
    turn_setup, turn_wait, turn_pass, turn_first = pingpong_turns(PINGPONG)
    issue = ["mbarrier.wait(b_ready.index(st), ph)",
             *(["mbarrier.wait(c_ready.index(prev), ((g - 1) // STAGES) & 1)",
                turn_wait.format(n="base + it + jb")] if turn_wait else []),
             "qk = warpgroup_mma(q_tile, b_bufs.index(st).permute((1, 0)), zero_s, "
             "use_acc=False, is_async=True)",
             *([] if turn_wait else ["mbarrier.wait(c_ready.index(prev), ((g - 1) // STAGES) & 1)"]),
             f"{pv_fold} = warpgroup_mma(p_op, c_bufs.index(prev), {pv_fold}, is_async=True)",
             # The deferred P·c reads p_op's registers until it completes, and the block
             # computes the next p_op before that: the operand passes through the wait
             # (``p_used``), so its registers stay live.  Without it LLVM may write the next
             # p_op into them (the loop's phi), and ptxas, seeing an in-flight wgmma's input
             # written, serializes every wgmma of the kernel (C7513; Triton 3.6, a
             # one-document mask: 17% slower than causal at S=16384 on an H200).
             "p_used = p_op",
             *([turn_pass] if turn_pass else []),
             "qk = warpgroup_mma_wait(1, deps=(qk, ))",
             "mbarrier.arrive(b_empty.index(st), count=1)"]

    em.stream_dtype, em.o_store_ok = next(iter(dts)), gluon_epilogue.TMA_STORE
    em.push("    ")
    epilogue(em)
    epi = em.pop()
    o_store = em.o_store  # the output tile by TMA (gluon_epilogue), under TMA_O
    prologue = em.pop()

    rng = gl_main(key_range(plan, name, data, rows))
    dm = ["dm_lo", "dm_hi"] if data and not persistent else []  # (a walk reads them per tile)
    em.push("    ")
    a_row, b_row, c_row = (_row_base(em, ld) for ld in (em.qk[0], em.qk[1], em.pv))
    bases = [*_gl(em.pop()), f"    a_row = {a_row} + row_first", f"    b_row = {b_row}",
             f"    c_row = {c_row}"]
    # a tile's place and key range (the consumers' prologue decodes the grid axes itself)
    tile = tile_lines(mode, rng, "producer", rows)

    o_args = ["o_smem", "o_desc"] if o_store else []  # the TMA store's buffer and tensor
    sig = ", ".join(["a_desc", "b_desc", "c_desc", *o_args[1:]] + args)
    tma_o, tma_o_param = (", TMA_O", ", TMA_O: gl.constexpr") if o_store else ("", "")
    where = ["num_tiles", "n_rb"] if persistent else ["pid_grid", "row_block", "j_lo", "n_blocks"]
    bars = ["a_bar", "q_empty", "b_ready", "b_empty", "c_ready", "c_empty"]
    bars += ["turn"] if turn_setup else []
    bars += ["t_ready"] if mode == "dynamic" else []  # the mailbox's two slots
    shared = ", ".join(["a_smem", "b_bufs", "c_bufs", *o_args, *bars, *where, *dm, *args])
    producer_args = ", ".join(["a_desc", "b_desc", "c_desc", "a_smem", "b_bufs", "c_bufs", *bars,
                               *(["num_tiles", "n_rb", *args] if persistent
                                 else ["a_row", "b_row", "c_row", "j_lo", "n_blocks"])])
    producer = [
        "    mbarrier.wait(q_empty, (it & 1) ^ 1)  # the consumers are done with the last rows",
        f"    mbarrier.expect(a_bar, {consumers} * a_desc.block_type.nbytes)",
        *[f"    tma_load(a_desc, [a_row + {k * ROWS}, 0], a_bar, a_smem.index({k}))"
          for k in range(consumers)],
        "    for jb in range(n_blocks):",
        "        s = (base + jb) % STAGES",
        "        ph = ((base + jb) // STAGES) & 1",
        "        mbarrier.wait(b_empty.index(s), ph ^ 1)",
        "        mbarrier.expect(b_ready.index(s), b_desc.block_type.nbytes)",
        "        tma_load(b_desc, [b_row + j_lo + jb * B_L, 0], b_ready.index(s), b_bufs.index(s))",
        "        mbarrier.wait(c_empty.index(s), ph ^ 1)",
        "        mbarrier.expect(c_ready.index(s), c_desc.block_type.nbytes)",
        "        tma_load(c_desc, [c_row + j_lo + jb * B_L, 0], c_ready.index(s), c_bufs.index(s))"]
    # Each warpgroup computes only the blocks its own rows see (``consumer_blocks``) under a
    # causal bound, at the key blocks where its rows can end one early (see OWN_BLOCKS);
    # with ping-pong every warpgroup takes a turn per block of the tile, so all compute all.
    own = (OWN_BLOCKS and consumers >= OWN_CONSUMERS and ps.hi_offset is not None
           and not turn_wait)
    count = "my_n" if own else "n_blocks"
    consumer = [
        f"    my_first = row_block * {rows} + WHICH * {ROWS}",
        *(consumer_blocks(plan, OWN_PAST_ROWS, consumers) if own else []),
        *_gl(prologue), *_gl(prologue_tail),
        "    mbarrier.wait(a_bar, it & 1)",
        "    # block 0: the first contraction and the block's math; its P·c is issued next block",
        "    l0 = j_lo",
        "    st = base % STAGES",
        "    mbarrier.wait(b_ready.index(st), (base // STAGES) & 1)",
        *(["    " + turn_wait.format(n="base + it")] if turn_wait else []),
        "    qk = warpgroup_mma(q_tile, b_bufs.index(st).permute((1, 0)), zero_s, use_acc=False, "
        "is_async=True)",
        *(["    " + turn_pass] if turn_pass else []),
        "    qk = warpgroup_mma_wait(0, deps=(qk, ))",
        "    mbarrier.arrive(b_empty.index(st), count=1)",
        *[ln[4:] for ln in _gl(body_edge)],
        *_gl(interior_loops(ps, body_edge, body_in, body_ew, issue, with_wait, data,
                            count=count)),
        RELEASE,
        f"    last = (base + {count} - 1) % STAGES",
        f"    mbarrier.wait(c_ready.index(last), ((base + {count} - 1) // STAGES) & 1)",
        *(["    " + turn_wait.format(n="base + it + n_blocks")] if turn_wait else []),
        f"    {pv_fold} = warpgroup_mma(p_op, c_bufs.index(last), {pv_fold}, is_async=True)",
        *(["    " + turn_pass] if turn_pass else []),
        f"    {pv_fold} = warpgroup_mma_wait(0, deps=({pv_fold}, ))",
        "    mbarrier.arrive(c_empty.index(last), count=1)",
        *_gl(epi), *(skipped_blocks(consumers) if own else [])]
    if persistent:
        place = persistent_place(plan, rows)
    else:
        place = [*grid_order(plan, rows),
                 "    R1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])",
                 *["    " + ln for ln in _gl(grid_decode(plan))],
                 *["    " + ln for ln in rng], *bases]
    src = [
        *source_header("lowering/gluon_ws.py", p, ", fence_async_shared" if o_store else ""),
        "", "",
        "@gluon.jit",
        f"def _producer({producer_args}, B_L: gl.constexpr):",
        "    # one warp: each tile's rows, then its b and c key blocks through the ring",
        "    STAGES: gl.constexpr = b_bufs.type.shape[0]",
        *walk(mode, "producer", producer, [*tile, *_gl(grid_decode(plan)),
                                            *[ln[4:] for ln in bases]]),
        "", "",
        "@gluon.jit",
        f"def _consumer({shared}, WHICH: gl.constexpr, B_L: gl.constexpr, DTYPE: gl.constexpr, "
        f"EVEN_L: gl.constexpr{tma_o_param}):",
        "    # one warpgroup: 64 rows, its own wgmma issue, block math between the two",
        "    STAGES: gl.constexpr = b_bufs.type.shape[0]",
        "    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], "
        "warps_per_cta=[4, 1], instr_shape=[16, B_L, 16])",
        "    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)",
        "    S_COLS: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)",
        "    # the rolling state's accumulator: c's columns wide (the key block need not be)",
        "    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], "
        "warps_per_cta=[4, 1], instr_shape=[16, c_bufs.type.shape[2], 16])",
        "    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)",
        "    O_COLS: gl.constexpr = gl.SliceLayout(0, O_LAYOUT)",
        "    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)",
        "    cols = gl.arange(0, B_L, S_COLS)",
        f"    zero_s = gl.zeros([{ROWS}, B_L], gl.float32, S_LAYOUT)",
        "    q_tile = a_smem.index(WHICH)",
        *turn_first,
        *walk(mode, "consumer", consumer, tile_lines(mode, rng, "consumer", rows),
              released=consumer.index(RELEASE) + 1),
        *(program_end() if o_store else []),
        "", "",
        "@gluon.jit",
        f"def {name}({sig}, B_L: gl.constexpr, STAGES: gl.constexpr, EVEN_L: gl.constexpr"
        f"{tma_o_param}):",
        "    DTYPE: gl.constexpr = a_desc.dtype",
        "    D: gl.constexpr = a_desc.block_type.shape[1]",
        *place,
        f"    a_smem = gl.allocate_shared_memory(DTYPE, [{consumers}, {ROWS}, D], a_desc.layout)",
        "    b_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, B_L, D], b_desc.layout)",
        "    c_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, B_L, c_desc.block_type.shape[1]], "
        "c_desc.layout)",
        *(allocation(consumers) if o_store else []),
        *[f"    {b} = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())"
          for b in ("a_bar", "q_empty")],
        *[f"    {b} = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())"
          for b in ("b_ready", "b_empty", "c_ready", "c_empty")],
        "    mbarrier.init(a_bar, count=1)",
        f"    mbarrier.init(q_empty, count={consumers})  # every consumer releases the row tiles",
        *turn_setup,
        *(["    t_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())",
           "    mbarrier.init(t_ready.index(0), count=1)  # the producer posts each tile",
           "    mbarrier.init(t_ready.index(1), count=1)"] if mode == "dynamic" else []),
        "    for i in gl.static_range(STAGES):",
        "        mbarrier.init(b_ready.index(i), count=1)",
        "        mbarrier.init(c_ready.index(i), count=1)",
        f"        mbarrier.init(b_empty.index(i), count={consumers})  # every consumer reads "
        "every block",
        f"        mbarrier.init(c_empty.index(i), count={consumers})",
        # a dynamic walk's tiles are read from what its ranges kernel wrote: the form is
        # launched dependent on that kernel, and its warps split only after it has finished
        *(["    " + ln for ln in gl_main([WAIT_FOR_PREPASS])] if mode == "dynamic" else []),
        "    gl.warp_specialize([",
        *[f"        (_consumer, ({shared}, {k}, B_L, DTYPE, EVEN_L{tma_o}))," for k in range(consumers)],
        f"        (_producer, ({producer_args}, B_L)),",
        # the extra consumer takes the registers the producer warp gives back
        f"    ], [{'4, ' * (consumers - 1)}1], "
        f"[{f'{CONSUMER_REGS[consumers]}, ' * (consumers - 1)}24])",
    ]
    # Key blocks worth timing (H200, the Gluon form alone, bench/gluon_validate.py
    # --only-key-blocks): 128 keys won wherever every row block sees a long key range --
    # global D=128 S=8192 1.84 vs 2.04 ms, causal D=128 S=2048 0.100 vs 0.104, D=64 global
    # and causal at S=4096 9% and 8% -- and 64 keys won where the range is narrow: a
    # window of 256 at S=8192 0.186 vs 0.251 ms, documents 0.263 vs 0.317, jagged 0.231
    # vs 0.285.  So 64 is offered only with a key range bounded below or a data mask.
    # (the one-consumer form: its point is a ring that fits twice, so 64 keys at width 128;
    # the three-consumer form: 64 keys won GQA 16/8 causal, 128 global, see _wide_form)
    narrow = ps.lo_offset is not None or data or consumers != 2
    return GluonForm(name, "\n".join(src) + "\n", streamed, widths, dts.pop(),
                     [f"{t}_ptr" for t in tensors], persistent,
                     KEY_BLOCKS if narrow else (128,), scheduled, (ps.lo_offset, ps.hi_offset),
                     ranges_kernel(plan, name, args, rows) if mode == "dynamic" else None,
                     consumers,
                     # the one-consumer form, for data masks only (``SOLO``): it wins on the
                     # device on short documents and jagged sequences (session 38) and lost
                     # elsewhere, where its compile would only lengthen a cold build
                     generate(plan, f"{name}_solo", 1)
                     if consumers == 2 and data and SOLO and mode == "single" else None,
                     not persistent,
                     _dynamic_form(plan, name) if mode == "single" and data and consumers == 2
                     and DYNAMIC_TIMED else None,
                     o_store=o_store, own_blocks=own, own_past_rows=own and OWN_PAST_ROWS,
                     wide=_wide_form(plan, name) if consumers == 2 and WIDE and not data
                     and widths == (64, 64) else None)


def _wide_form(plan: TilePlan, name: str) -> GluonForm:
    """A head-dim-64 plan's three-consumer form: FlashAttention-3's 192-row tile at head
    dim 64, where a key block's softmax takes as long as its products (session 45) and a
    third warpgroup gives the SM more to overlap them with.  The timer weighs it at both
    key blocks, a 2-deep ring (``runtime.tile_configs.wide_configs``).  H200 fp16, timed
    from the host on a flushed L2, alternated (bench/gluon_probe/wide_form.py --host):
    global B=4 H=16 S=5000 0.966 ms at 128 keys against 1.024 for the tl 64x64 tiles and
    1.039 for two consumers; GQA 16/8 S=3000 causal 0.222-0.226 at 64 keys against 0.232
    for two consumers (tl 0.212); causal B=4 S=5000 lost, 0.587 against 0.563, until each
    warpgroup computed only its own rows' blocks (session 47, ``consumer_blocks``: 0.520
    ms under CUDA graphs, cuDNN 0.521; chosen in every head-dim-64 off-grid row).  At 128
    keys ptxas spills ~800 bytes a thread within the consumers' 160 registers (S, P and O
    live at once); measured faster all the same.  Not for a data mask: its pre-pass's tl
    tiles take power-of-2 rows only."""
    return generate(plan, f"{name}_wide", 3)


def _dynamic_form(plan: TilePlan, name: str) -> GluonForm:
    """A data mask's dynamic walk, a second form the timer weighs against one program per
    tile (measured in ``generate``), at 64-key blocks only: at 128 keys the walk was -6% to
    +1% against one program per tile (H200 session 28, H100 session 39)."""
    form = generate(plan, f"{name}_dyn", 2, dynamic=True)
    form.key_blocks = tuple(b for b in form.key_blocks if b in DYNAMIC_KEYS) or form.key_blocks
    return form

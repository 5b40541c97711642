"""Tensor-descriptor (TMA) loads and stores: a lowering choice the tile config makes.

A load or store of a 2-D tile of a tensor -- two index positions that are kernel axes
starting at a block boundary (``offs_a = start + tl.arange(0, B_a)``), the second of them
the tensor's last dimension, every other position a program-constant scalar (a grid axis
or a literal) -- can go through a tensor descriptor: on Hopper the bulk tensor copy engine
(TMA) moves the whole tile into shared memory asynchronously, which is what lets Triton
pipeline and warp-specialise the key loop.  This covers the K and V tiles of attention in
the key loop, the Q tile in the prologue, the output store, and the same tiles of every
other derived fold (softmax rows, reduction chains): nothing here knows about attention.

The kernel keeps both forms behind the constexpr ``TMA`` (Triton compiles only the branch
taken, so one module serves both and the timer picks per config)::

    if TMA:   # prologue: one descriptor per (tensor, scalar offsets, tile dims)
        k_desc1 = tl.make_tensor_descriptor(k_ptr + ax_z * k_s0 + ax_y * k_s1,
                                            shape=[S, D], strides=[k_s2, 1], block_shape=[B_L, B_d])
    ...
        if TMA:
            t2 = k_desc1.load([l0, 0])
        else:
            t2 = tl.load(k_ptr + ..., mask=..., other=0.0)

Masking stays exact: the descriptor's shape is the very bound the pointer form masks with
(the axis extent, not the tensor's, which may be larger), and TMA zero-fills rows and
columns outside it, as the masked load's ``other=0.0`` does; a store outside it is
dropped.  The kernel's ``where`` masks on scores are untouched.  Descriptors are made on
the device (``tl.make_tensor_descriptor``): the per-(batch, head) base offset makes the
bounds exact per head, and the arguments stay plain tensors, so the fast launch path and
CUDA graphs are unchanged (Triton 3.6 needs ``triton.set_allocator`` for the descriptor's
global scratch: ``runtime.launcher.ensure_allocator``).  TMA needs a 16-byte aligned base,
16-byte multiples as strides and a contiguous last dimension; the launcher checks the
tensors of every call (``tma_ok``) and runs the pointer form where they do not hold.

Warp specialisation (``WS``) on Hopper is Triton's automatic pass (Triton 3.6: one TMA
producer warpgroup, two consumer warpgroups that split the row block).  Measured on an
H100 (bench/ws_probe, bench/results/ws_probe/README.md) it is right only in a narrow
form, which ``WS_WARPS`` / ``WS_RING`` / ``WS_MIN_ROWS`` below and
``runtime.tile_configs.lowering_variants`` keep to:

* a K/V ring of 2 buffers (the loop's ``num_stages``): with 3 or 4 every specialised
  kernel returned NaN / garbage, nondeterministically, at every size (multiples of the
  block too), with or without the partial key block peeled out of the loop, in Triton's
  tutorial formulation (``tl.dot(p, v, acc)``), and in a FlashAttention kernel written
  from scratch -- a miscompile in Triton, not in what we emit (likely the consumer
  releasing a K/V buffer right after issuing the asynchronous wgmma that reads it, as in
  its IR; not proven);
* 4 warps: with 8, Triton 3.6 leaves the loop unspecialised (a plain TMA kernel);
* at least 128 rows per block: each consumer takes half; at 64 both consumers computed
  and stored the same 64 rows (twice the work), and at 32 there is no wgmma to split;
* one main loop holding a ``tl.dot`` (a second loop after it -- a peeled boundary block
  -- made the pass abort in WSDataPartition).
"""
from __future__ import annotations

import re

TMA_FLAG, WS_FLAG, STAGES_FLAG = "TMA", "WS", "LOOP_STAGES"  # constexprs of every kernel
# The only warp-specialised form that was right on Triton 3.6 (module docstring).
WS_WARPS = 4        # 8 warps: the loop is not specialised at all
WS_RING = 2         # K/V buffers in flight; 3 or more miscompiled (NaN)
WS_MIN_ROWS = 128   # two consumer warpgroups x 64 wgmma rows
WS_MIN_KEYS = 64    # 32-key blocks were right but 25% slower than 64 (S=8192, D=128)
ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
MAX_BOX = 256        # TMA box extent limit per dimension (elements)
_SCALAR = re.compile(r"^(ax_[A-Za-z_0-9]+|[0-9]+)$")  # program-constant index codes


class DescriptorState:
    """What one kernel's emitter made: descriptors, and the loads it left as pointers."""

    def __init__(self):
        self.made: dict[tuple, str] = {}           # key -> descriptor variable
        self.row_dims: dict[str, set[int]] = {}    # tensor -> dims used as a tile's row dim
        self.pointer_loads = 0                     # loads that stay pointer loads under TMA
        self.desc_loads = 0


def _tile_dims(em, tensor: str, idx) -> tuple | None:
    """(scalar base terms, (dim, axis) of the row, (dim, axis) of the column) when the
    access is a descriptor tile, else None."""
    shape = em.p.shape_of(tensor)
    if em.p.dtype_of(tensor) not in ELEM_BYTES or len(idx) != len(shape) or len(idx) < 2:
        return None
    base, tiles = [], []
    for k, tile in enumerate(idx):
        if not tile.axes:
            if not _SCALAR.match(tile.code):
                return None  # a data-dependent scalar: its value is not known in the prologue
            if tile.code != "0":
                base.append(f"{tile.code} * {tensor}_s{k}")
        elif len(tile.axes) == 1 and tile.code == f"offs_{tile.axes[0]}" and tile.axes[0] in em.ranges:
            tiles.append((k, tile.axes[0]))
        else:
            return None  # packed rows, shifted or computed indices: pointer loads
    if len(tiles) != 2 or tiles[0][1] == tiles[1][1] or tiles[1][0] != len(shape) - 1:
        return None
    elem = ELEM_BYTES[em.p.dtype_of(tensor)]
    for n, (_, axis) in enumerate(tiles):
        fixed = em.plan.whole_axes.get(axis) if axis in em.plan.whole_axes else None
        if fixed is not None and (fixed > MAX_BOX or (n == 1 and (fixed * elem) % 16)):
            return None  # box too large, or an inner row under 16 bytes
    return tuple(base), tiles[0], tiles[1]


def _descriptor(em, tensor: str, dims) -> tuple[str, list[str]]:
    """The descriptor variable (made once in the prologue) and the tile's start offsets."""
    base, (dp, ap), (dq, aq) = dims
    state: DescriptorState = em.desc
    (sp, bp), (sq, bq) = em.ranges[ap], em.ranges[aq]
    key = (tensor, base, dp, ap, aq, bp, bq)
    name = state.made.get(key)
    if name is None:
        name = state.made[key] = f"{tensor}_desc{len(state.made) + 1}"
        ptr = " + ".join([f"{tensor}_ptr", *base])
        em.emit(f"if {TMA_FLAG}:", 0)
        em.emit(f"    {name} = tl.make_tensor_descriptor({ptr}, shape=[{bp}, {bq}], "
                f"strides=[{tensor}_s{dp}, 1], block_shape=[{em.block(ap)}, {em.block(aq)}])", 0)
        state.row_dims.setdefault(tensor, set()).add(dp)
    return name, [sp, sq]


def load(em, tensor: str, idx, axes: tuple, pointer_code: str, scope: int) -> str | None:
    """Emit the TMA / pointer load pair into ``scope``; the variable, or None when the
    access is no descriptor tile (the caller emits the pointer load)."""
    dims = _tile_dims(em, tensor, idx)
    if dims is None:
        em.desc.pointer_loads += 1
        return None
    name, starts = _descriptor(em, tensor, dims)
    code = f"{name}.load([{', '.join(starts)}])"
    if tuple(axes) != (dims[1][1], dims[2][1]):  # tensor dim order is not the tile's order
        code = f"tl.trans({code})"
    v = em.new()
    em.emit(f"if {TMA_FLAG}:", scope)
    em.emit(f"    {v} = {code}", scope)
    em.emit("else:", scope)
    em.emit(f"    {v} = {pointer_code}", scope)
    em.desc.desc_loads += 1
    return v


def store(em, tensor: str, idx, axes: tuple, value_code: str, pointer_line: str) -> bool:
    """Emit a TMA / pointer store pair; False when the store is no descriptor tile."""
    dims = _tile_dims(em, tensor, idx)
    if dims is None:
        return False
    name, starts = _descriptor(em, tensor, dims)
    if tuple(axes) != (dims[1][1], dims[2][1]):
        value_code = f"tl.trans({value_code})"
    em.emit(f"if {TMA_FLAG}:")
    em.emit(f"    {name}.store([{', '.join(starts)}], {value_code})")
    em.emit("else:")
    em.emit(f"    {pointer_line}")
    return True


def main_loop_header(lo: str, hi: str, step: str) -> str:
    """The key loop the config may pipeline deeper and warp-specialise (constexprs: the
    loop's stage count, ``WS``).  Only the main loop of a pass gets them: the causal
    boundary loops stay plain (specialising them too failed to compile on Triton 3.6).
    Specialised, the loop's stage count is the depth of the producer's K/V ring, which is
    held at ``WS_RING`` whatever the config asks: a deeper ring miscompiled (NaN)."""
    return (f"for l0 in tl.range({lo}, {hi}, {step}, "
            f"num_stages={WS_RING} if {WS_FLAG} else {STAGES_FLAG}, warp_specialize={WS_FLAG}):")


def warp_specializable(state: DescriptorState, plan, has_data_masks: bool,
                       has_dot: bool = True) -> tuple[int, ...]:
    """Warp counts at which warp-specialised configs are worth compiling (empty: none).
    Triton's warp specialisation of the loop needs every load of the kernel to be a TMA
    load (one pointer load, even outside the loop, failed for sm_90 with 'unsupported load
    type for producer commit'), and a body without data-dependent branches or nested
    chunk loops; split-k kernels are left out (partial stores and a semaphore after the
    loop).  Only the form measured right on Triton 3.6 (module docstring) is offered: one
    pass whose one loop holds a contraction, specialised at ``WS_WARPS`` warps.  Causal
    (mask-bounded) kernels get none: their boundary loops beside the main loop failed to
    compile with 4 warps, and with 8 Triton left the loop unspecialised."""
    if not (state.desc_loads > 0 and state.pointer_loads == 0 and not plan.split
            and not plan.chunked and not has_data_masks):
        return ()
    if not has_dot or len(plan.passes) != 1 or any(ps.bound_atoms for ps in plan.passes):
        return ()
    return (WS_WARPS,)


def collect(states: list[DescriptorState]) -> dict[str, tuple[int, ...]]:
    """tensor -> the dims its descriptor tiles use as rows, over every kernel of a module
    (what the launcher checks for 16-byte strides besides the dims indexed by scalars)."""
    out: dict[str, set[int]] = {}
    for st in states:
        for t, dims in st.row_dims.items():
            out.setdefault(t, set()).update(dims)
    return {t: tuple(sorted(d)) for t, d in out.items()}

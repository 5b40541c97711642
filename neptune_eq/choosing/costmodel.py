"""GPU cost model: predicted time of a lowered candidate on a device, per tile config.

Extraction's term cost (``extract.CostModel``) ranks terms inside the e-graph; this model
ranks *kernels*: it walks a tile plan and counts, for a given row/key block and split
factor,

* launches (split-k adds the combine kernel),
* HBM bytes: every input tensor once per pass that reads it (tiles re-read by other
  row blocks come from L2), outputs, and split-k scratch written and read back,
* tensor-core FLOPs of the ``tl.dot`` contractions *including padding* (a decode row
  block of 16 rows for one query pays 16x),
* SFU ops (exp, exp2, log, tanh, sqrt, sin, cos, erf) and other elementwise ops per tile element,
* grid fill: programs vs SMs, with wave quantisation; a grid smaller than the GPU gets
  only its share of bandwidth and compute -- which is why decode wants split-k;
* per tile config (``config_seconds``): registers per thread (fold states, score tiles,
  resident operands of the pointer form) against the 255 of sm_90 -- a spilling shape pays
  in proportion -- and whether the row block lets Triton issue ``wgmma`` (>= 64 rows per
  warpgroup), calibrated on ptxas's own counts (``bench/static_sm90.py``).

time = max(bytes / BW_eff, compute / fill, program waves * loop steps * step latency)
       + waves * passes * pass latency
       + launches * launch overhead.  Device constants
are measured (``bench/results``): H200 copy 4.3 TB/s, fp16 dense dot 790 TFLOP/s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir import Term, free_axes, rename_axis
from ..lowering.lower import TilePlan
from ..lowering.split_plan import split_factors

SFU_OPS = {"exp", "exp2", "log", "tanh", "sqrt", "rsqrt", "sin", "cos", "erf"}
ELEMENTWISE = {"add", "sub", "mul", "div", "maximum", "minimum", "where", "neg", "abs", "lt",
               "le", "gt", "ge", "eq", "ne", "and", "or", "not", "cast",
               "bitand", "bitor", "bitxor"}
_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "bool": 1}


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    hbm_bytes_per_s: float   # achieved device-to-device copy bandwidth
    dot_flops: float         # achieved fp16/bf16 dense tensor-core rate
    sfu_per_s: float         # exp2-class ops per second, whole GPU
    alu_per_s: float         # fp32 elementwise ops per second, whole GPU
    launch_s: float = 4e-6   # launch + tail of one kernel
    pass_s: float = 1e-6     # a pass over memory starts with a DRAM round trip and pipeline fill
    iter_s: float = 0.6e-6   # one pipelined loop step of a program that has its SM to itself
    occupancy: int = 2       # programs resident per SM that hide each other's latency
    bw_per_sm_share: float = 1.3  # one program streams ~1.3x an SM's fair share of bandwidth
    # fp32 atomic adds resolved in L2 (a scattered output's per-block terms): assumed at
    # twice the copy bandwidth until bench/backward_gpu.py measures the fused backward
    atomic_bytes_per_s: float = 8e12


FEW_ROW_RESIDENT = 8  # programs of < 16 rows resident per SM (see ``estimate``)


# Measured on the devices (bench/results/README.md: copy and 8192^3 matmul, same process).
# SFU/ALU from the SM's issue rates (16 MUFU, 128 FP32 lanes per SM per clock, 1.755 GHz).
DEVICES = {
    "H200": Device("H200", 132, 4.3e12, 790e12, 132 * 16 * 1.755e9, 132 * 128 * 1.755e9),
    "H100": Device("H100", 132, 3.0e12, 760e12, 132 * 16 * 1.755e9, 132 * 128 * 1.755e9),
}
DEFAULT_DEVICE = "H200"


def device_for(name: str | None) -> Device:
    """The device entry whose key appears in ``name`` (a torch device name); H200 else."""
    for key, dev in DEVICES.items():
        if name and key in name.upper():
            return dev
    return DEVICES[DEFAULT_DEVICE]


@dataclass
class Estimate:
    seconds: float
    launches: int
    hbm_bytes: float
    dot_flops: float
    sfu_ops: float
    alu_ops: float
    programs: int
    fill: float             # fraction of the GPU the grid keeps busy
    config: dict

    def describe(self) -> str:
        return (f"{self.seconds * 1e6:.1f} us predicted: {self.launches} launch(es), "
                f"{self.hbm_bytes / 1e6:.2f} MB HBM, {self.dot_flops / 1e9:.2f} GFLOP dot, "
                f"{self.sfu_ops / 1e6:.2f} M SFU, {self.programs} programs ({self.fill:.0%} of SMs)")


def _tile_elems(t: Term, dims: dict[str, int]) -> int:
    return math.prod(dims.get(a, 1) for a in free_axes(t))


def _count_ops(body: Term, dims: dict[str, int], seen: set) -> tuple[float, float, float]:
    """(dot flops, sfu ops, alu ops) of one evaluation of ``body`` on tiles of ``dims``."""
    dot = sfu = alu = 0.0
    nodes = list(body.walk())
    for n in nodes:  # contractions first: their products are the dot's, not elementwise
        if n.op in ("sum", "rollsum", "splitk") and n.args[0].op == "mul" and n not in seen:
            a, b = n.args[0].args
            if n.val in free_axes(a) & free_axes(b) and min(len(free_axes(a)), len(free_axes(b))) >= 2:
                dot += 2.0 * _tile_elems(n.args[0], dims)  # M·N·K multiply-adds
                seen.update((n, n.args[0]))
    for n in nodes:
        if n in seen:
            continue
        seen.add(n)
        elems = _tile_elems(n, dims)
        if n.op in SFU_OPS:
            sfu += elems
        elif n.op in ELEMENTWISE or n.kind == "reduce":
            alu += elems
    return dot, sfu, alu


def estimate(plan: TilePlan, device: Device, block_rows: int, block_keys: int,
             splits: int = 0) -> Estimate:
    p = plan.program
    ex = p.extents
    row_blocks = -(-plan.row_extent // block_rows)
    grid = 1
    for a in plan.grid_axes:
        grid *= plan.grid_extent(a)
    programs = row_blocks * grid * max(1, splits)
    hbm = 0.0
    atomics = 0.0  # fp32 bytes added into scattered outputs (resolved in L2)
    dot = sfu = alu = 0.0
    steps = 0  # loop steps one program runs (a split runs its chunk only)
    for ps in plan.passes:
        # each input read by this pass once (the loop's tiles are shared through L2)
        read = {n.val for f in ps.folds for n in f.term.walk() if n.op == "load"}
        hbm += sum(math.prod(ph.shape) * _BYTES.get(ph.dtype, 4) for ph in p.inputs if ph.name in read)
        visible = ps.extent
        if ps.lo_offset is not None or ps.hi_offset is not None:
            lo = ps.lo_offset if ps.lo_offset is not None else -ex[plan.block_axis]
            hi = ps.hi_offset if ps.hi_offset is not None else ps.extent
            # mean visible keys over the rows of one row block (causal: about half)
            mean_row = ex[plan.block_axis] / 2 if not plan.packed else 0
            span = min(ps.extent, mean_row + hi + block_rows / 2) - max(0, mean_row + lo - block_rows / 2)
            visible = max(block_keys, min(ps.extent, span))
        iters = math.ceil(visible / block_keys)
        # a chunked inner contraction is a loop inside each step: its chunks are serial too
        inner = math.prod(math.ceil(ex[a] / plan.whole_axes[a]) for a in plan.chunked
                          if any(n.kind == "reduce" and n.val == a for f in ps.folds
                                 for n in f.term.walk()))
        # (a pass after the split one runs whole in the combine: not cut by the split)
        cut = max(1, splits) if ps is plan.passes[0] else 1
        steps = max(steps, math.ceil(iters / cut) * inner)
        dims = {plan.block_axis: block_rows, **plan.whole_axes}
        # an inner contraction looped in chunks still does all of its work per key block
        dims.update({a: ex[a] for a in plan.chunked})
        seen: set = set()
        dims["@L"] = block_keys  # every fold of the pass shares one loop variable
        for f in ps.folds:
            d, s, a = _count_ops(rename_axis(f.term, f.axis, "@L"), dims, seen)
            dot, sfu, alu = dot + d * iters * row_blocks * grid, sfu + s * iters * row_blocks * grid, \
                alu + a * iters * row_blocks * grid
        for sc in ps.scattered:  # its sum over the row block (a product), then atomic adds
            body = Term("sum", (rename_axis(sc.term.args[0], sc.axis, "@L"),), plan.block_axis)
            d, s, a = _count_ops(body, dims, seen)
            n = iters * row_blocks * grid
            dot, sfu, alu = dot + d * n, sfu + s * n, alu + a * n
            width = math.prod(plan.whole_axes.get(x, 1) for x in sc.axes if x != sc.loop_axis)
            adds = block_keys * width
            if getattr(sc, "at", None):  # at a computed index: one add per pair, or per
                # diagonal where the index reads rows and keys only through r − j, or per
                # entry of a small table summed along its diagonals
                per, levels = sc.entry_sums(), (block_rows - 1) // block_keys + 2
                adds = per[1] if per else block_keys * (
                    levels if sc.diagonal() else block_rows)
                if per:  # the [keys × entries] select a q-level
                    alu += block_keys * (1 << (per[1] - 1).bit_length()) * levels * n
            atomics += 4.0 * adds * n
    col_passes = [e for e in plan.epilogue if e.loop_axes]
    for e in col_passes:  # softmax's normalisation re-reads its input
        read = {n.val for n in e.expr.walk() if n.op == "load"}
        hbm += sum(math.prod(ph.shape) * _BYTES.get(ph.dtype, 4) for ph in p.inputs if ph.name in read)
    for name in p.outputs:
        hbm += math.prod(p.shape_of(name)) * _BYTES.get(p.dtype_of(name), 4)
    if splits:
        state = sum(block_rows * math.prod(plan.whole_axes.get(a, 1) for a in f.state_axes)
                    for f in plan.passes[0].folds)
        hbm += 2.0 * 4 * state * row_blocks * grid * splits  # scratch written, then read
    busy = min(programs, device.sms)
    waves = math.ceil(programs / device.sms)
    # programs resident on an SM hide each other's round trips; a few-row program (a
    # row-wise chain's 1-8 rows on 4-8 warps) leaves room for many more than a tile's
    resident = device.occupancy if block_rows >= 16 else FEW_ROW_RESIDENT
    fill = programs / (waves * device.sms)
    bw = device.hbm_bytes_per_s * min(1.0, device.bw_per_sm_share * busy / device.sms)
    compute = dot / device.dot_flops + sfu / device.sfu_per_s + alu / device.alu_per_s
    launches = plan.launches
    starts = waves if block_rows >= 16 else math.ceil(programs / (device.sms * resident))
    serial = starts * (len(plan.passes) + len(col_passes)) * device.pass_s
    # a program's loop steps are serial: few programs with long loops are latency-bound
    latency = math.ceil(programs / (device.sms * resident)) * steps * len(plan.passes) * device.iter_s
    seconds = max(hbm / bw + atomics / device.atomic_bytes_per_s, compute / max(fill, 1e-9),
                  latency) + serial + launches * device.launch_s
    cfg = {"block_rows": block_rows, "block_keys": block_keys, "splits": splits}
    return Estimate(seconds, launches, hbm, dot, sfu, alu, programs, fill, cfg)


def best_estimate(plan: TilePlan, device: Device, few_rows: tuple = ()) -> Estimate:
    """The cheapest tile config of the plan under the model (block sizes, split factor).
    ``few_rows``: (rows, keys, splits) of the few-row shapes the kernel is offered
    (``tile_configs.ROW_WISE_SHAPES``, ``whole_row_shapes``), weighed too."""
    rows_opts = (16,) if plan.row_extent <= 16 else (64, 128)
    keys = plan.passes[0].extent if plan.passes else 1
    out = [estimate(plan, device, br, bk, sp if plan.split else 0) for br, bk, sp in few_rows]
    for br in rows_opts:
        for bk in (32, 64, 128):
            if plan.split:
                base = -(-plan.row_extent // br) * math.prod(plan.grid_extent(a) for a in plan.grid_axes)
                for k in split_factors(base, keys, bk, device.sms, past_waves=True):
                    out.append(estimate(plan, device, br, bk, k))
            else:
                out.append(estimate(plan, device, br, bk))
    return min(out, key=lambda e: e.seconds)


# Lowering choices the model cannot derive from counts: measured on an H200 for a
# hand-written FlashAttention forward (issue 16): pointer loads 480 TFLOP/s, tensor
# descriptors 524 (x0.92 time), descriptors + warp-specialised key loop 546 (x0.88).
# They rank variants of one tile shape among themselves; shapes are ranked by ``estimate``.
LOWERING_FACTOR = {"pointer": 1.0, "tma": 0.92, "warp_specialized": 0.88}


def config_seconds(plan: TilePlan, device: Device, cfg) -> float:
    """Predicted time of ``plan`` under tile config ``cfg`` (a ``runtime.tile_configs.TileConfig``):
    the count-based ``estimate``, times the lowering factor, times what the compiler makes
    of the tile shape -- register spills and whether the products can be Hopper ``wgmma``."""
    rows = cfg.blocks.get(f"B_{plan.block_axis}", 16)
    keys = cfg.blocks.get("B_L", 16)
    est = estimate(plan, device, rows, keys, cfg.splits if plan.split else 0)
    kind = "warp_specialized" if cfg.warp_specialize else "tma" if cfg.tma else "pointer"
    seconds = est.seconds
    if est.dot_flops and not wgmma_shape(rows, cfg.num_warps):
        # mma.sync instead of wgmma: about half the tensor-core rate on sm_90
        seconds += est.dot_flops / device.dot_flops / max(est.fill, 1e-9)
    excess = registers_per_thread(plan, rows, keys, cfg.num_warps, cfg.tma) - REGISTERS
    if excess > 0:  # spilled: local-memory traffic in the loop, growing with the excess
        seconds *= 1.0 + excess / 128.0
    return seconds * LOWERING_FACTOR[kind]


# What ptxas does with a tile shape, calibrated on the sm_90 cross-compile of the causal
# forward and its dQ and dK/dV kernels at D = 64 and 128 (bench/results/static_sm90*.md: the
# estimate below separates the spilling configs from the others in 63 of the 72 rows;
# the misses are near the cap: at most 72 bytes spilled, or predicted 258 unspilled).
REGISTERS = 255          # per thread on sm_90
REGISTER_BASE = 50       # indices, masks, row statistics, pipeline bookkeeping
LIVE_STEP_TILES = 2      # [rows x keys] fp32 tiles live in a loop step (S and P; dP and dS)
MMA_SYNC_EXTRA = 100     # mma.sync (no wgmma) takes both operands from registers


def wgmma_shape(rows: int, warps: int) -> bool:
    """Triton issues wgmma when each warpgroup (4 warps) gets at least 64 rows."""
    return rows // max(1, warps // 4) >= 64


def registers_per_thread(plan: TilePlan, rows: int, keys: int, warps: int, tma: bool) -> float:
    """Estimated 32-bit registers per thread: the folds' fp32 states (accumulators stay in
    registers across the loop), the score tiles of one loop step, and -- in the pointer
    form -- loop-invariant operand tiles (Q in the forward; K and V in dK/dV), which tensor
    descriptors leave in shared memory."""
    threads = 32 * warps
    whole = plan.whole_axes
    words = 0.0
    for ps in plan.passes:
        for f in ps.folds:
            cols = math.prod(whole.get(a, 1) for a in f.state_axes if a not in plan.row_axes)
            words += (rows if plan.block_axis in f.state_axes else 1) * cols
    words += LIVE_STEP_TILES * rows * keys
    for ps in plan.passes:  # a scattered output's term of one step: [keys x width] fp32
        for sc in ps.scattered:
            words += keys * math.prod(whole.get(a, 1) for a in sc.axes if a != sc.loop_axis)
    if not tma:
        tiles = {}  # (role, input) -> 32-bit words of its tile held in registers

        def tile_words(n: Term, lead: int) -> float:
            size = lead * math.prod(whole[a] for a in free_axes(n) if a in whole)
            return size / 2 if plan.program.dtype_of(n.val) in ("float16", "bfloat16") else size
        for ps in plan.passes:
            for f in ps.folds:
                for n in f.term.args[0].walk():
                    axes = free_axes(n)
                    if n.op != "load" or not axes & set(whole):
                        continue
                    if f.axis not in axes and plan.block_axis in axes:
                        tiles["resident", n.val] = tile_words(n, rows)  # the whole loop
                    elif f.axis in axes:
                        # a loop-moving tile passes through registers on its way to
                        # shared memory (one of them at a time: half their sum)
                        tiles["moving", n.val] = tile_words(n, keys) / 2
        words += sum(tiles.values())
    extra = 0 if wgmma_shape(rows, warps) else MMA_SYNC_EXTRA
    return REGISTER_BASE + extra + words / threads

"""The Gluon form's output tile stored through shared memory by the TMA engine.

A consumer warpgroup ends each tile with its 64 rows of the rolling state's columns (the
normalised ``o``).  Stored from the wgmma accumulator's registers, each thread writes two
16-bit elements a store (``STG.E``, 32 a thread at 128 columns, each warp's store touching
8 rows at half a sector; Triton 3.6's SASS), and the warpgroup waits for the issue of all
of them before its next tile.  FlashAttention-3 writes the tile to shared memory instead
and lets the TMA engine store it while the warpgroup goes on.  This module emits that
store where a pass's output is such a tile:

    wait for this buffer's last TMA store to have read it  (tma.store_wait(0))
    write the tile into the warpgroup's buffer             (o_smem.index(WHICH))
    fence the generic-proxy writes for the async proxy     (fence_async_shared)
    issue the TMA store of [64, width] at the tile's row

and before the program ends, waits for the last one.  A tile that runs past the rows of
its head keeps the pointer store: the descriptor is over the flattened (heads · rows,
width) view, where rows past one head's end are the next head's.

It is a compile-time choice (``TMA_O``, a constexpr the launcher sets): the two 64-row
buffers cost ``2 · 64 · width · 2`` bytes of shared memory (32 KiB at width 128), which
a 3-deep ring of 128-key blocks at width 128 leaves no room for.  Measured on an H200
against the pointer store, the product's forms with ``TMA_STORE`` off and on, same
process, CUDA graphs, outputs bit-identical (``bench/gluon_probe/tma_store_epilogue.py``,
bench/results/s45/): GQA 64/8 S=512 22.7 -> 19.1 us (+19%), 13 documents S=8192 +8% (one
program per tile) and +6% (the dynamic walk), causal D=64 B=4 S=5000 +2%, GQA 16/8 causal
S=3000 +2%, causal D=128 S=8192 +0.3%, global D=64 -0.5%.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .gluon_tiles import ROWS, flat_row

# NEPTUNE_EQ_GLUON_TMA_STORE=0: every output by pointer stores, as before session 45 (A/B)
TMA_STORE = os.environ.get("NEPTUNE_EQ_GLUON_TMA_STORE", "1") == "1"


@dataclass(frozen=True)
class TileStore:
    """The output a form stores by TMA: its tensor, the flattened view's row of a tile's
    first row less the tile's own offset (``my_first``), and its width."""
    tensor: str
    row_base: str
    width: int


def tile_store(em, name: str, idx: list, axes: tuple, value_code: str,
               pointer_line: str) -> TileStore | None:
    """Emit the TMA store of ``name``'s tile (``value_code``, already in the output dtype)
    with ``pointer_line`` kept for a ragged tile and for ``TMA_O`` off; None (nothing
    emitted) when the store is not such a tile: one output per form, indexed
    (grid axes…, rows, the state's columns) in that order, of the streamed dtype."""
    plan, p = em.plan, em.p
    ba, col = plan.block_axis, em.col
    dims = [i.axes for i in idx]
    n = len(dims)
    if (em.o_store is not None or n < 2 or dims[-2] != (ba,) or dims[-1] != (col,)
            or any(d for d in dims[:-2]) or tuple(axes) != em.canon((ba, col))
            or p.dtype_of(name) != em.stream_dtype or plan.whole_axes.get(col) is None):
        return None
    store = TileStore(name, flat_row(name, [i.code for i in idx[:-2]]), plan.whole_axes[col])
    em.emit("if TMA_O:  # through shared memory: the TMA engine stores while we go on")
    em.emit(f"    if my_first + {ROWS} <= {plan.row_extent}:")
    for ln in ("tma.store_wait(0)  # this buffer's last store has read it",
               f"o_smem.index(WHICH).store({value_code})",
               "fence_async_shared()",
               f"tma_store(o_desc, [{store.row_base} + my_first, 0], o_smem.index(WHICH))"):
        em.emit("        " + ln)
    em.emit("    else:  # past the rows: the flattened view's next rows are another head's")
    em.emit(f"        {pointer_line}")
    em.emit("else:")
    em.emit(f"    {pointer_line}")
    return store


def program_end() -> list[str]:
    """A consumer's last lines: its buffer's store must have read shared memory before
    the program's shared memory goes (``tma.store_wait`` is a no-op with none pending)."""
    return ["    if TMA_O:", "        tma.store_wait(0)  # the last tile's store"]


def allocation(consumers: int) -> list[str]:
    """The main kernel's lines giving each consumer its buffer (none with ``TMA_O`` off:
    the name stays bound to the row tiles, never used)."""
    return ["    if TMA_O:",
            f"        o_smem = gl.allocate_shared_memory(o_desc.dtype, [{consumers}, {ROWS}, "
            "o_desc.block_type.shape[1]], o_desc.layout)",
            "    else:",
            "        o_smem = a_smem"]

"""Tile configs: what a kernel can be launched with, and the grid of them a choice times.

A ``TileConfig`` is one launch shape of a generated kernel -- block sizes, warps, pipeline
stages, split-k chunks and the lowering choices the kernel's constexprs switch (tensor
descriptors, warp specialisation, one-launch split-k, CUDA-core contractions, the Gluon
form).  ``candidate_configs`` offers the handful worth timing for a kernel on a target;
the cost model prunes them (``choosing.choose.prune_configs``) and the timer picks.
Launching a config is ``runtime.launcher``'s job.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..lowering.codegen import VDOT_ROWS
from ..lowering.gluon_form import SMEM_BYTES
from ..lowering.kernelgen import KernelSource
from ..lowering.split_plan import split_factors
from .gluon_device import gluon_unavailable


@dataclass
class TileConfig:
    blocks: dict[str, int]
    num_warps: int = 4
    num_stages: int = 2
    splits: int = 0          # split-k chunks (0: not a split-k kernel)
    fused: bool = False      # split-k in one launch (the last chunk combines)
    tma: bool = False        # tiles through tensor descriptors (lowering/descriptors.py)
    warp_specialize: bool = False  # the main key loop warp-specialised (needs tma)
    loop_stages: int = 0     # pipeline depth of the main key loop (0: num_stages)
    gluon_ws: bool = False   # the warp-specialised Gluon form (lowering/gluon_ws.py);
    #                          num_stages is then the depth of its TMA ring
    vector_dot: bool = False  # contractions on the CUDA cores, not tl.dot (codegen.VDOT)
    per_tile: bool = False   # a persistent Gluon form launched one program per tile
    #                          (``gluon_launch.GluonLauncher``: the walk is a launch choice)
    one_loop: bool = False   # a data mask's key range as one masked loop (block_ranges)
    heads_first: bool = False  # a Gluon form's programs, one per tile, dispatched heads
    #                            first (``gluon_tiles.grid_order``: a launch choice)
    dynamic: bool = False    # a data mask's Gluon tiles taken from a counter by one
    #                          program per SM (``GluonForm.dynamic``: its own compile)

    def __str__(self):
        b = " ".join(f"{k}={v}" for k, v in self.blocks.items())
        sp = f" splits={self.splits}" if self.splits else ""
        sp += " one-launch" if self.fused else ""
        sp += " tma" if self.tma else ""
        sp += " warp-specialized" if self.warp_specialize else ""
        sp += f" loop-stages={self.loop_stages}" if self.loop_stages else ""
        sp += " gluon-ws" if self.gluon_ws else ""
        sp += " cuda-cores" if self.vector_dot else ""
        sp += " one-program-per-tile" if self.per_tile else ""
        sp += " one-loop" if self.one_loop else ""
        sp += " heads-first" if self.heads_first else ""
        sp += " dynamic-walk" if self.dynamic else ""
        return f"{b} warps={self.num_warps} stages={self.num_stages}{sp}"

    def at(self, values: dict) -> "TileConfig":
        """This config at the given sizes: a split factor chosen for a bucket is an
        expression of the named sizes (more keys, more chunks)."""
        from ..sizes import value
        return replace(self, splits=max(1, value(self.splits, values)) if self.splits else 0)

    def as_dict(self) -> dict:
        return {"blocks": dict(self.blocks), "num_warps": self.num_warps,
                "num_stages": self.num_stages, "splits": self.splits, "fused": self.fused,
                "tma": self.tma, "warp_specialize": self.warp_specialize,
                "loop_stages": self.loop_stages, "gluon_ws": self.gluon_ws,
                "vector_dot": self.vector_dot, "per_tile": self.per_tile, "one_loop": self.one_loop,
                "heads_first": self.heads_first, "dynamic": self.dynamic}

    @property
    def compiled_as(self) -> "TileConfig":
        """The config whose compiled kernel this one launches: the launch-only choices
        (one program per tile, heads first) dropped."""
        return replace(self, per_tile=False, heads_first=False)

    @property
    def pointer_form(self) -> "TileConfig":
        """The same tiles with pointer loads (where descriptors cannot be used)."""
        return replace(self, tma=False, warp_specialize=False)


def _tiled_blocks(ks: KernelSource) -> list[str]:
    """The block sizes a tile config sets: rows, keys and the epilogue's column block."""
    return [k for k in ks.tunables if k in ("B_L", "B_C") or k == f"B_{ks.block_axis}"]


# A chain without a contraction (a norm, a softmax, a log-sum-exp over rows) has no
# tensor-core tile to fill, and at 32+ rows a program 4096 rows make at most 128 programs:
# under one per SM, each streaming 32 whole rows.  H200, fp32, 4096 x 4099
# (``bench/gpu_validate_chains.py``, session 41): variance ran 234 us against torch eager's
# 50, log-softmax 190 against 56.  Where so few programs would run, a few rows a program
# are offered too -- timing decides.
FEW_PROGRAMS = 4   # x the SM count: below it, rows-per-program shapes are offered
ROW_WISE_SHAPES = ((4, 512, 4, 3), (8, 256, 4, 3), (2, 1024, 4, 3))
# ... and, where a row's loop fits one tile, the whole row in one step: no ragged block,
# and the epilogue's second read of the row follows the first at once.  Same chains and
# GPU, every 1-4 rows x 1024-8192 columns x 4-16 warps x 1/3 stages timed
# (``bench/probe/rowwise_probe.py``, session 42): one-step tiles of 8192 ran 37.8-42.0 us
# for log-softmax and softmax-one (torch eager 56 / 201; the offered shapes' best 67-70),
# two steps of 4096 43-66.  These three were within 3% of the best of each chain's plans;
# 2 rows on 4 warps, as fast, is over the cost model's register cap.
WHOLE_ROW_MAX = 8192
WHOLE_ROW_SHAPES = ((1, 4, 1), (1, 8, 1), (2, 8, 1))  # (rows, warps, stages)


def whole_row_shapes(ks: KernelSource) -> tuple:
    """``ROW_WISE_SHAPES``' one-step kin: (rows, keys, warps, stages) with the keys the
    loops' longest extent rounded up to a power of two, where that is at most
    ``WHOLE_ROW_MAX`` (extents from the kernel's ``EVEN_`` flags)."""
    rows = f"B_{ks.block_axis}"
    if ks.split_extent:  # a split of one chunk is the same loop plus a combine
        return ()
    ext = max((n for b, ns in ks.even_flags.values() if b != rows for n in ns
               if isinstance(n, int)), default=0)
    if not ext or ext > WHOLE_ROW_MAX:
        return ()
    keys = 1 << (ext - 1).bit_length()
    return tuple((r, keys, w, s) for r, w, s in WHOLE_ROW_SHAPES)


OFF_TENSOR_CORE_KEY_BLOCKS = (16, 32, 64)  # key blocks of a few-row kernel with no tl.dot (below)


def candidate_configs(ks: KernelSource, target: str, sms: int = 132) -> list[TileConfig]:
    """Tile configs to try: one small config in the interpreter, a handful on the GPU."""
    tun = _tiled_blocks(ks)
    if target == "interpreter":
        splits = min(3, max(1, -(-ks.split_extent // 16))) if ks.split_extent else 0
        return [TileConfig({k: 16 for k in tun}, 4, 1, splits)]
    wide = max([v for k, v in ks.tunables.items() if k not in tun] or [16])
    shapes = ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
              (64, 128, 4, 2), (32, 128, 4, 3))
    decode = ks.row_extent <= 16
    has_dot = "tl.dot(" in ks.source
    if decode:  # one row block; the loop block and split matter
        # 32-key blocks split 32 ways were the fastest GQA decode at 2048 keys on the GPU
        # alone; 256-key blocks never were (bench/results/decode_configs_h100.md).  128
        # keys at 8 warps was never the only best config of a case (GRID_EVIDENCE),
        # so that shape is not compiled.
        shapes = ((16, 32, 4, 3), (16, 64, 4, 3), (16, 128, 4, 3))
        if not ks.split_extent:
            # A single-pass decode is short (long ones split): host-bound, so the loop block
            # hardly moves its time, but it is the accuracy granularity -- P is re-based per
            # key block (TilePlan.block_rebase), one exact p = 1 each; 64 keys match the
            # split length of FlashDecoding-style kernels.
            shapes = ((16, 64, 4, 3), (16, 64, 4, 4), (16, 64, 8, 3), (16, 32, 4, 3))
        if not has_dot and len(ks.tunables) > len(tun):
            # Products over a whole axis off the tensor cores (a captured per-key table's
            # gradient: one key per program, its few head rows, the queries looped): no
            # row padding to 16 to pay for, and its [rows, keys, width] products at 16 x 64
            # x 64 floats overflowed shared memory in every config (795 KB against 227 KB
            # on the H200).  Its exact rows (a power of two), short key blocks.
            rows = 1 << max(0, (ks.row_extent - 1).bit_length())
            shapes = tuple((rows, keys, 4, 2) for keys in OFF_TENSOR_CORE_KEY_BLOCKS)
    if not decode and not has_dot and \
            -(-ks.row_extent // 32) * ks.grid_size < FEW_PROGRAMS * sms:
        shapes += ROW_WISE_SHAPES + whole_row_shapes(ks)
    out = []
    for bi, bl, w, s in shapes:
        if wide > 128 and bi * bl > 128 * 64:
            continue
        blocks = {}
        for k in tun:
            blocks[k] = bi if k == f"B_{ks.block_axis}" else bl
        programs = -(-ks.row_extent // bi) * ks.grid_size
        splits = split_factors(programs, ks.split_extent, bl, sms) if ks.split_extent else [0]
        if decode and bl == 128 and ks.split_extent >= 4 * bl:
            # a decode split in two: its combine reads the fewest partials, and with the
            # K/V cache out of L2 it was the fastest decode of 32 heads at 2048 and 8192
            # keys (bench/results/decode_configs_h100.md) -- at 128 keys a step; with
            # 32 or 64 it was at most 0.90x the best of its case (GRID_EVIDENCE)
            splits = sorted(set(splits) | {2})
        for sp in splits:
            out.append(TileConfig(blocks, w, s, sp))
            if sp and not (decode and ks.row_extent > 1):
                # and split-k in one launch: timing decides.  Not for a decode of packed
                # rows (GQA's heads of a group; several queries pack the same way): its
                # last program folds every row's partials alone, and it was at most 0.84x
                # the best of its case (GRID_EVIDENCE)
                out.append(TileConfig(blocks, w, s, sp, fused=True))
    # A decode's loads are a few rows and a stream of keys: with tensor descriptors it was
    # at most 0.91x the best of its case (GRID_EVIDENCE), so the variants are not offered
    variants = [] if decode else lowering_variants(ks, out)
    return out + one_loop_configs(ks, out) + variants + gluon_configs(ks) + vector_dot_configs(ks, sms)


# The tile shapes whose one-loop form is timed (``TileConfig.one_loop``): 64x64 was the
# fastest form of 64 documents in 8192 keys (0.080 ms against its three loops' 0.094, H200
# fp16 H=16 D=128), 128x64 the next (0.106); the others lost to these with either form.
ONE_LOOP_SHAPES = ((64, 64, 4), (128, 64, 8))


def one_loop_configs(ks: KernelSource, pointer_configs: list[TileConfig]) -> list[TileConfig]:
    """The one-loop form of a data mask's key range (``lowering.block_ranges``) at the
    ``ONE_LOOP_SHAPES`` pointer configs, where the kernel has that form."""
    if not getattr(ks, "one_loop", False):
        return []
    rows, keys = f"B_{ks.block_axis}", "B_L"
    return [replace(c, one_loop=True) for c in pointer_configs
            if (c.blocks.get(rows), c.blocks.get(keys), c.num_warps) in ONE_LOOP_SHAPES
            and not c.splits]


# Where the decode grid above was pruned from: every decode config timed cold (K/V from
# DRAM, on the GPU alone) in bench/results/**/decode_configs*.json -- sessions 11, 23 and
# 24, H100 and H200, causal / ALiBi / GQA / softcap decode at 2048 and 8192 keys -- ranked
# against the best of its case.  No kind left out was ever the only best config of a
# case (72-271 timings each; all four left out at once, every one of the 36 cases keeps
# its best).  It took a decode's cold choice from 20-34 compiled configs to 5-20
# (bench/results/cold_s25/).
GRID_EVIDENCE = "bench/results/grid_evidence.md"  # (python bench/grid_evidence.py)


VDOT_MAX_KEYS = 1024  # the longest key loop the CUDA-core form is offered for


def vector_dot_configs(ks: KernelSource, sms: int = 132) -> list[TileConfig]:
    """Configs of the CUDA-core contraction form (``codegen.VDOT``), where the kernel has
    one: a program of exactly its rows (1 or 2 -- no padding to the tensor core's 16),
    32 keys a step at 4 warps, split for 2, 4 and 8 programs an SM, combined in the same
    launch.  That is the form's one shape that won anywhere in a sweep of 16-128 keys x
    4/8 warps x splits 4-128 x one/two launches (H200, bench/results/decode_s23/): causal
    and ALiBi decode at 512 keys, where a call is all latency (graphed 1.15 TB/s, 1.04x
    SDPA; the tensor-core form's choice ran 0.87x in session 11).  From 2048 keys the
    tensor-core form's pipelined loads win (1.93 vs 1.83 TB/s at 2048, 3.29 vs 2.33 at
    8192), so it is offered up to ``VDOT_MAX_KEYS`` only: its configs cost a longer
    decode's cold choice 3-5 s and never won there."""
    if (not getattr(ks, "vector_dot", False) or ks.row_extent > VDOT_ROWS
            or ks.split_extent > VDOT_MAX_KEYS):
        return []
    rows = 1 if ks.row_extent <= 1 else 2
    keys, warps = 32, 4
    blocks = {k: (rows if k == f"B_{ks.block_axis}" else keys) for k in _tiled_blocks(ks)}
    if not ks.split_extent:
        return [TileConfig(blocks, warps, 3, vector_dot=True)]
    programs = ks.grid_size * -(-ks.row_extent // rows)
    return [TileConfig(blocks, warps, 3, sp, fused=True, vector_dot=True)
            for sp in split_factors(programs, ks.split_extent, keys, 2 * sms)]


def gluon_configs(ks: KernelSource) -> list[TileConfig]:
    """The warp-specialised Gluon form's configs (``lowering/gluon_ws.py``), where the plan
    has one and this machine runs it (``gluon_device.gluon_unavailable``): 128 rows per
    program (two consumer warpgroups), the key blocks the form finds worth timing
    (``GluonForm.key_blocks``: 128 fills the tensor cores better, 64 wastes less on a
    narrow key range) and a TMA ring 2 or 3 deep where it fits in shared memory (3 × 128
    keys fills 224 KiB at width 128); timing decides.  Not for a decode (at most 16
    rows): a 128-row program would compute mostly padding.

    A persistent form is also offered launched one program per tile (``per_tile``: the
    same compiled kernel, so no second compile).  Neither walk wins everywhere (H200,
    causal): persistent programs in a balanced order won the backward's dK/dV and dQ
    passes at S=2048 by 12-16% and were -1 to +6% at 8192 in two runs; the forward's
    lost 5% at D=128 S=8192 (497 vs 523 TFLOP/s), and at D=64 won at S=2560 by 8% and
    lost 1-4% at 5120 and 10240 in one run, none in another (bench/results/README.md,
    sessions 28 and 29)."""
    form = getattr(ks, "gluon", None)
    if form is None or ks.row_extent <= 16 or gluon_unavailable() is not None:
        return []
    return (with_orders(form, walked_configs(ks, form)) + dynamic_configs(ks) + solo_configs(ks)
            + wide_configs(ks))


def walked_configs(ks: KernelSource, form, rings: tuple[int, ...] | None = None
                   ) -> list[TileConfig]:
    """``form``'s programs at each key block it offers and each ring depth (``rings``, or
    the form's own) that fits in shared memory; a persistent form also launched one
    program per tile."""
    walks = (False, True) if form.persistent else (False,)
    return [TileConfig({f"B_{ks.block_axis}": form.rows, "B_L": bl}, 4, ring, gluon_ws=True,
                       per_tile=per_tile)
            for bl in form.key_blocks for ring in (rings or form.rings(bl))
            if form.ring_bytes(bl, ring) <= SMEM_BYTES for per_tile in walks]


def dynamic_configs(ks: KernelSource) -> list[TileConfig]:
    """A data mask's dynamic walk (``gluon_ws._dynamic_form``): 128-row tiles taken from a
    counter by one program per SM, at its key blocks and rings."""
    dyn = getattr(ks.gluon, "dynamic", None)
    if dyn is None:
        return []
    return [TileConfig({f"B_{ks.block_axis}": dyn.rows, "B_L": bl}, 4, ring, gluon_ws=True,
                       dynamic=True)
            for bl in dyn.key_blocks for ring in dyn.rings(bl)
            if dyn.ring_bytes(bl, ring) <= SMEM_BYTES]


def with_orders(form, configs: list[TileConfig]) -> list[TileConfig]:
    """``configs`` and, where the form runs one program per tile off either grid order
    (``GluonForm.heads_first_ok``), each launched heads first too: a launch choice of
    the same compiled kernel (``gluon_tiles.grid_order``), so timed without a compile."""
    if not form.heads_first_ok:
        return configs
    return [c2 for c in configs for c2 in (c, replace(c, heads_first=True))]


def solo_configs(ks: KernelSource) -> list[TileConfig]:
    """The one-consumer Gluon form's configs (``gluon_ws.generate``): 64-row programs with
    a ring 2 deep, at the key blocks where an SM holds two or more of them -- the form's
    point (``GluonForm.programs_per_sm``)."""
    solo = getattr(ks.gluon, "solo", None)
    if solo is None:
        return []
    return with_orders(solo, [TileConfig({f"B_{ks.block_axis}": solo.rows, "B_L": bl}, 4, 2,
                                         gluon_ws=True)
                              for bl in solo.key_blocks if solo.programs_per_sm(bl, 2) >= 2])


def wide_configs(ks: KernelSource) -> list[TileConfig]:
    """The three-consumer Gluon form's configs (``gluon_ws._wide_form``, head dim 64):
    192-row programs at both key blocks with a 2-deep ring (3 and 4 deep were within 2%
    at 64 keys, bench/gluon_probe/wide_form.py), walked as the two-consumer form's."""
    wide = getattr(ks.gluon, "wide", None)
    return [] if wide is None else with_orders(wide, walked_configs(ks, wide, rings=(2,)))


def lowering_variants(ks: KernelSource, pointer_configs: list[TileConfig]) -> list[TileConfig]:
    """The GPU-only lowering choices of each pointer config: its tiles through tensor
    descriptors (TMA), and -- where ``ks.warp_specializable`` says Triton can -- the main key
    loop warp-specialised; the cost model prunes what is timed (``choose.prune_configs``).
    ``NEPTUNE_EQ_TMA=0`` turns descriptors off.

    Warp-specialised configs take only the form that was right on Triton 3.6 (H100,
    bench/results/ws_probe/README.md; ``lowering.descriptors``): a row block of at least
    ``WS_MIN_ROWS`` (the two consumer warpgroups take half each), ``WS_WARPS`` warps, and
    a ``WS_RING``-deep K/V ring with ``num_stages`` = ``WS_RING`` (3 with a 2-deep ring was
    right but 5-11% slower).  Deeper rings returned NaN -- the four wrong configs of
    bench/results/gpu_validate_tma.md were 3- and 4-deep -- 8 warps left the loop
    unspecialised, and 64-row blocks computed every row twice.  Key blocks under
    ``WS_MIN_KEYS`` are left out (slow; they displaced the 128-key config in
    ``prune_configs``).  In that form every warp-specialised config was right: 9 of 9 over
    the three global cases (bench/gpu_validate_tma.py), and 10 of 10 in kernels taking
    their sizes at run time, at 5 sizes from 4500 to 8000 (``--symbolic``, H100,
    bench/results/gpu_validate_tma_symbolic.json).  The best gained 2-5% over the best
    pointer config at S=8192, D=128 on the H100.  Off unless ``NEPTUNE_EQ_WARP_SPECIALIZE=1``:
    on an H200 (session 13), bf16 B=2 H=16 S=8192 D=128 attention -- a shape the checks
    above never ran -- faulted (illegal memory access) in 3 of 3 cold choices timing them,
    and was right in 3 of 3 without (``bench/cold_choice_check.py``).  A fault
    poisons the user's CUDA context: no few percent is worth that."""
    from ..lowering.descriptors import WS_MIN_KEYS, WS_MIN_ROWS, WS_RING, WS_WARPS
    if not getattr(ks, "descriptors", None) or os.environ.get("NEPTUNE_EQ_TMA", "1") == "0":
        return []
    out = [replace(c, tma=True) for c in pointer_configs]
    warps = getattr(ks, "warp_specializable", ())
    if os.environ.get("NEPTUNE_EQ_WARP_SPECIALIZE", "0") != "1" or WS_WARPS not in warps:
        return out
    rows = f"B_{ks.block_axis}"
    seen = set()
    for c in pointer_configs:
        if (c.blocks.get(rows, ks.tunables.get(rows, 0)) < WS_MIN_ROWS
                or c.blocks.get("B_L", WS_MIN_KEYS) < WS_MIN_KEYS):
            continue
        ws = replace(c, num_warps=WS_WARPS, num_stages=WS_RING, tma=True, warp_specialize=True,
                     loop_stages=0)
        if str(ws) not in seen:
            seen.add(str(ws))
            out.append(ws)
    return out

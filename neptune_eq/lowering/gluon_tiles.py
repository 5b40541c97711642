"""Which tiles a Gluon program runs, and each tile's key range (``gluon_ws``, ``gluon_sums``).

A tile is one (row block, grid index) pair: 128 rows of one head.  Its key range
``[j_lo, j_lo + n_blocks·B_L)`` -- what the producer streams -- comes from the pass's affine
bounds and, with a mask over captured tensors, from the per-call block summaries
(``block_ranges``), with ``dm_lo``..``dm_hi`` the keys every row of the tile sees whole.
``key_range`` emits that code once, in ``tl`` syntax, for three users: the Gluon programs
that run one tile each (before their warpgroups split), the persistent programs that walk
tiles of affine ranges (every partition recomputes it per tile: a few scalar ops), and the
ranges kernel below.

How programs walk their tiles (``walk``):

* ``single``: one program per tile (the hardware's block scheduler balances them);
* ``round_robin``: one program per SM, tiles ``pid, pid + P, ...`` -- tiles of equal work;
* ``scheduled``: one program per SM, in the balanced order the launcher computed from the
  affine ranges (``runtime.tile_order``);
* ``dynamic``: one program per SM taking tiles from a global counter -- tiles whose work
  depends on the call's data (document masks, jagged offsets).  No order fixed on the host
  balances those, and one program per tile pays each tile's pipeline fill and epilogue
  unoverlapped (H200, Gluon causal: ~6 us a tile, bench/results/causal_s27/).  As in
  FlashAttention-3's dynamic persistent scheduler, the producer warp takes the next tile
  with an atomic add and hands its index to the two consumer warpgroups through a
  two-slot mailbox guarded by mbarriers; the tiles' key ranges were computed before the
  main kernel by the ranges kernel (``ranges_kernel``: one program per tile, after the
  summary pre-pass), because the producer's 24 registers cannot run the summaries' count
  pass.

The scheduler's int32 buffer (``tile_sched``, made per call by the launcher):
``[next tile, (j_lo, n_blocks, dm_lo, dm_hi) per tile..., two mailbox slots per program]``.
The ranges kernel zeroes the counter, so a call needs no memset launch.
"""
from __future__ import annotations

import re

from .block_ranges import data_ranges
from .block_skip import summary_specs
from .dependent_launch import WAIT_FOR_PREPASS
from .codegen import Emitter, grid_decode
from .lower import TilePlan

ROWS = 64          # rows per consumer warpgroup (one wgmma M)
CTA_ROWS = 2 * ROWS  # two consumer warpgroups per program
RANGE_FIELDS = ("j_lo", "n_blocks", "dm_lo", "dm_hi")  # a tile's entry in ``tile_sched``


def gl_lines(lines: list[str]) -> list[str]:
    """``tl`` code as Gluon code (the same calls under ``gl``)."""
    return [re.sub(r"\btl\.", "gl.", ln) for ln in lines]


def gl_main(lines: list[str]) -> list[str]:
    """``gl_lines`` for code that runs before the warpgroups split (4 warps): a bare
    ``arange`` (the summary counts of ``block_skip``) gets the 1-D layout ``R1``."""
    return [re.sub(r"gl\.arange\(0, (\w+)\)", r"gl.arange(0, \1, R1)", ln) for ln in gl_lines(lines)]


def key_range(plan: TilePlan, name: str, data: bool, rows: int = CTA_ROWS,
              dependent: bool = True) -> list[str]:
    """The ``tl`` lines fixing a tile's key range ``[j_lo, j_lo + n_blocks·B_L)`` from
    ``row_block`` (and the grid axes) and, with a data mask (``data``), ``dm_lo``..``dm_hi``:
    the keys every row of the tile sees whole.  ``rows``: the tile's rows (the program's).
    ``dependent``: the code runs in a kernel launched dependent on the summaries' pre-pass
    (a Gluon form), so it waits for it first; the ranges kernel is launched plainly and
    also runs in the interpreter, which has no inline assembly."""
    ps = plan.passes[0]
    rng = [f"row_first = row_block * {rows}", f"row_last = row_first + {rows - 1}",
           "j_lo = 0", f"j_hi = {ps.extent}"]
    if ps.lo_offset is not None:  # the affine bounds of the pass over the tile's rows
        rng.append(f"j_lo = (tl.maximum(row_first + ({ps.lo_offset}), 0) // B_L) * B_L")
    if ps.hi_offset is not None:
        rng.append(f"j_hi = tl.minimum(row_last + ({ps.hi_offset}), {ps.extent})")
    if data:
        # block_ranges' code over the tile's rows (the launcher builds the row summaries
        # at B_<row axis> = the tile's rows): the may / must key ranges and the flag they need
        if dependent and summary_specs(plan):  # (a mask reading a tensor at the grid's
            rng.append(WAIT_FOR_PREPASS)        # index has no summaries to wait for)
        em = Emitter(plan, name)
        em.push("")
        em.push("")
        dr = data_ranges(em, ps, 0)
        body = em.pop()
        rng += ["pid_block = row_block", *em.pop(), *body,
                f"j_ra = (tl.maximum(j_lo, {dr.may[0]}) // B_L) * B_L",
                f"j_rb = tl.maximum(tl.minimum(j_hi, {dr.may[1]}), j_ra)",
                f"dm_lo = tl.minimum(tl.maximum({dr.must[0]}, j_ra), j_rb)",
                f"dm_hi = tl.maximum(tl.minimum({dr.must[1]}, j_rb), dm_lo)"]
        if dr.mono is None:
            rng += ["j_lo = j_ra", "j_hi = j_rb"]
        else:  # unsorted data: every block of the affine range, each masked per element
            rng += [f"j_lo = tl.where({dr.mono}, j_ra, j_lo)",
                    f"j_hi = tl.where({dr.mono}, j_rb, j_hi)",
                    f"dm_hi = tl.where({dr.mono}, dm_hi, dm_lo)"]
        # a range with no visible key still runs block 0, masked to nothing: keep it a
        # block of this head's keys, not the next head's
        rng.append(f"j_lo = tl.minimum(j_lo, (({ps.extent} - 1) // B_L) * B_L)")
    rng.append("n_blocks = tl.maximum(tl.cdiv(j_hi - j_lo, B_L), 1)")
    return rng


def affine_walk(ps) -> str:
    """The persistent walk of tiles whose work the pass's affine key range fixes: round
    robin where every tile has the same work (no bound moving with the rows, or both:
    a window), the launcher's balanced order where one bound moves (causal)."""
    return "round_robin" if (ps.lo_offset is None) == (ps.hi_offset is None) else "scheduled"


def persistent_place(plan: TilePlan, rows: int = CTA_ROWS) -> list[str]:
    """A persistent program's lines before its partitions split: the row blocks per grid
    index and the number of tiles its walk draws from."""
    grid_n = " * ".join(f"({plan.grid_extent(a)})" for a in plan.grid_axes) or "1"
    return [f"    n_rb = gl.cdiv({plan.row_extent}, {rows})", f"    num_tiles = n_rb * {grid_n}"]


def sched_size(num_tiles: int, programs: int) -> int:
    """int32 entries of the ``tile_sched`` buffer (see the module's docstring)."""
    return 1 + len(RANGE_FIELDS) * num_tiles + 2 * programs


# The order a dynamic walk takes its tiles in (``_tile_of``): heads first -- every head's
# last row block, then every head's one before -- as ``grid_order`` launches one program
# per tile, which was 5-13% faster than one head after another on short documents (H100,
# session 37), the narrow key ranges the dynamic walk is offered for.  A generation
# switch (the A/B bench flips it; part of a cache entry's key).
DYNAMIC_HEADS_FIRST = True


def _tile_of(t: str, heads_first: bool = False) -> list[str]:
    """A tile's place from its index ``t``: heads (grid indices) outer, so the programs in
    flight share a head's keys in L2; within a head the last row blocks first.
    ``heads_first``: row blocks outer, last first, every head's in turn."""
    if heads_first:
        return [f"pid_grid = {t} % (num_tiles // n_rb)",
                f"row_block = n_rb - 1 - {t} // (num_tiles // n_rb)"]
    return [f"pid_grid = {t} // n_rb", f"row_block = n_rb - 1 - {t} % n_rb"]


def _tile_index(heads_first: bool) -> str:
    """The inverse of ``_tile_of`` in the ranges kernel (grid: row blocks, grid size)."""
    if heads_first:
        return "(n_rb - 1 - row_block) * tl.num_programs(1) + pid_grid"
    return "pid_grid * n_rb + n_rb - 1 - row_block"


def ranges_kernel(plan: TilePlan, name: str, args: list[str],
                  rows: int = CTA_ROWS) -> tuple[str, str]:
    """(kernel name, ``tl`` module) of the ranges kernel of a dynamic walk: grid (row
    blocks, grid size), each program writes its tile's ``RANGE_FIELDS`` into ``tile_sched``;
    program (0, 0) zeroes the tile counter.  ``args``: the main kernel's parameters after
    its descriptors (pointers, strides, sizes; ``tile_sched_ptr`` among them) -- the
    launcher passes it the same ones."""
    kname = f"{name}_ranges"
    at = f"tile_sched_ptr + 1 + ({_tile_index(DYNAMIC_HEADS_FIRST)}) * {len(RANGE_FIELDS)}"
    src = [f"# generated by neptune_eq (lowering/gluon_tiles.py): the tile key ranges of {name}",
           "import triton", "import triton.language as tl", "", "",
           "@triton.jit",
           f"def {kname}({', '.join(args)}, B_L: tl.constexpr):",
           "    row_block = tl.program_id(0)",
           "    pid_grid = tl.program_id(1)",
           "    n_rb = tl.num_programs(0)",
           *["    " + ln for ln in grid_decode(plan)],
           *["    " + ln for ln in key_range(plan, name, data=True, rows=rows, dependent=False)],
           *[f"    tl.store({at} + {k}, {f})" for k, f in enumerate(RANGE_FIELDS)],
           "    tl.store(tile_sched_ptr, 0, mask=(row_block == 0) & (pid_grid == 0))"]
    return kname, "\n".join(src) + "\n"


def tile_lines(mode: str, rng: list[str], role: str = "producer",
               rows: int = CTA_ROWS) -> list[str]:
    """A walking program's lines placing tile ``t`` (Gluon): its place, then its key range
    -- ``rng`` (``gl_main(key_range(..))``) recomputed, or read from ``tile_sched`` (by a
    dynamic walk's consumers one tile ahead, see ``walk``)."""
    grid, row = _tile_of("t", mode == "dynamic" and DYNAMIC_HEADS_FIRST)
    if mode != "dynamic":
        return [grid, row + "  # long rows first", *rng]
    place = [grid, row, f"row_first = row_block * {rows}"]
    if role == "consumer":
        return place + [f"{f} = next_{f}" for f in RANGE_FIELDS]
    return place + _range_loads("t", "", maybe_past_end=False)


def _range_loads(t: str, prefix: str, maybe_past_end: bool = True) -> list[str]:
    """Loads of tile ``t``'s key range from ``tile_sched`` into ``<prefix><field>``; where
    ``t`` may be past the last tile (a read ahead at the walk's end) it reads zeros, never
    past the ranges."""
    at = f"tile_sched_ptr + 1 + {t} * {len(RANGE_FIELDS)}"
    mask = f", mask={t} < num_tiles, other=0" if maybe_past_end else ""
    return [f"{prefix}{f} = gl.load({at} + {k}{mask})" for k, f in enumerate(RANGE_FIELDS)]


def walk(mode: str, role: str, lines: list[str], per_tile: list[str],
         released: int | None = None) -> list[str]:
    """Gluon lines running ``lines`` (a partition's work on one tile, 4-space indented)
    for each tile of the program, with the ring position ``base`` and the row tiles' phase
    ``it`` carried across tiles; ``per_tile`` places tile ``t`` (``tile_lines``).  ``role``:
    "producer" (the warp that takes the next tile in a dynamic walk) or "consumer".
    ``released``: a consumer's count of ``lines`` up to its release of the tile's rows,
    where a dynamic walk reads the next tile ahead."""
    head = ["    base = 0", "    it = 0"]
    if mode == "single":
        return [*head, *lines]
    inner = [*["        " + ln for ln in per_tile], *["    " + ln for ln in lines],
             "        base += n_blocks", "        it += 1"]
    if mode == "round_robin":
        return [*head, "    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):",
                *inner]
    if mode == "scheduled":
        return [*head, "    first = gl.load(tile_order_ptr + gl.program_id(0))",
                "    for k in range(first, gl.load(tile_order_ptr + gl.program_id(0) + 1)):",
                "        t = gl.load(tile_order_ptr + gl.num_programs(0) + 1 + k)", *inner]
    # dynamic: the tile index goes through mailbox slot it % 2 (written by the producer
    # before it arrives on t_ready[it % 2], read by the consumers after they wait on it).
    # A slot is rewritten two tiles later, after the producer has waited for the
    # consumers to release the rows of the tile between: they have read it by then.
    slot = (f"tile_sched_ptr + 1 + {len(RANGE_FIELDS)} * num_tiles + 2 * gl.program_id(0) "
            "+ it % 2")
    if role == "producer":
        post = [f"gl.store({slot}, t)", "mbarrier.arrive(t_ready.index(it % 2), count=1)"]
        take = "t = gl.atomic_add(tile_sched_ptr, 1)"
        return [*head, "    " + take, "    while t < num_tiles:",
                *["        " + ln for ln in post], *inner, "        " + take,
                "    # past the last tile: tells the consumers to stop",
                *["    " + ln for ln in post]]
    # The consumers read the next tile's index and key range as soon as they release
    # this tile's rows (after its last score product), so the reads' latency overlaps
    # the tile's last P·c and epilogue instead of delaying the next tile's start.
    if released is None:
        raise ValueError("walk: a dynamic walk's consumers need the point they release the "
                         "tile's rows at (released=)")
    cut = released
    read = ["mbarrier.wait(t_ready.index(it % 2), (it // 2) & 1)",
            f"t = gl.load({slot}, volatile=True)", *_range_loads("t", "next_")]
    ahead = ["mbarrier.wait(t_ready.index((it + 1) % 2), ((it + 1) // 2) & 1)",
             f"t_next = gl.load({slot.replace('it % 2', '(it + 1) % 2')}, volatile=True)",
             *_range_loads("t_next", "next_")]
    return [*head, *["    " + ln for ln in read], "    while t < num_tiles:",
            *["        " + ln for ln in per_tile], *["    " + ln for ln in lines[:cut]],
            "        # the next tile, read ahead",
            *["        " + ln for ln in ahead], *["    " + ln for ln in lines[cut:]],
            "        base += n_blocks", "        it += 1", "        t = t_next"]


def pingpong_turns(on: bool) -> tuple[list[str], str, str, list[str]]:
    """Ping-pong's lines: (barrier set-up, the wait before a warpgroup issues the products
    of its turn -- ``{n}``: the turn's number --, the arrive that hands the turn to the
    other warpgroup, and the other warpgroup's first arrive), or no lines when off.

    Turns are counted, not kept: every tile gives each warpgroup one turn per key block
    (block 0's first product, block j's first product with block j-1's deferred one)
    plus one for the last deferred product, so turn ``base + it + jb`` is the jb-th of
    tile ``it`` (``base``: the blocks of the tiles before).  Both warpgroups walk the
    same tiles and key blocks, so the counts always meet.  ``turn[w]`` completes a phase
    when the other warpgroup hands over; warpgroup 1 hands warpgroup 0 its first turn."""
    if not on:
        return [], "", "", []
    setup = ["    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())",
             "    mbarrier.init(turn.index(0), count=1)  # warpgroup 0 may issue",
             "    mbarrier.init(turn.index(1), count=1)  # warpgroup 1 may issue"]
    return (setup, "mbarrier.wait(turn.index(WHICH), ({n}) & 1)  # this warpgroup's turn",
            "mbarrier.arrive(turn.index(1 - WHICH), count=1)  # the other's turn",
            ["    if WHICH == 1:  # warpgroup 0 issues first",
             "        mbarrier.arrive(turn.index(0), count=1)"])


def grid_order(plan: TilePlan, rows: int) -> list[str]:
    """A one-program-per-tile kernel's lines placing its tile: the grid is (row blocks,
    grid size) or, heads first, (grid size, row blocks) -- a launch choice the timer
    weighs (``TileConfig.heads_first``), read off the grid's shape, so one compiled
    kernel runs both.  Row-major, the hardware dispatches one head's tiles, long rows
    first, then the next head's: programs in flight share a head's keys in L2.  Heads
    first, it dispatches every head's last row block, then every head's one before: on
    short documents 5-13% faster, on long key ranges (prefix-LM, 4 documents at S=32768)
    2-39% slower (H100, fp16 H=16 D=128, ``bench/gluon_probe/solo_form.py``, which times
    every config both ways; bench/results/README.md, session 37).  Where the two extents
    are equal either decode visits every tile once."""
    return [f"    n_rb = gl.cdiv({plan.row_extent}, {rows})",
            "    hf = (gl.num_programs(0) != n_rb).to(gl.int32)  # heads first",
            "    row_block = n_rb - 1 - (gl.program_id(0) + hf * (gl.program_id(1) - "
            "gl.program_id(0)))  # long rows first",
            "    pid_grid = gl.program_id(1) + hf * (gl.program_id(0) - gl.program_id(1))"]

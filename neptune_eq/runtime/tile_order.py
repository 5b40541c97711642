"""The order in which persistent Gluon programs walk tiles of unequal work.

A causal mask gives row block ``r`` of a head about ``r + 1`` key blocks: walked round
robin, one program per SM draws long and short tiles unevenly and the last programs run
alone (H200, S=2048: 344 -> 276 TFLOP/s, bench/results/gluon_s18).  The hardware's own
block scheduler balances a grid of one program per tile, longest first, because each
SM takes the next tile when it frees; this module computes that schedule on the host,
once per launcher, from the tiles' key blocks (list scheduling: each tile, longest
first, goes to the program with the least work so far), so the programs can be
persistent and still balanced.  Heads are taken in groups of about two waves' tiles, so
the tiles running at one time share few heads' keys and values in L2 (a head-major order
was 7-12% faster than a row-block-major one for global attention, session 18) -- but the
last group holds at least ``TAIL_WAVES`` tiles a program: list scheduling balances the
walk's end only with many tiles left to place, and a last group of two waves left one
program running alone at the end (H200, session 46, ``bench/gluon_probe/tile_timeline.py``:
causal head dim 64, B=4 H=16 S=5000, the last program ended 43 us after the median of a
529 us walk; the schedule's own makespan was 7.7% over its average, 0.6% with the merged
last group).

The order is a permutation of the tiles: any order is correct, this one is fast.
"""
from __future__ import annotations

import heapq

TAIL_WAVES = 4  # tiles a program, at least, in the last group of heads (see above)


def tile_work(n_rb: int, rows_per_tile: int, keys: int, key_block: int,
              lo: int | None, hi: int | None, consumer_rows: int | None = None,
              row_extent: int | None = None) -> list[int]:
    """Per row block, the key blocks the kernel visits in ``[i + lo, i + hi)`` over the
    tile's rows (``gluon_tiles.key_range``), plus one for the tile's own start and store.
    With ``consumer_rows`` (and the rows' ``row_extent``), summed over the tile's consumer
    warpgroups, each counting the blocks its own rows see (``gluon_tiles.consumer_blocks``:
    a warpgroup past the rows computes one)."""
    def blocks(first: int, last: int) -> int:
        j_lo = (max(first + lo, 0) // key_block) * key_block if lo is not None else 0
        j_hi = min(last + hi, keys) if hi is not None else keys
        return max(-(-(j_hi - j_lo) // key_block), 1)
    out = []
    for rb in range(n_rb):
        first = rb * rows_per_tile
        n = blocks(first, first + rows_per_tile - 1)
        if consumer_rows is None:
            out.append(n + 1)
            continue
        work = 0
        for c0 in range(first, first + rows_per_tile, consumer_rows):
            # (a warpgroup's blocks start at the tile's first key block)
            mine = n if hi is None else min(n, blocks(first, c0 + consumer_rows - 1))
            past = row_extent is not None and c0 >= row_extent
            work += (1 if past else mine) + 1
        out.append(work)
    return out


def tile_order(work: list[int], heads: int, programs: int) -> list[int]:
    """``[first entry of each program (programs + 1 values)..., tile ids...]`` where tile
    ``t = head · n_rb + (n_rb − 1 − row block)`` (the kernel's decoding: long rows have
    low ids).  Every tile appears once."""
    if programs < 1 or heads < 1 or not work:
        raise ValueError(f"tile_order: expected at least one program, head and row block, "
                         f"got programs={programs}, heads={heads}, row blocks={len(work)}.")
    n_rb = len(work)
    group = max(1, -(-2 * programs // n_rb))  # heads in about two waves of tiles
    firsts = list(range(0, heads, group))
    while len(firsts) > 1 and (heads - firsts[-1]) * n_rb < TAIL_WAVES * programs:
        firsts.pop()  # the last groups merged: enough tiles to balance the end
    loads = [(0, p) for p in range(programs)]
    lists: list[list[int]] = [[] for _ in range(programs)]
    for g0, g1 in zip(firsts, firsts[1:] + [heads]):
        tiles = sorted(((work[rb], h, rb) for h in range(g0, g1)
                        for rb in range(n_rb)), key=lambda x: (-x[0], x[1], -x[2]))
        for w, h, rb in tiles:
            load, p = heapq.heappop(loads)
            lists[p].append(h * n_rb + n_rb - 1 - rb)
            heapq.heappush(loads, (load + w, p))
    starts = [0]
    for ts in lists:
        starts.append(starts[-1] + len(ts))
    return starts + [t for ts in lists for t in ts]


def one_tile_per_program(work: list[int], heads: int) -> list[int]:
    """``tile_order``'s layout for one program per tile (a persistent form launched with a
    program per tile: ``TileConfig.per_tile``): program ``p`` runs the ``p``-th tile of
    the order a grid of one program per tile runs in -- heads in turn, each head's row
    blocks longest first -- so the hardware's block scheduler balances them, and the
    tiles in flight share few heads' keys in L2."""
    if heads < 1 or not work:
        raise ValueError(f"one_tile_per_program: expected at least one head and row block, "
                         f"got heads={heads}, row blocks={len(work)}.")
    n_rb = len(work)
    by_work = sorted(range(n_rb), key=lambda rb: (-work[rb], -rb))
    ids = [h * n_rb + n_rb - 1 - rb for h in range(heads) for rb in by_work]
    return list(range(len(ids) + 1)) + ids

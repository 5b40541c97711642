"""Split-k over the visible keys, not over the cache: a decode's partials share the key
range its data mask leaves, each checking its own chunk for keys that range missed.

FlashDecoding cuts the cache into one fixed chunk per partial.  Under a document mask
the query's document is a small part of the cache, so one or two chunks hold all of it
and their programs walk it alone while the rest find nothing -- one SM's share of the
memory bandwidth reading the whole document (H200, 64/8 heads, S = 32768, 64 documents:
20.8 us for 967 visible keys, against 7.7 us for 51 at S = 8192; session 53).

Here every partial ``p`` of ``n``:

1. bounds the visible keys over the whole cache from a sample of the ids, its key
   blocks' first and last keys (``block_skip._count_sampled``: one vector load) --
   exact to the block where the ids are sorted, the blocks' minima and maxima then;
   unchecked, so only used to share out work: [ga, gb);
2. runs its ``1/n`` of [ga, gb), every block under the elementwise mask (the range may
   hold keys that are not visible; the mask keeps the answer right whatever the data);
3. counts its own fixed chunk of the ids (``block_skip._count_keys``, checked: sorted
   there, its visible keys are one range) and runs what of that lies outside [ga, gb)
   -- nothing, on sorted ids; where the chunk's ids are not sorted, all of the chunk
   outside [ga, gb), masked.

Every key outside [ga, gb) belongs to exactly one chunk and every key inside to exactly
one share, so each visible key is folded once, by one partial, on any data; the combine
is unchanged (a partial that found nothing stores the fold's identity).  Where the range
covers most of the cache the fixed chunks are kept (each with its unmasked interior).
"""
from __future__ import annotations

from .block_ranges import data_range_form, data_ranges, range_bounds
from .block_skip import data_atoms, inline_summaries
from .codegen import LOOP, Emitter

WIDE = (3, 4)  # a sampled range over 3/4 of the cache runs in the fixed chunks


def shares_visible_keys(em: Emitter, k: int) -> bool:
    """Whether pass ``k`` of a split-k partial shares its visible keys: a decode whose
    data mask has the key-range form and is read in the kernel (``inline_summaries``)."""
    plan = em.plan
    ps = plan.passes[k]
    return inline_summaries(plan) and bool(data_atoms(plan, ps)) and data_range_form(plan, ps)


def shared_split_loops(em: Emitter, k: int, lo: str, hi: str, loop) -> bool:
    """Pass ``k``'s loops over [lo, hi) (its affine bounds; ``lo`` block-aligned) in a
    split-k partial, shared as the module says, where it ``shares_visible_keys`` (else
    nothing is emitted and False returned).  ``loop(em, k, lo, hi, known, test)`` emits
    one loop.

    Two loops whatever the data, with no branch around them: one masked loop over up to
    three key ranges (``_segment_loop``) and the fixed chunk's unmasked interior (empty
    where the range is shared).  Triton 3.6 gives the loops in both branches of an ``if``
    their K/V rings at once: with the fixed chunks and the shares in two branches the
    partial needed 262 KiB of shared memory at 128 keys and 3 stages (more than the
    H200's 227) against 137 KiB so, and seven loop bodies to compile (sm_90, session 54).
    Where a chunk's ids are not sorted, its part of [lo, hi) outside the shares runs
    masked with no per-block test (a tested loop is a branch around the loads)."""
    if not shares_visible_keys(em, k):
        return False
    ps = em.plan.passes[k]
    B = f"B_{LOOP}"
    row: dict = {}  # (both emit here: the query side's ids are read once)
    whole = data_ranges(em, ps, k, sampled=True, bounds=row)
    own = data_ranges(em, ps, k, split=True, bounds=row)
    ga, gb, gu, wide = f"j_ga{k}", f"j_gb{k}", f"j_gu{k}", f"j_wide{k}"
    em.emit(f"{ga} = (tl.maximum({lo}, {whole.may[0]}) // {B}) * {B}  # the sampled range")
    em.emit(f"{gb} = tl.maximum(tl.minimum({hi}, {whole.may[1]}), {ga})")
    em.emit(f"{gu} = (({gb} + {B} - 1) // {B}) * {B}  # ... as the shares' blocks cover it")
    c_lo, c_hi = "pid_split * CHUNK", f"tl.minimum(pid_split * CHUNK + CHUNK, {ps.extent})"
    em.emit(f"j_ca{k} = tl.maximum({lo}, {c_lo})  # this partial's chunk")
    em.emit(f"j_cb{k} = tl.maximum(tl.minimum({hi}, {c_hi}), j_ca{k})")
    # Most of the cache visible (one document): the fixed chunks are as balanced, and their
    # own checked counts give each an unmasked interior (the shares mask every block:
    # 17.2 against 15.5 us, S = 8192, H200).  Every partial takes the same choice: the
    # sample is the same for all.
    em.emit(f"{wide} = ({gb} - {ga}) * {WIDE[1]} >= {WIDE[0]} * {ps.extent}  # fixed chunks")
    a, b, c, d = range_bounds(em, k, lo, hi, True, own, unordered=(f"j_ca{k}", f"j_cb{k}"))
    shares = _shares(em, k, own)
    chunk = [(a, c), (d, b), (b, b)]  # its masked edges (the interior apart)
    segments = [tuple(f"tl.where({wide}, {x}, {y})" for x, y in zip(ch, sh))
                for ch, sh in zip(chunk, shares)]
    _segment_loop(em, k, segments, loop)
    em.emit(f"j_ri{k} = tl.where({wide}, {d}, {c})  # the interior: none where shared")
    loop(em, k, c, f"j_ri{k}", ps.bound_atoms | own.atoms, False)
    return True


def _shares(em: Emitter, k: int, own) -> list[tuple[str, str]]:
    """This partial's share of the sampled range, and its chunk's visible keys outside
    that range (none where the ids are sorted: its counted range where its ids are
    sorted, else all of it), before and after: three [lo, hi), emitted."""
    B = f"B_{LOOP}"
    ga, gb, gu, share = f"j_ga{k}", f"j_gb{k}", f"j_gu{k}", f"j_gs{k}"
    em.emit(f"{share} = (({gb} - {ga} + tl.num_programs(2) * {B} - 1) "
            f"// (tl.num_programs(2) * {B})) * {B}")
    em.emit(f"j_sa{k} = {ga} + pid_split * {share}  # this partial's share")
    em.emit(f"j_sb{k} = tl.maximum(tl.minimum(j_sa{k} + {share}, {gb}), j_sa{k})")
    first = f"tl.maximum(j_ca{k}, {own.may[0]})"
    last = f"tl.minimum(j_cb{k}, {own.may[1]})"
    if own.mono is not None:  # (none: the atoms read no ids at the key; the range is exact)
        first = f"tl.where({own.mono}, {first}, j_ca{k})"
        last = f"tl.where({own.mono}, {last}, j_cb{k})"
    em.emit(f"j_xa{k} = {first}")
    em.emit(f"j_xb{k} = tl.maximum(tl.minimum({last}, {ga}), j_xa{k})  # ... before the shares")
    em.emit(f"j_xc{k} = tl.maximum(j_xa{k}, {gu})  # ... and after them")
    em.emit(f"j_xd{k} = tl.maximum({last}, j_xc{k})")
    return [(f"j_sa{k}", f"j_sb{k}"), (f"j_xa{k}", f"j_xb{k}"), (f"j_xc{k}", f"j_xd{k}")]


def _segment_loop(em: Emitter, k: int, segments: list[tuple[str, str]], loop) -> None:
    """One masked loop over the key blocks of two or more [lo, hi) ranges (block-aligned
    starts), one after the other: a virtual key position walks their lengths end to end
    and each block's start is found from it.  One loop body, not one per range: each
    body is compiled (the partial's cold build) and each pipelined loop fills and drains
    its own K/V ring."""
    B = f"B_{LOOP}"
    starts, ends, total = [], [], "0"
    for a, b in segments:
        first, length = em.new(f"j_seg{k}_"), em.new(f"j_len{k}_")
        em.emit(f"{first} = {a}")
        em.emit(f"{length} = (({b} - {first} + {B} - 1) // {B}) * {B}")
        total = length if total == "0" else f"{total} + {length}"
        starts.append(first)
        ends.append(total)
    v = f"j_v{k}"
    start = f"{starts[-1]} + {v} - ({ends[-2]})"
    for a, end, before in reversed(list(zip(starts[:-1], ends[:-1], ["0"] + ends[:-2]))):
        start = f"tl.where({v} < {end}, {a} + {v} - ({before}), {start})"
    lines = em.scopes[-1][0]
    at = len(lines)
    loop(em, k, "0", f"{total}", frozenset(), False)
    head = "for l0 in range(0, "
    if not lines[at].lstrip().startswith(head):  # (the loop helper's own header)
        raise AssertionError(f"expected a key loop header, got {lines[at]!r}")
    lines[at] = lines[at].replace("for l0 in", f"for {v} in", 1)
    lines.insert(at + 1, em.scopes[-1][2] + f"    l0 = {start}  # its range's block")

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
   -- nothing, on sorted ids; on unsorted ids the chunk's blocks outside [ga, gb) each
   get the per-block test.

Every key outside [ga, gb) belongs to exactly one chunk and every key inside to exactly
one share, so each visible key is folded once, by one partial, on any data; the combine
is unchanged (a partial that found nothing stores the fold's identity).  Where the range
covers most of the cache the fixed chunks are kept (each with its unmasked interior).
"""
from __future__ import annotations

from .block_ranges import data_range_form, data_ranges, range_loops
from .block_skip import data_atoms, inline_summaries
from .codegen import LOOP, Emitter

WIDE = (3, 4)  # a sampled range over 3/4 of the cache runs in the fixed chunks


def shares_visible_keys(em: Emitter, k: int) -> bool:
    """Whether pass ``k`` of a split-k partial shares its visible keys: a decode whose
    data mask has the key-range form and is read in the kernel (``inline_summaries``)."""
    plan = em.plan
    ps = plan.passes[k]
    return inline_summaries(plan) and bool(data_atoms(plan, ps)) and data_range_form(plan, ps)


def shared_split_loops(em: Emitter, k: int, lo: str, hi: str, loop, tested) -> None:
    """Pass ``k``'s loops over [lo, hi) (its affine bounds; ``lo`` block-aligned) in a
    split-k partial, shared as the module says.  ``loop(em, k, lo, hi, known, test)``
    emits one loop; ``tested(lo, hi)`` the per-block test loops over this chunk's part
    of [lo, hi)."""
    ps = em.plan.passes[k]
    B = f"B_{LOOP}"
    whole = data_ranges(em, ps, k, sampled=True)
    own = data_ranges(em, ps, k, split=True)
    ga, gb, gu = f"j_ga{k}", f"j_gb{k}", f"j_gu{k}"
    em.emit(f"{ga} = (tl.maximum({lo}, {whole.may[0]}) // {B}) * {B}  # the sampled range")
    em.emit(f"{gb} = tl.maximum(tl.minimum({hi}, {whole.may[1]}), {ga})")
    em.emit(f"{gu} = (({gb} + {B} - 1) // {B}) * {B}  # ... as the shares' blocks cover it")
    outer = em.scopes[-1][2]
    # Most of the cache visible (one document): the fixed chunks are as balanced, and their
    # own checked counts give each an unmasked interior (the shares mask every block:
    # 17.2 against 15.5 us, S = 8192, H200).  Every partial takes the same branch: the
    # sample is the same for all.
    em.emit(f"if ({gb} - {ga}) * {WIDE[1]} >= {WIDE[0]} * {ps.extent}:  # fixed chunks")
    em.push(outer + "    ")
    range_loops(em, k, lo, hi, True, own, loop, lambda: tested(lo, hi))
    em.scopes[-2][0].extend(em.pop())
    em.emit("else:  # the partials share the sampled range")
    em.push(outer + "    ")
    _shared(em, k, lo, hi, own, loop, tested)
    em.scopes[-2][0].extend(em.pop())


def _shared(em: Emitter, k: int, lo: str, hi: str, own, loop, tested) -> None:
    ps = em.plan.passes[k]
    B = f"B_{LOOP}"
    ga, gb, gu, share = f"j_ga{k}", f"j_gb{k}", f"j_gu{k}", f"j_gs{k}"
    em.emit(f"{share} = (({gb} - {ga} + tl.num_programs(2) * {B} - 1) "
            f"// (tl.num_programs(2) * {B})) * {B}")
    em.emit(f"j_sa{k} = {ga} + pid_split * {share}  # this partial's share")
    em.emit(f"j_sb{k} = tl.maximum(tl.minimum(j_sa{k} + {share}, {gb}), j_sa{k})")
    loop(em, k, f"j_sa{k}", f"j_sb{k}", frozenset(), False)
    c_lo, c_hi = "pid_split * CHUNK", f"tl.minimum(pid_split * CHUNK + CHUNK, {ps.extent})"
    outer = em.scopes[-1][2]
    # (no flag: the atoms read no ids at the key, their ranges are exact, nothing is missed)
    em.emit(f"if {own.mono or True}:  # this chunk's ids are sorted: its visible keys are one range")
    em.push(outer + "    ")
    first = f"tl.maximum(tl.maximum({lo}, {own.may[0]}), {c_lo})"
    last = f"tl.minimum(tl.minimum({hi}, {own.may[1]}), {c_hi})"
    em.emit(f"j_xa{k} = {first}  # ... those before the sampled range (none where sorted)")
    em.emit(f"j_xb{k} = tl.maximum(tl.minimum({last}, {ga}), j_xa{k})")
    loop(em, k, f"j_xa{k}", f"j_xb{k}", frozenset(), False)
    em.emit(f"j_xc{k} = tl.maximum({first}, {gu})  # ... and after it")
    em.emit(f"j_xd{k} = tl.maximum({last}, j_xc{k})")
    loop(em, k, f"j_xc{k}", f"j_xd{k}", frozenset(), False)
    em.scopes[-2][0].extend(em.pop())
    if own.mono is None:
        return
    em.emit("else:  # unsorted: test each key block of the chunk outside the sampled range")
    em.push(outer + "    ")
    tested(lo, f"tl.maximum(tl.minimum({hi}, {ga}), {lo})")
    tested(f"tl.maximum({lo}, {gu})", hi)
    em.scopes[-2][0].extend(em.pop())

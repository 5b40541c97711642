"""The dynamic tile walk of the Gluon form (lowering/gluon_tiles.py): the ranges kernel that
gives every tile of a data mask its key range runs here in the interpreter (the Gluon
kernel itself compiles for sm_90 in test_gluon_ws.py and runs on the GPU in
bench/gluon_validate.py).  What must hold for any data: every visible (row, key) pair of a
tile lies in the keys the producer streams, ``[j_lo, j_lo + n_blocks·B_L)``, and every key
in ``[dm_lo, dm_hi)`` is visible to every real row of the tile wherever the mask's affine
atoms hold (the blocks there run without the mask; the affine atoms are the consumers'
own loop bounds)."""
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neptune_eq as ne
from neptune_eq.lowering import gluon_tiles
from neptune_eq.lowering.gluon_tiles import CTA_ROWS, RANGE_FIELDS, sched_size
from neptune_eq.runtime.block_summary import build_summaries
from neptune_eq.runtime.launcher import import_source

S = 300  # three row blocks of 128, the last one ragged
H = 2
DOC = ne.placeholder((S,), "int32", "doc")
OFFSETS = ne.placeholder((9,), "int32", "offsets")
PREFIX = ne.placeholder((1,), "int32", "prefix")
MASKS = {  # (mask over the placeholders, over torch tensors, its affine atoms (loop bounds))
    "documents": (lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv),
                  lambda t, q, kv: (t["doc"][q] == t["doc"][kv]) & (q >= kv),
                  lambda t, q, kv: q >= kv),
    "jagged": (lambda b, h, q, kv: (kv >= OFFSETS[DOC[q]]) & (q >= kv),
               lambda t, q, kv: (kv >= t["offsets"][t["doc"][q].long()]) & (q >= kv),
               lambda t, q, kv: q >= kv),
    "prefix-lm": (lambda b, h, q, kv: (kv < PREFIX[b]) | (q >= kv),
                  lambda t, q, kv: (kv < t["prefix"][0]) | (q >= kv),
                  lambda t, q, kv: q >= 0),  # an | leaves no affine bound
}
_KERNELS: dict = {}


def _kernel(name):
    if name not in _KERNELS:
        _KERNELS[name] = ne.superoptimize(
            ne.attention(1, H, S, S, 64, "float16", mask_mod=MASKS[name][0]),
            target="interpreter", cache=False)
    return _KERNELS[name]


def _row_block(t: int, n_rb: int) -> int:
    """Tile ``t``'s row block in the dynamic walk's order (``gluon_tiles._tile_of``)."""
    return n_rb - 1 - (t // H if gluon_tiles.DYNAMIC_HEADS_FIRST else t % n_rb)


def _tile_ranges(kern, data: dict, key_block: int) -> torch.Tensor:
    """Run the ranges kernel of ``kern``'s dynamic walk (its second Gluon form; the
    interpreter) on ``data``: [tiles, 4] ranges, tile ``t`` at row block ``_row_block``."""
    ks, p = kern.kernel_source, kern.program
    form = ks.gluon.dynamic
    kname, source = form.ranges
    fn = import_source(source, kname, [kname], interpret=True)[0]
    tensors = {ph.name: torch.zeros(p.shape_of(ph.name), dtype=getattr(torch, p.dtype_of(ph.name)))
               for ph in p.inputs}
    tensors.update({o: torch.zeros(p.shape_of(o), dtype=torch.float16) for o in p.outputs})
    tensors.update(data)
    tensors.update(build_summaries(ks.summaries, tensors,
                                   {f"B_{ks.block_axis}": CTA_ROWS, "B_L": key_block}))
    n_rb = -(-S // CTA_ROWS)
    sched = torch.full((sched_size(n_rb * H, 1),), -7, dtype=torch.int32)
    tensors["tile_sched"] = sched
    ptrs = [tensors[n[:-len("_ptr")]] for n in form.params]
    fn[(n_rb, H)](*ptrs, *[s for t in ptrs for s in t.stride()], B_L=key_block)
    assert sched[0] == 0  # the tile counter starts every call at 0
    return sched[1:1 + len(RANGE_FIELDS) * n_rb * H].view(-1, len(RANGE_FIELDS))


def _check(name: str, data: dict, key_block: int) -> None:
    ranges = _tile_ranges(_kernel(name), data, key_block)
    q = torch.arange(S)[:, None]
    kv = torch.arange(S)[None, :]
    visible = MASKS[name][1](data, q, kv)
    whole = visible | ~MASKS[name][2](data, q, kv)
    n_rb = -(-S // CTA_ROWS)
    for t, (j_lo, n_blocks, dm_lo, dm_hi) in enumerate(ranges.tolist()):
        rb = _row_block(t, n_rb)
        rows = visible[rb * CTA_ROWS:(rb + 1) * CTA_ROWS]
        seen = rows.any(0).nonzero().flatten()
        assert j_lo % key_block == 0 and n_blocks >= 1, (name, t)
        if len(seen):  # every visible pair is streamed
            assert j_lo <= seen.min() and seen.max() < j_lo + n_blocks * key_block, (name, t)
        assert j_lo <= dm_lo <= dm_hi, (name, t)
        # blocks run without the mask: every row sees them where the affine atoms hold
        assert bool(whole[rb * CTA_ROWS:(rb + 1) * CTA_ROWS, dm_lo:dm_hi].all()), (name, t)


def _documents(draw_lengths: list[int]) -> torch.Tensor:
    lens = torch.tensor(draw_lengths)
    lens = lens * S // lens.sum()
    lens[-1] += S - lens.sum()
    return torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), lens)


@pytest.mark.parametrize("key_block", [64, 128])
@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), shuffled=st.booleans())
def test_document_ranges_never_skip_a_visible_pair(key_block, lengths, shuffled):
    """Sorted document ids (each tile's range from the summaries) and shuffled ones (the
    device flag says unsorted: the affine range, nothing seen whole)."""
    doc = _documents(lengths)
    if shuffled:
        doc = doc[torch.randperm(S, generator=torch.Generator().manual_seed(len(lengths)))]
    _check("documents", {"doc": doc}, key_block)


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=8, max_size=8))
def test_jagged_ranges_never_skip_a_visible_pair(lengths):
    doc = _documents(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32),
                         torch.bincount(doc.long(), minlength=8).cumsum(0).to(torch.int32)])
    _check("jagged", {"doc": doc, "offsets": offsets}, 64)


@settings(max_examples=6, deadline=None)
@given(prefix=st.integers(0, S))
def test_prefix_lm_ranges_never_skip_a_visible_pair(prefix):
    _check("prefix-lm", {"prefix": torch.tensor([prefix], dtype=torch.int32)}, 128)


def test_a_document_tile_streams_only_its_documents():
    """Not only safe but narrow: with sorted ids, a row block inside one long document
    streams that document's keys up to its diagonal, not the whole causal range."""
    doc = torch.tensor([0] * 200 + [1] * 100, dtype=torch.int32)
    ranges = _tile_ranges(_kernel("documents"), {"doc": doc}, 64)
    n_rb = -(-S // CTA_ROWS)
    last = ranges[n_rb - 1 - 2]  # row block 2 (rows 256..299), all in document 1
    # document 1 starts at 200: its key blocks from 192 to the diagonal (two of 64); the
    # keys of document 1's first whole block on need no document test (the causal
    # diagonal is the consumers' affine bound)
    assert last.tolist() == [192, 2, 256, 300]


# ---- a consumer warpgroup's own blocks (gluon_tiles.consumer_blocks) ----

_AFFINE_S = 500  # not a multiple of 64, 128 or 192: the last tile's warpgroups run past it
AFFINE = {  # mask over torch index tensors
    "causal": lambda q, kv: q >= kv,
    "window": lambda q, kv: (q >= kv) & (q - kv < 100),
    "global": lambda q, kv: (q >= 0) & (kv >= 0),
}
_AFFINE_PLANS: dict = {}


def _affine_plan(name):
    from neptune_eq.lowering.lower import plan as make_plan
    if name not in _AFFINE_PLANS:
        mod = AFFINE[name]
        kern = ne.superoptimize(
            ne.attention(1, 1, _AFFINE_S, _AFFINE_S, 64, "float16",
                         mask_mod=None if name == "global" else (lambda b, h, q, kv: mod(q, kv))),
            target="interpreter", cache=False)
        _AFFINE_PLANS[name] = make_plan(kern.program)
    return _AFFINE_PLANS[name]


class _Ops:
    """``tl`` / ``gl`` as the emitted range lines use them, on torch scalars."""
    int32 = torch.int32

    @staticmethod
    def maximum(a, b):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))

    @staticmethod
    def minimum(a, b):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))

    @staticmethod
    def cdiv(a, b):
        return -((-torch.as_tensor(a)) // b)


def _run_lines(lines, env):
    exec(textwrap.dedent("\n".join(lines)), {"tl": _Ops, "gl": _Ops}, env)
    return env


@pytest.mark.parametrize("name", sorted(AFFINE))
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("key_block", [64, 128])
def test_a_warpgroup_skips_only_blocks_its_rows_never_see(name, consumers, key_block):
    """Every key block of a tile past a warpgroup's ``my_n`` is masked whole for that
    warpgroup's real rows -- what lets it release the block unread -- and a warpgroup
    past the rows computes block 0 only.  Run for every tile of a 500-row attention with
    the lines the generator emits (``key_range``, ``consumer_blocks``)."""
    pl = _affine_plan(name)
    rows = 64 * consumers
    mask = AFFINE[name]
    n_rb = -(-_AFFINE_S // rows)
    skipped = 0
    for rb in range(n_rb):
        env = _run_lines(gluon_tiles.key_range(pl, "k", data=False, rows=rows),
                         {"row_block": rb, "B_L": key_block})
        for which in range(consumers):
            mine = _run_lines(gluon_tiles.consumer_blocks(pl, consumers=consumers),
                              dict(env, my_first=torch.tensor(rb * rows + which * 64)))
            my_n, n_blocks = int(mine["my_n"]), int(env["n_blocks"])
            assert 1 <= my_n <= n_blocks
            first = rb * rows + which * 64
            q = torch.arange(first, max(first, min(first + 64, _AFFINE_S)))
            if len(q) == 0:  # (at the key blocks the warpgroups skip at)
                assert my_n == 1 or key_block > 64 * (consumers - 1)
                continue
            j_lo = int(env["j_lo"])
            start = j_lo + my_n * key_block
            kv = torch.arange(start, max(start, min(j_lo + n_blocks * key_block, _AFFINE_S)))
            assert not mask(q[:, None], kv[None, :]).any(), (rb, which, my_n, n_blocks)
            skipped += n_blocks - my_n
    if name == "causal" and (consumers, key_block) != (2, 128):
        assert skipped > 0  # the first warpgroups' rows end a block early: not vacuous

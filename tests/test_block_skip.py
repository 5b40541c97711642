"""Kernels skip key blocks that a mask over captured tensors hides (issue 17), in the
Triton interpreter against the fp64 reference: document masks (sorted and unsorted ids,
odd sizes, padding rows with nothing visible), prefix-LM with a per-sample prefix, a
decode (split into one row block), and ne.flex_attention.  That blocks really are
skipped is shown by NaN values in V that any visited block would spread (0 * NaN is NaN
even where the elementwise mask zeroes the weight)."""
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import neptune_eq as ne
from neptune_eq.interp import evaluate

D = 16


def key_loops(src: str) -> list[list[str]]:
    """The body lines of every key loop (``for l0 in range``) of a kernel's source."""
    lines = src.splitlines()
    out = []
    for n, line in enumerate(lines):
        if line.lstrip().startswith(("for l0 in range(", "for l0 in tl.range(")):
            ind = len(line) - len(line.lstrip())
            body = []
            for nxt in lines[n + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= ind:
                    break
                body.append(nxt.strip())
            out.append(body)
    return out


def branch_free_loops(src: str) -> int:
    """How many key loops have no ``if`` in their body (a data mask as loop bounds); the
    ``if TMA:`` of a tile's two load forms is a compile-time constant, not a branch."""
    return sum(not any(b.startswith("if ") and not b.startswith("if TMA") for b in body)
               for body in key_loops(src))


def run_against_reference(kern, tensors: dict, atol=1e-4):
    """The kernel against the fp64 reference -- and, where its data-mask key range has the
    one-loop form (``TileConfig.one_loop``, a GPU config), that form too, launched here."""
    got = kern(**tensors)
    ref = evaluate(kern.input_program, tensors)["o"]
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), ref, atol=atol, rtol=atol), (got.double() - ref).abs().max()
    if kern.kernel_source.one_loop:
        from dataclasses import replace
        from neptune_eq.runtime.launcher import Launcher
        one = torch.empty_like(got)
        Launcher(kern.program, kern.kernel_source, "interpreter",
                 replace(kern.config, one_loop=True))({**tensors, "o": one})
        assert torch.isfinite(one).all()
        assert torch.allclose(one.double(), ref, atol=atol, rtol=atol), (one.double() - ref).abs().max()
    return got


def qkv(b, h, sq, skv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, D, generator=g) for n in (sq, skv, skv)]


@pytest.fixture(scope="module")
def document_kernel():
    """Documents, causal inside each, padding tokens (id -1) visible to nobody."""
    doc = ne.placeholder((53,), "int32", "doc")
    out = ne.attention(1, 2, 53, 53, D, "float32",
                       mask_mod=lambda b, h, i, j: (doc[i] == doc[j]) & (doc[j] >= 0) & (j <= i))
    return ne.superoptimize(out, target="interpreter")


def test_document_mask_kernel_has_a_block_test(document_kernel):
    src = document_kernel.source
    # the key blocks' summary comes from the pre-pass; the row block's ids the kernel
    # reads itself (its elementwise mask loads them anyway): exact, and nothing to wait for
    assert "bs_doc_d0_loop_ptr" in src and "bs_doc_d0_row_ptr" not in src
    assert "(else: skipped)" in src and "every pair visible: no elementwise mask" in src
    # every summary comes from one pre-pass launch
    assert document_kernel.launches == ["neptune_o_summaries", "neptune_o"]
    assert src.count("def neptune_o_summaries(") == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_document_mask_matches_reference_on_random_documents(document_kernel, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, 4, (53,), generator=g)
    if seed < 2:   # sorted ids (packed documents); seed 2: unsorted, nothing to skip safely
        ids = torch.sort(ids).values
    q, k, v = qkv(1, 2, 53, 53, seed)
    q = q * (30.0 if seed == 1 else 1.0)   # large-magnitude scores
    got = run_against_reference(document_kernel, dict(q=q, k=k, v=v, doc=ids.to(torch.int32)))
    pad = ids < 0
    assert (got[:, :, pad] == 0).all()   # padding rows see nothing: 0, not NaN


def test_skipped_blocks_are_never_read(document_kernel):
    """Keys 16..31 (one whole 16-key block in the interpreter's tiles) are padding; their V
    is NaN.  Any visit of that block would make every row's output NaN."""
    ids = torch.tensor([0] * 16 + [-1] * 16 + [1] * 21, dtype=torch.int32)
    q, k, v = qkv(1, 2, 53, 53, 3)
    v[:, :, 16:32] = float("nan")
    k[:, :, 16:32] = float("nan")
    got = document_kernel(q=q, k=k, v=v, doc=ids)
    clean = v.clone()
    clean[:, :, 16:32] = 0.0
    ref = evaluate(document_kernel.input_program, dict(q=q, k=k.nan_to_num(), v=clean, doc=ids))["o"]
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), ref, atol=1e-4)


def test_prefix_lm_with_a_per_sample_prefix():
    """Bidirectional over each sample's prefix, causal after it: the ``|`` is no loop
    bound, so only the block test can skip the keys past both."""
    prefix = ne.placeholder((2,), "int32", "prefix")
    out = ne.attention(2, 1, 45, 45, D, "float32",
                       mask_mod=lambda b, h, i, j: (j < prefix[b]) | (j <= i))
    kern = ne.superoptimize(out, target="interpreter")
    # both sides of the | are key ranges (keys < prefix[b], keys <= i): loop bounds only,
    # no per-block test and no summaries at all
    assert "bs_prefix_all_ptr" not in kern.source and "(else: skipped)" not in kern.source
    assert kern.launches == ["neptune_o"]
    # masked, unmasked, masked -- and the one-loop form a config may take (ONE_LOOP)
    assert branch_free_loops(kern.source) == len(key_loops(kern.source)) == 4
    assert kern.kernel_source.one_loop
    from neptune_eq.runtime.tile_configs import ONE_LOOP_SHAPES, candidate_configs
    ones = [c for c in candidate_configs(kern.kernel_source, "cuda") if c.one_loop]
    assert ones and all((c.blocks["B_i"], c.blocks["B_L"], c.num_warps) in ONE_LOOP_SHAPES
                        for c in ones)
    q, k, v = qkv(2, 1, 45, 45, 4)
    lens = torch.tensor([20, 3], dtype=torch.int32)
    run_against_reference(kern, dict(q=q, k=k, v=v, prefix=lens))
    # rows 0..15 of sample 1 see keys < 16 only: NaN in V past key 31 must not be read there
    v2 = v.clone()
    v2[1, :, 32:] = float("nan")
    got = kern(q=q, k=k, v=v2, prefix=lens)
    assert torch.isfinite(got[1, :, :16]).all()


def test_decode_split_skips_masked_blocks():
    """Decode with a per-head keep list: the split-k / one-row-block forms test each key
    block too -- on the block's own entries, read in the kernel (a decode has no summary
    pre-pass, ``block_skip.inline_summaries``)."""
    keep = ne.placeholder((2, 70), "int32", "keep")
    out = ne.attention(1, 2, 1, 70, D, "float32", mask_mod=lambda b, h, i, j: keep[h, j] > 0)
    kern = ne.superoptimize(out, target="interpreter")
    assert "bs_" not in kern.source and kern.kernel_source.prepass is None
    assert "tl.minimum(l0 + tl.arange(0, B_L), 70 - 1)" in kern.source
    q, k, v = qkv(1, 2, 1, 70, 5)
    mask = torch.zeros(2, 70, dtype=torch.int32)
    mask[0, 40:] = 1
    mask[1, :9] = 1
    run_against_reference(kern, dict(q=q, k=k, v=v, keep=mask))
    v[0, :, :32] = float("nan")  # head 0 sees only keys >= 40: blocks 0 and 1 are skipped
    got = kern(q=q, k=k, v=v, keep=mask)
    assert torch.isfinite(got[0, 0]).all()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_decode_at_the_cache_s_end_skips_other_documents_grouped_or_not(kv_heads):
    """One query at the cache's end (``doc[q + S - 1] == doc[kv]``): the query's row axis
    has extent 1, so its read is one element per program and the key blocks are tested
    (sorted ids: one range) against it -- also for packed GQA rows, whose heads share
    that query.  The kernel counts the range on the ids themselves, no summary pre-pass.
    Keys of other documents are never read (NaN there); unsorted ids stay right."""
    S = 90
    doc = ne.placeholder((S,), "int32", "doc")
    out = ne.attention(1, 4, 1, S, D, "float32", kv_heads=kv_heads,
                       mask_mod=lambda b, h, i, j: doc[i + S - 1] == doc[j])
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    assert "bs_" not in kern.source and kern.kernel_source.prepass is None
    assert "this program's keys, read here" in kern.source
    assert f"doc_ptr + ({S - 1}) * doc_s0" in kern.source
    assert (kern.plan.packed is not None) == (kv_heads == 2)
    q, k, v = qkv(1, 4, 1, S, 3)
    k, v = k[:, :kv_heads], v[:, :kv_heads].clone()
    ids = torch.tensor([0] * 40 + [1] * 25 + [2] * 25, dtype=torch.int32)
    run_against_reference(kern, dict(q=q, k=k, v=v, doc=ids))
    v[..., :64, :] = float("nan")  # the last document is keys 65..89: blocks before 64 unread
    got = kern(q=q, k=k, v=v, doc=ids)
    assert torch.isfinite(got).all()
    ref = evaluate(kern.input_program, dict(q=q, k=k, v=v.nan_to_num(), doc=ids))["o"]
    assert torch.allclose(got.double(), ref, atol=1e-4)
    shuffled = ids[torch.randperm(S, generator=torch.Generator().manual_seed(0))]
    run_against_reference(kern, dict(q=q, k=k, v=v.nan_to_num(), doc=shuffled))
    # the split-k candidate (partials + combine, and one launch) tests every chunk the same way
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import candidate_configs
    row = next(r for r in kern.candidates if r.plan is not None and r.plan.split)
    assert "bs_" not in row.kernel.source
    assert re.search(r"ks_lo\d+ = pid_split \* CHUNK", row.kernel.source)
    for fused in (False, True):
        cfg = candidate_configs(row.kernel, "interpreter")[0]
        cfg.splits, cfg.fused = 3, fused
        o = torch.empty(1, 4, 1, D)
        Launcher(row.program, row.kernel, "interpreter", cfg)(dict(q=q, k=k, v=v, doc=ids, o=o))
        assert torch.isfinite(o).all() and torch.allclose(o.double(), ref, atol=1e-4)


@pytest.fixture(scope="module")
def gqa_decode_kernel():
    S = 90
    doc = ne.placeholder((S,), "int32", "doc")
    out = ne.attention(1, 4, 1, S, D, "float32", kv_heads=2,
                       mask_mod=lambda b, h, i, j: doc[i + S - 1] == doc[j])
    return ne.superoptimize(out, target="interpreter", cache=False)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), shuffle=st.booleans(),
       seed=st.integers(0, 99))
def test_a_grouped_decode_s_key_test_never_skips_a_visible_key(gqa_decode_kernel, lengths,
                                                               shuffle, seed):
    """Random documents (sorted: one key range; shuffled: the per-block test): the packed
    GQA decode's key blocks tested against the query's own id give the reference's
    answer, with the keys of other documents poisoned (NaN) where the ids are sorted."""
    S = 90
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:S]
    ids = torch.cat([ids, ids.new_full((S - len(ids),), ids[-1].item())]).to(torch.int32)
    g = torch.Generator().manual_seed(seed)
    if shuffle:
        ids = ids[torch.randperm(S, generator=g)]
    q, k, v = qkv(1, 4, 1, S, seed)
    k, v = k[:, :2], v[:, :2]
    ref = evaluate(gqa_decode_kernel.input_program, dict(q=q, k=k, v=v, doc=ids))["o"]
    if not shuffle:  # no key block wholly outside the query's document is read
        v = _poison_unread(v, ids, gqa_decode_kernel.config.blocks["B_L"])
    got = gqa_decode_kernel(q=q, k=k, v=v, doc=ids)
    assert torch.isfinite(got).all() and torch.allclose(got.double(), ref, atol=1e-4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), splits=st.sampled_from([2, 3, 6]),
       seed=st.integers(0, 99))
def test_split_k_partials_count_their_own_keys_and_never_skip_a_visible_one(
        gqa_decode_kernel, lengths, splits, seed):
    """The split-k candidate's partials each count the query's document on their own
    chunk of ids (``block_skip._count_keys``: floor / ceil of in-chunk counts, a ragged
    last block at S = 90): the reference's answer, with every key block outside the
    query's document poisoned (NaN), for chunk edges inside and between documents."""
    row = next(r for r in gqa_decode_kernel.candidates if r.plan is not None and r.plan.split)
    _check_split_decode(gqa_decode_kernel, row, _sorted_ids(lengths, 90), splits, seed, True)


def _sorted_ids(lengths: list[int], S: int) -> torch.Tensor:
    """Documents of these lengths in order, the last one stretched (or cut) to S keys."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:S]
    return torch.cat([ids, ids.new_full((S - len(ids),), ids[-1].item())])


def _poison_unread(v: torch.Tensor, ids: torch.Tensor, blk: int) -> torch.Tensor:
    """``v`` (B, H, S, D) with NaN in every key block of ``blk`` keys that holds none of
    the query's document (the last key's id; ids (S,) or (B, S), each sequence its own):
    a decode that reads such a block returns NaN."""
    rows = ids.view(-1, ids.shape[-1])
    B, S = rows.shape
    pad = torch.zeros(B, (-S) % blk, dtype=torch.bool)
    seen = torch.cat([rows == rows[:, -1:], pad], 1).view(B, -1, blk).any(2, keepdim=True)
    unread = ~seen.expand(-1, -1, blk).reshape(B, -1)[:, :S]
    return torch.where(unread[:, None, :, None], float("nan"), v)


def _check_split_decode(kern, row, ids, splits: int, seed: int, poison: bool,
                        chosen_too: bool = False) -> None:
    """The split-k candidate ``row`` of a grouped decode at the cache's end, run with
    ``splits`` partials on document ids ``ids`` ((S,), or (B, S): each sequence its own),
    against the reference; ``poison``: every key block holding none of the query's
    document is NaN in V (never read); ``chosen_too``: the chosen kernel as well."""
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import candidate_configs
    ids = ids.to(torch.int32)
    rows = ids.view(-1, ids.shape[-1])
    B, S = rows.shape
    q, k, v = qkv(B, 4, 1, S, seed)
    k, v = k[:, :2], v[:, :2]
    ref = evaluate(kern.input_program, dict(q=q, k=k, v=v, doc=ids))["o"]
    cfg = candidate_configs(row.kernel, "interpreter")[0]
    cfg.splits = splits
    if poison:
        blk = cfg.blocks["B_L"]
        assert not chosen_too or blk == kern.config.blocks["B_L"]  # one poisoning for both
        v = _poison_unread(v, ids, blk)
    o = torch.empty(B, 4, 1, D)
    Launcher(row.program, row.kernel, "interpreter", cfg)(dict(q=q, k=k, v=v, doc=ids, o=o))
    assert torch.isfinite(o).all() and torch.allclose(o.double(), ref, atol=1e-4)
    if chosen_too:
        got = kern(q=q, k=k, v=v, doc=ids)
        assert torch.isfinite(got).all() and torch.allclose(got.double(), ref, atol=1e-4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), splits=st.sampled_from([2, 3]),
       seed=st.integers(0, 99))
def test_in_kernel_counts_carry_across_several_vectors(monkeypatch, lengths, splits, seed):
    """The in-kernel counts load their first vector apart (``block_skip._first_loads``:
    the partial's counts issue their loads together) and loop over the rest; with 16 keys
    and 2 key blocks a vector the S = 90 decode takes several of each, so a first vector
    summed twice or a wrong carry into the loop would shift a range and read a poisoned
    block or drop a visible one (split-k partials and the chosen kernel)."""
    from neptune_eq.lowering import block_skip
    monkeypatch.setattr(block_skip, "SCAN_KEYS", 16)
    monkeypatch.setattr(block_skip, "SAMPLES", 2)
    S = 90
    doc = ne.placeholder((S,), "int32", "doc")
    out = ne.attention(1, 4, 1, S, D, "float32", kv_heads=2,
                       mask_mod=lambda b, h, i, j: doc[i + S - 1] == doc[j])
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    row = next(r for r in kern.candidates if r.plan is not None and r.plan.split)
    assert "tl.arange(0, 16)" in row.kernel.source and "tl.arange(0, 2)" in row.kernel.source
    ids = _sorted_ids(lengths, S)
    _check_split_decode(kern, row, ids, splits, seed, True)
    ids = ids.to(torch.int32)  # the chosen kernel, its unread key blocks poisoned alike
    q, k, v = qkv(1, 4, 1, S, seed)
    k, v = k[:, :2], v[:, :2]
    ref = evaluate(kern.input_program, dict(q=q, k=k, v=v, doc=ids))["o"]
    got = kern(q=q, k=k, v=_poison_unread(v, ids, kern.config.blocks["B_L"]), doc=ids)
    assert torch.isfinite(got).all() and torch.allclose(got.double(), ref, atol=1e-4)


@pytest.fixture(scope="module")
def long_gqa_decode_split():
    """The split-k candidate of a grouped decode over 1500 keys (blocks of the ids read
    whole-cache by ``_count_sampled``, chunks by ``_count_keys``)."""
    S = 1500
    doc = ne.placeholder((S,), "int32", "doc")
    out = ne.attention(1, 4, 1, S, D, "float32", kv_heads=2,
                       mask_mod=lambda b, h, i, j: doc[i + S - 1] == doc[j])
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    return kern, next(r for r in kern.candidates if r.plan is not None and r.plan.split)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 600), min_size=1, max_size=12),
       order=st.sampled_from(["sorted", "documents shuffled", "keys shuffled"]),
       splits=st.sampled_from([2, 5]), seed=st.integers(0, 99))
def test_partials_share_the_sampled_range_and_catch_what_it_misses(
        long_gqa_decode_split, lengths, order, splits, seed):
    """``split_share``: the partials share the visible range found from the key blocks'
    first and last ids, and each checks its own chunk for visible keys outside it.  Sorted ids: nothing
    outside the query's document is read (NaN there); documents in a shuffled order
    (each chunk sorted or not, the sample meaningless) and shuffled keys: still the
    reference's answer."""
    kern, row = long_gqa_decode_split
    g = torch.Generator().manual_seed(seed)
    ids = _sorted_ids(lengths, 1500)
    if order == "documents shuffled":
        ids = torch.randperm(int(ids.max()) + 1, generator=g)[ids]
    elif order == "keys shuffled":
        ids = ids[torch.randperm(len(ids), generator=g)]
    _check_split_decode(kern, row, ids, splits, seed, order == "sorted")


def test_the_shared_partial_runs_two_key_loops_outside_any_branch(long_gqa_decode_split):
    """``split_share``: whatever the data, a partial runs one masked loop over its key
    ranges and its chunk's unmasked interior, both at the kernel's top level -- Triton
    3.6 kept the K/V rings of loops in both branches of an ``if`` at once (262 KiB of
    shared memory at 128 keys, 3 stages: more than an H200 has)."""
    src = long_gqa_decode_split[1].kernel.source
    start = re.search(r"^def \w+_partial\(", src, re.M).start()
    partial = src[start:src.index("\ndef ", start + 1)]
    loops = re.findall(r"^( *)for (l0|j_v\d+) in range", partial, re.M)
    assert [len(indent) for indent, _ in loops] == [4, 4], loops


@pytest.fixture(scope="module")
def batched_doc_decode():
    """A decode of two sequences, each with its own documents (``doc[b, j]``): chosen
    kernel and split-k candidate."""
    S = 200
    doc = ne.placeholder((2, S), "int32", "doc")
    out = ne.attention(2, 4, 1, S, D, "float32", kv_heads=2,
                       mask_mod=lambda b, h, i, j: doc[b, i + S - 1] == doc[b, j])
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    return kern, next(r for r in kern.candidates if r.plan is not None and r.plan.split)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.lists(st.integers(1, 120), min_size=1, max_size=6), min_size=2, max_size=2),
       shuffled=st.booleans(), splits=st.sampled_from([2, 3]), seed=st.integers(0, 99))
def test_a_batch_s_own_documents_are_a_key_range_per_sequence(batched_doc_decode, lengths,
                                                              shuffled, splits, seed):
    """``doc[b, i + S - 1] == doc[b, j]``: a read of a 2-D tensor at the key whose other
    index is the program's sequence has the key-range form where the kernel reads the ids
    itself (``_key_side(any_rank=True)``, ``_key_read``), so the partials share each
    sequence's visible keys.  Sorted ids: no key block outside the query's document is
    read (NaN there), for the chosen kernel and the split-k one; documents in shuffled id
    order: the reference's answer."""
    kern, row = batched_doc_decode
    assert "bs_" not in row.kernel.source and "the sampled range" in row.kernel.source
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([_sorted_ids(ls, 200) for ls in lengths])
    if shuffled:
        ids = torch.stack([torch.randperm(int(r.max()) + 1, generator=g)[r] for r in ids])
    _check_split_decode(kern, row, ids, splits, seed, not shuffled, chosen_too=True)


def test_flex_attention_document_mask_skips_blocks():
    """ne.flex_attention with a document mask_mod (named size S): same answer as torch's
    flex_attention, and a padding block's NaN values are never read."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention as torch_flex
    s = 40
    doc = torch.tensor([0] * 10 + [-1] * 16 + [1] * 14, dtype=torch.int32)
    doc_pad_aligned = torch.tensor([0] * 16 + [-1] * 16 + [1] * 8, dtype=torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (doc[kv_idx] >= 0)

    q, k, v = qkv(1, 2, s, s, 6)
    bm = create_block_mask(mask_mod, None, None, s, s, device="cpu")
    got = ne.flex_attention(q, k, v, mask_mod=mask_mod)
    want = torch_flex(q, k, v, block_mask=bm)
    keep = doc >= 0
    assert torch.allclose(got[:, :, keep], want[:, :, keep], atol=1e-4)
    doc.copy_(doc_pad_aligned)   # the same closure, new ids: summaries are rebuilt per call
    v[:, :, 16:32] = float("nan")
    got = ne.flex_attention(q, k, v, mask_mod=mask_mod)
    assert torch.isfinite(got).all()


def test_jagged_sequences_from_offsets_nested_read():
    """Packed sequences: a query sees keys from its sequence's start, offsets[doc[i]] (a
    nested read), up to itself.  The kernel reads offsets[doc[i]] for its own rows (the
    mask needs them anyway) and starts its keys at their minimum: blocks before it are
    skipped (NaN there is never read), whatever order the offsets are in -- with no
    summary, so no pre-pass to wait for: the pre-pass only checks the ids."""
    doc = ne.placeholder((50,), "int32", "doc")
    offsets = ne.placeholder((4,), "int32", "offsets")
    out = ne.attention(1, 1, 50, 50, D, "float32",
                       mask_mod=lambda b, h, i, j: (j >= offsets[doc[i]]) & (j <= i))
    kern = ne.superoptimize(out, target="interpreter")
    main = kern.source.split("_check_ids(")[0]  # (the pre-pass waits for the kernel before it)
    assert "bs_" not in kern.source and "gdc_wait" not in main
    assert kern.launches == ["neptune_o_check_ids", "neptune_o"]
    lens = [16, 20, 14]
    ids = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(lens))
    offs = torch.tensor([0, 16, 36, 50], dtype=torch.int32)
    q, k, v = qkv(1, 1, 50, 50, 7)
    run_against_reference(kern, dict(q=q, k=k, v=v, doc=ids, offsets=offs))
    v2 = v.clone()
    v2[:, :, :16] = float("nan")   # sequence 0: only rows 0..15 (row block 0) may read it
    got = kern(q=q, k=k, v=v2, doc=ids, offsets=offs)
    assert torch.isfinite(got[:, :, 16:32]).all()   # row block 1 is all in sequence 1
    # the same kernel on a table whose offsets are not sorted: still exact
    run_against_reference(kern, dict(q=q, k=k, v=v, doc=ids, offsets=torch.tensor(
        [30, 0, 5, 50], dtype=torch.int32)))


def test_sorted_document_ids_become_loop_bounds():
    """The loop-bounds form for monotone ids: with sorted ids a row block's visible keys
    are one range (counted from the key-block summaries) and the blocks it sees
    whole another -- three loops (masked, unmasked, masked) with no per-block ``if``, under
    the ids' nondecreasing flag; unsorted ids take the per-block test form.  NaN in the V
    blocks of other documents shows the loop bounds alone keep them unread."""
    doc = ne.placeholder((64,), "int32", "doc")
    out = ne.attention(1, 1, 64, 64, D, "float32", mask_mod=lambda b, h, i, j: doc[i] == doc[j])
    kern = ne.superoptimize(out, target="interpreter")
    src = kern.source
    assert "if mono0_" in src and "else:  # unsorted: test each key block" in src
    loops = key_loops(src)[1:]  # (the first: the one-loop form, every block masked)
    assert "doc_ptr" in " ".join(key_loops(src)[0])
    # + the tested fallback loop and its ragged last key block (``if not (EVEN_L or WS)``)
    assert len(loops) == 5 and branch_free_loops(src) == 4
    assert [len(b) > 0 for b in loops[:3]] == [True] * 3
    assert "t" in " ".join(loops[1]) and "doc_ptr" not in " ".join(loops[1])  # unmasked
    assert all("doc_ptr" in " ".join(b) for b in (loops[0], loops[2]))      # boundary
    ids = torch.tensor([0] * 16 + [1] * 32 + [2] * 16, dtype=torch.int32)
    q, k, v = qkv(1, 1, 64, 64, 8)
    run_against_reference(kern, dict(q=q, k=k, v=v, doc=ids))
    v2 = v.clone()
    v2[:, :, :16] = float("nan")      # document 0 = key block 0
    v2[:, :, 48:] = float("nan")      # document 2 = key block 3
    got = kern(q=q, k=k, v=v2, doc=ids)
    assert torch.isfinite(got[:, :, 16:48]).all()   # rows of document 1 never loop there
    shuffled = ids[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    run_against_reference(kern, dict(q=q, k=k, v=v, doc=shuffled))
    # the range form needs only the key blocks' [min, max] in order, checked in the count
    # pass itself -- no whole-tensor walk in the pre-pass; ids shuffled inside each key
    # block keep it, and stay exact
    assert "bs_doc_all_ptr" not in src and "bs_nd" in src
    g = torch.Generator().manual_seed(1)
    ragged = torch.tensor([0] * 10 + [1] * 30 + [2] * 24, dtype=torch.int32)  # cuts inside blocks
    inside = torch.cat([blk[torch.randperm(len(blk), generator=g)] for blk in ragged.split(16)])
    assert not torch.equal(inside, ragged)
    run_against_reference(kern, dict(q=q, k=k, v=v, doc=inside))


@pytest.mark.parametrize("seed", range(4))
def test_sorted_documents_with_padding_random(document_kernel, seed):
    """Random sorted documents with a padding run (id -1) first, causal inside each: the
    range form (no per-block test) against the fp64 reference, and the padding keys'
    NaN values are never read by any row."""
    g = torch.Generator().manual_seed(100 + seed)
    pad = int(torch.randint(0, 20, (), generator=g))
    cuts = torch.sort(torch.randint(pad, 53, (3,), generator=g)).values
    ids = torch.full((53,), -1, dtype=torch.int32)
    for c in cuts.tolist():
        ids[c:] += 1
    ids[pad:] = ids[pad:].clamp(min=0)
    q, k, v = qkv(1, 2, 53, 53, seed)
    run_against_reference(document_kernel, dict(q=q, k=k, v=v, doc=ids))
    v2 = v.clone()
    v2[:, :, :pad - pad % 16] = float("nan")  # whole key blocks of padding
    got = document_kernel(q=q, k=k, v=v2, doc=ids)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("seed", range(3))
def test_jagged_random_offsets_are_loop_bounds(seed):
    """Jagged sequences, ``j >= offsets[doc[i]]`` and causal: a key-index range (no flag
    needed), exact against the reference for random lengths."""
    doc = ne.placeholder((61,), "int32", "doc")
    offsets = ne.placeholder((5,), "int32", "offsets")
    out = ne.attention(1, 1, 61, 61, D, "float32",
                       mask_mod=lambda b, h, i, j: (j >= offsets[doc[i]]) & (j <= i))
    kern = ne.superoptimize(out, target="interpreter")
    assert branch_free_loops(kern.source) == len(key_loops(kern.source))
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(1, 61, (3,), generator=g)).values
    offs = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([61])]).to(torch.int32)
    ids = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), offs.diff().long())
    q, k, v = qkv(1, 1, 61, 61, 20 + seed)
    run_against_reference(kern, dict(q=q, k=k, v=v, doc=ids, offsets=offs))


@pytest.fixture(scope="module")
def jagged_kernel():
    doc = ne.placeholder((45,), "int32", "doc")
    offsets = ne.placeholder((6,), "int32", "offsets")
    out = ne.attention(1, 1, 45, 45, D, "float32",
                       mask_mod=lambda b, h, i, j: (j >= offsets[doc[i]]) & (j <= i))
    return ne.superoptimize(out, target="interpreter")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(-6, 5), min_size=45, max_size=45),
       offs=st.lists(st.integers(-3, 50), min_size=6, max_size=6))
def test_a_row_block_s_own_ids_bound_its_keys_whatever_the_data(jagged_kernel, ids, offs):
    """The row side read by the kernel itself (``block_skip.row_read``): a row block's keys
    start at the least offsets[doc[i]] over its rows, read under torch's index rule --
    unsorted ids, negative ones counting from the end, offsets in any order or outside the
    keys -- and the answer is the reference's (a skipped visible block would change it)."""
    q, k, v = qkv(1, 1, 45, 45, 30)
    run_against_reference(jagged_kernel, dict(q=q, k=k, v=v, doc=torch.tensor(ids, dtype=torch.int32),
                                               offsets=torch.tensor(offs, dtype=torch.int32)))


def test_decode_split_with_key_ranges_per_head():
    """Decode (split-k / one-row-block forms) with a per-head key window read from data:
    the window is a key range in every chunk (no per-block test); keys outside it are
    never read (NaN there), and the answer matches the reference."""
    lo = ne.placeholder((2,), "int32", "lo")
    hi = ne.placeholder((2,), "int32", "hi")
    out = ne.attention(1, 2, 1, 90, D, "float32",
                       mask_mod=lambda b, h, i, j: (j >= lo[h]) & (j < hi[h]))
    kern = ne.superoptimize(out, target="interpreter")
    assert branch_free_loops(kern.source) == len(key_loops(kern.source)) > 0
    q, k, v = qkv(1, 2, 1, 90, 9)
    starts, ends = torch.tensor([33, 0], dtype=torch.int32), torch.tensor([90, 20], dtype=torch.int32)
    run_against_reference(kern, dict(q=q, k=k, v=v, lo=starts, hi=ends))
    v[0, 0, :32] = float("nan")   # head 0 sees keys 33..89: key blocks 0, 1 never read
    v[0, 1, 32:] = float("nan")   # head 1 sees keys 0..19: blocks from 2 on never read
    got = kern(q=q, k=k, v=v, lo=starts, hi=ends)
    assert torch.isfinite(got).all()
    # the split-k candidate (partial + combine, and one launch) bounds every chunk the same way
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import candidate_configs
    row = next((r for r in kern.candidates if r.plan is not None and r.plan.split), None)
    if row is None:
        pytest.skip("no split-k candidate for this decode")
    assert branch_free_loops(row.kernel.source) == len(key_loops(row.kernel.source)) > 0
    ref = evaluate(kern.input_program, dict(q=q, k=k, v=v.nan_to_num(), lo=starts, hi=ends))["o"]
    for fused in (False, True):
        cfg = candidate_configs(row.kernel, "interpreter")[0]
        cfg.splits, cfg.fused = 3, fused
        o = torch.empty(1, 2, 1, D)
        Launcher(row.program, row.kernel, "interpreter", cfg)(dict(q=q, k=k, v=v, lo=starts,
                                                                    hi=ends, o=o))
        assert torch.isfinite(o).all() and torch.allclose(o.double(), ref, atol=1e-4)


def test_block_range_count_spans_several_chunks(monkeypatch):
    """The key ranges count summary entries SEARCH_CHUNK at a time; with a chunk of 2 the
    4-7 key blocks here take several chunks, so a wrong carry between chunks (or a stray
    entry past the last block) would shift a range and drop or admit a block."""
    from neptune_eq.lowering import block_skip
    monkeypatch.setattr(block_skip, "SEARCH_CHUNK", 2)
    doc = ne.placeholder((100,), "int32", "doc")
    out = ne.attention(1, 1, 100, 100, D, "float32",
                       mask_mod=lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i))
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    assert "tl.arange(0, 2)" in kern.source
    # the atom's four counts (may/must x first/last) share one pass over the summary
    assert kern.source.count("for bs_c") == 1, kern.source
    ids = torch.repeat_interleave(torch.arange(5, dtype=torch.int32),
                                  torch.tensor([7, 30, 21, 2, 40]))
    q, k, v = qkv(1, 1, 100, 100, 3)
    run_against_reference(kern, dict(q=q, k=k, v=v, doc=ids))

"""The block predicate (lowering.block_predicate) is sound: over every (query block, key
block) it never says "no pair visible" for a block holding a visible pair, and never
says "every pair visible" for a block holding a masked pair.  Masks are random
compositions of document, jagged-offset, prefix-LM, causal, window and modular atoms
over random data (property-based), bounded with the same summaries the kernels get."""
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from neptune_eq.interp import Interpreter, Val
from neptune_eq.ir import Placeholder, Program, Term, const, var
from neptune_eq.lowering.block_predicate import PyOps, block_truth, summary_dim
from neptune_eq.runtime.block_summary import summarize

Q, KV, B = var("q"), var("kv"), var("b")


def T(op, *args, val=None):
    return Term(op, tuple(args), val)


def load(name, *idx):
    return Term("load", tuple(idx), name)


def atoms():
    doc_q, doc_kv = load("doc", Q), load("doc", KV)
    return st.sampled_from([
        T("eq", doc_q, doc_kv),                                    # document mask
        T("ge", Q, KV),                                            # causal
        T("ge", KV, load("offsets", doc_q)),                       # jagged: key after q's start
        T("lt", KV, load("offsets", T("add", doc_q, const(1)))),   # ... and before its end
        T("lt", KV, load("prefix", B)),                            # prefix-LM, per sample
        T("lt", T("sub", Q, KV), const(5)),                        # sliding window
        T("eq", T("floordiv", Q, const(7)), T("floordiv", KV, const(7))),
        T("lt", T("mod", KV, const(6)), const(2)),
        T("eq", load("bdoc", B, Q), load("bdoc", B, KV)),           # per-sample documents
        T("gt", T("mul", doc_q, const(2)), T("sub", doc_kv, const(1))),
        T("le", T("abs", T("sub", doc_q, doc_kv)), const(1)),
        T("eq", T("maximum", doc_q, doc_kv), T("minimum", doc_q, const(2))),
        load("allowed", doc_q, doc_kv),                            # a captured bool table
        T("ne", T("where", T("lt", Q, KV), doc_q, doc_kv), const(0)),
    ])


masks = st.recursive(atoms(), lambda inner: st.one_of(
    st.builds(lambda a, b: T("and", a, b), inner, inner),
    st.builds(lambda a, b: T("or", a, b), inner, inner),
    st.builds(lambda a: T("not", a), inner)), max_leaves=5)


@st.composite
def data(draw):
    s = draw(st.integers(1, 24))
    ndoc = draw(st.integers(1, 6))
    sorted_ids = draw(st.booleans())
    ids = draw(st.lists(st.integers(0, ndoc - 1), min_size=s, max_size=s))
    doc = torch.tensor(sorted(ids) if sorted_ids else ids, dtype=torch.int32)
    offsets = torch.tensor(sorted(draw(st.lists(st.integers(0, s), min_size=ndoc + 1,
                                                 max_size=ndoc + 1))), dtype=torch.int32)
    bdoc = torch.tensor(draw(st.lists(st.lists(st.integers(0, 3), min_size=s, max_size=s),
                                      min_size=2, max_size=2)), dtype=torch.int64)
    prefix = torch.tensor(draw(st.lists(st.integers(0, s), min_size=2, max_size=2)),
                          dtype=torch.int32)
    allowed = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=ndoc, max_size=ndoc),
                                         min_size=ndoc, max_size=ndoc)))
    return s, dict(doc=doc, offsets=offsets, bdoc=bdoc, prefix=prefix, allowed=allowed)


def truth_table(cond: Term, s: int, tensors: dict, b: int) -> torch.Tensor:
    """The mask on every (q, kv) pair, by the reference interpreter."""
    prog = Program([Placeholder(n, tuple(t.shape), str(t.dtype).replace("torch.", ""))
                    for n, t in tensors.items()], [], {"q": s, "kv": s}, ["x"])
    interp = Interpreter(prog, tensors)
    v = interp.eval(cond, {"q": Val(torch.arange(s), ("q",)), "kv": Val(torch.arange(s), ("kv",)),
                           "b": Val(torch.tensor(b), ())}, {})
    return v.expand_to(("q", "kv")).bool() if v.axes else v.t.bool().expand(s, s)


def analyse(cond, tensors, q0, q1, k0, k1, bq, bk, b, memo=None):
    """(may, must) over rows [q0, q1] x keys [k0, k1], bounded as a kernel bounds it."""
    memo = {} if memo is None else memo

    def summary(name, dim, size):  # what the launcher passes the kernel, as Python lists
        if (name, dim, size) not in memo:
            memo[name, dim, size] = summarize(tensors[name], dim, size).tolist()
        return memo[name, dim, size]

    ranges = {"q": (q0, q1), "kv": (k0, k1), "b": (b, b)}
    blocks = {"row": (q0 // bq, bq), "loop": (k0 // bk, bk)}

    def bound_load(t, idx):
        hit = summary_dim(t, {"q": "row", "kv": "loop"}, {"b"})
        if hit is None:  # global [min, max, nondecreasing]: see block_skip._global_bounds
            lo, hi, mono = summary(t.val, None, 1)
            x = tensors[t.val]
            if mono and x.ndim == 1 and idx[0] is not None:
                a, b = (min(max(e, 0), len(x) - 1) for e in idx[0])
                return x[a].item(), x[b].item()
            return lo, hi
        dim, role = hit
        if dim is None:  # one element per program: the element itself
            v = tensors[t.val][tuple(lo for lo, _ in idx)].item()
            return v, v
        blk, size = blocks[role]
        at = [lo for lo, _ in idx]
        at[dim] = blk
        out = summary(t.val, dim, size)
        for k in at:
            out = out[k]
        return tuple(out)

    return block_truth(cond, PyOps(), ranges.get, bound_load)


def check_blocks(cond, s, tensors, bq, bk):
    skipped = unmasked = 0
    memo = {}
    for b in range(2):
        table = truth_table(cond, s, tensors, b)
        for q0 in range(0, s, bq):
            q1 = min(q0 + bq, s) - 1
            for k0 in range(0, s, bk):
                k1 = min(k0 + bk, s) - 1
                tile = table[q0:q1 + 1, k0:k1 + 1]
                may, must = analyse(cond, tensors, q0, q1, k0, k1, bq, bk, b, memo)
                assert may or not tile.any(), (str(cond), b, q0, k0, "skipped a visible pair")
                assert not must or tile.all(), (str(cond), b, q0, k0, "unmasked a masked pair")
                skipped += not may
                unmasked += bool(must)
    return skipped, unmasked


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks, data(), st.integers(1, 9), st.integers(1, 9))
def test_block_predicate_never_skips_a_visible_pair_nor_unmasks_a_masked_one(cond, d, bq, bk):
    s, tensors = d
    check_blocks(cond, s, tensors, bq, bk)


def test_document_causal_mask_skips_and_unmasks_blocks():
    """Not vacuous: with 4 sorted documents and causal inside each, off-document and
    future blocks are skipped, whole blocks inside one document before the diagonal need no
    mask, and exactly the blocks that hold a visible pair are kept."""
    s, bq = 64, 8
    doc = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), 16)
    cond = T("and", T("eq", load("doc", Q), load("doc", KV)), T("ge", Q, KV))
    tensors = {"doc": doc}
    skipped, unmasked = check_blocks(cond, s, tensors, bq, bq)
    table = truth_table(cond, s, tensors, 0)
    blocks = table.reshape(8, 8, 8, 8).any(3).any(1)
    full = table.reshape(8, 8, 8, 8).all(3).all(1)
    assert skipped == 2 * int((~blocks).sum())   # tight: every empty block is skipped
    assert unmasked == 2 * int(full.sum())       # every full block is unmasked
    assert skipped > 0 and unmasked > 0


def test_unknown_terms_are_never_decided():
    """A score (a producer read) has no bound: the block is kept and stays masked."""
    cond = T("and", T("gt", Term("ref", (Q, KV), "s"), const(0.0)), T("ge", Q, KV))
    may, must = analyse(cond, {}, 0, 3, 0, 3, 4, 4, 0)
    assert may is True and must is False
    may, _ = analyse(cond, {}, 0, 3, 8, 11, 4, 4, 0)  # the causal atom alone decides
    assert may is False


@given(st.integers(1, 3), st.integers(1, 30), st.integers(1, 9), st.sampled_from(
    [torch.int32, torch.int64, torch.float32, torch.bool]))
@settings(max_examples=60, deadline=None)
def test_summaries_are_exact_per_block_min_max(rows, n, block, dtype):
    """summarize(): block k of dim 1 holds [min, max] of elements k*B .. k*B+B-1 (a short
    last block is not widened by padding); the global one [min, max, nondecreasing]."""
    g = torch.Generator().manual_seed(n * 31 + block)
    x = torch.randint(-5, 6, (rows, n), generator=g).to(dtype)
    s = summarize(x, 1, block)
    xi = x.to(torch.int64) if dtype == torch.bool else x
    assert s.shape == (rows, -(-n // block), 2)
    for k in range(-(-n // block)):
        part = xi[:, k * block:(k + 1) * block]
        assert torch.equal(s[:, k, 0].to(xi.dtype), part.amin(1))
        assert torch.equal(s[:, k, 1].to(xi.dtype), part.amax(1))
    lo, hi, mono = summarize(xi[0], None, 1).tolist()
    assert (lo, hi) == (xi[0].min().item(), xi[0].max().item())
    assert bool(mono) == bool((xi[0][1:] >= xi[0][:-1]).all())

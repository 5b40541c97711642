"""``ne.flex_attention`` against torch's own ``flex_attention`` (eager, float32, CPU), and
under ``torch.compile(fullgraph=True)`` (issue 14, items 3-5).

Every new structure costs one superoptimization (~8 s here, most of it translation
validation in the interpreter), so the tests share structures where the point allows:
causal serves block_mask, mask_mod=, return_lse and the two-lengths check; softcap 20/30
serve the closure test and the compile recompilation test; ALiBi+GQA serves the compile
test of a module with a captured buffer.
"""
import dataclasses
import functools

import pytest
import torch
from torch.nn.attention.flex_attention import (AuxRequest, BlockMask, create_block_mask,
                                               flex_attention as torch_flex)

import neptune_eq as ne
from neptune_eq.dropin import flex
from neptune_eq.dropin import torch_op
from neptune_eq.egraph.saturate import EGraphStage

# torch's eager flex_attention warns that it is unfused, and return_lse is deprecated
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without",
                                        "ignore:return_lse is deprecated")


@pytest.fixture
def saturations(monkeypatch):
    """Counts e-graph saturations in this test (as tests/test_sizes.py does)."""
    count = [0]
    real = EGraphStage.saturate

    def counted(self, *a, **kw):
        count[0] += 1
        return real(self, *a, **kw)
    monkeypatch.setattr(EGraphStage, "saturate", counted)
    return count


def qkv(b=2, hq=2, hkv=None, lq=24, s=30, e=16, ev=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hkv, ev = hkv or hq, ev or e
    return (torch.randn(b, hq, lq, e, generator=g), torch.randn(b, hkv, s, e, generator=g),
            torch.randn(b, hkv, s, ev, generator=g))


def assert_close(got, want, tol=3e-5):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "-inf in different places"
    fin = torch.isfinite(want)
    err = (got[fin].double() - want[fin].double()).abs().max().item()
    assert err <= tol * max(1.0, want[fin].abs().max().item()), err


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_softcap(cap):
    def softcap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    return softcap


def make_alibi(slopes):
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi


def test_plain_matches_torch():
    q, k, v = qkv()
    assert_close(ne.flex_attention(q, k, v), torch_flex(q, k, v))
    assert_close(ne.flex_attention(q, k, v, scale=0.5), torch_flex(q, k, v, scale=0.5))


def test_causal_block_mask_mask_mod_and_lse(saturations):
    q, k, v = qkv()
    bm = create_block_mask(causal, None, None, 24, 30, device="cpu")
    want, want_lse = torch_flex(q, k, v, block_mask=bm, return_lse=True)
    got, lse = ne.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert_close(got, want)
    assert lse.dtype == torch.float32
    assert_close(lse, want_lse)
    before = saturations[0]
    out, aux = ne.flex_attention(q, k, v, mask_mod=causal, return_aux=AuxRequest(lse=True))
    assert_close(out, want)   # the same structure: no second saturation
    assert_close(aux.lse, want_lse) and aux.max_scores is None
    q, k, v = qkv(b=1, lq=7, s=40, seed=1)   # another length: no saturation either
    bm = create_block_mask(causal, None, None, 7, 40, device="cpu")
    assert_close(ne.flex_attention(q, k, v, mask_mod=causal), torch_flex(q, k, v, block_mask=bm))
    assert saturations[0] == before


def make_document(doc):
    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
    return document


def test_new_lengths_do_not_saturate_even_with_a_captured_length(saturations, monkeypatch,
                                                                   tmp_path):
    """Document masking: ids of length S read at q_idx and kv_idx; their dim takes the
    name S (and the query length too), so every length runs one saturated structure."""
    monkeypatch.setenv("NEPTUNE_EQ_CACHE", str(tmp_path))   # no kernel from the disk cache
    monkeypatch.setattr(flex, "STRUCTURES", {})
    for b, s in ((2, 24), (1, 37), (2, 9)):
        doc = torch.sort(torch.randint(0, 3, (s,))).values.to(torch.int32)
        q, k, v = qkv(b=b, lq=s, s=s, seed=s)
        bm = create_block_mask(make_document(doc), None, None, s, s, device="cpu")
        assert_close(ne.flex_attention(q, k, v, mask_mod=make_document(doc)),
                     torch_flex(q, k, v, block_mask=bm))
    assert saturations[0] == 1
    (st,) = flex.STRUCTURES.values()
    assert st.symbols == ["B", "S"] and "doc[S]" in st.text


def test_softcap_and_a_changed_closure_gets_a_new_kernel(saturations):
    q, k, v = (t * 4 for t in qkv())   # scores large enough that the cap matters
    keys = []
    for cap in (20.0, 30.0, 20.0):
        assert_close(ne.flex_attention(q, k, v, make_softcap(cap)),
                     torch_flex(q, k, v, make_softcap(cap)))
        keys.append(flex.trace(flex.check(q, k, v, None, False, False),
                               make_softcap(cap), None)[0].key)
    assert keys[0] != keys[1] and keys[0] == keys[2]
    assert saturations[0] <= 2   # 20, 30; the second 20 reuses its kernel


def test_alibi_gqa_captured_slopes(saturations):
    q, k, v = qkv(b=1, hq=4, hkv=2, lq=20, s=26)
    slopes = torch.rand(4)
    assert_close(ne.flex_attention(q, k, v, make_alibi(slopes), enable_gqa=True),
                 torch_flex(q, k, v, make_alibi(slopes), enable_gqa=True))
    before = saturations[0]
    other = torch.rand(4) * 3  # new values, same shape: a kernel input, same structure
    assert_close(ne.flex_attention(q, k, v, make_alibi(other), enable_gqa=True),
                 torch_flex(q, k, v, make_alibi(other), enable_gqa=True))
    assert saturations[0] == before


def test_value_dim_fully_masked_rows_lse_and_max_scores():
    q, k, v = qkv(b=1, hq=2, lq=20, s=24, ev=8)

    def late(b, h, q_idx, kv_idx):  # rows 0..2 see nothing
        return kv_idx <= q_idx - 3
    bm = create_block_mask(late, None, None, 20, 24, device="cpu")
    want, want_lse = torch_flex(q, k, v, block_mask=bm, return_lse=True)
    out, aux = ne.flex_attention(q, k, v, block_mask=bm,
                                 return_aux=AuxRequest(lse=True, max_scores=True))
    assert out.shape == (1, 2, 20, 8)
    assert_close(out, want)
    assert_close(aux.lse, want_lse)
    assert (out[:, :, :3] == 0).all() and (aux.lse[:, :, :3] == float("-inf")).all()
    # torch has no CPU max_scores: the masked row max of the scaled scores
    s = (q @ k.transpose(-1, -2)) / 4.0
    seen = torch.arange(24)[None, :] <= torch.arange(20)[:, None] - 3
    assert_close(aux.max_scores, s.masked_fill(~seen, float("-inf")).amax(-1))


def _sparse_tables() -> BlockMask:
    n = torch.tensor([[[1]]], dtype=torch.int32)
    return BlockMask.from_kv_blocks(n, torch.tensor([[[[0, 1]]]], dtype=torch.int32),
                                    BLOCK_SIZE=16)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((torch.randn(2, 24, 16),) * 3, {}, ValueError, "rank 4"),
    (qkv(b=2)[:1] + qkv(b=1)[1:], {}, ValueError, "one batch size"),
    (qkv(hq=4)[:1] + qkv(hq=2)[1:], {}, ValueError, "enable_gqa=True"),
    (qkv(hq=3)[:1] + qkv(hq=2)[1:], {"enable_gqa": True}, ValueError, "multiple of the key/value"),
    (qkv(e=16)[:1] + qkv(e=8)[1:], {}, ValueError, "same head dim"),
    (qkv(e=1, ev=1)[:2] + (torch.randn(2, 2, 30, 0),), {}, ValueError, "head dims of at least 1"),
    (qkv()[:2] + (qkv()[2].half(),), {}, ValueError, "one dtype"),
    (tuple(t.double() for t in qkv()), {}, ne.ProgramError, "float16, bfloat16 or float32"),
    (qkv(), {"block_mask": "causal", "mask_mod": causal}, ValueError, "got both"),
    (qkv(), {"block_mask": causal}, ValueError, "use mask_mod="),
    (qkv(), {"return_lse": True, "return_aux": AuxRequest(lse=True)}, ValueError, "got both"),
    (qkv(lq=32, s=32), {"block_mask": _sparse_tables()}, ne.ProgramError, "from_kv_blocks"),
    (qkv(), {"scale": "0.5"}, ValueError, "scale"),
    (qkv(), {"score_mod": lambda s, b, h, i, j: torch.cumsum(s, 0)}, ne.ProgramError,
     "Supported:"),
    # a mod FlexAttention could not call: said before the trace, not Python's TypeError
    (qkv(), {"score_mod": lambda s, b: s}, ValueError,
     r"score_mod to take 5 positional arguments \(score, b, h, q_idx, kv_idx\), got .*\(s, b\)"),
    (qkv(), {"mask_mod": lambda b, h, i, j, extra: i >= j}, ValueError, "mask_mod to take 4"),
    (qkv(), {"score_mod": 2.0}, ValueError, "score_mod to be a function"),
])
def test_errors_say_what_to_do(args, kwargs, error, match):
    if kwargs.get("block_mask") == "causal":
        kwargs = {**kwargs, "block_mask": create_block_mask(causal, None, None, 24, 30, device="cpu")}
    with pytest.raises(error, match=match):
        ne.flex_attention(*args, **kwargs)


@pytest.mark.parametrize("b, lq, s", [(0, 24, 30), (2, 0, 30), (2, 24, 0)])
def test_empty_batch_queries_or_keys_return_what_torch_would(b, lq, s):
    """An empty batch or query: empty outputs of torch's shapes (its eager flex_attention
    returns them); no keys: every row sees none -- output 0, lse and max -inf, as a fully
    masked row -- and zero gradients of the inputs' shapes, GQA and a value width of its
    own included; no mod is traced."""
    q, k, v = qkv(b=b, hq=4, hkv=2, lq=lq, s=s, ev=8)
    for t in (q, k, v):
        t.requires_grad_()
    traced = []
    out, aux = ne.flex_attention(q, k, v, score_mod=lambda sc, *_: traced.append(1) or sc,
                                 enable_gqa=True, return_aux=AuxRequest(lse=True, max_scores=True))
    assert out.shape == (b, 4, lq, 8) and out.dtype == q.dtype and not traced
    assert aux.lse.shape == aux.max_scores.shape == (b, 4, lq)
    assert (out == 0).all() and (aux.lse == float("-inf")).all()
    assert (aux.max_scores == float("-inf")).all()
    if b and lq:  # (torch's own flex_attention refuses no keys)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert_close(out, want)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.shape == t.shape and (g == 0).all() for g, t in zip(grads, (q, k, v)))


# ----------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------
class Alibi(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("slopes", torch.rand(4))
        self.score_mod = make_alibi(self.slopes)

    def forward(self, q, k, v):
        return ne.flex_attention(q, k, v, self.score_mod, enable_gqa=True) * 2


def test_compiled_module_fullgraph_with_a_captured_buffer(saturations):
    torch._dynamo.reset()
    m = Alibi()
    q, k, v = qkv(b=1, hq=4, hkv=2, lq=20, s=26)
    explained = torch._dynamo.explain(m)(q, k, v)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.neptune_eq.flex_attention.default in ops
    c = torch.compile(m, fullgraph=True)
    assert_close(c(q, k, v), torch_flex(q, k, v, make_alibi(m.slopes), enable_gqa=True) * 2)
    built = saturations[0]
    m.slopes.mul_(-3)   # the buffer is a graph input: in-place changes are seen
    assert_close(c(q, k, v), torch_flex(q, k, v, make_alibi(m.slopes), enable_gqa=True) * 2)
    q, k, v = qkv(b=2, hq=4, hkv=2, lq=33, s=37, seed=5)   # new sizes: no saturation
    assert_close(c(q, k, v), torch_flex(q, k, v, make_alibi(m.slopes), enable_gqa=True) * 2)
    assert saturations[0] == built


class Softcap(torch.nn.Module):
    def __init__(self, cap):
        super().__init__()
        self.score_mod = make_softcap(cap)

    def forward(self, q, k, v):
        return ne.flex_attention(q, k, v, self.score_mod)


def test_compiled_closure_change_recompiles_instead_of_a_stale_kernel():
    """Dynamo guards a function only by its code object; the constant read from the
    closure is guarded by neptune_eq, so softcap 20 -> 30 re-keys the structure."""
    torch._dynamo.reset()
    q, k, v = (t * 4 for t in qkv())
    m = Softcap(20.0)
    c = torch.compile(m, fullgraph=True, backend="eager")
    want = [torch_flex(q, k, v, make_softcap(cap)) for cap in (20.0, 30.0)]
    assert (want[0] - want[1]).abs().max() > 1e-2   # a stale kernel would be caught
    for cap, w in zip((20.0, 30.0), want):
        m.score_mod = make_softcap(cap)
        assert_close(c(q, k, v), w)


def test_compiled_with_dynamic_shapes(saturations):
    """dynamic=True: batch and lengths symbolic in the graph and in the kernel (heads and
    head dims are specialised for the structure lookup)."""
    torch._dynamo.reset()
    c = torch.compile(lambda q, k, v: ne.flex_attention(q, k, v, mask_mod=causal, return_lse=True),
                      fullgraph=True, dynamic=True, backend="eager")
    for b, lq, s in ((2, 24, 30), (1, 7, 40), (2, 9, 9)):
        q, k, v = qkv(b=b, lq=lq, s=s, seed=lq)
        bm = create_block_mask(causal, None, None, lq, s, device="cpu")
        for got, want in zip(c(q, k, v), torch_flex(q, k, v, block_mask=bm, return_lse=True)):
            assert_close(got, want)
    assert saturations[0] <= 1   # the causal structure, if no test before built it


class _Traced(Exception):
    pass


def _trace_only(module, *args):
    """Compile with fullgraph=True and a backend that keeps the graph and never runs it
    (so no kernel is built): the graph, or the error Dynamo raised."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def never(*a):
            raise _Traced
        return never
    torch._dynamo.reset()
    with pytest.raises(_Traced):
        torch.compile(module, fullgraph=True, backend=backend)(*args)
    return graphs[0]


class MethodMod(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.randn(2, 30))
        self.cap = 5.0

    def mod(self, score, b, h, q_idx, kv_idx):
        return score + self.bias[h, kv_idx] * self.cap

    def forward(self, q, k, v):
        return ne.flex_attention(q, k, v, self.mod, mask_mod=functools.partial(window, w=8))


def window(b, h, q_idx, kv_idx, w=4):
    return (q_idx - kv_idx < w) & (kv_idx - q_idx < w)


def test_bound_method_and_partial_mods_trace_fullgraph():
    m = MethodMod()
    gm = _trace_only(m, *qkv())
    calls = [n for n in gm.graph.nodes if n.target == torch.ops.neptune_eq.flex_attention.default]
    assert len(calls) == 1
    captured = calls[0].args[3]
    assert len(captured) == 1 and captured[0].meta["example_value"].shape == (2, 30)
    plan = torch_op.compile_plan(m.mod.__func__, m, functools.partial(window, w=8), None,
                                 *dataclasses.astuple(flex.check(*qkv(), None, False, False)))
    guarded = {torch_op._show(p): x for _, p, x in plan[1]}
    assert guarded["mod.__self__.cap"] == 5.0 and guarded["mod.keywords['w']"] == 8
    assert plan[3] == (("path", 0, (("self", None), ("attr", "bias"))),)


class InnerClosure(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cap = 20.0

    def forward(self, q, k, v):
        def softcap(score, b, h, q_idx, kv_idx):   # closes over self: a traced value
            return torch.tanh(score / self.cap) * self.cap
        return ne.flex_attention(q, k, v, softcap)


def test_a_closure_made_inside_the_compiled_region():
    """Dynamo cannot hand such a function over: fullgraph=True names it, and without
    fullgraph the call runs eagerly (a graph break), with the right answer."""
    q, k, v = (t * 4 for t in qkv())
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="non-constructible closure"):
        torch.compile(InnerClosure(), fullgraph=True, backend="eager")(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(InnerClosure(), backend="eager")(q, k, v)
    assert_close(got, torch_flex(q, k, v, make_softcap(20.0)))


def test_empty_inputs_under_torch_compile():
    """The empty case is torch ops only, so a compiled module runs it too (Dynamo
    specialises sizes 0 and 1): an empty batch, and no keys (zeros)."""
    f = torch.compile(lambda q, k, v: ne.flex_attention(q, k, v), fullgraph=True)
    q, k, v = qkv(b=0)
    assert f(q, k, v).shape == (0, 2, 24, 16)
    q, k, v = qkv(s=0)
    got = f(q, k, v)
    assert got.shape == (2, 2, 24, 16) and (got == 0).all()


def test_a_table_longer_than_the_keys_after_one_exactly_as_long(saturations):
    """``tab[kv_idx]`` with tab of 24 entries: at 24 keys its dim is named S; at 17 keys the
    same structure runs on its first 17 entries (torch reads no further), eagerly, with
    its gradient (zero past 17), and under torch.compile with dynamic shapes.  At more
    keys than entries the read is out of range: refused by name."""
    tab = torch.randn(24, requires_grad=True)

    def bias(score, b, h, q_idx, kv_idx):
        return score + tab[kv_idx]
    compiled = torch.compile(lambda q, k, v: ne.flex_attention(q, k, v, score_mod=bias),
                             fullgraph=True, dynamic=True, backend="eager")
    for s in (24, 17):
        q, k, v = qkv(lq=9, s=s, seed=s)
        want = torch_flex(q, k, v, score_mod=bias)
        got = ne.flex_attention(q, k, v, score_mod=bias)
        assert_close(got, want.detach())
        with torch.no_grad():
            assert_close(compiled(q, k, v), want.detach())
    (g_want,) = torch.autograd.grad(want.sum(), tab)
    (g_got,) = torch.autograd.grad(got.sum(), tab)
    assert g_got.shape == (24,) and torch.all(g_got[17:] == 0)
    assert_close(g_got, g_want, tol=1e-4)
    assert saturations[0] <= 2   # the forward; the backward's own program
    with pytest.raises(ne.ProgramError, match="Size S is 30 .* but 24 in dim 0"):
        ne.flex_attention(*qkv(lq=9, s=30), score_mod=bias)


def test_float32_inputs_follow_torchs_matmul_precision(monkeypatch):
    """A float32 call under "high" gets a structure and kernel of its own with TF32
    products (torch's flex_attention follows the same setting); the "highest" one keeps
    exact fp32 products, eagerly and under torch.compile (Dynamo guards on the setting)."""
    monkeypatch.setattr(flex, "STRUCTURES", {})
    q, k, v = qkv(b=1, lq=20, s=20)
    compiled = torch.compile(lambda q, k, v: ne.flex_attention(q, k, v, mask_mod=causal),
                             fullgraph=True, backend="eager")
    want = torch_flex(q, k, v, block_mask=create_block_mask(causal, None, None, 20, 20,
                                                            device="cpu"))
    previous = torch.get_float32_matmul_precision()
    try:
        for setting in ("high", "highest"):
            torch.set_float32_matmul_precision(setting)
            assert_close(ne.flex_attention(q, k, v, mask_mod=causal), want)
            assert_close(compiled(q, k, v), want)
    finally:
        torch.set_float32_matmul_precision(previous)
    tf32 = {st.fp32_precision: '"tf32"' in st.kernel.source for st in flex.STRUCTURES.values()}
    assert tf32 == {"high": True, "highest": False}


def test_longer_tables_at_new_lengths_and_the_ones_that_cannot_fit():
    """Query ids and key ids of 40 entries (``doc_q[q_idx] == doc_kv[kv_idx]``): traced at
    L = S = 40, then run at L=17, S=23 on their prefixes.  A table shorter than S reads out
    of range (torch raises IndexError), and one table read at both q_idx and kv_idx with
    L != S cannot take one size: both are refused saying what fits and what to do."""
    g = torch.Generator().manual_seed(3)
    doc_q, doc_kv = (torch.sort(torch.randint(0, 3, (40,), generator=g)).values for _ in "qk")
    short = torch.randn(20, generator=g)

    def cross(b, h, q_idx, kv_idx):
        return doc_q[q_idx] == doc_kv[kv_idx]

    def same(b, h, q_idx, kv_idx):
        return doc_q[q_idx] == doc_q[kv_idx]
    for lq, s in ((40, 40), (17, 23)):
        q, k, v = qkv(b=1, lq=lq, s=s, seed=lq)
        bm = create_block_mask(cross, None, None, lq, s, device="cpu")
        assert_close(ne.flex_attention(q, k, v, mask_mod=cross), torch_flex(q, k, v, block_mask=bm))
    with pytest.raises(ne.ProgramError, match=r"at least S entries.*doc_q = doc\[:L\]"):
        ne.flex_attention(*qkv(b=1, lq=17, s=23), mask_mod=same)
    with pytest.raises(ne.ProgramError, match=r"fit this call \(B=1, L=9, S=30\).*extent 20"):
        ne.flex_attention(*qkv(b=1, lq=9, s=30), score_mod=lambda s, b, h, i, j: s + short[j])


def test_a_tensor_a_mod_computes_from_data_is_an_error_under_compile():
    """Compiled, a tensor a mod computes from one it closes over (``(doc > 0)[q_idx]``)
    would be baked into the graph with the first call's values: an error saying so and
    what to write instead, never a stale kernel."""
    torch._dynamo.reset()
    q, k, v = qkv()
    doc = torch.zeros(q.shape[2], dtype=torch.int32)

    def mask(b, h, i, j):
        return (doc > 0)[i] | (i >= j)

    def f(q, k, v):
        return ne.flex_attention(q, k, v, mask_mod=mask)
    with pytest.raises(Exception, match=r"computes from one of them while traced.*Compute it "
                                        r"outside the mod \(flag = doc > 0"):
        torch.compile(f, fullgraph=True, backend="eager")(q, k, v)


"""Reverse-mode differentiation of the IR (issue 18, item 1): the plain backward
programs, evaluated by the fp64 interpreter, against torch autograd in fp64 through the
forward program (the interpreter is written in torch ops, so autograd runs through it)."""
import re

import pytest
import torch

import neptune_eq as ne
from neptune_eq.frontend import examples
from neptune_eq.frontend.autodiff import backward_program
from neptune_eq.interp import evaluate


def _inputs(p, scale=1.0):
    return {ph.name: torch.randn(ph.shape, dtype=torch.float64) * scale for ph in p.inputs}


def grads_both_ways(out, wrt, scale=1.0, **kw):
    """(reference, derived) gradients of <outputs, random cotangents> w.r.t. ``wrt``."""
    p = out if isinstance(out, ne.ir.Program) else ne.build_program(out)
    bw = backward_program(p, wrt, **kw)
    ins = _inputs(p, scale)
    leaf = {n: t.clone().requires_grad_(n in wrt) for n, t in ins.items()}
    fw = evaluate(p, leaf)
    cots = {"d_" + o: torch.randn(fw[o].shape, dtype=torch.float64) for o in p.outputs}
    loss = sum((fw[o] * cots["d_" + o]).sum() for o in p.outputs)
    ref = dict(zip(wrt, torch.autograd.grad(loss, [leaf[w] for w in wrt])))
    feed = {**ins, **{n: fw[n].detach() for n in bw.saved}, **cots}
    got = evaluate(bw.program, {ph.name: feed[ph.name] for ph in bw.program.inputs})
    return ref, {w: got["d_" + w] for w in wrt}, bw


def assert_close(ref, got, tol=1e-10):
    for w in ref:
        assert torch.isfinite(got[w]).all(), w
        err = (got[w] - ref[w]).abs().max().item()
        assert err <= tol * max(1.0, ref[w].abs().max().item()), (w, err)


def test_softmax_backward_matches_autograd():
    ref, got, bw = grads_both_ways(examples.softmax(3, 7, "float64"), ["x"])
    assert_close(ref, got)
    # the saved output y is read back (∂y/∂den = −y/den), as torch's softmax backward does
    assert [ph.name for ph in bw.program.inputs] == ["x", "mx", "den", "y", "d_y"]


@pytest.mark.parametrize("chain", examples.CHAINS)
def test_reduction_chains_backward(chain):
    out = examples.reduction_chain(chain, 3, 7, 5, "float64")
    wrt = ["x"] if chain in ("log-sum-exp", "max-consumer") else ["x", "v"]
    ref, got, _ = grads_both_ways(out, wrt)
    assert_close(ref, got)


def test_rms_matmul_backward_program_is_plain_ir():
    """The backward of Σ x·w/√ss is a program of the same IR: reductions of the forward
    became broadcasts (d_x reads g_ss[i] along every column) and broadcasts reductions
    (d_v sums over the rows i it was broadcast along)."""
    out = examples.reduction_chain("rms-matmul", 4, 6, 3, "float64")
    _, _, bw = grads_both_ways(out, ["x", "v"])
    text = str(bw.program)
    # gradient axes are named after the forward's (the lowering matches reads by name)
    assert "d_v[v0, e] = sum[i" in text and "d_x[i, x1] =" in text and "g_ss[i] * x[i, x1]" in text


def test_plain_attention_backward():
    ref, got, _ = grads_both_ways(ne.attention(1, 2, 5, 6, 3, "float64"), ["q", "k", "v"],
                                  constant=("mx",))
    assert_close(ref, got)


def test_softmax_gradient_term_reads_the_saved_output():
    """Σ_j P_ij·dP_ij appears as Σ_e dO_ie·O_ie: ∂O/∂l = −O/l reads the saved O."""
    _, _, bw = grads_both_ways(ne.attention(1, 2, 4, 6, 3, "float64"), ["q", "k", "v"],
                               constant=("mx",))
    g_den = str(bw.program.definition("g_den").body)
    assert "(g_o[z, y, i, e_" in g_den and "* o[z, y, i, e_" in g_den and "jo" not in g_den


def test_max_as_constant_changes_nothing():
    """Softmax attention does not depend on its stabilising max: treating it as a constant
    gives the same gradients as differentiating through it (argmax indicator)."""
    out = ne.attention(1, 2, 4, 6, 3, "float64")
    torch.manual_seed(1)
    ref, with_max, _ = grads_both_ways(out, ["q", "k", "v"])
    torch.manual_seed(1)
    _, without, _ = grads_both_ways(out, ["q", "k", "v"], constant=("mx",))
    assert_close(ref, with_max)
    assert_close(ref, without)


def test_causal_softcap_gqa_with_fully_masked_row():
    def softcap(s, b, h, i, j):
        return 5.0 * torch.tanh(s / 5.0)

    def mask(b, h, i, j):  # causal with a look-ahead of 2, query row 3 sees nothing
        return (j <= i + 2) & (i != 3)

    out = ne.attention(2, 4, 5, 7, 3, "float64", kv_heads=2, score_mod=softcap, mask_mod=mask)
    ref, got, bw = grads_both_ways(out, ["q", "k", "v"], scale=3.0, constant=("mx",))
    assert_close(ref, got)
    assert torch.equal(got["q"][:, :, 3], torch.zeros_like(got["q"][:, :, 3]))
    assert "(y_" in str(bw.program.definition("d_k").body)  # GQA: Σ over query heads of a group


def test_learnable_alibi_slopes_get_their_gradient():
    """d_slope[h] = Σ_{b,i,j} dS·(j − i): a reduction over the indices the slope lacks."""
    slope = ne.placeholder((3,), "float64", "slope")
    out = ne.attention(2, 3, 4, 6, 2, "float64",
                       score_mod=lambda s, b, h, i, j: s + slope[h] * (j - i))
    ref, got, bw = grads_both_ways(out, ["q", "k", "v", "slope"])
    assert_close(ref, got)
    # one row-wise partial over the keys (like dQ), then the sum over batch and queries
    part = bw.program.definition("p_slope_1")
    assert part.axes == ("y", "z", "i") and part.body.op == "sum" and "(j_" in str(part.body)
    assert str(bw.program.definition("d_slope").body).count("sum[") == 2


def test_relative_position_table_indexed_by_computed_index():
    """A table read at j − i + (S−1): its gradient gathers every (i, j) on a diagonal."""
    table = ne.placeholder((9,), "float64", "rel")
    out = ne.attention(1, 2, 5, 5, 2, "float64",
                       score_mod=lambda s, b, h, i, j: s + rel_at(table, i, j))
    ref, got, _ = grads_both_ways(out, ["q", "k", "v", "rel"], constant=("mx",))
    assert_close(ref, got)


def rel_at(table, i, j):
    return table[j - i + 4]


def test_decode_shape():
    ref, got, _ = grads_both_ways(ne.attention(2, 2, 1, 9, 4, "float64"), ["q", "k", "v"],
                                  constant=("mx",))
    assert_close(ref, got)


def test_large_magnitude_scores_stay_finite():
    ref, got, _ = grads_both_ways(ne.attention(1, 1, 4, 5, 2, "float64"), ["q", "k", "v"],
                                  scale=30.0, constant=("mx",))
    assert_close(ref, got, tol=1e-9)


def test_unary_ops_and_ties():
    x = ne.placeholder((3, 4), "float64", "x")
    j = ne.reduce_axis(4, "j")
    y = ne.compute((3,), lambda i: ne.sum(
        ne.sqrt(ne.abs(x[i, j]) + 1.0) * ne.tanh(x[i, j]) + ne.rsqrt(x[i, j] * x[i, j] + 2.0)
        + ne.exp2(x[i, j]) / ne.maximum(x[i, j], 0.5) + ne.log(ne.minimum(x[i, j], 0.0) * -1.0 + 1.0),
        axis=j), "y")
    ref, got, _ = grads_both_ways(y, ["x"])
    assert_close(ref, got)
    p = ne.build_program(ne.compute((3,), lambda i: ne.max(xt[i, jt], axis=jt), "m"))
    bw = backward_program(p, ["xt"])
    ins = {"xt": torch.tensor([[1.0, 3.0, 3.0, 0.0]] * 3, dtype=torch.float64),
           "m": torch.full((3,), 3.0, dtype=torch.float64), "d_m": torch.ones(3, dtype=torch.float64)}
    got = evaluate(bw.program, ins)["d_xt"]
    leaf = ins["xt"].clone().requires_grad_(True)
    torch.autograd.grad(leaf.amax(1).sum(), leaf)[0].equal(got)
    assert torch.equal(got, torch.autograd.grad(leaf.amax(1).sum(), leaf)[0])  # ties share


xt = ne.placeholder((3, 4), "float64", "xt")
jt = ne.reduce_axis(4, "jt")


def test_errors_are_clear():
    p = ne.build_program(examples.softmax(2, 3, "float64"))
    with pytest.raises(ne.ProgramError, match="inputs of the program"):
        backward_program(p, ["y"])
    with pytest.raises(ne.ProgramError, match="at least one input"):
        backward_program(p, [])
    with pytest.raises(ne.ProgramError, match="name definitions"):
        backward_program(p, ["x"], saved=["nope"])
    with pytest.raises(ne.ProgramError, match="depends on"):
        backward_program(p, ["x"], constant=("mx", "den", "y"))


class _Interpreted(torch.autograd.Function):
    """Forward: the forward program in the fp64 interpreter; backward: the derived
    backward program in the fp64 interpreter -- what gradcheck holds to finite
    differences."""

    @staticmethod
    def forward(ctx, p, bw, names, *tensors):
        ins = dict(zip(names, tensors))
        fw = evaluate(p, ins)
        ctx.p, ctx.bw, ctx.names, ctx.ins, ctx.fw = p, bw, names, ins, fw
        return tuple(fw[o] for o in p.outputs)

    @staticmethod
    def backward(ctx, *gs):
        feed = {**ctx.ins, **{n: ctx.fw[n] for n in ctx.bw.saved},
                **{"d_" + o: g for o, g in zip(ctx.p.outputs, gs)}}
        got = evaluate(ctx.bw.program, {ph.name: feed[ph.name] for ph in ctx.bw.program.inputs})
        return (None, None, None, *[got.get("d_" + n) for n in ctx.names])


def _gradcheck(out, wrt, scale=1.0, **kw):
    p = ne.build_program(out)
    bw = backward_program(p, wrt, **kw)
    names = [ph.name for ph in p.inputs]
    ts = [(torch.randn(ph.shape, dtype=torch.float64) * scale).requires_grad_(ph.name in wrt)
          for ph in p.inputs]
    assert torch.autograd.gradcheck(lambda *t: _Interpreted.apply(p, bw, names, *t), ts)


def test_gradcheck_softmax_and_lse():
    _gradcheck(examples.softmax(2, 5, "float64"), ["x"])
    _gradcheck(examples.reduction_chain("log-sum-exp", 2, 5, 3, "float64"), ["x"],
               constant=("mx",))


def test_gradcheck_causal_softcap_gqa_alibi():
    slope = ne.placeholder((4,), "float64", "slope")

    def score(s, b, h, i, j):
        return 4.0 * torch.tanh(s / 4.0) + slope[h] * (j - i)

    out = ne.attention(1, 4, 3, 4, 2, "float64", kv_heads=2, score_mod=score,
                       mask_mod=lambda b, h, i, j: (j <= i + 1) & (i != 1))
    _gradcheck(out, ["q", "k", "v", "slope"], constant=("mx",))


def test_gradcheck_decode():
    _gradcheck(ne.attention(1, 2, 1, 5, 2, "float64"), ["q", "k", "v"], constant=("mx",))


def test_saved_constant_and_precomputed_row_statistic_keep_the_gradients():
    """Attention's backward fed ``m := lse`` has denominator 1: ``with_constant_input``
    folds it away; ``with_definition_as_input`` reads Σ_e dO·O from elsewhere (dQ's kernel);
    the gradients stay those of autograd, and misuse is a clear error."""
    from neptune_eq.frontend.backward_forms import (with_constant_input,
                                                    with_definition_as_input, with_outputs)
    p = ne.build_program(ne.attention(1, 2, 5, 6, 3, "float64"))
    ins = _inputs(p)
    leaf = {n: t.clone().requires_grad_(n in "qkv") for n, t in ins.items()}
    fw = evaluate(p, leaf)
    cot = torch.randn(fw["o"].shape, dtype=torch.float64)
    ref = torch.autograd.grad((fw["o"] * cot).sum(), [leaf[w] for w in "kv"])
    lse = fw["mx"] + torch.log(fw["den"])
    bw = backward_program(p, ["k", "v"], constant=("mx",), saved=("mx", "den", "o"))
    bw = with_constant_input(bw, "den", 1.0)
    assert "den" not in {ph.name for ph in bw.program.inputs}
    assert not re.search(r"[^_]den\[", str(bw.program)) and "/ 1.0" not in str(bw.program)
    feed = {**ins, "mx": lse.detach(), "o": fw["o"].detach(), "d_o": cot}
    stat = bw.program.definition("g_den")
    row = evaluate(with_outputs(bw, ["g_den"]).program,
                   {ph.name: feed[ph.name] for ph in bw.program.inputs})["g_den"]
    pre = with_definition_as_input(bw, stat.name)
    assert "o" not in {ph.name for ph in pre.program.inputs}  # O is read only by Σ dO·O
    got = evaluate(pre.program, {**{ph.name: feed.get(ph.name) for ph in pre.program.inputs},
                                 "g_den": row})
    for r, w in zip(ref, "kv"):
        assert (got["d_" + w] - r).abs().max().item() <= 1e-10 * max(1.0, r.abs().max().item())
    with pytest.raises(ne.ir.ProgramError, match="saved input .* or a cotangent"):
        with_constant_input(bw, "q", 1.0)
    with pytest.raises(ne.ir.ProgramError, match="intermediate definition"):
        with_definition_as_input(bw, "d_k")


def test_guarded_reads_equal_the_fixed_up_input():
    """``with_guarded_reads``: reading ``where(mx <= -5e29, 1e30, mx)`` in the program
    equals feeding the fixed-up row shift -- what ``flex_backward`` did with torch ops
    before each call -- and a guard of another shape is refused."""
    from neptune_eq.frontend.backward_forms import with_constant_input, with_guarded_reads
    p = ne.build_program(ne.attention(1, 2, 5, 6, 3, "float64"))
    bw = backward_program(p, ["q", "k", "v"], constant=("mx",), saved=("mx", "den", "o"))
    bw = with_constant_input(bw, "den", 1.0)
    guarded = with_guarded_reads(bw, "mx", "mx", -5e29, 1e30)
    feed = {ph.name: torch.randn(ph.shape, dtype=torch.float64) for ph in bw.program.inputs}
    feed["mx"][0, 1, 2] = float("-inf")   # a row with no visible key, as returned
    feed["mx"][0, 0, 4] = -1e30           # ... as the kernel leaves it when not returned
    unseen = feed["mx"] <= -5e29
    fixed = dict(feed, mx=feed["mx"].masked_fill(unseen, 1e30))
    want = evaluate(bw.program, fixed)
    got = evaluate(guarded.program, feed)
    for w in ("d_q", "d_k", "d_v"):
        assert torch.isfinite(got[w]).all() and torch.equal(got[w], want[w]), w
    assert torch.isnan(evaluate(bw.program, feed)["d_k"]).any()  # unguarded: NaN
    with pytest.raises(ne.ir.ProgramError, match="one shape to guard"):
        with_guarded_reads(bw, "q", "mx", -5e29, 0.0)

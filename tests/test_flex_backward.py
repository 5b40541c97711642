"""``ne.flex_attention`` under autograd (issue 18, item 3): gradients for q, k, v (and
through the returned lse) from kernels derived from the plain program, against fp64
torch autograd of the same attention -- GQA, softcap, causal masks, a fully masked row,
decode.  Small shapes: the kernels run in the Triton interpreter."""
import math
import re

import pytest
import torch

import neptune_eq as ne
from neptune_eq.dropin import flex

from helpers import filled_shapes

TOL = 3e-5


def reference(q, k, v, score_mod=None, mask=None, group=1):
    """fp64 attention written with torch ops: its autograd is the reference."""
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None]
    if score_mod is not None:
        s = score_mod(s, i, j)
    if mask is not None:
        s = s.masked_fill(~mask(i, j), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ vv, lse


def grads(fn, tensors, g, gl):
    out, lse = fn(*tensors)
    loss = (out * g).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * gl).sum()
    return torch.autograd.grad(loss, tensors)


def check(b, hq, hkv, lq, s, e, score=None, mask_mod=None, ref_score=None, ref_mask=None):
    q = torch.randn(b, hq, lq, e, requires_grad=True)
    k = torch.randn(b, hkv, s, e, requires_grad=True)
    v = torch.randn(b, hkv, s, e, requires_grad=True)
    g = torch.randn(b, hq, lq, e)
    gl = torch.randn(b, hq, lq)
    got = grads(lambda *t: ne.flex_attention(*t, score_mod=score, mask_mod=mask_mod,
                                             enable_gqa=hq != hkv, return_lse=True),
                [q, k, v], g, gl)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = grads(lambda *t: reference(*t, ref_score, ref_mask, hq // hkv), ins, g.double(),
                gl.double())
    for name, a, r in zip("qkv", got, ref):
        assert torch.isfinite(a).all(), name
        err = (a.double() - r).abs().max().item()
        assert err <= TOL * max(1.0, r.abs().max().item()), (name, err)
    return got


def test_plain_gradients():
    check(1, 2, 2, 6, 9, 4)


def test_causal_softcap_gqa_and_a_fully_masked_row():
    def softcap(score, b, h, i, j):
        return 8.0 * torch.tanh(score / 8.0)

    def mask(b, h, i, j):
        return (j <= i) & (i != 2)

    dq, _, _ = check(1, 4, 2, 5, 5, 4, softcap, mask,
                     lambda s, i, j: 8.0 * torch.tanh(s / 8.0), lambda i, j: (j <= i) & (i != 2))
    assert torch.equal(dq[:, :, 2], torch.zeros_like(dq[:, :, 2]))  # zero, never NaN
    # GQA: dK/dV are per query head (summed per group after the kernel), but K and V are
    # read from the [B, Hkv, ...] tensors at head y // G: no per-call copy of them
    st = next(s for s in flex.STRUCTURES.values() if s.backward and s.shapes["k"][1] == 2
              and s.shapes["q"][1] == 4)
    bw = next(b[0] for key, b in st.backward.items() if key[0][:2] == ("k", "v"))
    assert bw.program.shape_of("k")[1] == 2 and bw.program.shape_of("v")[1] == 2
    assert bw.program.shape_of("d_k")[1] == 4


def test_a_mod_reading_the_score_twice_sums_one_score_tile():
    """``score * sigmoid(score)``: the product rule sends a cotangent to each read of the
    raw score.  Copied as terms, each copy of ``Σ_d q·k`` got its own reduce axis, so dK
    and dQ were two sums each recomputing the scores, no tile config compiled on an H200
    at S = 200 ([rows, keys, head dim] products); the raw score is now one definition
    the gradients read (``autodiff._repeated_reductions_named``): one sum, on the tensor
    cores."""
    def gate(score, b, h, i, j):
        return score * torch.sigmoid(score)
    check(1, 2, 2, 7, 11, 16, gate, None, lambda s, i, j: s * torch.sigmoid(s))
    st = next(s for s in flex.STRUCTURES.values() if "exp(-" in s.text
              and any(key[0][:2] == ("k", "v") for key in s.backward))
    bw = next(b[0] for key, b in st.backward.items() if key[0][:2] == ("k", "v"))
    d_k = bw.program.definition("d_k")
    assert d_k.body.op == "sum" and "ref" in {t.op for t in d_k.body.walk()}
    assert sum(t.kind == "reduce" for t in d_k.body.walk()) == 1


def test_integer_softcap_gradients_and_gpu_sources():
    """A softcap written with integers (``tanh(s / 30) * 30``, as users do): its backward
    derives constants such as ``30 / 30`` in int arithmetic.  The GPU form of every ranked
    candidate (bf16 products, not the interpreter's fp32) must be valid Python -- it once
    emitted ``30.to(tl.float32)``, which only the GPU's build reached."""
    from neptune_eq.lowering.kernelgen import generate

    def softcap(score, b, h, i, j):
        return torch.tanh(score / 30) * 30
    check(1, 2, 2, 4, 6, 4, softcap, None, lambda s, i, j: torch.tanh(s / 30) * 30)
    st = [s for s in flex.STRUCTURES.values() if s.backward][-1]  # (the newest traced)
    assert "30" in str(st.program)
    for _, kern, *_rest in st.backward.values():
        for row in kern.candidates:
            if row.plan is not None:
                compile(generate(row.plan, bf16_dot_in_fp32=False).source, "gpu_form", "exec")


def test_gpu_form_products_stay_bf16():
    """The GPU form of every bf16 backward kernel multiplies bf16 tiles (tensor cores):
    a rewrite that left both operands of a product computed in fp32 (a scale moved onto
    K, say) would emit an fp32 ``ieee`` product, many times slower, and still pass every
    interpreter check."""
    from neptune_eq.lowering.kernelgen import generate
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = ne.flex_attention(q, k, v, mask_mod=lambda b, h, i, j: j <= i)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    st = [s for s in flex.STRUCTURES.values() if s.backward][-1]
    for _, kern, *_rest in st.backward.values():
        src = generate(kern.chosen_row.plan, bf16_dot_in_fp32=False).source
        assert "tl.dot(" in src and "ieee" not in src, src
    for _, kern in st.row_kernels.values():  # Σ_e dO·O alone: a row reduction, no product
        src = generate(kern.chosen_row.plan, bf16_dot_in_fp32=False).source
        assert "tl.dot(" not in src and "ieee" not in src, src


def test_a_row_masked_by_its_score_mod_has_zero_gradients():
    """A row whose every score the score_mod sets to -inf (no mask_mod): its lse is -inf
    and its gradients are exactly 0, never NaN, the lse's cotangent on it included."""
    def hide_row_2(score, b, h, i, j):
        return torch.where(i == 2, -float("inf"), score)

    def ref_hide(s, i, j):
        return s.masked_fill((i == 2) & (j >= 0), float("-inf"))
    dq, dk, dv = check(1, 2, 2, 5, 6, 4, hide_row_2, None, ref_hide)
    assert torch.equal(dq[:, :, 2], torch.zeros_like(dq[:, :, 2]))


def test_decode_gradients():
    check(2, 2, 2, 1, 11, 4)


def test_backward_kernels_are_derived_once_per_structure_and_input():
    check(1, 2, 2, 3, 4, 2)
    st = next(s for s in flex.STRUCTURES.values() if s.backward and s.shapes["q"][-1] == 2)
    # (gradients, shared row statistics between two kernels, the loss reads the lse):
    # one kernel for all three, dQ added atomically inside dK/dV's loop
    assert set(st.backward) == {(("k", "v", "q"), False, True)}
    bw, kern, _, _, stats, pre = st.backward[(("k", "v", "q"), False, True)]
    # Σ_e dO·O is computed once, by a row kernel of its own (kept with the structure for
    # dQ's kernel too), and read as an input
    first, row_kern = pre
    assert st.row_kernels == {str(first.program): pre}
    assert stats and first.program.outputs == stats
    assert all(any(ph.name == n for ph in bw.program.inputs) for n in stats)
    assert bw.program.dtype_of("d_q") == "float32"  # summed by atomic adds in fp32
    text = kern.explain()
    # FlashAttention-2's backward: one program per block of keys j, one loop over the
    # query rows i updating dK and dV (P recomputed once) and adding dQ's share
    assert "blocked: j" in text and "d_v:sum" in text and "d_k_f0:sum" in text, text
    # dS = P∘(dP − D) (one product by P), and the softmax scale of dS applied to dK once,
    # after the loop (dQ, added per block, carries it on each block's term)
    assert "add-factor-right" in text and "sum-pull-inner-factor" in text, text
    assert "epilogue: d_k[" in text, text
    assert "d_q[z, y, i, " in text and "term atomically" in text, text
    assert "m := lse" in text and "computed once by a row kernel" in text, text
    loops = re.split(r"for l0 in (?:tl\.)?range\(", kern.source)[1:]
    assert loops and not any(re.search(r"\bo_ptr", lp) for lp in loops)  # no O tile in them
    assert "den[" not in kern.source  # the denominator is the constant 1: folded away
    # five products per block: S = Q·Kᵀ, dV += Pᵀ·dO, dP = dO·Vᵀ, dK += dSᵀ·Q, dQ += dS·K
    assert all(lp.count("tl.dot(") == 5 and lp.count("tl.atomic_add(") == 1 for lp in loops)


def test_deterministic_mode_has_no_float_atomics():
    """``torch.use_deterministic_algorithms(True)``: dQ by a kernel of its own (a loop over
    key blocks per query block), after a row kernel of the row statistics that both it and
    dK/dV's kernel read; no atomics, and the same gradients."""
    torch.use_deterministic_algorithms(True)
    try:
        check(1, 2, 2, 3, 4, 3)
    finally:
        torch.use_deterministic_algorithms(False)
    st = next(s for s in flex.STRUCTURES.values() if s.backward and s.shapes["q"][-1] == 3)
    assert set(st.backward) == {(("q",), True, True), (("k", "v"), True, True)}
    bw, kern, _, _, stats, pre = st.backward[(("k", "v"), True, True)]
    dq_bw, dq_kern, _, _, dq_stats, (first, _) = st.backward[(("q",), True, True)]
    assert pre is None and stats == dq_stats and first.program.outputs == stats
    # dQ's kernel reads them too: one pass over the key blocks, nothing before it
    assert all(any(ph.name == n for ph in dq_bw.program.inputs) for n in stats)
    assert "1 pass(es) over memory" in dq_kern.explain()
    assert "computed once by the row kernel dQ's backward runs first" in kern.explain()
    for _, k2, *_ in st.backward.values():
        assert "atomic_add" not in k2.source
    loops = re.split(r"for l0 in (?:tl\.)?range\(", kern.source)[1:]
    # four products per block: S = Q·Kᵀ, dV += Pᵀ·dO, dP = dO·Vᵀ, dK += dSᵀ·Q
    assert all(lp.count("tl.dot(") == 4 for lp in loops), loops
    # every output of the step's kernels is written whole: none is filled with NaN first
    # (torch's deterministic fill of new tensors, a launch per output on the GPU)
    q, k, v = (torch.randn(1, 2, 4, 3, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 2, 4, 3)
    torch.use_deterministic_algorithms(True)
    try:
        def step():
            return torch.autograd.grad(ne.flex_attention(q, k, v), [q, k, v], g)
        step()
        assert filled_shapes(step) == []
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_loss_without_the_lse_folds_its_gradient_away():
    """The usual loss reads only the output: autograd hands the backward None for the lse
    (grads are not materialised), and the kernels are built with d_lse = 0 folded away --
    no d_lse input, no term -- and give the same gradients as fp64 autograd."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 4, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 2, 9, 4)

    def causal(b, h, i, j):  # row 4 sees no key: the lse is never returned, so the
        return (j <= i) & (i != 4)  # backward reads the kernel's raw masked-row value
    out = ne.flex_attention(q, k, v, mask_mod=causal)
    got = torch.autograd.grad((out * g).sum(), [q, k, v])
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = grads(lambda *t: reference(*t, mask=lambda i, j: (j <= i) & (i != 4)), ins,
                g.double(), torch.zeros(1, 2, 9, dtype=torch.float64))
    for a, r in zip(got, ref):
        assert torch.isfinite(a).all()
        assert (a.double() - r).abs().max().item() <= TOL * max(1.0, r.abs().max().item())
    assert torch.equal(got[0][:, :, 4], torch.zeros_like(got[0][:, :, 4]))
    st = next(s for s in flex.STRUCTURES.values()
              if any(key[2] is False for key in s.backward) and s.shapes["q"][-1] == 4)
    for key, (bw, kern, *_) in st.backward.items():
        if key[2] is False:
            assert "d_lse" not in {ph.name for ph in bw.program.inputs}
            assert "d_lse" not in kern.source


def test_learnable_captured_slopes_get_gradients():
    """A captured float tensor that requires grad (ALiBi slopes) gets
    d_slope[h] = Σ_{b,i,j} dS·(j − i): a row-wise partial kernel, summed over the rows."""
    slopes = torch.tensor([0.5, -0.25], requires_grad=True)

    def alibi(score, b, h, i, j):
        return score + slopes[h] * (j - i)

    q = torch.randn(1, 2, 5, 4, requires_grad=True)
    k = torch.randn(1, 2, 7, 4, requires_grad=True)
    v = torch.randn(1, 2, 7, 4, requires_grad=True)
    out = ne.flex_attention(q, k, v, score_mod=alibi)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, slopes), g)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v, slopes)]
    sd = ins[3]
    ref_out, _ = reference(*ins[:3], lambda s, i, j: s + sd[None, :, None, None] * (j - i))
    ref = torch.autograd.grad(ref_out, ins, g.double())
    for a, r in zip(got, ref):
        assert torch.isfinite(a).all()
        assert (a.double() - r).abs().max().item() <= TOL * max(1.0, r.abs().max().item())


def test_learnable_slopes_shared_by_a_gqa_group_get_gradients():
    """GQA (two query heads per KV head) beside a one-dimensional captured tensor that
    requires grad: dK/dV are summed over each group's heads after the kernel, the slopes'
    partial over the rows (the 1-D input once crashed the GQA rewrite)."""
    slopes = torch.tensor([0.5, -0.25], requires_grad=True)

    def alibi(score, b, h, i, j):
        return score + slopes[h // 2] * (j - i)

    q = torch.randn(1, 4, 6, 4, requires_grad=True)
    k = torch.randn(1, 2, 7, 4, requires_grad=True)
    v = torch.randn(1, 2, 7, 4, requires_grad=True)
    out = ne.flex_attention(q, k, v, score_mod=alibi, mask_mod=lambda b, h, i, j: i >= j,
                            enable_gqa=True)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, slopes), g)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v, slopes)]
    per_head = ins[3].repeat_interleave(2)[None, :, None, None]
    ref_out, _ = reference(*ins[:3], lambda s, i, j: s + per_head * (j - i),
                           lambda i, j: i >= j, group=2)
    ref = torch.autograd.grad(ref_out, ins, g.double())
    for name, a, r in zip(("q", "k", "v", "slopes"), got, ref):
        assert a.shape == r.shape and torch.isfinite(a).all(), name
        assert (a.double() - r).abs().max().item() <= TOL * max(1.0, r.abs().max().item()), name


def test_the_op_and_the_eager_function_give_the_same_gradients():
    """Eager calls with grad take ``torch_op.EagerFlexAttention`` (no custom-op dispatch);
    ``torch.compile`` takes the ``neptune_eq::flex_attention`` op and its registered
    autograd formula.  Both run ``flex_backward.run_backward``: the same gradients."""
    from neptune_eq.dropin import torch_op
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 4, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 2, 6, 4)
    eager = torch.autograd.grad(ne.flex_attention(q, k, v), (q, k, v), g)
    skey = next(key for key, s in flex.STRUCTURES.items()  # plain: no mods, nothing captured
                if set(s.shapes) == {"q", "k", "v"} and s.shapes["q"][1:] == (2, s.shapes["q"][2], 4)
                and s.program is not None
                and "where" not in str(s.program.definition("s").body))
    out, _, _ = torch_op.flex_attention_op(q, k, v, [], skey, False)
    via_op = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(eager, via_op):
        assert torch.equal(a, b)


def test_document_mask_backward_skips_blocks_like_the_forward():
    """A mask over a captured tensor (sorted document ids, causal inside each): the
    backward kernels derive the same block summaries and key ranges as the forward (one
    summary pre-pass, then the kernel), and the gradients match fp64 autograd."""
    torch.manual_seed(0)
    n = 37
    doc = torch.tensor(sorted(torch.randint(0, 4, (n,)).tolist()), dtype=torch.int32)

    def mask(b, h, i, j):
        return (doc[i] == doc[j]) & (j <= i)

    got = check(1, 2, 2, n, n, 8, None, mask, None,
                lambda i, j: (doc[i] == doc[j]) & (j <= i))
    assert all(torch.isfinite(x).all() for x in got)
    st = [s for s in flex.STRUCTURES.values() if s.backward and "doc" in s.shapes][-1]
    for _, kern, *_ in st.backward.values():
        # the pre-pass of the block summaries, then the kernel (named after its gradients)
        name = "neptune_" + "_".join(kern.program.outputs)
        assert kern.launches == [f"{name}_summaries", name], kern.launches


def test_sliding_window_bounds_both_backward_loops():
    """A causal window ``q - kv < W`` bounds dQ's loop over keys to [i-W+1, i] and, read
    from the key side (``i - j < W`` with i the loop), dK/dV's loop over queries to
    [j, j+W): both ends, so a key block visits O(W) query blocks, not all later ones."""
    torch.manual_seed(0)
    n, w = 41, 9

    def mask(b, h, i, j):
        return (i >= j) & (i - j < w)
    check(1, 2, 2, n, n, 8, None, mask, None, lambda i, j: (i >= j) & (i - j < w))
    torch.use_deterministic_algorithms(True)  # ... and dQ's own kernel, without atomics
    try:
        check(1, 2, 2, n, n, 8, None, mask, None, lambda i, j: (i >= j) & (i - j < w))
    finally:
        torch.use_deterministic_algorithms(False)
    st = [s for s in flex.STRUCTURES.values() if s.backward][-1]
    loops = {wrt: [ln for ln in kern.explain().splitlines() if "loop bounds" in ln]
             for (wrt, *_), (_, kern, *_) in st.backward.items()}
    assert any(f"[i-{w - 1}, i+1)" in ln for ln in loops[("q",)]), loops
    assert any(f"[i+0, i+{w})" in ln for ln in loops[("k", "v")]), loops
    # the fused kernel's loop is dK/dV's: dQ's terms ride in the blocks it visits
    assert any(f"[i+0, i+{w})" in ln for ln in loops[("k", "v", "q")]), loops


def test_value_head_dim_differs_dk_dv_still_share_one_loop():
    """Ev != E: dK[j, k3] and dV[j, e] keep the same key rows (autodiff names them alike
    where the extents agree), so they still share one loop over query blocks."""
    torch.manual_seed(0)
    q, k = (torch.randn(1, 2, 21, 8, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 21, 16, requires_grad=True)
    g = torch.randn(1, 2, 21, 16)
    got = torch.autograd.grad(ne.flex_attention(q, k, v, mask_mod=lambda b, h, i, j: j <= i),
                              (q, k, v), g)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(reference(*ins, mask=lambda i, j: j <= i)[0], ins, g.double())
    for a, r in zip(got, ref):
        assert (a.double() - r).abs().max().item() <= TOL * max(1.0, r.abs().max().item())
    st = [s for s in flex.STRUCTURES.values() if s.backward and s.shapes["v"][-1] == 16][-1]
    assert "blocked: j" in st.backward[(("k", "v", "q"), False, False)][1].explain()


def test_training_under_torch_compile():
    """``torch.compile(fullgraph=True)`` traces the backward with fake tensors: the
    gradients are one opaque ``neptune_eq::flex_attention_backward`` op (its kernels built
    and run at run time), so a compiled step gives eager's gradients -- q, k, v, a
    learnable captured bias and the lse included."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)

    def alibi(s, b, h, i, j):
        return s - slopes[h] * (i - j)

    def causal(b, h, i, j):
        return j <= i

    def loss(q, k, v):
        o, lse = ne.flex_attention(q, k, v, score_mod=alibi, mask_mod=causal, return_lse=True)
        return (o * o).sum() + lse.sum()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v, slopes))
    ref = torch.autograd.grad(loss(q, k, v), (q, k, v, slopes))
    for a, r in zip(got, ref):
        assert torch.allclose(a, r, atol=1e-5), (a - r).abs().max()


def test_half_precision_training_builds_and_matches_fp64():
    """fp16 q, k, v: the dK/dV kernel writes fp16 gradients, and translation validation's
    large-magnitude inputs give gradients past fp16's range (-130166).  There the right
    fp16 answer is the infinity the value rounds to; the build used to refuse the kernel
    for it (measured on an H100 and here, S=64, D=16)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 64, 16, generator=g).half().requires_grad_() for _ in range(3)]
    d_o = torch.randn(1, 2, 64, 16, generator=g).half()
    out = ne.flex_attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j)
    got = torch.autograd.grad(out, (q, k, v), d_o)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*ins, mask=lambda i, j: i >= j)
    want = torch.autograd.grad(ref, ins, d_o.double())
    for name, a, r in zip("qkv", got, want):
        assert a.dtype == torch.float16 and torch.isfinite(a).all(), name
        assert (a.double() - r).abs().max().item() <= 1e-2 * max(1.0, r.abs().max().item()), name
    # the fused form's fp32 dQ is zeroed and converted outside its kernel; fp16 dK, dV not
    from neptune_eq.dropin.flex_backward import outside_work
    st = next(s for s in flex.STRUCTURES.values() if s.backward and s.shapes["q"][-1] == 16
              and s.program.dtype_of("q") == "float16")
    bw, kern, *_ = st.backward[(("k", "v", "q"), False, False)]
    assert outside_work(bw, kern, ("k", "v", "q"), {"q": q, "k": k, "v": v}) == [
        ((1, 2, 64, 16), True, torch.float16)]


def test_first_builds_time_their_configs_on_the_calls_own_tensors(monkeypatch):
    """The forward and backward kernels of a new structure are built with the call's
    tensors as ``example_inputs`` (the document ids themselves, not zeros: one document
    would pick the dense case's tiles for every document mask)."""
    import neptune_eq.api as api
    seen = []
    real = api.superoptimize

    def recording(*a, **kw):
        seen.append(kw.get("example_inputs"))
        return real(*a, **kw)
    monkeypatch.setattr(api, "superoptimize", recording)
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3], dtype=torch.int32)

    def same_doc_window(b, h, q_idx, kv_idx):   # a structure no other test builds
        return (doc[q_idx] == doc[kv_idx]) & (q_idx - kv_idx < 3) & (q_idx >= kv_idx)
    q, k, v = [torch.randn(1, 2, 11, 16, requires_grad=True) for _ in range(3)]
    out = ne.flex_attention(q, k, v, mask_mod=same_doc_window)
    out.backward(torch.randn_like(out))
    assert len(seen) >= 2
    for example in seen:                        # forward, then each backward kernel
        assert example["q"] is q and any(t is doc for t in example.values())
    assert any("d_o" in example for example in seen[1:])



def test_the_form_choice_counts_the_fused_forms_zeroing():
    """The timer's choice between the fused backward and the two kernels adds what runs
    outside the kernels (``outside_work``): the fused form's atomically summed dQ is zeroed
    before its launch; the atomic-free form's dQ kernel writes every row itself."""
    from neptune_eq.dropin.flex_backward import outside_work
    check(1, 2, 2, 3, 4, 5)
    st = next(s for s in flex.STRUCTURES.values() if s.backward and s.shapes["q"][-1] == 5)
    env = {n: torch.empty(1, 2, 3 if n == "q" else 4, 5) for n in "qkv"}
    bw, kern, *_ = st.backward[(("k", "v", "q"), False, True)]
    assert outside_work(bw, kern, ("k", "v", "q"), env) == [((1, 2, 3, 5), True, None)]
    torch.use_deterministic_algorithms(True)
    try:
        check(1, 2, 2, 3, 4, 5)
    finally:
        torch.use_deterministic_algorithms(False)
    bw, kern, *_ = st.backward[(("q",), True, True)]
    assert outside_work(bw, kern, ("q",), env) == []


def test_the_backward_form_is_chosen_per_size_bucket(monkeypatch):
    """Fused or two kernels is a timed choice per size bucket (a first call at B=1, S=64
    must not fix the form of S=8192); a bucket with no time for its kernels takes the
    form timed at the nearest bucket."""
    from types import SimpleNamespace as NS
    from neptune_eq.dropin import flex_backward as fb
    times = {64: {"fused": 0.1, "split": 0.2}, 8192: {"fused": 6.5, "split": 5.7}}

    def kernel(form):
        def bucket_ms(sizes, tensors):  # None: no time (graph capture, no GPU)
            ms = times.get(sizes["S"], {}).get(form)
            # the fused form: row kernel + one; two kernels: row kernel + dQ's + dK/dV's
            return None if ms is None else ms / (2 if form == "fused" else 3)
        return NS(bucket_ms=bucket_ms)

    def group_kernels(st, groups, sizes, lse_grad, env):
        form = "fused" if any(fb.fused_group(g) for g in groups) else "split"
        for g in groups:
            bw = NS(program=NS(inputs=[]))
            yield g, (bw, kernel(form), 0, {}, [], (bw, kernel(form)) if g[0] == "q" or
                      fb.fused_group(g) else None)
    monkeypatch.setattr(fb, "group_kernels", group_kernels)
    monkeypatch.setattr(fb, "outside_ms", lambda *a: 0.0)
    st = NS(backward_form={})
    names, needs = ["q", "k", "v"], [True, True, True]

    def fused(S):
        return fb.fused_is_faster(st, names, needs, {"B": 1, "L": S, "S": S}, False, {})
    assert fused(64) and not fused(8192)
    assert not fused(2048) and fused(128)  # untimed: as at 8192, as at 64
    assert st.backward_form[(False, fb.bucket_of({"B": 1, "L": 2048, "S": 2048}))] == (False, False)


def test_a_learnable_per_key_bias_longer_than_the_keys():
    """``score + bias[kv_idx]`` with a 40-entry learnable bias and 23 keys: its gradient
    is torch's on the first 23 entries and 0 past them.  Its kernel (one key per program,
    the few head rows, the queries looped, products over whole head-dim axes off the
    tensor cores) is offered exact rows and short key blocks on the GPU: padded to 16 rows
    its [rows, keys, width] products overflowed shared memory in every config on the H200."""
    from neptune_eq.runtime.tile_configs import candidate_configs
    torch.manual_seed(0)
    bias = torch.randn(40, requires_grad=True)

    def biased(s, b, h, i, j):
        return s + bias[j]
    q, k, v = (torch.randn(2, 3, n, 8, requires_grad=True) for n in (11, 23, 23))
    out = ne.flex_attention(q, k, v, score_mod=biased)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, bias), g)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref_out, _ = reference(*ins[:3], lambda s, i, j: s + ins[3][j])
    ref = torch.autograd.grad(ref_out, ins, g.double())
    for a, r in zip(got, ref):
        assert (a.double() - r).abs().max().item() <= TOL * max(1.0, r.abs().max().item())
    assert torch.all(got[3][23:] == 0)
    (st,) = [s for s in flex.STRUCTURES.values() if (("bias",), False, False) in s.backward]
    ks = st.backward[(("bias",), False, False)][1].kernel_source
    assert "tl.dot(" not in ks.source and ks.row_extent == 3
    configs = candidate_configs(ks, "cuda")
    assert configs and all(c.blocks["B_y"] == 4 and c.blocks["B_L"] <= 64 for c in configs)


@pytest.mark.parametrize("lq", [9, 13])
def test_a_learnable_table_read_at_queries_and_at_keys(lq):
    """``score + t[q_idx] - 2·t[kv_idx]`` with a 16-entry table and 13 keys.

    9 queries: the table is not cut to one length, so its gradient reads ``g_s`` through
    the ``where(q == m)`` form (it raised an ExtentError), and its kernel loads ``t[q]``
    and ``t[kv]`` as two tiles -- both pad to 16, but their masks differ (one load served
    both, and the gradient was wrong by 1.0, which translation validation then passed:
    it ran the kernel only on the large-magnitude inputs, where the softmax is one-hot
    and this gradient ~0).  13 queries (self-attention): the table is cut to S and its
    gradient adds a partial per query (summed over keys) and one per key (summed over
    queries); one kernel holding both could not be built at any size, each is now a
    kernel of its own (``flex_backward._partial_pieces``)."""
    torch.manual_seed(0)
    t = torch.randn(16, requires_grad=True)

    def both(s, b, h, i, j):
        return s + t[i] - 2 * t[j]
    q, k, v = (torch.randn(2, 2, n, 16, requires_grad=True) for n in (lq, 13, 13))
    out = ne.flex_attention(q, k, v, score_mod=both)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, t), g)
    ins = [x.detach().double().requires_grad_() for x in (q, k, v, t)]
    ref_out, _ = reference(*ins[:3], lambda s, i, j: s + ins[3][i] - 2 * ins[3][j])
    ref = torch.autograd.grad(ref_out, ins, g.double())
    for a, r in zip(got, ref):
        assert (a.double() - r).abs().max().item() <= TOL * max(1.0, r.abs().max().item())
    assert torch.all(got[3][13:] == 0)


def test_a_gradient_of_a_gradient_is_a_clear_error():
    """No double backward, as FlexAttention: differentiating the gradients says so (was
    torch's "element 0 of tensors does not require grad"); create_graph=True for a
    first-order gradient still works, and gives the same values."""
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    (g,) = torch.autograd.grad(ne.flex_attention(q, k, v).sum(), q, create_graph=True)
    (plain,) = torch.autograd.grad(ne.flex_attention(q, k, v).sum(), q)
    assert torch.equal(g, plain)
    with pytest.raises(ne.ProgramError, match="double backward"):
        torch.autograd.grad(g.sum(), q)



def test_a_partial_that_cancels_to_zero_is_not_refused():
    """``t[q_idx] - 2·t[kv_idx]`` beside a sigmoid gate: the table's per-query partial is
    Σ_j dS = 0 exactly, so on the ±40-scaled inputs every evaluation of it is rounding
    noise of terms ~1e7 -- the fp32 evaluation's 0.35, the kernel's 1.69.  One fp32
    evaluation's error was the noise estimate, and the right kernel was refused;
    translation validation now takes the worst of three (two on inputs nudged by an
    fp32 rounding)."""
    torch.manual_seed(0)
    t = torch.randn(16, requires_grad=True)

    def mod(s, b, h, i, j):
        return s + t[i] - 2 * t[j] + s * torch.sigmoid(s)
    q, k, v = (torch.randn(2, 2, 13, 16, requires_grad=True) for _ in range(3))
    out = ne.flex_attention(q, k, v, score_mod=mod)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, t), g)
    ins = [x.detach().double().requires_grad_() for x in (q, k, v, t)]
    ref_out, _ = reference(*ins[:3], lambda s, i, j: s + ins[3][i] - 2 * ins[3][j]
                           + s * torch.sigmoid(s))
    ref = torch.autograd.grad(ref_out, (ins[0], ins[3]), g.double())
    for a, r in zip(got, ref):
        assert (a.double() - r).abs().max().item() <= TOL * max(1.0, r.abs().max().item())

"""Differentiable kernels (issue 18, item 3): the forward kernel and the superoptimized
backward kernels run under torch autograd; gradients against fp64 torch autograd.

Generated kernels compute in fp32 (whatever the input dtype), so gradients are checked in
float32 against fp64 references; the derived backward programs themselves are
gradchecked in float64 in test_autodiff.py."""
import pytest
import torch

import neptune_eq as ne
from neptune_eq.dropin.autograd import differentiable
from neptune_eq.frontend import examples

TOL = 2e-5


def _close(got, ref, tol=TOL):
    assert torch.isfinite(got).all()
    err = (got.double() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), err


def test_softmax_kernel_is_differentiable():
    fn = differentiable(examples.softmax(3, 5, "float32"), ["x"], constant=("mx",),
                        target="interpreter", cache=False)
    x = torch.randn(3, 5, requires_grad=True)
    y = fn(x)
    g = torch.randn(3, 5)
    (gx,) = torch.autograd.grad(y, x, g)
    xd = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(torch.softmax(xd, 1), xd, g.double())
    _close(gx, ref)
    text = fn.backward_kernels["x"].explain()
    assert "d_x[i, c]" in text and "rules that fired" in text


def test_rms_matmul_chain_gradients_for_both_inputs():
    fn = differentiable(examples.reduction_chain("rms-matmul", 4, 6, 3), ["x", "v"],
                        target="interpreter", cache=False)
    x = torch.randn(4, 6, requires_grad=True)
    v = torch.randn(6, 3, requires_grad=True)
    g = torch.randn(4, 3)
    gx, gv = torch.autograd.grad(fn(x, v), (x, v), g)
    xd, vd = (t.detach().double().requires_grad_() for t in (x, v))
    y = (xd / xd.pow(2).sum(1, keepdim=True).sqrt()) @ vd
    rx, rv = torch.autograd.grad(y, (xd, vd), g.double())
    _close(gx, rx)
    _close(gv, rv)


def _reference(q, k, v, group, softcap, mask):
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None]
    s = s.masked_fill(~mask(i, j), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ vv


def test_causal_softcap_gqa_attention_with_a_fully_masked_row():
    def softcap(s, b, h, i, j):
        return 5.0 * torch.tanh(s / 5.0)

    def mask(b, h, i, j):
        return (j <= i + 2) & (i != 3)

    out = ne.attention(1, 4, 5, 7, 4, "float32", kv_heads=2, score_mod=softcap, mask_mod=mask)
    fn = differentiable(out, ["q", "k", "v"], constant=("mx",), target="interpreter",
                        cache=False)
    q = torch.randn(1, 4, 5, 4, requires_grad=True)
    k = torch.randn(1, 2, 7, 4, requires_grad=True)
    v = torch.randn(1, 2, 7, 4, requires_grad=True)
    o = fn(q, k, v)
    g = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), g)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(_reference(*ins, 2, 5.0, lambda i, j: (j <= i + 2) & (i != 3)),
                              ins, g.double())
    for a, b in zip(got, ref):
        _close(a, b)
    assert torch.equal(got[0][:, :, 3], torch.zeros_like(got[0][:, :, 3]))


def test_only_the_deterministic_form_exists():
    with pytest.raises(ne.ProgramError, match="no atomics"):
        differentiable(examples.softmax(2, 3), ["x"], deterministic=False)


def test_call_errors_name_the_inputs():
    fn = differentiable(examples.softmax(2, 3), ["x"], constant=("mx",), target="interpreter",
                        cache=False)
    with pytest.raises(TypeError, match="Missing inputs"):
        fn()


def test_learnable_alibi_slopes_through_kernels():
    """d_slope[h] = Σ_{b,i,j} dS·(j − i), from a row-wise partial kernel (fixed sizes)."""
    slope = ne.placeholder((2,), "float32", "slope")
    out = ne.attention(1, 2, 5, 6, 4, "float32",
                       score_mod=lambda s, b, h, i, j: s + slope[h] * (j - i))
    fn = differentiable(out, ["q", "k", "v", "slope"], constant=("mx",),
                        target="interpreter", cache=False)
    q = torch.randn(1, 2, 5, 4, requires_grad=True)
    k = torch.randn(1, 2, 6, 4, requires_grad=True)
    v = torch.randn(1, 2, 6, 4, requires_grad=True)
    sl = torch.tensor([0.5, -0.25], requires_grad=True)
    o = fn(q, k, v, sl)
    g = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v, sl), g)
    qd, kd, vd, sd = (t.detach().double().requires_grad_() for t in (q, k, v, sl))
    i, j = torch.arange(5)[:, None], torch.arange(6)[None]
    s = qd @ kd.transpose(-1, -2) / 2.0 + sd[None, :, None, None] * (j - i)
    ref = torch.autograd.grad(torch.softmax(s, -1) @ vd, (qd, kd, vd, sd), g.double())
    for a, b in zip(got, ref):
        _close(a, b)


def test_kernels_inside_torch_compile_run_eagerly_between_graphs():
    """A ``Kernel`` or differentiable kernel called inside ``torch.compile`` is a graph
    break (Dynamo cannot trace the launcher): it runs eagerly and the compiled code around
    it -- values and gradients -- matches eager.  (``ne.flex_attention`` compiles whole.)"""
    out = ne.attention(1, 2, 8, 8, 4, "float32")
    kern = ne.superoptimize(out, target="interpreter")
    fn = differentiable(out, ["q", "k", "v"], constant=("mx",), target="interpreter")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: kern(q, k, v) * 2, backend="aot_eager")
    assert torch.allclose(compiled(q, k, v), kern(q, k, v) * 2)
    ref = torch.autograd.grad((fn(q, k, v) ** 2).sum(), (q, k, v))
    step = torch.compile(lambda q, k, v: (fn(q, k, v) ** 2).sum(), backend="aot_eager")
    got = torch.autograd.grad(step(q, k, v), (q, k, v))
    for a, r in zip(got, ref):
        assert torch.allclose(a, r, atol=1e-6)

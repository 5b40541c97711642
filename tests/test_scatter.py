"""Scattered outputs (``lowering.scatter``): an output summed over the rows of the plan
it shares with the first output is accumulated atomically inside that plan's loop -- a
general lowering (here two products of one shared tile, nothing attention-specific),
checked in the interpreter against torch, and refused where it does not apply."""
import torch

import neptune_eq as ne
from neptune_eq.lowering.lower import plan


def _program(out_dtype: str):
    """a[j, e] = Σ_i exp(x[i, j])·y[i, e]  and  b[i, f] = Σ_j exp(x[i, j])·z[j, f]: the
    second sums over the first's rows j and keeps its loop axis i."""
    n, m, e = 37, 21, 16
    x = ne.placeholder((n, m), "float32", "x")
    y = ne.placeholder((n, e), "float32", "y")
    z = ne.placeholder((m, e), "float32", "z")
    i, j = ne.reduce_axis(n, "i"), ne.reduce_axis(m, "j")
    a = ne.compute((m, e), lambda jj, c: ne.sum(ne.exp(x[i, jj]) * y[i, c], axis=i), "a")
    b = ne.compute((n, e), lambda ii, c: ne.sum(ne.exp(x[ii, j]) * z[j, c], axis=j), "b",
                   dtype=out_dtype)
    return [a, b]


def test_a_sum_over_the_rows_is_added_atomically_in_the_loop():
    outs = _program("float32")
    kern = ne.superoptimize(outs, target="interpreter", cache=False)
    text = kern.plan.describe()
    assert "b[" in text and "term atomically" in text, text
    assert kern.source.count("tl.atomic_add(") == 2  # the key loop's and its ragged tail's
    torch.manual_seed(0)
    x, y, z = torch.randn(37, 21), torch.randn(37, 16), torch.randn(21, 16)
    a, b = kern(x, y, z)
    torch.testing.assert_close(a, x.exp().T @ y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b, x.exp() @ z, rtol=1e-4, atol=1e-4)
    a2, b2 = kern(x, y, z)  # the output is zeroed per call, not added onto
    torch.testing.assert_close(b2, b, rtol=1e-5, atol=1e-5)


def test_a_narrow_output_is_not_scattered():
    """fp32 atomics need an fp32 output: a bf16 b keeps a plan of its own rows."""
    p = ne.build_program(_program("bfloat16"))
    tp = plan(p)
    assert not any(ps.scattered for ps in tp.passes)


def test_scaled_sums_keep_the_atomic_form():
    """Both outputs scaled by constants pulled out of their sums (``c · Σ_i …``, as the
    rule ``sum-pull-inner-factor`` leaves dK and dQ): the first is scaled once after its
    loop, the scattered one carries its scale on each block's term."""
    n, m, e = 37, 21, 16
    x = ne.placeholder((n, m), "float32", "x")
    y = ne.placeholder((n, e), "float32", "y")
    z = ne.placeholder((m, e), "float32", "z")
    i, j = ne.reduce_axis(n, "i"), ne.reduce_axis(m, "j")
    a = ne.compute((m, e), lambda jj, c: ne.sum(ne.exp(x[i, jj]) * y[i, c], axis=i) * 0.5, "a")
    b = ne.compute((n, e), lambda ii, c: ne.sum(ne.exp(x[ii, j]) * z[j, c], axis=j) * 0.25, "b")
    kern = ne.superoptimize([a, b], target="interpreter", cache=False)
    text = kern.plan.describe()
    assert "b[" in text and "term atomically" in text and "epilogue: a[" in text, text
    assert kern.source.count("tl.atomic_add(") == 2  # the key loop's and its ragged tail's
    torch.manual_seed(0)
    xt, yt, zt = torch.randn(n, m), torch.randn(n, e), torch.randn(m, e)
    got_a, got_b = kern(xt, yt, zt)
    torch.testing.assert_close(got_a, 0.5 * xt.exp().T @ yt, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_b, 0.25 * xt.exp() @ zt, rtol=1e-4, atol=1e-4)

"""Outputs at a computed index (``lowering.index_scatter``): a relative-position table's
gradient, T5's buckets, a cross-correlation -- one pass over the terms, each added where
its index points, against fp64 references."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import neptune_eq as ne
from neptune_eq.dropin import flex
from neptune_eq.lowering import index_scatter

from test_flex_backward import TOL, reference


def table_kernels(name: str):
    """The kernels built for the gradient of captured tensor ``name``."""
    return [val[1] for st in flex.STRUCTURES.values() for key, val in st.backward.items()
            if key[0] == (name,)]


def check_grads(q, k, v, table, mod, ref_mod, mask=None, ref_mask=None, group=1):
    out = ne.flex_attention(q, k, v, score_mod=mod, mask_mod=mask, enable_gqa=group > 1)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, table), g)
    ins = [x.detach().double().requires_grad_() for x in (q, k, v, table)]
    ref_out, _ = reference(*ins[:3], lambda s, i, j: ref_mod(s, ins[3], i, j),
                           ref_mask, group=group)
    ref = torch.autograd.grad(ref_out, ins, g.double())
    for a, r in zip(got, ref):
        assert a.shape == r.shape
        assert (a.double() - r).abs().max().item() <= TOL * max(1.0, r.abs().max().item())
    return got


@pytest.mark.parametrize("lq", [9, 13])
def test_a_relative_table_gradient_is_one_pass_of_atomic_adds(lq):
    """``rel[q_idx - kv_idx + 12]`` under a causal mask: its gradient kernel loops over the
    score tiles once and adds each score's gradient at its diagonal; it used to be one
    program per table entry recomputing every score (work ~ table x L x S; on an H200 at
    1024 keys its launch failed)."""
    torch.manual_seed(0)
    rel_ix = torch.randn(25, requires_grad=True)
    q = torch.randn(2, 2, lq, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 13, 16, requires_grad=True) for _ in range(2))
    got = check_grads(q, k, v, rel_ix, lambda s, b, h, i, j: s + rel_ix[i - j + 12],
                      lambda s, t, i, j: s + t[i - j + 12],
                      mask=lambda b, h, i, j: i + (13 - lq) >= j,
                      ref_mask=lambda i, j: i + (13 - lq) >= j)
    # entries only masked pairs read get nothing added (visible: lq - 1 <= i - j + 12 <= lq + 11)
    assert torch.all(got[3][:lq - 1] == 0) and torch.all(got[3][lq + 12:] == 0)
    assert torch.all(got[3][lq - 1:lq + 12] != 0)
    kerns = table_kernels("rel_ix")  # (one per lq)
    for kern in kerns:
        src = kern.kernel_source.source
        assert "tl.atomic_add(d_rel_ix_ptr" in src and src.count("tl.dot(") >= 2
        # i - j + 12 reads queries and keys only through their difference: a tile's
        # terms are summed along its diagonals, one add per diagonal
        assert "tl.gather(" in src and "summed along its diagonals" in kern.explain()


def t5_bucket(i, j, buckets=8, max_distance=40):
    """T5's bidirectional relative bucket: half exact, half log-spaced."""
    n = (i - j).abs()
    exact = buckets // 2
    far = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (buckets - exact)).to(torch.int64)
    return torch.where(n < exact, n, torch.clamp(far, max=buckets - 1))


def test_t5_buckets_per_head_many_scores_meet_one_entry():
    """A per-head table read at T5's log buckets, with GQA: many scores add into one of
    few entries, and the head axis addresses the table's rows.  One add per score
    collided there (H200, 4096 keys, 32 buckets a head: 88.9 ms fwd+bwd against 1.3 with
    the table detached); the bucket reads queries and keys only through their
    difference, so a tile's terms are summed along its diagonals first, then per entry
    of the head's 8 (one add per entry a tile), and the table needs no copies."""
    torch.manual_seed(1)
    t5_rows = torch.randn(4, 8, requires_grad=True)
    q = torch.randn(1, 4, 29, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 29, 16, requires_grad=True) for _ in range(2))
    h_of = torch.arange(4).view(1, 4, 1, 1)

    def ref_mod(s, tt, i, j):
        return s + tt[h_of, t5_bucket(i, j)]
    check_grads(q, k, v, t5_rows, lambda s, b, h, i, j: s + t5_rows[h, t5_bucket(i, j)], ref_mod,
                group=2)
    (kern,) = table_kernels("t5_rows")
    assert "tl.atomic_add(d_t5_rows_ptr" in kern.kernel_source.source
    assert "tl.gather(" in kern.kernel_source.source and "copy =" not in kern.explain()
    assert "then per entry of" in kern.explain() and "dg_acc" in kern.kernel_source.source


def test_few_entries_at_an_index_off_the_diagonals_spread_over_copies():
    """``t[(q_idx + kv_idx) % 8]`` reads queries and keys not only through their
    difference: each score adds on its own, and 8 entries take them all, so the adds are
    spread over 64 copies of the table by query row (``backward_forms.with_spread_output``),
    summed after the kernel."""
    torch.manual_seed(4)
    t_anti = torch.randn(8, requires_grad=True)
    q = torch.randn(1, 2, 21, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 19, 16, requires_grad=True) for _ in range(2))
    check_grads(q, k, v, t_anti, lambda s, b, h, i, j: s + t_anti[(i + j) % 8],
                lambda s, t, i, j: s + t[(i + j) % 8])
    (kern,) = table_kernels("t_anti")
    assert "tl.atomic_add(d_t_anti_ptr" in kern.kernel_source.source
    assert "tl.gather(" not in kern.kernel_source.source
    assert "copy = (i" in kern.explain() and "% 64)" in kern.explain()


def test_deterministic_algorithms_keep_the_row_wise_form():
    """Under ``torch.use_deterministic_algorithms`` the adds (in no fixed order) are
    barred: the gradient comes from the row-wise partials, as right, with no atomics."""
    torch.manual_seed(2)
    rel_det = torch.randn(21, requires_grad=True)
    q, k, v = (torch.randn(1, 2, 11, 16, requires_grad=True) for _ in range(3))
    torch.use_deterministic_algorithms(True)
    try:
        assert not index_scatter.allowed()
        check_grads(q, k, v, rel_det, lambda s, b, h, i, j: s + 0.5 * rel_det[j - i + 10],
                    lambda s, t, i, j: s + 0.5 * t[j - i + 10])
    finally:
        torch.use_deterministic_algorithms(False)
    kerns = [kn for st in flex.STRUCTURES.values() for key, val in st.backward.items()
             if key[0] == ("rel_det",) and "deterministic" in key for kn in [val[1]]]
    assert kerns and all("atomic_add" not in kn.kernel_source.source for kn in kerns)


def correlation(n: int, k: int, out: int):
    """``c[m] = Σ_i Σ_j [i − j + k − 1 = m]·a[i]·b[j]`` over ``out`` entries, built."""
    a = ne.placeholder((n,), "float32", "a")
    b = ne.placeholder((k,), "float32", "b")
    i, j = ne.reduce_axis(n, "i"), ne.reduce_axis(k, "j")
    c = ne.compute((out,), lambda m: ne.sum(ne.sum(
        ne.where(i - j + (k - 1) == m, a[i] * b[j], 0.0), axis=j), axis=i), "c")
    return ne.superoptimize(c, target="interpreter", cache=False)


def test_a_cross_correlation_is_one_pass():
    """Nothing here names attention: ``c[m] = Σ_i Σ_j [i − j + 8 = m]·a[i]·b[j]`` (numpy's
    full correlation, cut to 17 of its 21 entries: the terms that would land past the
    output are dropped) lowers to rows over i, a loop over j and adds at i − j + 8."""
    kern = correlation(13, 9, 17)
    x, y = torch.randn(13), torch.randn(9)
    want = np.correlate(x.double().numpy(), y.double().numpy(), "full")[:17]
    assert np.abs(kern(x, y).double().numpy() - want).max() < 1e-5
    assert "tl.atomic_add(c_ptr" in kern.kernel_source.source


def test_a_bucket_read_from_data_at_the_difference_adds_per_pair():
    """``t[bk[q_idx - kv_idx + 19]]`` (buckets precomputed as a tensor, as some T5 code
    does) reads queries and keys only through their difference, but through a load: on
    the diagonals' lanes that load would take the key lanes' mask (its kernel was wrong,
    translation validation refused it), so each score adds on its own, spread over
    copies."""
    torch.manual_seed(5)
    t_bk = torch.randn(12, requires_grad=True)
    bk = torch.randint(0, 12, (40,))
    q = torch.randn(1, 2, 21, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 19, 16, requires_grad=True) for _ in range(2))
    check_grads(q, k, v, t_bk, lambda s, b, h, i, j: s + t_bk[bk[i - j + 19]],
                lambda s, t, i, j: s + t[bk[i - j + 19]])
    (kern,) = table_kernels("t_bk")
    assert "tl.gather(" not in kern.kernel_source.source and "copy = (i" in kern.explain()


@pytest.mark.parametrize("rows, keys", [(16, 16), (32, 16), (16, 32), (64, 16)])
def test_diagonal_sums_at_unequal_row_and_key_blocks(rows, keys):
    """The full cross-correlation of 45 and 37 values (81 entries, i − j + 36) at row
    blocks taller, shorter and equal to the key blocks: the skew's diagonals ``t + qK``
    for every ``q`` the rows reach, ragged blocks on both axes, against numpy."""
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import TileConfig
    kern = correlation(45, 37, 81)
    assert "tl.gather(" in kern.kernel_source.source
    x, y = torch.randn(45), torch.randn(37)
    want = np.correlate(x.double().numpy(), y.double().numpy(), "full")
    out = torch.full((81,), float("nan"))
    blocks = {k: (rows if k == f"B_{kern.kernel_source.block_axis}" else keys)
              for k in kern.kernel_source.tunables}
    la = Launcher(kern.program, kern.kernel_source, "interpreter", TileConfig(blocks, 4, 2))
    la({"a": x, "b": y, "c": out})
    assert np.abs(out.double().numpy() - want).max() < 1e-5


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 40), k=st.integers(1, 40), scale=st.sampled_from([1, 2, -1]),
       cut=st.integers(0, 6), rows=st.sampled_from([16, 32, 64]),
       keys=st.sampled_from([16, 32]), per_entry=st.booleans())
def test_diagonal_sums_match_a_direct_sum(n, k, scale, cut, rows, keys, per_entry):
    """Random lengths, indices ``scale·(i − j) + offset`` (a stride, a reflection, some
    entries cut off the output's end) and tiles: the diagonal sums -- added one per
    diagonal, or, for an output of at most 64 entries, summed per entry first -- equal
    numpy's direct sum over every pair."""
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import TileConfig
    lo = scale * (n - 1 if scale < 0 else -(k - 1))  # the least scale·(i − j)
    size = abs(scale) * (n + k - 2) + 1 - cut
    if size < 1:
        return
    a = ne.placeholder((n,), "float32", "a")
    b = ne.placeholder((k,), "float32", "b")
    i, j = ne.reduce_axis(n, "i"), ne.reduce_axis(k, "j")
    c = ne.compute((size,), lambda m: ne.sum(ne.sum(
        ne.where(scale * (i - j) - lo == m, a[i] * b[j], 0.0), axis=j), axis=i), "c")
    was, index_scatter.ENTRY_SUMS = index_scatter.ENTRY_SUMS, per_entry
    try:
        kern = ne.superoptimize(c, target="interpreter", cache=False)
    finally:
        index_scatter.ENTRY_SUMS = was
    assert "tl.gather(" in kern.kernel_source.source
    assert ("dg_acc" in kern.kernel_source.source) == (per_entry and size <= 64)
    x, y = torch.randn(n, dtype=torch.float64), torch.randn(k, dtype=torch.float64)
    want = np.zeros(size)
    for p in range(n):
        for r in range(k):
            if 0 <= scale * (p - r) - lo < size:
                want[scale * (p - r) - lo] += x[p].item() * y[r].item()
    out = torch.full((size,), float("nan"))
    ks = kern.kernel_source
    blocks = {t: (rows if t == f"B_{ks.block_axis}" else keys) for t in ks.tunables}
    Launcher(kern.program, ks, "interpreter", TileConfig(blocks, 4, 2))(
        {"a": x.float(), "b": y.float(), "c": out})
    assert np.abs(out.double().numpy() - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_an_index_through_the_difference_alone_is_summed_along_diagonals():
    """``IndexScattered.diagonal`` proves ``f(i, j) = g(i − j)`` by substituting ``i = δ + j``: the
    index's arithmetic cancels ``j``, any other operation is a function of its
    arguments."""
    a = ne.placeholder((13,), "float32", "a")
    i, j = ne.reduce_axis(13, "i"), ne.reduce_axis(13, "j")

    def row(index, n=25):
        out = ne.compute((n,), lambda m: ne.sum(ne.sum(
            ne.where(index == m, a[i] * a[j], 0.0), axis=j), axis=i), "c")
        (sc, _), = index_scatter.find(ne.build_program(out))
        return sc.diagonal()
    assert row(i - j + 12).startswith("i") and row(12 - (j - i)).startswith("i")
    assert row(2 * (i + 6) - 2 * j, 50) and row((i - j + 12) // 2, 13)
    assert row(i + j) is None and row(i - 2 * j + 24, 38) is None
    assert row(i * j - j * i + j) is None  # (cancels to j alone: moves with the keys)


def test_what_is_not_the_form():
    """``m`` read beside its equation, or a narrower output than fp32: not scattered."""
    a = ne.placeholder((13,), "float32", "a")
    i, j = ne.reduce_axis(13, "i"), ne.reduce_axis(13, "j")

    def prog(body, dtype="float32"):
        out = ne.compute((25,), lambda m: ne.sum(ne.sum(body(m), axis=j), axis=i), "c", dtype)
        return ne.build_program(out)
    ok = prog(lambda m: ne.where(i - j + 12 == m, a[i] * a[j], 0.0))
    assert [list(sc.at) for sc, _ in index_scatter.find(ok)] == [["m"]]
    assert not index_scatter.find(prog(lambda m: ne.where(i - j + 12 == m, a[i] * m, 0.0)))
    assert not index_scatter.find(prog(lambda m: ne.where(i == m, a[i], 0.0), "float16"))
    assert not index_scatter.find(prog(lambda m: ne.where(i <= m, a[j], 0.0)))


def test_a_table_read_at_queries_and_keys_of_unequal_lengths_trains():
    """``t[q_idx] - 2·t[kv_idx]`` at L = 37, S = 53 (a 56-entry table, not cut to one
    length): the per-key partial reads ``where(j == m)``, an index moving with the keys,
    and is added at its index; the per-query one stays row-wise.  Both sat in one kernel
    that held queries and keys whole: "numel exceeds triton maximum" past toy sizes."""
    torch.manual_seed(3)
    t_qk = torch.randn(56, requires_grad=True)
    q = torch.randn(1, 2, 37, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 53, 16, requires_grad=True) for _ in range(2))
    got = check_grads(q, k, v, t_qk, lambda s, b, h, i, j: s + t_qk[i] - 2 * t_qk[j],
                      lambda s, t, i, j: s + t[i] - 2 * t[j])
    assert torch.all(got[3][53:] == 0)
    assert any("tl.atomic_add(d_t_qk_ptr" in kn.kernel_source.source
               for kn in table_kernels("t_qk"))

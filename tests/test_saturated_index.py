"""A computed index that stops moving far from the diagonal (``lowering.saturated_index``):
T5's buckets past |i − j| >= D read one entry, so those key blocks read it once and a
table gradient adds each of their tiles once -- found by interval reasoning, checked
here against torch's own evaluation of the index and against fp64 attention."""
from __future__ import annotations


import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import neptune_eq as ne
from neptune_eq.ir import rename_axis
from neptune_eq.dropin import eager_env, flex
from neptune_eq.lowering import saturated_index as si

from test_index_scatter import check_grads, t5_bucket, table_kernels


def _index_term(mod, table):
    """The index term ``mod`` reads ``table`` at, over (ROW, KEY), from a traced call."""
    q = torch.randn(1, 1, 3, 4)
    structure, _ = flex.trace(flex.check(q, q, q, None, False, False), mod, None)
    prog = structure.program
    (ix,) = {a for d in prog.defs for a in si._load_indices(d.body)}
    r, j = sorted({n.val for n in ix.walk() if n.op == "var"})
    return rename_axis(rename_axis(ix, r, si.ROW), j, si.KEY)


def _least_far(values: torch.Tensor, deltas: torch.Tensor, sign: int):
    """(least D, value) with ``values`` constant for every sign·δ >= D in the sample."""
    order = torch.argsort(sign * deltas, descending=True)
    v, d = values[order], sign * deltas[order]
    last = v[0]
    k = int(torch.nonzero(v != last)[0]) if bool((v != last).any()) else len(v)
    return int(d[k - 1]), int(last)


@settings(max_examples=12, deadline=None)
@given(buckets=st.sampled_from([4, 8, 16, 32, 64]), max_distance=st.sampled_from([12, 40, 128, 500]))
def test_t5_buckets_saturate_exactly_where_torch_says(buckets, max_distance):
    """The analysis's D and constant on each side match torch's own fp32 evaluation of
    T5's bucket over δ in [-4096, 4096]: sound (every pair past D reads the constant)
    and tight (within two diagonals of the least D in torch)."""
    if max_distance <= buckets // 2:
        return
    t = torch.zeros(2, buckets)
    ix = _index_term(lambda s, b, h, i, j: s + t[h, t5_bucket(i, j, buckets, max_distance)], t)
    deltas = torch.arange(-4096, 4097)
    values = t5_bucket(deltas, torch.zeros_like(deltas), buckets, max_distance)
    got = si.saturation(ix)
    for n, sign in enumerate((+1, -1)):
        assert got[n] is not None
        d, c = got[n]
        assert bool((values[sign * deltas >= d] == c).all())
        least, value = _least_far(values, deltas, sign)
        # (a value that lands exactly on an integer -- log 16/2 / log 6 * 2 = 3 -- is
        # left to the band: the kernel's fp32 log might round it under)
        assert c == value and least <= d <= least + 2


def test_an_index_that_never_stops_moving_has_no_far_side():
    """A relative table ``rel[i − j + n]`` is a new entry on every diagonal; a clamped one
    stops at its clamp, on each side at its own distance."""
    rel = torch.zeros(400)
    assert si.saturation(_index_term(lambda s, b, h, i, j: s + rel[i - j + 200], rel)) == (None, None)
    clamped = _index_term(lambda s, b, h, i, j: s + rel[torch.clamp(i - j, -30, 50) + 200], rel)
    assert si.saturation(clamped) == ((50, 250), (30, 170))


def test_a_float_comparison_in_the_index_is_not_claimed():
    """Where the index compares floats (the outcome could flip under the kernel's fp32
    rounding), no far side is claimed."""
    t = torch.zeros(8)
    ix = _index_term(lambda s, b, h, i, j: s + t[torch.where((i - j).float() / 3 < 2.5, 0, 7)], t)
    assert si.saturation(ix) == (None, None)


def _t5_call(S: int, grads: bool):
    torch.manual_seed(3)
    t5_rows = torch.randn(2, 8, requires_grad=grads)
    q, k, v = (torch.randn(1, 2, S, 16, requires_grad=grads) for _ in range(3))
    h_of = torch.arange(2).view(1, 2, 1, 1)
    mod = lambda s, b, h, i, j: s + t5_rows[h, t5_bucket(i, j)]  # noqa: E731
    return q, k, v, t5_rows, mod, lambda s, tt, i, j: s + tt[h_of, t5_bucket(i, j)]


@pytest.mark.parametrize("S", [67, 100])
def test_t5_far_key_blocks_read_one_entry_forward_and_gradients(S):
    """T5 (8 buckets up to 40: one entry past |i − j| >= 23) at lengths whose far blocks
    exist on both sides: the forward's key loop is cut into far / band / far, the table
    gradient adds each far tile once, and every gradient matches fp64 attention."""
    eager_env.forget()
    q, k, v, t5_rows, mod, ref_mod = _t5_call(S, grads=True)
    check_grads(q, k, v, t5_rows, mod, ref_mod)
    st_ = next(iter(flex.STRUCTURES.values()))
    src = st_.kernel.kernel_source.source
    assert "keys far below the rows: the index is 7 where i - j >= 23" in src
    assert "keys far above the rows: the index is 7 where j - i >= 23" in src
    (kern,) = table_kernels("t5_rows")
    assert "far_sum" in kern.kernel_source.source


def test_the_switch_turns_the_far_loops_off(monkeypatch):
    monkeypatch.setattr(si, "ENABLED", False)
    eager_env.forget()
    q, k, v, t5_rows, mod, _ = _t5_call(67, grads=False)
    ne.flex_attention(q, k, v, score_mod=mod)
    src = next(iter(flex.STRUCTURES.values())).kernel.kernel_source.source
    assert "far below" not in src and "far above" not in src


def test_t5_at_head_dim_64_is_checked_past_the_far_distance():
    """T5's own 32 buckets up to 128 (one entry past |i − j| >= 113) at head dim 64: the
    table and the head dim are kept as called in translation validation (the table is
    read in bounds only at its size), and the far check moves only the lengths past 113
    -- moving every size above them made a head dim of 540 that could not be lowered."""
    eager_env.forget()
    torch.manual_seed(5)
    t = torch.randn(2, 32)
    q, k, v = (torch.randn(1, 2, 40, 64) for _ in range(3))
    out = ne.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + t[h, t5_bucket(i, j, 32, 128)])
    i, j = torch.arange(40).view(-1, 1), torch.arange(40).view(1, -1)
    s = q.double() @ k.double().transpose(-1, -2) / 8 + t.double()[:, t5_bucket(i, j, 32, 128)]
    assert (out.double() - torch.softmax(s, -1) @ v.double()).abs().max().item() < 1e-5
    kern = next(iter(flex.STRUCTURES.values())).kernel
    report = kern.trace.validation
    assert report.far_sizes and all(v < 100 for k, v in report.far_sizes.items() if k in (32, 64))
    assert "where its far key loops run" in str(report)


@pytest.mark.parametrize("group", [1, 2])
def test_a_t5_decode_reads_the_far_bucket_once(group):
    """One query at the end of 300 keys (``q_idx + 299``), grouped heads packed or not:
    every key up to 276 past the query is the last bucket (a negative far distance), and
    the output matches fp64."""
    eager_env.forget()
    torch.manual_seed(6)
    t = torch.randn(2 * group, 8)
    q = torch.randn(1, 2 * group, 1, 16)
    k, v = (torch.randn(1, 2, 300, 16) for _ in range(2))
    out = ne.flex_attention(q, k, v, enable_gqa=group > 1,
                            score_mod=lambda s, b, h, i, j: s + t[h, t5_bucket(i + 299, j)])
    kk, vv = (x.double().repeat_interleave(group, 1) for x in (k, v))
    j = torch.arange(300).view(1, -1)
    s = q.double() @ kk.transpose(-1, -2) / 4 + t.double()[:, t5_bucket(torch.tensor([[299]]), j)]
    assert (out.double() - torch.softmax(s, -1) @ vv).abs().max().item() < 1e-5
    src = next(iter(flex.STRUCTURES.values())).kernel.kernel_source.source
    # (q_idx + 299 is one bucket for every key up to 276 past the query: D₊ = -276)
    assert "the index is 7 where i - j >= -276" in src


def test_split_k_chunks_are_cut_at_the_far_distance():
    """A DSL decode reading a T5-like table at ``q + 159 − kv`` (8 buckets up to 40):
    split-k's chunk programs each cut their own key range (3 chunks, in partials plus a
    combine and in one launch), and agree with the reference interpreter."""
    from neptune_eq.interp import evaluate
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import candidate_configs

    S = 160
    tab = ne.placeholder((4, 8), "float32", "tab")

    def bucket(i, j):  # T5's, written with the DSL's ops
        n = ne.abs(i + (S - 1) - j)
        far = 4 + ne.cast(ne.log(ne.maximum(n, 1) / 4) * 4 / math.log(10), "int64")
        return ne.where(n < 4, n, ne.minimum(far, 7))
    out = ne.attention(1, 4, 1, S, 16, "float32",
                       score_mod=lambda s, b, h, i, j: s + tab[h, bucket(i, j)])
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    row = next(r for r in kern.candidates if r.plan is not None and r.plan.split)
    assert "the index is 7 where i - j >= -136" in row.kernel.source
    torch.manual_seed(7)
    data = {"q": torch.randn(1, 4, 1, 16), "k": torch.randn(1, 4, S, 16),
            "v": torch.randn(1, 4, S, 16), "tab": torch.randn(4, 8)}
    ref = evaluate(kern.input_program, data)["o"]
    for fused in (False, True):
        cfg = candidate_configs(row.kernel, "interpreter")[0]
        cfg.splits, cfg.fused = 3, fused
        o = torch.empty(1, 4, 1, 16)
        Launcher(row.program, row.kernel, "interpreter", cfg)({**data, "o": o})
        assert torch.allclose(o.double(), ref, atol=1e-4)

"""ne.attention variants (Neptune's operators, small shapes) equal the reference, incl.
odd sizes, captured tensors, GQA, decode and fully masked rows."""

import pytest
import torch

import neptune_eq as ne
from neptune_eq.interp import evaluate
from helpers import check_kernel

B, H, D = 1, 2, 16


def causal(b, h, i, j):
    return i >= j


def window(w):
    return lambda b, h, i, j: (i >= j) & (i - j < w)


def softcap(cap):
    return lambda s, b, h, i, j: ne.tanh(s / cap) * cap


def alibi(slopes):
    return lambda s, b, h, i, j: s + slopes[h] * (j - i)


@pytest.mark.parametrize("name, sq, skv, kw", [
    ("global", 9, 21, {}),
    ("causal", 21, 21, {"mask_mod": causal}),
    ("softcap", 9, 21, {"score_mod": softcap(5.0)}),
    ("window", 21, 21, {"mask_mod": window(6), "score_mod": softcap(5.0)}),
    ("gqa", 9, 21, {"kv_heads": 1}),
    ("causal-decode", 1, 37, {"mask_mod": lambda b, h, i, j: j <= 36}),
    ("softcap-decode", 1, 37, {"score_mod": softcap(5.0)}),
])
def test_attention_variant(name, sq, skv, kw):
    kern = check_kernel(ne.attention(B, H, sq, skv, D, "float32", **kw))
    assert kern.plan.n_passes == 1, name


def test_alibi_with_captured_slopes():
    slopes = ne.placeholder((H,), "float32", "slopes")
    kern = check_kernel(ne.attention(B, H, 9, 21, D, "float32", score_mod=alibi(slopes),
                                     mask_mod=causal))
    assert [p.name for p in kern.input_program.inputs] == ["q", "k", "v", "slopes"]


def test_alibi_softcap_window_gqa_together_in_fp16():
    slopes = ne.placeholder((4,), "float32", "slopes")
    mods = [alibi(slopes), softcap(20.0)]
    kern = check_kernel(ne.attention(1, 4, 19, 19, D, "float16", kv_heads=2, mask_mod=window(5),
                                     score_mod=lambda s, b, h, i, j: mods[1](mods[0](s, b, h, i, j), b, h, i, j)))
    assert kern.plan.n_passes == 1


def test_document_mask_from_a_captured_tensor():
    doc = ne.placeholder((21,), "int32", "doc")
    out = ne.attention(B, H, 21, 21, D, "float32", mask_mod=lambda b, h, i, j: doc[i] == doc[j])
    kern = ne.superoptimize(out, target="interpreter")
    q, k, v = (torch.randn(B, H, 21, D) for _ in range(3))
    ids = torch.tensor([0] * 7 + [1] * 9 + [2] * 5, dtype=torch.int32)
    got = kern(q, k, v, ids)
    mask = ids[:, None] == ids[None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(got, ref, atol=1e-5)


def test_fully_masked_rows_return_zero_not_nan():
    out = ne.attention(B, H, 9, 13, D, "float32", mask_mod=lambda b, h, i, j: j > i + 5)
    kern = ne.superoptimize(out, target="interpreter")
    q, k, v = (torch.randn(B, H, n, D) for n in (9, 13, 13))
    got = kern(q, k, v)
    assert torch.isfinite(got).all() and got[:, :, 7:].abs().max() == 0
    ref = evaluate(kern.input_program, {"q": q, "k": k, "v": v})["o"]
    assert torch.allclose(got.double(), ref, atol=1e-5)


def test_large_magnitude_scores_match_sdpa():
    out = ne.attention(B, H, 9, 21, D, "float32", scale=1.0)
    kern = ne.superoptimize(out, target="interpreter")
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) * 25 for n in (9, 21, 21))
    got = kern(q.float(), k.float(), v.float())
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)
    assert torch.isfinite(got).all()
    assert (got.double() - ref).abs().max() / ref.abs().max() < 1e-4


def test_gqa_rejects_bad_head_counts():
    with pytest.raises(ne.ProgramError, match="multiple of kv heads"):
        ne.attention(1, 3, 4, 4, 8, kv_heads=2)


@pytest.mark.parametrize("mask, lo, hi", [
    (causal, None, 1),
    (window(6), -5, 1),
    (lambda b, h, i, j: j > i + 5, 6, None),
    # the same bounds however the affine comparison is spelt
    (lambda b, h, i, j: (j <= i) & (j >= i - 5), -5, 1),
    (lambda b, h, i, j: (i - j >= 0) & (6 > i - j), -5, 1),
    (lambda b, h, i, j: j == i, 0, 1),
])
def test_affine_masks_become_loop_bounds(mask, lo, hi):
    kern = check_kernel(ne.attention(B, H, 40, 40, D, "float32", mask_mod=mask))
    (p,) = kern.plan.passes
    assert (p.lo_offset, p.hi_offset) == (lo, hi)
    assert ("j_hi0" in kern.source) == (hi is not None) and ("j_lo0" in kern.source) == (lo is not None)


def test_non_affine_masks_keep_the_full_loop():
    doc = ne.placeholder((21,), "int32", "doc")
    kern = ne.superoptimize(ne.attention(B, H, 21, 21, D, "float32",
                                         mask_mod=lambda b, h, i, j: doc[i] == doc[j]),
                            target="interpreter")
    assert kern.plan.passes[0].lo_offset is None and kern.plan.passes[0].hi_offset is None


def test_decode_rebases_each_key_block_on_its_own_max():
    """Decode (one row block): every key block's P is taken at the block's own max and
    re-based by the fold's correction (FlashDecoding's split rule, per block).  Leading
    blocks fully masked (a captured mask: no loop bound to skip them), scores of ±1e3, and
    a row with nothing visible still equal the reference; prefill keeps the plain update."""
    keep = ne.placeholder((2, 53), "int32", "keep")
    out = ne.attention(1, 2, 1, 53, D, "float32", scale=1.0,
                       mask_mod=lambda b, h, i, j: keep[h, j] > 0)
    kern = ne.superoptimize(out, target="interpreter")
    assert "block's own max" in kern.plan.describe() and "o_f0 * " in kern.source
    assert "mx_blk" in kern.source
    q, k, v = (torch.randn(1, 2, n, D) * s for n, s in ((1, 8.0), (53, 8.0), (53, 1.0)))
    mask = torch.zeros(2, 53, dtype=torch.int32)
    mask[0, 35:] = 1  # head 0: the first two 16-key blocks fully masked; head 1: nothing visible
    got = kern(q, k, v, mask)
    ref = evaluate(kern.input_program, {"q": q, "k": k, "v": v, "keep": mask})["o"]
    assert torch.isfinite(got).all() and got[0, 1].abs().max() == 0
    assert torch.allclose(got.double(), ref, atol=1e-4, rtol=1e-4)
    prefill = ne.superoptimize(ne.attention(1, 2, 40, 40, D, "float32"), target="interpreter")
    assert "_blk" not in prefill.source and "own max" not in prefill.plan.describe()


@pytest.mark.parametrize("kw, error, match", [
    ({"kv_heads": 0}, ne.ProgramError, "kv_heads to be a positive int"),
    ({"kv_heads": 3}, ne.ProgramError, "multiple of kv heads"),
    ({"d": 0}, ne.ProgramError, "d to be a positive int"),
    ({"dv": -2}, ne.ProgramError, "dv to be a positive int"),
    ({"score_mod": lambda s: s}, ValueError, r"score_mod to take 5 positional arguments"),
    ({"mask_mod": lambda b, h, i: i > 0}, ValueError, r"mask_mod to take 4 positional"),
    ({"mask_mod": "causal"}, ValueError, "mask_mod to be a function"),
])
def test_bad_arguments_are_said_before_the_trace(kw, error, match):
    """Head counts and head dims are positive ints; a mod FlexAttention could not call is
    named with its form -- not a ZeroDivisionError from the scale or Python's TypeError
    from inside the trace."""
    args = {"d": D, **{k: v for k, v in kw.items() if k == "d"}}
    rest = {k: v for k, v in kw.items() if k != "d"}
    with pytest.raises(error, match=match):
        ne.attention(B, 4, 8, 8, args["d"], "float32", **rest)

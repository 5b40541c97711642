"""FlexAttention mods copied verbatim from their sources, for tests/test_flex_mods.py.

Every mod function body below is copied exactly as written (only the *setup* around it is
scaled to interpreter sizes: S <= 40, CPU tensors instead of device="cuda"; each entry
quotes the original setup lines it changed).  Sources:

* PT = pytorch/pytorch, test/inductor/test_flex_attention.py (stored version at commit
  00125ef3dad64a9f8dd8768e81326a34ed7ba91d);
* AG = meta-pytorch/attention-gym, attn_gym/masks/*.py and attn_gym/mods/*.py (commit
  7fdb85d0b96668397adee48de54b6f1036497717): in flex_mod_cases_gym.py.

A case is ``Case(id, origin, build, sq, skv, ...)``; ``build()`` returns the mods (and the
tensors they capture live in its closure), so each test gets fresh captured tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, noop_mask

CASES: list["Case"] = []


@dataclass
class Case:
    id: str
    origin: str
    build: Callable[[], dict]
    sq: int = 21
    skv: int = 21
    q_scale: float = 1.0       # ~30: large-magnitude scores
    kv_heads: Optional[int] = None
    xfail: Optional[str] = None  # the exact reason neptune_eq cannot run it


def case(origin: str, **kw):
    def reg(fn):
        CASES.append(Case(fn.__name__, origin, fn, **kw))
        return fn
    return reg


PT = "pytorch/pytorch test/inductor/test_flex_attention.py"
H_ = 2  # heads in every case (the sources' H is 8 or more)


# ============================== PT: module-level mods ==================================
# PT, module level ("Useful score mod functions for testing"), verbatim:
def _causal(
    score: Tensor,
    batch: Tensor,
    head: Tensor,
    token_q: Tensor,
    token_kv: Tensor,
) -> Tensor:
    return torch.where(token_q >= token_kv, score, float("-inf"))


def _rel_causal(
    score: Tensor,
    batch: Tensor,
    head: Tensor,
    token_q: Tensor,
    token_kv: Tensor,
) -> Tensor:
    return torch.where(token_q >= token_kv, score + (token_q - token_kv), float("-inf"))


def _generate_alibi_bias(num_heads: int):
    def _alibi_bias(
        score: Tensor,
        batch: Tensor,
        head: Tensor,
        token_q: Tensor,
        token_kv: Tensor,
    ) -> Tensor:
        scale = torch.exp2(-((head + 1) * 8.0 / num_heads))
        return score + (token_kv - token_q) * scale

    return _alibi_bias


def _inverse_causal(score, b, h, m, n):
    return torch.where(m <= n, score, float("-inf"))


def _squared(score, b, h, m, n):
    """Joint graph needed for correctness"""
    return score * score


def _trig(score, b, h, m, n):
    """Joint graph needed for correctness"""
    return torch.sin(torch.cos(score)) + torch.tan(b)


def _trig2(score, b, h, m, n):
    """Branching joint graph"""
    cos_score = torch.cos(score)
    sin_score = torch.sin(score)
    z = cos_score * sin_score + torch.tan(b)
    return z


@case(PT + " (test_builtin_score_mods: _causal)")
def pt_causal():
    return {"score_mod": _causal}


@case(PT + " (test_builtin_score_mods: _rel_causal)", q_scale=30.0)
def pt_rel_causal():
    return {"score_mod": _rel_causal}


@case(PT + " (test_GQA: _generate_alibi_bias(8), Hq = 2*Hkv)", kv_heads=1)
def pt_alibi_gqa():
    return {"score_mod": _generate_alibi_bias(8)}


# More queries than keys: the rows m > n_max see no key (fully masked by the score_mod's -inf).
@case(PT + " (test_builtin_score_mods_different_seqlen: _inverse_causal)", sq=27, skv=13)
def pt_inverse_causal_fully_masked_rows():
    return {"score_mod": _inverse_causal}


@case(PT + " (test_builtin_score_mods_dynamic: test_score_mask_mod_map[_squared] = noop_mask)")
def pt_squared_noop_mask():
    return {"score_mod": _squared, "mask_mod": noop_mask}


@case(PT + " (test_aot_eager_gradcheck: _trig, _trig2)")
def pt_trig():
    return {"score_mod": lambda s, b, h, m, n: _trig(s, b, h, m, n) + _trig2(s, b, h, m, n)}


# PT _head_offset: `head_offset = torch.rand(H, device="cuda", dtype=dtype)`
@case(PT + " (captured_buffers_map: _head_offset)")
def pt_head_offset():
    head_offset = torch.rand(H_, dtype=torch.float32)

    def score_mod(score, b, h, m, n):
        return score * head_offset[h]

    return {"score_mod": score_mod}


# ============================== PT: tests with captured tensors ========================
# test_doc_mask_sparse: `document_id = torch.zeros(S, dtype=torch.int, device="cuda")`,
# `for i in range(0, S, 256): document_id[i : i + 256] = i // 256` (here blocks of 8).
@case(PT + " (test_doc_mask_sparse)")
def pt_document_masking_causal():
    S = 21
    document_id = torch.zeros(S, dtype=torch.int)
    for i in range(0, S, 8):
        document_id[i : i + 8] = i // 8

    def document_masking_causal(score, b, h, q_idx, kv_idx):
        causal_mask = q_idx >= kv_idx
        document_mask = document_id[q_idx] == document_id[kv_idx]
        return torch.where(causal_mask & document_mask, score, -float("inf"))

    return {"score_mod": document_masking_causal}


# test_index_weird1: `bias = torch.randn(4, B, H, S, device="cuda")`
@case(PT + " (test_index_weird1)")
def pt_index_weird1():
    B, H, S = 1, H_, 21
    bias = torch.randn(4, B, H, S)

    def index_weird1(score, b, h, q_idx, kv_idx):
        return score + bias[0][b, h][q_idx]

    return {"score_mod": index_weird1}


# test_index_weird2: `bias = torch.randn(B, H, 4, S, device="cuda")`,
# `which_bias = torch.tensor(0, device="cuda")` (a 0-d captured index; here 2)
@case(PT + " (test_index_weird2)")
def pt_index_weird2():
    B, H, S = 1, H_, 21
    bias = torch.randn(B, H, 4, S)
    which_bias = torch.tensor(2)

    def index_weird2(score, b, h, q_idx, kv_idx):
        return score + bias[b][h][which_bias, q_idx]

    return {"score_mod": index_weird2}


@case(PT + " (test_skip_odd_keys)")
def pt_skip_odd_keys():
    def score_mod(score, b, h, q, kv):
        return torch.where(kv % 2 == 0, score, float("-inf"))

    return {"score_mod": score_mod}


# test_load_rel_bias: `rel_bias = torch.randn(2 * S, device="cuda", dtype=dtype)`
@case(PT + " (test_load_rel_bias)", q_scale=30.0)
def pt_load_rel_bias():
    S = 21
    rel_bias = torch.randn(2 * S, dtype=torch.float32)

    def bias_mod(score, b, h, q, kv):
        return score + rel_bias[(q - kv) + S]

    return {"score_mod": bias_mod}


# test_dependent_causal_bidirectional:
# `num_bidirectional = torch.randint(0, S, (B,), device="cuda", dtype=torch.int32)`
@case(PT + " (test_dependent_causal_bidirectional)")
def pt_dependent_causal_bidirectional():
    B, S = 1, 21
    num_bidirectional = torch.randint(0, S, (B,), dtype=torch.int32)

    def bias_mod(score, b, h, q, kv):
        causal_attention = q >= kv
        cur_num_bidirectional = num_bidirectional[b]
        bidirectional_attention_on_video = (q <= cur_num_bidirectional) & (
            kv <= cur_num_bidirectional
        )
        return torch.where(
            bidirectional_attention_on_video | causal_attention,
            score,
            -float("inf"),
        )

    return {"score_mod": bias_mod}


# test_natten_2d: `H = 32`, `W = S // H`, `WINDOW = 3` (here a 6 x 6 canvas, WINDOW = 1).
@case(PT + " (test_natten_2d)", sq=36, skv=36)
def pt_natten_2d():
    S, H = 36, 6
    W = S // H
    WINDOW = 1
    assert W * H == S

    def get_x_y(idx):
        # This should be a floor divide, but we don't support that properly
        return idx / W, idx % W

    def natten_mask(score, b, h, q, kv):
        q_x, q_y = get_x_y(q)
        kv_x, kv_y = get_x_y(kv)
        return torch.where(
            ((q_x - kv_x).abs() <= WINDOW) | ((q_y - kv_y).abs() <= WINDOW),
            score,
            float("-inf"),
        )

    return {"score_mod": natten_mask}


@case(PT + " (test_silu_on_score)", q_scale=30.0)
def pt_silu():
    def silu_score(score, b, h, q, kv):
        return torch.nn.functional.silu(score)

    return {"score_mod": silu_score}


# test_padded_dense_causal: `seq_len = torch.arange(B, device="cuda", dtype=torch.int32) + 1`.
# The mask compares the *score* with seq_len[b]: data-dependent, so with scores of ~±30 some
# rows have no score <= 1 and are fully masked.
@case(PT + " (test_padded_dense_causal)", q_scale=30.0)
def pt_padded_dense_causal():
    B = 1
    seq_len = torch.arange(B, dtype=torch.int32) + 1

    def create_padded_dense_wrapper(orig_score_mod):
        def njt_score_mod(qk, b, h, q, kv):
            return torch.where(
                qk <= seq_len[b], orig_score_mod(qk, b, h, q, kv), -float("inf")
            )

        return njt_score_mod

    causal_njt = create_padded_dense_wrapper(_causal)
    return {"score_mod": causal_njt}


# test_captured_scale: `scale = torch.ones((), device="cuda", dtype=torch.int32)`
@case(PT + " (test_captured_scale)")
def pt_captured_scale():
    scale = torch.ones((), dtype=torch.int32)

    def score_mod_scale(qk, b, h, q, kv):
        return qk + scale

    return {"score_mod": score_mod_scale}


# test_captured_reduction (an @expectedFailure in PyTorch too):
# `scale = torch.randn((B, 8), device="cuda")`
@case(PT + " (test_captured_reduction)",
      xfail="reduces a captured tensor inside the mod (scale[b].sum(dim=-1)); mods see one "
            "element, and FlexAttention rejects this too (expectedFailure upstream)")
def pt_captured_reduction():
    B = 1
    scale = torch.randn((B, 8))

    def score_mod_scale(qk, b, h, q, kv):
        return qk + scale[b].sum(dim=-1)

    return {"score_mod": score_mod_scale}


# test_njt_causal: `offsets = torch.tensor([0, 1024, 1024 + 512, S], device="cuda",
# dtype=torch.int32)`, `seq_idx = torch.zeros(S, device="cuda", dtype=torch.int32)`
@case(PT + " (test_njt_causal)")
def pt_njt_causal():
    S = 21
    offsets = torch.tensor([0, 8, 8 + 5, S], dtype=torch.int32)
    seq_idx = torch.zeros(S, dtype=torch.int32)
    for idx in range(len(offsets) - 1):
        seq_idx[offsets[idx] : offsets[idx + 1]] = idx

    def create_njt_wrapper(orig_score_mod, offsets, seq_idx):
        def njt_score_mod(qk, b, h, q, kv):
            q_nested = q - offsets[seq_idx[q]]
            kv_nested = kv - offsets[seq_idx[kv]]
            return orig_score_mod(qk, b, h, q_nested, kv_nested)

        return njt_score_mod

    causal_njt = create_njt_wrapper(_causal, offsets, seq_idx)
    return {"score_mod": causal_njt}


def _combiner_mods():
    # test_mask_mod_combiners, verbatim (the window is 512 there; 5 here)
    def causal_mask(b, h, q, kv):
        return q >= kv

    def neg_causal_mask(b, h, q, kv):
        return q < kv

    def sliding_window(b, h, q, kv):
        return (q - kv) <= 5

    return causal_mask, neg_causal_mask, sliding_window


@case(PT + " (test_mask_mod_combiners: and_masks(causal_mask, sliding_window))")
def pt_and_masks():
    causal_mask, _, sliding_window = _combiner_mods()
    return {"mask_mod": and_masks(causal_mask, sliding_window)}


# Every row is fully masked: the output must be all zeros, not NaN.
@case(PT + " (test_mask_mod_combiners: and_masks(causal_mask, neg_causal_mask))")
def pt_and_masks_empty():
    causal_mask, neg_causal_mask, _ = _combiner_mods()
    return {"mask_mod": and_masks(causal_mask, neg_causal_mask)}


# test_new_empty_mask_mod: `attn_mask = torch.ones(4, 1, S, S, dtype=torch.bool,
# device="cuda").tril()`; both mods as there (the block mask is made from `causal`).
@case(PT + " (test_new_empty_mask_mod)")
def pt_new_empty_mask_mod():
    S = 21
    attn_mask = torch.ones(4, 1, S, S, dtype=torch.bool).tril()

    def score_mod(score, b, h, q_idx, kv_idx):
        h_ = h.new_zeros(h.shape)
        return score + attn_mask[b, h_, q_idx, kv_idx]

    def causal(b, h, q_idx, kv_idx):
        h_ = h.new_zeros(h.shape)
        return attn_mask[b, h_, q_idx, kv_idx]

    return {"score_mod": score_mod, "mask_mod": causal}


# test_fully_masked_out_rows: `M = S // 2`; rows q >= M see nothing.
@case(PT + " (test_fully_masked_out_rows)")
def pt_fully_masked_out_rows():
    S = 21
    M = S // 2

    def mask_mod(b, h, q, kv):
        return q < M

    return {"mask_mod": mask_mod}

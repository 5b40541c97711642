"""attention-gym mods copied verbatim, for tests/test_flex_mods.py (conventions: see
flex_mod_cases.py).  Source: meta-pytorch/attention-gym at commit
7fdb85d0b96668397adee48de54b6f1036497717, attn_gym/masks/*.py and attn_gym/mods/*.py; the
copied functions' docstrings and type-alias return annotations are left out, code lines
are as written.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import BoolTensor, IntTensor, Tensor
from torch.nn.attention.flex_attention import and_masks, or_masks

from flex_mod_cases import H_, case

AG = "meta-pytorch/attention-gym attn_gym/"


# ============================== AG: masks ==============================================
# AG masks/causal.py, verbatim:
def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@case(AG + "masks/causal.py (causal_mask)", q_scale=30.0)
def ag_causal():
    return {"mask_mod": causal_mask}


# AG masks/sliding_window.py, verbatim:
def generate_sliding_window(window_size: int):
    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window_size

    sliding_window_mask = and_masks(sliding_window, causal_mask)
    sliding_window_mask.__name__ = f"sliding_window_{window_size}"
    return sliding_window_mask


@case(AG + "masks/sliding_window.py (generate_sliding_window(3))")
def ag_sliding_window():
    return {"mask_mod": generate_sliding_window(3)}


# AG masks/prefix_lm.py, verbatim:
def generate_prefix_lm_mask(prefix_length: int):
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    prefix_lm_causal_mask = or_masks(prefix_mask, causal_mask)
    prefix_lm_causal_mask.__name__ = f"prefix_lm_causal_mask_{prefix_length}"
    return prefix_lm_causal_mask


@case(AG + "masks/prefix_lm.py (generate_prefix_lm_mask(4))")
def ag_prefix_lm():
    return {"mask_mod": generate_prefix_lm_mask(prefix_length=4)}


# AG masks/document_mask.py, verbatim:
def _offsets_to_doc_ids_tensor(offsets):
    device = offsets.device
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(
        torch.arange(len(counts), device=device, dtype=torch.int32), counts
    )


def length_to_offsets(lengths: list[int], device: str | torch.device) -> Tensor:
    offsets = [0]
    offsets.extend(lengths)
    offsets = torch.tensor(offsets, device=device, dtype=torch.int32)
    offsets = torch.cumsum(offsets, dim=-1)
    return offsets


def generate_doc_mask_mod(mask_mod, offsets: Tensor):
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask

    return doc_mask_mod


# main(): `lengths = generate_random_lengths(max_seq_len, doc_count)` (here fixed lengths)
@case(AG + "masks/document_mask.py (generate_doc_mask_mod(causal_mask, offsets))")
def ag_document_causal():
    offsets = length_to_offsets([5, 9, 7], "cpu")
    return {"mask_mod": generate_doc_mask_mod(causal_mask, offsets)}


# AG masks/dilated_sliding_window.py, verbatim:
def generate_dilated_sliding_window(window_size: int, dilation: int):
    def dilated_sliding_window(b, h, q_idx, kv_idx):
        diff = torch.abs(q_idx - kv_idx)
        in_window = diff <= window_size
        is_dilated = (diff % dilation) == 0
        return in_window & is_dilated

    dilated_sliding_window.__name__ = f"dilated_sliding_window_{window_size}_dilation_{dilation}"
    return dilated_sliding_window


@case(AG + "masks/dilated_sliding_window.py (window_size=4, dilation=2)")
def ag_dilated_sliding_window():
    return {"mask_mod": generate_dilated_sliding_window(window_size=4, dilation=2)}


# AG masks/natten.py, verbatim (Morton-curve NATTEN: bit interleaving with & | << >>):
def interleave_bits_32(x):
    x = x & 0x0000FFFF  # Ensure x is 16 bits
    x = (x | (x << 8)) & 0x00FF00FF
    x = (x | (x << 4)) & 0x0F0F0F0F
    x = (x | (x << 2)) & 0x33333333
    x = (x | (x << 1)) & 0x55555555
    return x


def deinterleave_bits_32(code):
    code = code & 0x55555555
    code = (code | (code >> 1)) & 0x33333333
    code = (code | (code >> 2)) & 0x0F0F0F0F
    code = (code | (code >> 4)) & 0x00FF00FF
    code = (code | (code >> 8)) & 0x0000FFFF
    return code


def morton_decode(code):
    x = deinterleave_bits_32(code)
    y = deinterleave_bits_32(code >> 1)
    return x, y


def generate_morton_natten(
    canvas_w: int,
    canvas_h: int,
    kernel_w: int,
    kernel_h: int,
):
    def natten_mask_mod(
        b: IntTensor,
        h: IntTensor,
        q_idx: IntTensor,
        kv_idx: IntTensor,
    ) -> BoolTensor:
        q_x, q_y = morton_decode(q_idx)
        kv_x, kv_y = morton_decode(kv_idx)
        # kernel nominally attempts to center itself on the query, but kernel center
        # is clamped to a fixed distance (kernel half-length) from the canvas edge
        kernel_center_x = q_x.clamp(kernel_w // 2, (canvas_w - 1) - kernel_w // 2)
        kernel_center_y = q_y.clamp(kernel_h // 2, (canvas_h - 1) - kernel_h // 2)
        hori_mask = (kernel_center_x - kv_x).abs() <= kernel_w // 2
        vert_mask = (kernel_center_y - kv_y).abs() <= kernel_h // 2
        return hori_mask & vert_mask

    natten_mask_mod.__name__ = f"morton_natten_c{canvas_w}x{canvas_h}_k{kernel_w}x{kernel_h}"
    return natten_mask_mod


# main(): CANVAS 6 x 6, kernel_size = 3 (a 4 x 4 Morton tile of 16 tokens here: 6 x 6 is
# not a Morton square, its codes would run past 36)
@case(AG + "masks/natten.py (generate_morton_natten)", sq=16, skv=16)
def ag_morton_natten():
    return {"mask_mod": generate_morton_natten(canvas_w=4, canvas_h=4, kernel_w=3, kernel_h=3)}


# AG masks/flamingo.py, verbatim:
def generate_vision_cross_attention_mask_mod(
    intervals: Tensor,
    image_token_length: int,
):
    num_images = intervals.shape[0]
    image_boundaries = torch.repeat_interleave(
        torch.arange(num_images, device=intervals.device), repeats=image_token_length
    )

    def vision_cross_attention_mask_mod(b, h, q_idx, kv_idx):
        image_idx = image_boundaries[kv_idx]
        interval = intervals[image_idx]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    return vision_cross_attention_mask_mod


# main(): `intervals = torch.tensor([[0, 7], [1, 7], [7, 12]], dtype=torch.int32, ...)`;
# here text tokens 5 and 6 belong to no image, so their rows are fully masked.
@case(AG + "masks/flamingo.py (generate_vision_cross_attention_mask_mod)", sq=12, skv=9)
def ag_flamingo():
    intervals = torch.tensor([[0, 5], [1, 5], [7, 12]], dtype=torch.int32)
    return {"mask_mod": generate_vision_cross_attention_mask_mod(intervals, 3)}


# AG masks/block_diffusion.py, verbatim:
def generate_block_diffusion_mask(seq_len: int, block_size: int):
    def block_diffusion_mask(b, h, q_idx, kv_idx):
        q_noised = q_idx < seq_len
        kv_noised = kv_idx < seq_len
        q_block = (q_idx % seq_len) // block_size
        kv_block = (kv_idx % seq_len) // block_size
        block_diagonal = (q_block == kv_block) & (q_noised == kv_noised)
        offset_block_causal = (q_block > kv_block) & q_noised & ~kv_noised
        block_causal = (q_block >= kv_block) & ~q_noised & ~kv_noised
        return block_diagonal | offset_block_causal | block_causal

    block_diffusion_mask.__name__ = f"block_diffusion_{seq_len}_{block_size}"
    return block_diffusion_mask


@case(AG + "masks/block_diffusion.py (seq_len=10, block_size=4)", sq=20, skv=20)
def ag_block_diffusion():
    return {"mask_mod": generate_block_diffusion_mask(10, block_size=4)}


# AG masks/global_sliding_window.py, verbatim:
def generate_global_sliding_window(window_size: int, is_global: Tensor):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window_size

    def global_attention(b, h, q_idx, kv_idx):
        return is_global[q_idx] | is_global[kv_idx]

    global_sliding_window_mask = or_masks(sliding_window, global_attention)
    global_sliding_window_mask.__name__ = f"global_sliding_window_{window_size}"
    return global_sliding_window_mask


@case(AG + "masks/global_sliding_window.py (window 3, global tokens 0 and 8)", sq=16, skv=16)
def ag_global_sliding_window():
    is_global = torch.zeros(16, dtype=torch.bool)
    is_global[0] = True
    is_global[8] = True
    return {"mask_mod": generate_global_sliding_window(3, is_global)}


# ============================== AG: score mods =========================================
# AG mods/alibi.py, verbatim:
def generate_alibi_bias(H: int):
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        bias = (kv_idx - q_idx) * scale
        return score + bias

    return alibi_mod


@case(AG + "mods/alibi.py (generate_alibi_bias) with masks/causal.py", q_scale=30.0)
def ag_alibi_causal():
    return {"score_mod": generate_alibi_bias(H_), "mask_mod": causal_mask}


# AG mods/softcapping.py, verbatim except that `_tanh_approx` (a CUDA-only custom op with
# inline PTX, registered at import there) is not copied: approx=False never reaches it.
_tanh_approx = None


def generate_tanh_softcap(soft_cap: int, approx: bool = False):
    tanh = _tanh_approx if approx else torch.tanh

    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * tanh(score / soft_cap)

    prefix = "tanh_softcap_approx" if approx else "tanh_softcap"
    tanh_softcap.__name__ = f"{prefix}_{soft_cap}"
    return tanh_softcap


@case(AG + "mods/softcapping.py (generate_tanh_softcap(30))", q_scale=30.0)
def ag_softcap():
    return {"score_mod": generate_tanh_softcap(30, approx=False)}


# AG mods/activation.py, verbatim:
def generate_activation_score_mod(
    activation: Callable[[Tensor], Tensor] = F.gelu,
    offset: float = 1.0,
):
    def activation_score_mod(score, b, h, q_idx, kv_idx):
        return torch.log(activation(score) + offset)

    return activation_score_mod


@case(AG + "mods/activation.py (generate_activation_score_mod(F.gelu))")
def ag_activation_gelu():
    return {"score_mod": generate_activation_score_mod()}


# AG mods/sandwich.py, verbatim (setup lines included; `device` is "cpu"):
def generate_sandwich_bias(H: int, max_seq_len: int, d_bar: int = 128, device="cpu"):
    freqs = 1.0 / 10000 ** (
        2 * torch.arange(d_bar // 2, device=device, dtype=torch.float32) / d_bar
    )
    padded_len = -(-(2 * max_seq_len - 1) // 8) * 8
    distances = torch.arange(padded_len, device=device, dtype=torch.float32) - (max_seq_len - 1)
    rel_bias = torch.cos(distances.abs()[:, None] * freqs).sum(dim=-1)
    offset = max_seq_len - 1
    head_scale = H / (8.0 * torch.arange(1, H + 1, device=device, dtype=torch.float32))

    def sandwich_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor):
        return score + rel_bias[q_idx - kv_idx + offset] * head_scale[h]

    return sandwich_mod


@case(AG + "mods/sandwich.py (generate_sandwich_bias)")
def ag_sandwich():
    return {"score_mod": generate_sandwich_bias(H_, 21)}


# AG mods/graphormer.py, verbatim (inputs: random path tables instead of Floyd-Warshall's):
def generate_graphormer_edge_bias(
    edge_bias: Tensor, path_edge_types: Tensor, path_lengths: Tensor
):
    max_path_len = path_edge_types.shape[-1]
    position_tables = [edge_bias[:, n] for n in range(max_path_len)]

    def graphormer_edge_bias(score, b, h, q_idx, kv_idx):
        length = path_lengths[b, q_idx, kv_idx]
        total = 0.0
        for n, table in enumerate(position_tables):
            contrib = table[h, path_edge_types[b, q_idx, kv_idx, n]]
            total = total + torch.where(length > n, contrib, 0.0)
        return score + total / torch.clamp(length, min=1)

    return graphormer_edge_bias


@case(AG + "mods/graphormer.py (generate_graphormer_edge_bias)", sq=12, skv=12)
def ag_graphormer_edge_bias():
    g = torch.Generator().manual_seed(3)
    edge_bias = torch.randn(H_, 2, 5, generator=g)  # (H, K, num_edge_types): slices are strided
    path_edge_types = torch.randint(0, 5, (1, 12, 12, 2), generator=g, dtype=torch.int32)
    path_lengths = torch.randint(0, 3, (1, 12, 12), generator=g, dtype=torch.int32)
    return {"score_mod": generate_graphormer_edge_bias(edge_bias, path_edge_types, path_lengths)}


# AG mods/latent_attention.py, verbatim:
def generate_mla_rope_score_mod(
    query_rope: Tensor,
    key_rope: Tensor,
    num_heads: int,
    scale: float = 1.0,
):
    def mla_rope_score_mod(
        score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return score + (
            scale * torch.dot(query_rope[b, h, q_idx], key_rope[b, h // num_heads, kv_idx])
        )

    mla_rope_score_mod.__name__ = f"mla_rope_score_mod_scale_{scale}"
    return mla_rope_score_mod


@case(AG + "mods/latent_attention.py (generate_mla_rope_score_mod)",
      xfail="torch.dot over a captured tensor's last dimension: a mod may only read single "
            "elements of captured tensors; a reduction inside the score would need its own "
            "reduce axis in the program")
def ag_mla_rope():
    query_pe, key_pe = torch.rand(1, H_, 21, 8), torch.rand(1, 1, 21, 8)
    return {"score_mod": generate_mla_rope_score_mod(query_pe, key_pe, num_heads=H_)}

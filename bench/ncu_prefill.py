"""Ours and cuDNN's SDPA on one operator setup of ``neptune_ops`` (prefill or decode: the
name is from its first use), a few launches each, for Nsight Compute
(`ncu -k regex:NAME ... python bench/ncu_prefill.py OP S`): the kernel is built first
(its cold choice times many launches, so run once without ncu to fill the cache)."""
import sys

import torch
import torch.nn.functional as F

import neptune_ops as nb
import neptune_eq as ne


def main():
    op, S = sys.argv[1], int(sys.argv[2])
    out, spec, *_ = nb.build(op, S)
    q, k, v, slopes, args = nb.make_inputs(spec)
    kern = ne.superoptimize(out, target="cuda")
    hq, hkv, sq, skv, off, alibi, softcap, masked, window = spec
    print(f"{op} S={S}: {kern.config}", flush=True)
    for _ in range(3):
        kern(*args)
    torch.cuda.synchronize()
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v, is_causal=masked and sq > 1, enable_gqa=hq > hkv)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""Why decode RMS error depends on where P is taken: a CPU emulation of the rounding.

    python bench/decode_rounding.py [--seeds 6]

A decode kernel rounds P = exp(s − m) to fp16 before the P·V dot; p is exact only where
s = m.  This replays, in torch on CPU, three ways to walk the keys of one query row
(H=32 heads, D=128, q, k, v ~ N(0, 1) in fp16) and prints the RMS error against fp64:
  running      one running max per row (FlashAttention's update),
  flex         8 splits of running max, combined in fp32 (FlashDecoding / Flex decoding),
  block-local  each key block's P at the block's own max, re-based by exp(m_blk − m)
               (neptune_eq's decode kernels, ``TilePlan.block_rebase``), at 64 and 128 keys.
"""
import argparse
import math

import torch


def emulate(S: int, seed: int, H: int = 32, D: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, 1, D, generator=g).half()
    k = torch.randn(H, S, D, generator=g).half()
    v = torch.randn(H, S, D, generator=g).half()
    s64 = (q.double() @ k.double().transpose(1, 2)) / math.sqrt(D)
    ref = torch.softmax(s64, -1) @ v.double()
    s2 = (q.float() @ k.float().transpose(1, 2)) / math.sqrt(D) / math.log(2)  # exp2 domain

    def fold(lo, hi, bn, local):
        m = torch.full((H, 1, 1), -math.inf)
        l, acc = torch.zeros(H, 1, 1), torch.zeros(H, 1, D)
        for b in range(lo, hi, bn):
            sb, vb = s2[..., b:min(hi, b + bn)], v[:, b:min(hi, b + bn)].float()
            mb = sb.amax(-1, keepdim=True)
            mn = torch.maximum(m, mb)
            at = mb if local else mn
            p, beta, alpha = torch.exp2(sb - at), torch.exp2(at - mn), torch.exp2(m - mn)
            acc = acc * alpha + beta * (p.half().float() @ vb)
            l = l * alpha + beta * p.sum(-1, keepdim=True)
            m = mn
        return m, l, acc

    def run(splits, bn, local=False):
        ch = -(-S // splits)
        parts = [fold(i, min(S, i + ch), bn, local) for i in range(0, S, ch)]
        M = torch.stack([p[0] for p in parts]).amax(0)
        L = sum(p[1] * torch.exp2(p[0] - M) for p in parts)
        A = sum(p[2] * torch.exp2(p[0] - M) for p in parts)
        return (A / L).half()

    outs = {"running (128-key blocks)": run(1, 128), "flex (8 splits, 64-key blocks)": run(8, 64),
            "block-local 128": run(1, 128, True), "block-local 64": run(1, 64, True)}
    return {n: (o.double() - ref).pow(2).mean().sqrt().item() for n, o in outs.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 2048])
    a = ap.parse_args()
    for S in a.seqs:
        errs: dict[str, list[float]] = {}
        for seed in range(a.seeds):
            for n, e in emulate(S, seed).items():
                errs.setdefault(n, []).append(e)
        print(f"S={S}: " + ", ".join(f"{n} {sum(v) / len(v):.3e}" for n, v in errs.items()))


if __name__ == "__main__":
    main()

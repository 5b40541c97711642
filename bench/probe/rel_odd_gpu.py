"""Which launch of a relative-table step fails at odd, unequal lengths on the GPU.

    CUDA_LAUNCH_BLOCKING=1 python bench/probe/rel_odd_gpu.py [--L 300 --S 517]

Runs the forward, then the q/k/v gradients with the table detached, then the table's
gradient, synchronising after each, and prints which one raised (with its traceback)."""
from __future__ import annotations

import argparse
import traceback

import torch

import neptune_eq as ne


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=300)
    ap.add_argument("--S", type=int, default=517)
    a = ap.parse_args()
    L, S = a.L, a.S
    torch.manual_seed(0)
    q = torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 4, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    rel = torch.randn(2 * max(L, S), device="cuda", requires_grad=True)
    steps = {
        "forward": lambda: ne.flex_attention(q, k, v, lambda s, b, h, i, j: s + rel[i - j + S]),
        "q/k/v grads, table detached": lambda: torch.autograd.grad(ne.flex_attention(
            q, k, v, lambda s, b, h, i, j: s + rel.detach()[i - j + S]).sum(), (q, k, v)),
        "table grad": lambda: torch.autograd.grad(ne.flex_attention(
            q, k, v, lambda s, b, h, i, j: s + rel[i - j + S]).sum(), (rel,)),
    }
    for name, step in steps.items():
        try:
            step()
            torch.cuda.synchronize()
            print(f"{name}: ok", flush=True)
        except Exception:  # noqa: BLE001 - the point is to say which
            print(f"{name}: RAISED", flush=True)
            traceback.print_exc()
            return


if __name__ == "__main__":
    main()

"""Probe (session 28): one Gluon prefill kernel launched a few times, for Nsight Compute.

The kernel is built as ``causal_overhead.py`` builds it (the product's plan, the Gluon
form at 128-key blocks and a 2-deep ring, launched directly), so ``ncu`` can compare a
causal launch with its global twin at the same shape: where the causal tiles' extra time
goes (issue 16: at head dim 64 the Gluon causal form runs 0.84x its global twin's
TFLOP/s, cuDNN's causal 1.05x its own global).

    ncu --clock-control none --kernel-name regex:neptune --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python bench/gluon_probe/tile_profile.py causal 0
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

import causal_overhead as co  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig  # noqa: E402


def main():
    variant, shape = sys.argv[1], int(sys.argv[2])
    b, h, s, d, kv = co.SHAPES[shape]
    cfg = TileConfig({"B_i": 128, "B_L": 128}, 4, 2, gluon_ws=True)
    la = co.launcher(variant, b, h, s, d, kv, cfg)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, kv or h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q)}
    for _ in range(6):
        la(t)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""Issue #2 check on the GPU: generated attention vs PyTorch SDPA, same process.

    python bench/skeleton_attention.py [--out bench/results]

Builds *plain* attention (B=1, H=32, S=4096, D=128, fp16) in the DSL, superoptimizes it
(the rolling-update rules derive the single-pass form), checks it against SDPA and an
fp32 reference, then times both with triton.testing.do_bench (median) and reports
TFLOP/s = 4·B·H·S·S·D / t and the ratio.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import neptune_eq as ne
from neptune_eq.frontend import examples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seq", type=int, default=4096)
    a = ap.parse_args()
    B, H, S, D = 1, 32, a.seq, 128
    t0 = time.perf_counter()
    kern = ne.superoptimize(examples.attention(B, H, S, S, D, "float16"), target="cuda")
    t_opt = time.perf_counter() - t0
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    ours = kern(q, k, v)
    sdpa = F.scaled_dot_product_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err_ours = (ours.float() - ref).abs().max().item()
    err_sdpa = (sdpa.float() - ref).abs().max().item()
    assert torch.isfinite(ours).all(), "non-finite output"
    assert err_ours <= max(4 * err_sdpa, 2e-3), (err_ours, err_sdpa)
    flops = 4 * B * H * S * S * D
    ms_ours = do_bench(lambda: kern(q, k, v), warmup=50, rep=300, return_mode="median")
    ms_sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v), warmup=50, rep=300,
                       return_mode="median")
    res = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "shape": [B, H, S, D], "dtype": "float16",
        "superoptimize_s": round(t_opt, 2), "config": str(kern.config),
        "tile_configs": [(str(c), ms, s) for c, ms, s in kern.timings],
        "max_abs_err_vs_fp32": {"neptune_eq": err_ours, "sdpa": err_sdpa},
        "ms": {"neptune_eq": ms_ours, "sdpa": ms_sdpa},
        "tflops": {"neptune_eq": flops / ms_ours / 1e9, "sdpa": flops / ms_sdpa / 1e9},
        "ratio_vs_sdpa": ms_sdpa / ms_ours,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "skeleton_attention.json").write_text(json.dumps(res, indent=2))
    (out / "skeleton_attention.source.py").write_text(kern.source)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

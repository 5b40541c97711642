"""End to end: neptune_eq's own choice for global attention B=1 H=32 S=8192 D=128 fp16,
with warp-specialised configs off and on (``NEPTUNE_EQ_WARP_SPECIALIZE``), each checked
against SDPA and timed against it in the same process.

    python bench/ws_probe/e2e.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import neptune_eq as ne


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws_probe"))
    a = ap.parse_args()
    b, h, s, d = 1, 32, 8192, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g).half() for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v)
    flops = 4 * b * h * s * s * d
    sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v))
    rows = [{"what": "SDPA", "ms": sdpa, "tflops": flops / sdpa / 1e9}]
    print(f"SDPA {sdpa:.3f} ms {flops / sdpa / 1e9:.1f} TFLOP/s", flush=True)
    for ws in ("0", "1"):
        os.environ["NEPTUNE_EQ_WARP_SPECIALIZE"] = ws
        t0 = time.perf_counter()
        kern = ne.superoptimize(ne.attention(b, h, s, s, d, "float16"), target="cuda", cache=False)
        cold = time.perf_counter() - t0
        o = kern(q, k, v)
        err = (o.float() - ref.float()).abs().max().item()
        ms = do_bench(lambda: kern(q, k, v))
        row = {"what": f"neptune_eq WS={ws}", "config": str(kern.config), "ms": ms,
               "tflops": flops / ms / 1e9, "vs_sdpa": sdpa / ms, "max_err_vs_sdpa": err,
               "cold_s": round(cold, 1),
               "timings": [str(t) for t in getattr(kern, "timings", [])][:24]}
        rows.append(row)
        print(f"WS={ws}: chosen [{kern.config}] {ms:.3f} ms {row['tflops']:.1f} TFLOP/s "
              f"{row['vs_sdpa']:.3f}x SDPA, max err vs SDPA {err:.2e}, cold {cold:.1f}s", flush=True)
        for t in row["timings"]:
            print("   ", t, flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "e2e.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""GPU check and timing of the Gluon kernels emitted from neptune_eq plans (from_plan.py).
`python bench/gluon_probe/run_from_plan.py --out DIR` writes DIR/from_plan.json: for each
variant, the max error against an fp32 torch reference on several shapes (an odd length,
large-magnitude scores) and TFLOP/s at the timing shape beside cuDNN SDPA where it runs
and the hand-written probe (fa_hopper.py)."""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fa_hopper  # noqa: E402
import plan_kernels as pk  # noqa: E402

MODS = {  # the same variants in torch, for the reference
    "global": (None, None),
    "causal": (None, lambda q, kv: q >= kv),
    "alibi": (lambda s, h, q, kv: s + (kv - q) * (h + 1) * -0.0625, None),
    "softcap": (lambda s, h, q, kv: 30.0 * torch.tanh(s / 30.0), lambda q, kv: q >= kv),
    "window": (None, lambda q, kv: (q >= kv) & (q - kv < 256)),
}


def reference(variant, q, k, v):
    score_mod, mask_mod = MODS[variant]
    b, h, s, d = q.shape
    out = torch.empty_like(q, dtype=torch.float32)
    qi = torch.arange(s, device=q.device)[:, None]
    kj = torch.arange(s, device=q.device)[None, :]
    for hh in range(h):  # one head at a time: S² fp32 per head
        sc = q[:, hh].float() @ k[:, hh].float().transpose(-1, -2) / math.sqrt(d)
        if score_mod:
            sc = score_mod(sc, hh, qi, kj)
        if mask_mod:
            sc = sc.masked_fill(~mask_mod(qi, kj), float("-inf"))
        out[:, hh] = torch.softmax(sc, -1) @ v[:, hh].float()
    return out


def flops(variant, b, h, s, d):
    dense = 4 * b * h * s * s * d
    if variant in ("causal", "softcap"):
        return dense / 2
    if variant == "window":
        return 4 * b * h * s * min(256, s) * d
    return dense


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--variants", default="global,causal,alibi,softcap,window")
    ap.add_argument("--timing-shape", default="1,32,8192,128")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    tb, th, ts, td = map(int, args.timing_shape.split(","))
    for variant in args.variants.split(","):
        for (b, h, s, d, dt, big) in [(1, 2, 1000, 128, "float16", False),
                                      (2, 2, 777, 128, "bfloat16", True),
                                      (tb, th, ts, td, "float16", False)]:
            row = {"variant": variant, "B": b, "H": h, "S": s, "D": d, "dtype": dt,
                   "large_scores": big}
            try:
                t0 = time.time()
                prog, mod, _ = pk.module(variant, b, h, s, d, dt)
                row["derive_emit_s"] = time.time() - t0
                dtype = getattr(torch, dt)
                torch.manual_seed(0)
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
                if big:
                    q = q * 8
                o = torch.empty_like(q)
                tensors = {"q": q, "k": k, "v": v, "o": o}
                pk.launch(mod, prog, tensors, 128 if d == 128 else 64)
                torch.cuda.synchronize()
                if h <= 2:
                    ref = reference(variant, q, k, v)
                    row["max_err"] = (o.float() - ref).abs().max().item()
                    row["nan"] = bool(torch.isnan(o).any())
                if s == ts:
                    ms = triton.testing.do_bench(lambda: pk.launch(mod, prog, tensors, 128),
                                                 warmup=50, rep=300)
                    row["ms"], row["tflops"] = ms, flops(variant, b, h, s, d) / ms / 1e9
                    if variant in ("global", "causal"):
                        from torch.nn.attention import SDPBackend, sdpa_kernel
                        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                            ms_c = triton.testing.do_bench(
                                lambda: F.scaled_dot_product_attention(
                                    q, k, v, is_causal=variant == "causal"), warmup=50, rep=300)
                        row["cudnn_tflops"] = flops(variant, b, h, s, d) / ms_c / 1e9
                        ms_h = triton.testing.do_bench(
                            lambda: fa_hopper.attention(q, k, v, variant == "causal", 128, 2, True),
                            warmup=50, rep=300)
                        row["hand_tflops"] = flops(variant, b, h, s, d) / ms_h / 1e9
                        ref = F.scaled_dot_product_attention(q, k, v, is_causal=variant == "causal")
                        row["max_diff_vs_sdpa"] = (o.float() - ref.float()).abs().max().item()
            except Exception as e:  # recorded, the next case still runs
                row["error"] = repr(e)[-600:]
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "from_plan.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

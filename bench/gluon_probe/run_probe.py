"""Check and time the hand-written Gluon forward (fa_hopper.py) beside cuDNN and
FlashAttention-2 SDPA in one process.  `python bench/gluon_probe/run_probe.py --out DIR`
writes DIR/gluon_probe.json (one row per kernel and shape) and prints a table.
GPU only (Hopper)."""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fa_hopper  # noqa: E402


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def tflops(b, h, s, d, causal, ms):
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    return flops / ms / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default="1,32,8192,128;2,16,8192,128;2,16,2048,128;4,32,4096,64;1,32,16384,128")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--configs", default="128:2:0:1,128:2:1:1,128:3:0:1,128:3:1:1,128:2:0:0,128:2:1:0,64:2:0:1")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend
    peers = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash2": sdpa(SDPBackend.FLASH_ATTENTION)}
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for shape in args.shapes.split(";"):
        b, h, s, d = map(int, shape.split(","))
        for dt in args.dtypes.split(","):
            dtype = getattr(torch, dt)
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
            for causal in (False, True):
                ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                     is_causal=causal)
                base = {"B": b, "H": h, "S": s, "D": d, "dtype": dt, "causal": causal}
                for name, fn in peers.items():
                    try:
                        err = (fn(q, k, v, causal).float() - ref).abs().max().item()
                        ms = triton.testing.do_bench(lambda: fn(q, k, v, causal), warmup=50, rep=300)
                        rows.append(dict(base, kernel=name, ms=ms, tflops=tflops(b, h, s, d, causal, ms), err=err))
                    except Exception as e:  # a peer that does not run here is recorded, not fatal
                        rows.append(dict(base, kernel=name, error=repr(e)[:200]))
                for cfg in args.configs.split(","):
                    bn, st, pp, ov = map(int, cfg.split(":"))
                    name = f"gluon_ws bn{bn} st{st}{' pingpong' if pp else ''}{'' if ov else ' no-overlap'}"
                    try:
                        t0 = time.time()
                        out = fa_hopper.attention(q, k, v, causal, bn, st, bool(pp), bool(ov))
                        torch.cuda.synchronize()
                        build_s = time.time() - t0
                        err = (out.float() - ref).abs().max().item()
                        again = fa_hopper.attention(q, k, v, causal, bn, st, bool(pp), bool(ov))
                        same = bool(torch.equal(out, again))
                        ms = triton.testing.do_bench(
                            lambda: fa_hopper.attention(q, k, v, causal, bn, st, bool(pp), bool(ov)),
                            warmup=50, rep=300)
                        rows.append(dict(base, kernel=name, ms=ms, tflops=tflops(b, h, s, d, causal, ms),
                                         err=err, repeatable=same, build_s=build_s))
                    except Exception as e:
                        rows.append(dict(base, kernel=name, error=repr(e)[:300]))
                for r in rows[-(2 + len(args.configs.split(","))):]:
                    print(json.dumps(r), flush=True)
    with open(os.path.join(args.out, "gluon_probe.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

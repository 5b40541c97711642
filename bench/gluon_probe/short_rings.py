"""Probe (session 35): deeper K/V rings for short key ranges (issue 16: GQA 64/8 prefill at
S=512 runs at 0.81x SDPA with inputs from DRAM, its own speed with L2 warm).

A tile of S=512 has 4 key blocks of 128 (8 of 64); the producer keeps at most ``ring``
blocks in flight, so the first blocks' DRAM latency is paid with few loads outstanding.
Here the Gluon form of the product's plan runs at every key block x ring depth that fits
in shared memory, timed with ``do_bench`` (L2 flushed before each call, as a model's
layer meets its inputs) and CUDA-graph replays (L2 warm), beside SDPA on the same inputs.

    python bench/gluon_probe/short_rings.py --out DIR
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import gluon_validate as gv  # noqa: E402
from neptune_eq.lowering import gluon_form  # noqa: E402

SHAPES = ((1, 64, 512, 128, 8), (1, 32, 512, 128, None), (1, 64, 1024, 128, 8))


def rows_for(b, h, s, d, kv):
    prog, ks = gv.derive("global", b, h, s, d, "float16", kv)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, kv or h, s, d, device="cuda", dtype=torch.float16) for _ in range(2))
    fl = gv.flops("global", b, h, s, d)
    base = {"B": b, "H": h, "S": s, "D": d, "kv": kv}
    out = []

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=kv is not None)
    ref = sdpa()
    ms = triton.testing.do_bench(sdpa, warmup=25, rep=200)
    g = triton.testing.do_bench_cudagraph(sdpa, rep=200)
    out.append({**base, "kernel": "sdpa", "tflops_flushed": fl / ms / 1e9, "tflops_graph": fl / g / 1e9})
    print(json.dumps(out[-1]), flush=True)
    for kb in (128, 64):
        for ring in (2, 3, 4, 5, 6):
            if ks.gluon.ring_bytes(kb, ring) > gluon_form.SMEM_BYTES:
                continue
            row = {**base, "kernel": f"gluon keys{kb} ring{ring}"}
            try:
                la = gv.gluon_launcher(prog, ks, kb, ring)
                t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q)}
                la(t)
                torch.cuda.synchronize()
                row["max_diff_vs_sdpa"] = (t["o"].float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(lambda: la(t), warmup=25, rep=200)
                g = triton.testing.do_bench_cudagraph(lambda: la(t), rep=200)
                row.update(tflops_flushed=fl / ms / 1e9, tflops_graph=fl / g / 1e9)
            except Exception as e:  # noqa: BLE001 - a probe row, never the whole run
                row["error"] = repr(e)[-300:]
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    rows = []
    for sh in SHAPES:
        rows += rows_for(*sh)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "short_rings.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

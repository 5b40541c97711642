"""float32 attention under torch's float32 matmul precision, beside torch's own kernels.

``ne.flex_attention`` on float32 inputs builds its kernel for
``torch.get_float32_matmul_precision()``: exact fp32 products under "highest", TF32 tensor
cores under "high" -- as torch's compiled flex_attention and its matmuls do.  For each
setting this times, in one process, ours against compiled FlexAttention and SDPA (median
of ``do_bench``), and reports each one's error against an fp64 reference.

    python bench/fp32_precision_gpu.py [--S 2048] [--out bench/results/fp32_precision.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402

B, H, D = 2, 16, 64


def causal(b, h, q, kv):
    return q >= kv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--S", type=int, default=2048)
    ap.add_argument("--out", default="bench/results/fp32_precision.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp32_precision_gpu needs a CUDA GPU.", file=sys.stderr)
        return 2
    S = a.S
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    bm = create_block_mask(causal, None, None, S, S, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    flops = 4 * B * H * S * S * D / 2
    rows = []
    for setting in ("highest", "high"):
        torch.set_float32_matmul_precision(setting)
        torch._dynamo.reset()
        runs = {"neptune_eq": lambda: ne.flex_attention(q, k, v, mask_mod=causal),
                "flex": lambda: flex(q, k, v, block_mask=bm),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
        row = {"setting": setting, "S": S}
        for name, fn in runs.items():
            out = fn()
            row[f"{name}_err"] = (out.double() - want).abs().max().item()
            ms = do_bench(fn)
            row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / ms / 1e9
        row["vs_best_peer"] = min(row["flex_ms"], row["sdpa_ms"]) / row["neptune_eq_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, B=B, H=H, D=D,
                mask="causal", dtype="float32")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Captured tables longer than the call's sizes, on the GPU (session 43's drop-in fix).

A table read at kv_idx (or q_idx, or b) whose dim is longer than the call's size runs on
its first entries, as torch reads it: eagerly, under torch.compile(dynamic=True), and with
its gradient.  Each case runs at the length its structure was traced at, then at shorter
ones, and is compared with torch's flex_attention (eager, fp32 math on the same inputs).

    python bench/probe/captured_tables_gpu.py [--grad-only] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention as torch_flex

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import neptune_eq as ne  # noqa: E402

H, D = 4, 64


def cases(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    n = 1024
    doc_q = torch.sort(torch.randint(0, 5, (n,), device=dev, generator=g)).values
    doc_kv = torch.sort(torch.randint(0, 5, (n,), device=dev, generator=g)).values
    bias = torch.randn(n, device=dev, generator=g)
    head_bias = torch.randn(H, n, device=dev, generator=g)
    prefix = torch.tensor([100, 300, 50, 700], device=dev)
    return {
        "cross-documents": dict(mask_mod=lambda b, h, q, kv: doc_q[q] == doc_kv[kv]),
        "key-bias": dict(score_mod=lambda s, b, h, q, kv: s + bias[kv]),
        "head-key-bias": dict(score_mod=lambda s, b, h, q, kv: s + head_bias[h, kv]),
        "per-sample-prefix": dict(mask_mod=lambda b, h, q, kv: (kv <= prefix[b]) | (q >= kv)),
    }, bias


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/captured_tables_gpu.json")
    ap.add_argument("--grad-only", action="store_true", help="only the gradient cases")
    a = ap.parse_args()
    dev = "cuda"
    table, bias = cases(dev)
    rows, bad = [], 0
    for mode in () if a.grad_only else ("eager", "compile"):
        for name, kw in table.items():
            fn = lambda q, k, v, kw=kw: ne.flex_attention(q, k, v, **kw)  # noqa: E731
            if mode == "compile":
                torch._dynamo.reset()
                fn = torch.compile(fn, fullgraph=True, dynamic=True)
            for b, lq, s in ((4, 1024, 1024), (2, 333, 777), (3, 1000, 129)):
                q, k, v = (torch.randn(b, H, n, D, device=dev, dtype=torch.float16)
                           for n in (lq, s, s))
                bm = (create_block_mask(kw["mask_mod"], b, H, lq, s, device=dev)
                      if "mask_mod" in kw else None)
                want = torch_flex(q.float(), k.float(), v.float(), score_mod=kw.get("score_mod"),
                                  block_mask=bm)
                try:
                    got = fn(q, k, v)
                    err = (got.float() - want).abs().max().item()
                    ok = err < 1e-2
                except Exception as e:  # noqa: BLE001 - recorded
                    err, ok = f"{type(e).__name__}: {str(e)[:200]}", False
                bad += not ok
                rows.append(dict(mode=mode, case=name, B=b, L=lq, S=s, err=err, ok=ok))
                print(json.dumps(rows[-1]), flush=True)
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps(dict(rows=rows), indent=1))
    # the gradient of a longer table: zero past S, equal to torch's before it
    bias.requires_grad_(True)
    sm = table["key-bias"]["score_mod"]
    for dtype in (torch.float16, torch.float32):
        q, k, v = (torch.randn(2, H, n, D, device=dev, dtype=dtype) for n in (300, 700, 700))
        grad = dict(case=f"key-bias gradient {dtype}")
        try:
            (g_ours,) = torch.autograd.grad(ne.flex_attention(q, k, v, score_mod=sm).sum(), bias)
            (g_torch,) = torch.autograd.grad(torch_flex(q.float(), k.float(), v.float(),
                                                        score_mod=sm).sum(), bias)
            grad.update(err=(g_ours - g_torch).abs().max().item(),
                        zero_past_S=bool((g_ours[700:] == 0).all()))
            grad["ok"] = grad["err"] < 5e-2 * max(1.0, g_torch.abs().max().item()) \
                and grad["zero_past_S"]
        except Exception as e:  # noqa: BLE001 - recorded
            grad.update(err=f"{type(e).__name__}: {str(e)[:400]}", ok=False)
        bad += not grad["ok"]
        rows.append(grad)
        print(json.dumps(grad), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                           torch=torch.__version__, rows=rows), indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

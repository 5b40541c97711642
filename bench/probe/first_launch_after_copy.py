"""A call whose first launch is dependent (``NEPTUNE_EQ_PDL_FIRST``) right after a copy
that is not a kernel (``cudaMemcpyAsync`` device to device: torch's ``copy_`` of a
contiguous tensor), as a model writes its KV cache before attention -- eager and captured
in a CUDA graph.  Checks the output against torch each time: the dependent launch must
still see the copy's data.

    python bench/probe/first_launch_after_copy.py
Prints one JSON line per case.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import neptune_eq as ne  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def decode_case(S: int = 2048) -> dict:
    out = ne.attention(1, 64, 1, S, 128, "float16", kv_heads=8)
    kern = ne.superoptimize(out, target="cuda", top_k=2)
    q = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.zeros(1, 8, S, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    news = [(torch.randn_like(k), torch.randn_like(v)) for _ in range(3)]

    def step(kn, vn):
        k.copy_(kn)  # a D2D memcpy, not a kernel, right before the call
        v.copy_(vn)
        return kern(q, k, v)
    errs = []
    for kn, vn in news:  # eager
        got = step(kn, vn)
        ref = F.scaled_dot_product_attention(q, kn, vn, enable_gqa=True)
        errs.append((got.float() - ref.float()).abs().max().item())
    step(*news[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    kin, vin = torch.empty_like(k), torch.empty_like(v)
    with torch.cuda.graph(g):
        res = step(kin, vin)
    graphed = []
    for kn, vn in news:
        kin.copy_(kn)
        vin.copy_(vn)
        g.replay()
        ref = F.scaled_dot_product_attention(q, kn, vn, enable_gqa=True)
        graphed.append((res.float() - ref.float()).abs().max().item())
    return {"case": f"gqa decode S={S}", "config": str(kern.config),
            "eager_max_err": max(errs), "graphed_max_err": max(graphed)}


def doc_case(S: int = 4096) -> dict:
    doc = torch.repeat_interleave(torch.arange(8, device="cuda", dtype=torch.int32), S // 8)
    ids = torch.empty_like(doc)

    def mask(b, h, i, j):
        return (ids[i] == ids[j]) & (j <= i)
    q, k, v = (torch.randn(1, 16, S, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    ids.copy_(doc)
    ne.flex_attention(q, k, v, mask_mod=mask)
    errs, graphed = [], []
    perms = [torch.roll(doc, s) for s in (0, 100, 1000)]  # the ids change per call
    vis = lambda d: (d[:, None] == d[None, :]) & torch.ones(S, S, dtype=torch.bool, device="cuda").tril()  # noqa: E731
    for d in perms:
        ids.copy_(d)  # a memcpy right before the call (its pre-pass reads ids)
        got = ne.flex_attention(q, k, v, mask_mod=mask)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=vis(d))
        errs.append((got.float() - ref.float()).abs().max().item())
    src = torch.empty_like(doc)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ids.copy_(src)
        res = ne.flex_attention(q, k, v, mask_mod=mask)
    for d in perms:
        src.copy_(d)
        g.replay()
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=vis(d))
        graphed.append((res.float() - ref.float()).abs().max().item())
    return {"case": f"document mask S={S}", "eager_max_err": max(errs),
            "graphed_max_err": max(graphed)}


if __name__ == "__main__":
    for case in (decode_case, doc_case):
        try:
            print(json.dumps(case()), flush=True)
        except Exception as e:  # noqa: BLE001 - a case that fails is reported
            print(json.dumps({"case": case.__name__, "error": f"{type(e).__name__}: {e}"}),
                  flush=True)

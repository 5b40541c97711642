"""Probe (session 50): replayed calls (``BoundCall`` / ``GluonBoundCall``) stay right.

    python bench/probe/replay_check_gpu.py [--out FILE]

A call at a signature met before is replayed: outputs from ``OutputMaker``, pointers
passed to the launcher as ints (session 50).  Here each setup is called four times on
fresh inputs -- the first call binds, the rest replay -- and every output is compared
with a reference on the same inputs: document and jagged masks through
``ne.flex_attention`` (the Gluon form with its pre-pass) against Flex with a prebuilt
BlockMask, causal prefill and GQA decode through ``ne.attention`` against SDPA; GQA decode
also captured in a CUDA graph and replayed over fresh inputs.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
import doc_mask_gpu as dm  # noqa: E402


def check(name, ours, ref, shapes, dtype, calls=4):
    errs = []
    for c in range(calls):
        torch.manual_seed(100 + c)
        args = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
        got, want = ours(*args), ref(*args)
        errs.append((got.float() - want.float()).abs().max().item())
    row = {"setup": name, "max_err_per_call": errs, "ok": max(errs) < 2e-2}
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    flex = torch.compile(flex_attention, dynamic=False)
    S = 4096
    for case in ("doc13", "jagged"):
        mask, B, _ = dm.case(case, S)
        bm = create_block_mask(mask, B, None, S, S, device="cuda")
        shapes = [(B, dm.H, S, dm.D)] * 3
        rows.append(check(f"{case} S={S} fp16", lambda q, k, v: ne.flex_attention(q, k, v, mask_mod=mask),
                          lambda q, k, v: flex(q, k, v, block_mask=bm), shapes, torch.float16))
    causal = ne.superoptimize(ne.attention(1, 16, 2000, 2000, 128, "bfloat16",
                                           mask_mod=lambda b, h, i, j: j <= i), target="cuda")
    rows.append(check("causal prefill S=2000 bf16 " + str(causal.config), causal,
                      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      [(1, 16, 2000, 128)] * 3, torch.bfloat16))
    gqa = ne.superoptimize(ne.attention(1, 64, 1, 2048, 128, "float16", kv_heads=8), target="cuda")
    rows.append(check("gqa decode S=2048 fp16 " + str(gqa.config), gqa,
                      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                      [(1, 64, 1, 128), (1, 8, 2048, 128), (1, 8, 2048, 128)], torch.float16))
    shapes = [(1, 64, 1, 128), (1, 8, 2048, 128), (1, 8, 2048, 128)]
    rows.append(graphed("gqa decode S=2048 fp16, replay captured in a CUDA graph", gqa, shapes,
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


def graphed(name, ours, shapes, ref, dtype=torch.float16, replays=4, between=None):
    """``ours`` bound and replayed, then captured in a CUDA graph (a split-k combine
    launched dependent on its partials there too, since session 52) and the graph replayed
    over fresh inputs copied into its buffers: each replay against ``ref`` on those
    inputs, as are the eager calls before the capture.  ``between(c)``: also run before
    replay ``c`` (new documents in a captured id tensor)."""
    static = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
    errs = []
    for _ in range(3):  # bind, then replay (the path a capture takes)
        errs.append((ours(*static).float() - ref(*static).float()).abs().max().item())
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ours(*static)
    for c in range(replays):
        torch.manual_seed(200 + c)
        for t, s in zip(static, shapes):
            t.copy_(torch.randn(s, device="cuda", dtype=dtype))
        if between is not None:
            between(c)
        g.replay()
        want = ref(*static)
        errs.append((out.float() - want.float()).abs().max().item())
    row = {"setup": name, "max_err_per_call_then_replay": errs, "ok": max(errs) < 2e-2}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()

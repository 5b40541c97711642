"""Probe (session 52): a decode whose mask reads a tensor -- its pre-pass, then the chosen
(split-k where chosen) launches, each released first thing by the one before -- eager and
captured in a CUDA graph, documents changed between replays, against SDPA with the mask
as a boolean tensor (``replay_check_gpu.graphed``).

    python bench/probe/doc_decode_check.py [--S 8192] [--out FILE]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import neptune_eq as ne  # noqa: E402
import doc_mask_gpu as dm  # noqa: E402
from replay_check_gpu import graphed  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="*", default=[8192])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for S in a.S:
        ids = dm.doc_ids(S, 13)[0]
        doc = ne.placeholder((S,), "int32", "doc")
        t0 = time.perf_counter()
        dd = ne.superoptimize(ne.attention(1, 64, 1, S, 128, "float16", kv_heads=8,
                                           mask_mod=lambda b, h, i, j, S=S: doc[i + S - 1] == doc[j]),
                              target="cuda")
        cold = time.perf_counter() - t0
        row = graphed(f"doc-mask gqa decode S={S} fp16 {dd.config}", lambda q, k, v: dd(q, k, v, ids),
                      [(1, 64, 1, 128), (1, 8, S, 128), (1, 8, S, 128)],
                      lambda q, k, v: F.scaled_dot_product_attention(
                          q, k, v, attn_mask=(ids[S - 1] == ids)[None, None, None, :],
                          enable_gqa=True),
                      between=lambda c: ids.copy_(dm.doc_ids(S, 13, seed=c + 1)[0]))
        rows.append({**row, "cold_s": round(cold, 1), "split_k": bool(dd.kernel_source.split_extent),
                     "prepass": bool(dd.kernel_source.prepass)})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

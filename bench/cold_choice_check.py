"""One cold choice of ne.flex_attention (plain, bf16, B=2 H=16 D=128), checked against SDPA.

    NEPTUNE_EQ_CACHE=$(mktemp -d) python bench/cold_choice_check.py default|side [S]

Prints one ``RESULT`` JSON line: the max error, or the error raised.  A fresh
``NEPTUNE_EQ_CACHE`` per process makes the call time its tile configs (a cache hit times
nothing).  ``side``: the first call made on a side stream.  Session 13 (H200): with
warp-specialised configs timed (``NEPTUNE_EQ_WARP_SPECIALIZE=1``) 3 of 3 processes
faulted with an illegal memory access; without them 3 of 3 were right.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.getcwd())
import neptune_eq as ne  # noqa: E402


def main():
    mode = sys.argv[1]
    S = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    q, k, v = (torch.randn(2, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    res = {"mode": mode, "S": S, "tma": os.environ.get("NEPTUNE_EQ_TMA", "1")}
    try:
        if mode == "side":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                o = ne.flex_attention(q, k, v)
        else:
            o = ne.flex_attention(q, k, v)
        torch.cuda.synchronize()
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        res["err"] = (o.float() - ref.float()).abs().max().item()
    except Exception as e:  # noqa: BLE001 - the fault is the result
        res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        traceback.print_exc()
    print("RESULT", json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

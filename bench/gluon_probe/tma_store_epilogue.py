"""Probe (session 45): the Gluon form's epilogue through shared memory and a TMA store.

``tile_timeline.py`` (first run on an H200, session 45, ``bench/results/s45/``) put the
per-tile fixed cost at 1-2.7 us, not the 3-6 us of session 28's fit, and the largest part
of it in the epilogue: 2.4 us of a 61 us tile at causal D=128 S=8192, 1.6 of 9 us at GQA
64/8 S=512 (18% of the program's time), 1.3 of 12 us on 13 documents.  The generated
epilogue stores the output from the wgmma accumulator's registers with pointer stores:
two 16-bit elements per thread per store (``STG.E``, 32 a thread at D=128, each warp's
store touching 8 rows at half a sector each; offline SASS, Triton 3.6).  FlashAttention-3
writes the tile to shared memory and lets the TMA engine store it while the warpgroup
goes on to its next tile.

Its first run (session 45, at commit 5af5d89 -- bench/results/s45/tma_store_epilogue_h200.json)
patched session 44's generated form that way.  The lowering now emits it
(``lowering/gluon_epilogue.py``, switch ``gluon_epilogue.TMA_STORE``), so this probe is
the product's A/B: each case's form generated with the switch off and on, launched as the
product launches it, outputs checked identical, then timed side by side under CUDA
graphs, alternating.

    python bench/gluon_probe/tma_store_epilogue.py [--cases ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import tile_timeline as tt  # noqa: E402  (its cases and builders)
import torch  # noqa: E402

from neptune_eq.lowering import gluon_epilogue  # noqa: E402
from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402

CASES = ["causal-d128-8192", "gqa-512", "doc13-8192", "doc13-8192-dynamic", "causal-d64",
         "global-d64", "causal-d128-8192-ring3", "gqa16-3000-causal"]
tt.CASES.update({  # (tile_timeline's fields) a ring with no room for the buffers; off-grid GQA
    "causal-d128-8192-ring3": ("causal", 1, 32, 8192, 128, None, "float16", 128, 3, {}),
    "gqa16-3000-causal": ("causal", 1, 16, 3000, 128, 8, "bfloat16", 128, 2, {})})


def _launcher(case: str, tma_store: bool):
    """The case's product launcher with the output by TMA or by pointer stores."""
    gluon_epilogue.TMA_STORE = tma_store
    try:
        prog, ks, cfg, captured = tt.build(case)
    finally:
        gluon_epilogue.TMA_STORE = True
    if bool(ks.gluon.o_store) != tma_store:
        raise SystemExit(f"{case}: the switch did not give the form it names")
    return prog, cfg, captured, make_launcher(prog, ks, "cuda", cfg)


def measure(case: str) -> dict:
    import triton
    prog, cfg, captured, off = _launcher(case, False)
    on = _launcher(case, True)[3]
    tensors = tt._tensors(prog, tt.CASES[case][6], captured)
    (oname,) = prog.outputs
    o = tensors[oname]
    row = {"case": case, "config": str(cfg), "device": torch.cuda.get_device_name(),
           "tma_o": on.consts.get("TMA_O")}
    outs = []
    for la in (off, on):
        o.fill_(float("nan"))
        la(dict(tensors))
        torch.cuda.synchronize()
        outs.append(o.clone())
    row["identical"] = bool(torch.equal(*(torch.nan_to_num(x, 7.0) for x in outs)))
    for rnd in range(3):  # alternate, so drift in clock or heat falls on both
        for key, la in (("us_pointer_store", off), ("us_tma_store", on)):
            try:
                t = triton.testing.do_bench_cudagraph(lambda: la(dict(tensors)), rep=200) * 1e3
            except Exception:  # (a launch the graph cannot capture: as called)
                t = triton.testing.do_bench(lambda: la(dict(tensors)), return_mode="median") * 1e3
                row["as_called"] = True
            row.setdefault(key, []).append(t)
    row["ratio_pointer_over_tma"] = min(row["us_pointer_store"]) / min(row["us_tma_store"])
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=CASES)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    tt.run_cases(args.cases, measure, os.path.join(args.out, "tma_store_epilogue.json"))


if __name__ == "__main__":
    main()

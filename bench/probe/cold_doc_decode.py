"""Probe (session 52): the cold superoptimize of a decode whose mask reads a tensor at
the cache's end (230 s on an H200 in ``doc_decode_check.py`` before session 52's
validation changes, against 4-10 s for the plain decodes): its wall time, the validation's
report, every config the timer weighed, and with ``--profile`` a cProfile of the build
(which slowed it about twofold: a first run under it hit its time limit).

    python bench/probe/cold_doc_decode.py [--S 8192] [--profile] [--out DIR]
Writes DIR/cold_doc_decode.json (and DIR/cold_doc_decode.prof.txt).
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch

import neptune_eq as ne


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    S = a.S
    doc = ne.placeholder((S,), "int32", "doc")
    prog = ne.attention(1, 64, 1, S, 128, "float16", kv_heads=8,
                        mask_mod=lambda b, h, i, j: doc[i + S - 1] == doc[j])
    torch.cuda.init()
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    kern = ne.superoptimize(prog, target="cuda", cache=False, progress=True)
    wall = time.perf_counter() - t0
    if prof:
        prof.disable()
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text)
        st.sort_stats("cumulative").print_stats(45)
        st.sort_stats("tottime").print_stats(25)
        open(os.path.join(a.out, "cold_doc_decode.prof.txt"), "w").write(text.getvalue())
    row = {"S": S, "device": torch.cuda.get_device_name(), "wall_s": round(wall, 1),
           "validation": str(kern.trace.validation), "config": str(kern.config),
           "timings": [(str(c), ms, why) for c, ms, why in kern.timings]}
    json.dump(row, open(os.path.join(a.out, "cold_doc_decode.json"), "w"), indent=1)
    print(json.dumps(row, indent=1), flush=True)


if __name__ == "__main__":
    main()

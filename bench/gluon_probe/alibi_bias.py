"""Probe (session 38): ALiBi's in-block bias as a row vector and a column vector instead of
a 2-D tile (issue 16: ALiBi 562 / 586 TFLOP/s at S = 8192 / 32768, goal > 600).

The block shift (``lowering/block_shift``) writes slope·(j - i) over a block as
slope·(l0 - first row) -- a scalar per block -- plus slope·(jj - ii), a [64, B_L] tile
built once and kept live across the key loop: 64 registers a thread beside the
accumulators.  Nsight Compute put ALiBi's extra time at the P·V issue and its waits,
not in more instructions (bench/results/README.md, session 38).  Here the generated
Gluon source is edited so that the tile becomes slope·jj (a column vector, 32 registers)
and the row part slope·(l0 - first row - ii) a per-row vector made each block -- the same
sum -- and both forms are timed alternately, each output checked against the other.

    python bench/gluon_probe/alibi_bias.py [--S 8192 32768] [--stages 2 3]

The product now emits the split form (``block_shift._split``, commit 6f7604b), so the
probe compares the two only at an earlier commit; at this one it says so and stops.
"""
import argparse
import json
import os
import re
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

import causal_overhead as co  # noqa: E402
from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig  # noqa: E402

TILE = re.compile(r"(t\d+) = (t\d+) \* \(\(\(cols\)\[None, :\] - \(gl\.arange\(0, 64, S_ROWS\)\)"
                  r"\[:, None\]\)\)\.to\(gl\.float32\)")
SHIFT = re.compile(r"(t\d+) = (t\d+) \* \(\(\(l0\) - \(my_first\)\)\)")


def split_bias(la):
    """``la`` rebuilt with the in-block bias as a column vector and a per-row vector."""
    src = la.ks.gluon.source
    new, n_tile = TILE.subn(r"\1 = \2 * ((cols)[None, :]).to(gl.float32)", src)
    new, n_shift = SHIFT.subn(r"\1 = \2 * (((l0) - (my_first)) - gl.arange(0, 64, S_ROWS))"
                              r".to(gl.float32)", new)
    if not (n_tile and n_shift):
        raise SystemExit("The generated source has no [rows, keys] bias tile to split: since "
                         "session 38 block_shift emits the split form itself.  Run this probe "
                         "at a commit before 6f7604b to compare the two.")
    ks = replace(la.ks, gluon=replace(la.ks.gluon, source=new))
    return make_launcher(la.program, ks, "cuda", la.config)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--stages", type=int, nargs="*", default=[2, 3])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    b, h, d = 1, 32, 128
    for s in a.S:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d
        for stages in a.stages:
            cfg = TileConfig({"B_i": 128, "B_L": 128}, 4, stages, gluon_ws=True)
            forms = {"tile": co.launcher("alibi", b, h, s, d, None, cfg)}
            forms["split"] = split_bias(forms["tile"])
            outs = {}
            for name, la in forms.items():
                t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q)}
                la(t)
                torch.cuda.synchronize()
                outs[name] = t["o"].float()
            diff = (outs["tile"] - outs["split"]).abs().max().item()
            times = {n: [] for n in forms}
            for _ in range(a.rounds):
                for name, la in forms.items():
                    t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q)}
                    times[name].append(co.timed(lambda: la(t)))
            row = {"S": s, "stages": stages, "max_abs_diff": diff,
                   **{n: round(flops / (sorted(ts)[len(ts) // 2] * 1e-3) / 1e12, 1)
                      for n, ts in times.items()}}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

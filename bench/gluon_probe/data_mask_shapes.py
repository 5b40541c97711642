"""Tile shapes of the `tl` form beyond the candidate grid, on data masks (issue 17): which
(rows, keys, warps, stages) of the pointer form times best per case, each with three
loops and with one (``TileConfig.one_loop``), timed on the case's data in one process.

    python bench/gluon_probe/data_mask_shapes.py [--S 8192 32768] [--cases jagged doc13]
    python bench/gluon_probe/data_mask_shapes.py --S 32768 --cases jagged --choice-methods

``--choice-methods``: the chooser's candidates only (``candidate_configs``), each timed
three times alternating by both of the chooser's methods -- on the GPU alone (graph
replays) and from the host on a flushed L2 (``host=True``, what a call over
``choose.HOST_BOUND_US`` is timed by) -- to see whether a cold choice between near-equal
forms can flip.

Prints one JSON line per (case, config); fp16 H=16 D=128 (``doc_mask_gpu.case``).
"""
import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import doc_mask_gpu as dm  # noqa: E402

from neptune_eq.runtime.tile_configs import TileConfig, candidate_configs  # noqa: E402
from neptune_eq.runtime.tuning import time_configs  # noqa: E402
from neptune_eq.sizes import sizes_of  # noqa: E402

SHAPES = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 64, 8, 3), (64, 32, 4, 3),
          (64, 32, 4, 4), (32, 64, 4, 3), (64, 128, 8, 2), (128, 64, 8, 2), (128, 64, 4, 3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--cases", nargs="*", default=["jagged", "doc13"])
    ap.add_argument("--choice-methods", action="store_true")
    a = ap.parse_args()
    for S in a.S:
        for name in a.cases:
            mask, _, pairs = dm.case(name, S)
            q, k, v = (torch.randn(1, dm.H, S, dm.D, device="cuda", dtype=torch.float16)
                       for _ in range(3))
            kern, la, bound = dm.launcher_of(q, k, v, mask)
            values = sizes_of(kern.input_program, bound)
            rows = f"B_{la.ks.block_axis}"
            if a.choice_methods:
                cands = [c.at(values) for c in candidate_configs(la.ks, "cuda")]
                for rnd in range(3):
                    for host in (False, True):
                        for c, ms, why in time_configs(la.program, la.ks, "cuda", bound, cands,
                                                       values, host=host):
                            print(json.dumps({"case": name, "S": S, "round": rnd, "host": host,
                                              "config": str(c), "ms": ms, "why": why or ""}),
                                  flush=True)
                continue
            cfgs = []
            for bi, bl, w, st in SHAPES:
                c = TileConfig({rows: bi, "B_L": bl}, w, st)
                cfgs += [c, replace(c, one_loop=True)]
            for c, ms, why in time_configs(la.program, la.ks, "cuda", bound, cfgs, values):
                tf = 4 * dm.D * pairs * dm.H / (ms * 1e-3) / 1e12 if ms else None
                print(json.dumps({"case": name, "S": S, "config": str(c), "ms": ms,
                                  "tflops": tf, "why": why or ""}), flush=True)


if __name__ == "__main__":
    main()

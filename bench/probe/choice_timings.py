"""Probe (session 45): every config the timer weighed for one operator, with its time or
why it has none -- the choice table behind a ``bench/neptune_ops.py`` row.

    python bench/probe/choice_timings.py [--ops gqa-pf] [--seqs 512] [--out DIR]

Writes ``choice_timings.json`` (one row per operator and length: the chosen config and
each candidate's (config, ms or None, status)).  A cold superoptimize, no cache.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import neptune_eq as ne  # noqa: E402
import neptune_ops as nops  # noqa: E402
import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="+", default=["gqa-pf"], choices=list(nops.OPS))
    ap.add_argument("--seqs", type=int, nargs="+", default=[512])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for op in args.ops:
        for s in args.seqs:
            out = nops.build(op, s)[0]
            kern = ne.superoptimize(out, target="cuda", top_k=2, cache=False)
            row = {"op": op, "S": s, "device": torch.cuda.get_device_name(),
                   "config": str(kern.config),
                   "timings": [(str(c), ms, why) for c, ms, why in kern.timings]}
            rows.append(row)
            print(json.dumps(row, indent=1), flush=True)
            with open(os.path.join(args.out, "choice_timings.json"), "w") as fh:
                json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()

"""Probe (session 50): where a warm decode call's host time goes, piece by piece, beside SDPA.

    python bench/probe/host_split.py [--ops gqa-dc causal-dc] [--S 2048]

``bench/interleaved_ratio.py`` reads decode as called at S <= 8192 below SDPA when our
host time per call (30-56 us on the H200 host) passes the L2 flush ``do_bench`` puts
before each call, and SDPA's (23-33 us) does not.  This times, without synchronising
(mean over 3000 calls, each piece alone, interleaved over 5 rounds): the whole call, the
signature lookup, the replay (``BoundCall``), its outputs' allocation, the device/stream/
capture queries, the argument lists, the launches alone (tensors, or their pointers as
ints), ways to allocate the output, and SDPA's whole call.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
import neptune_ops as nops  # noqa: E402
from neptune_eq import api  # noqa: E402
from neptune_eq.runtime.launch import current_stream, written_outputs  # noqa: E402


def per_call_us(fn, n=3000):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def warm_kernel(op, S):
    """(spec, q, k, v, slopes, call arguments, kernel) of ``neptune_ops`` setup ``op`` at
    ``S``, superoptimized and called 20 times (its replay made and warm)."""
    out, spec, work, unit = nops.build(op, S)
    q, k, v, slopes, args = nops.make_inputs(spec)
    kern = ne.superoptimize(out, target="cuda", top_k=2)
    for _ in range(20):
        kern(*args)
    return spec, q, k, v, slopes, args, kern


def pieces(op, S):
    spec, q, k, v, slopes, args, kern = warm_kernel(op, S)
    sig = api._signature(args)
    bc = kern._bound[sig]
    la = bc.launcher
    dev = bc.device
    outs = written_outputs(bc.out_specs, dev)
    vals = list(args) + outs
    cur = torch.cuda.current_device()
    stream = current_stream(cur)
    align = tuple([vals[k].data_ptr() & 15 == 0 for k in bc.param_slots])
    cks = la._checked.get((cur, align, bc.int_key))
    lists = bc.arg_lists(vals, stream, False)
    ptrs = [t.data_ptr() for t in vals]
    int_lists = bc.arg_lists(ptrs, stream, False, pointers=True)
    shape, dt = bc.out_specs[0]
    proto = outs[0]
    sdpa = nops.peers(spec, q, k, v, slopes)["sdpa"]

    def launches(lists=lists):
        for fl, ck, a in zip(bc.steps, cks, lists):
            fl.fast(ck, a, stream)

    def state():
        c = torch.cuda.current_device()
        current_stream(c)
        torch.cuda.is_current_stream_capturing()

    parts = {
        "whole call": lambda: kern(*args),
        "signature": lambda: api._signature(args),
        "replay (BoundCall)": lambda: bc(list(args)),
        "outputs (torch.empty)": lambda: written_outputs(bc.out_specs, dev),
        "outputs (OutputMaker)": bc.make_outputs,
        "device/stream/capture": state,
        "argument lists": lambda: bc.arg_lists(vals, stream, False),
        f"launches ({len(bc.steps)}), tensors": launches,
        f"launches ({len(bc.steps)}), int pointers": lambda: launches(int_lists),
        "data pointers": lambda: [t.data_ptr() for t in vals],
        "torch.empty(shape, dtype, device)": lambda: torch.empty(shape, dtype=dt, device=dev),
        "x.new_empty(shape, dtype)": lambda: args[0].new_empty(shape, dtype=dt),
        "torch.empty_like(proto)": lambda: torch.empty_like(proto),
        "sdpa whole call": sdpa,
    }
    rounds = {n: [] for n in parts}
    for _ in range(5):
        for n, f in parts.items():
            rounds[n].append(per_call_us(f))
    row = {"setup": f"{op} S={S}", "config": str(kern.config),
           "us": {n: round(statistics.median(x), 2) for n, x in rounds.items()}}
    print(json.dumps(row), flush=True)
    return row


def arguments():
    """--ops, --S, --out: this probe's, and ``host_sections.py``'s."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="+", default=["gqa-dc", "causal-dc"])
    ap.add_argument("--S", type=int, default=2048)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main():
    a = arguments()
    rows = [pieces(op, a.S) for op in a.ops]
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

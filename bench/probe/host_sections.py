"""Probe (session 51): a warm decode call's host time, section by section, in one call.

    python bench/probe/host_sections.py [--ops gqa-dc causal-dc] [--S 2048] [--out FILE]

``host_split.py`` (session 50) timed each piece of a replayed call alone, and the pieces
summed to ~24 us of a replay that took ~40 us on the H200's host: where the other ~16 us
go is not known.  This probe times the pieces *inside* a call instead: it runs the
replay's steps as session 50 left them (``BoundCall.__call__`` for a pointer-form
split-k or one-launch call: ``arg_lists`` and ``FastLaunch.fast`` per launch, the public
device / stream / capture queries, written out here step by step) with a clock read
between steps, over 3000 calls, interleaved over 5 rounds with the real call, so the
sections add up to a call -- since session 51 the real call is the faster replay, so
"whole call" against "sections_sum_us" is that change's A/B in one process.  It also
runs cProfile over 2000 real calls (builtins show which torch/triton C calls take the
time), and times the real call with Python's garbage collector off.
"""
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_ops as nops  # noqa: E402
from host_profile import host_profile  # noqa: E402
from host_split import arguments, per_call_us, warm_kernel  # noqa: E402  (this folder)
from neptune_eq import api  # noqa: E402
from neptune_eq.runtime.launch import current_stream  # noqa: E402


def sectioned(kern, bc, args, n=3000):
    """The replay's steps with a clock between them; mean us per section."""
    clock = time.perf_counter_ns
    names = ["is_compiling", "signature", "bound lookup", "outputs", "device+stream",
             "capturing", "data pointers", "checked lookup", "argument lists",
             "launch 1", "launch 2+", "result"]
    acc = dict.fromkeys(names, 0)
    la = bc.launcher
    torch.cuda.synchronize()
    for _ in range(n):
        t0 = clock()
        torch.compiler.is_compiling()
        t1 = clock()
        sig = api._signature(args)
        t2 = clock()
        rep = kern._bound.get(sig)
        t3 = clock()
        outs = rep.make_outputs()
        t4 = clock()
        cur = torch.cuda.current_device()
        stream = current_stream(cur)
        t5 = clock()
        capturing = bool(rep.pre or rep.scratch) and torch.cuda.is_current_stream_capturing()
        t6 = clock()
        vals = list(args) + outs
        ptrs = [t.data_ptr() for t in vals]
        t7 = clock()
        align = tuple([ptrs[k] & 15 == 0 for k in rep.param_slots])
        cks = la._checked.get((cur, align, rep.int_key))
        t8 = clock()
        lists = rep.arg_lists(ptrs, stream, capturing, pointers=True)
        t9 = clock()
        rep.steps[0].fast(cks[0], lists[0], stream)
        t10 = clock()
        for fl, ck, a in zip(rep.steps[1:], cks[1:], lists[1:]):
            fl.fast(ck, a, stream)
        t11 = clock()
        res = outs[0] if len(outs) == 1 else tuple(outs)
        del res
        t12 = clock()
        ts = (t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12)
        for k, name in enumerate(names):
            acc[name] += ts[k + 1] - ts[k]
    torch.cuda.synchronize()
    return {k: v / n / 1e3 for k, v in acc.items()}


def probe(op, S):
    spec, q, k, v, slopes, args, kern = warm_kernel(op, S)
    bc = kern._bound[api._signature(args)]
    if bc.launcher.tma or bc.pre or type(bc).__name__ != "BoundCall":
        raise SystemExit(f"{op}: the sectioned replay covers the pointer form only")
    # the written-out steps launch what the call launches: same output, checked
    ref = kern(*args).float()
    got_outs = bc.make_outputs()
    torch.cuda.synchronize()
    sdpa = nops.peers(spec, q, k, v, slopes)["sdpa"]
    whole = lambda: kern(*args)  # noqa: E731

    def no_gc():
        gc.disable()
        try:
            return per_call_us(whole)
        finally:
            gc.enable()

    rounds = {"whole call": [], "whole call, gc off": [], "sdpa whole call": [],
              "sections": []}
    for _ in range(5):
        rounds["whole call"].append(per_call_us(whole))
        rounds["whole call, gc off"].append(no_gc())
        rounds["sdpa whole call"].append(per_call_us(sdpa))
        rounds["sections"].append(sectioned(kern, bc, args))
    sec = {k: round(statistics.median([r[k] for r in rounds["sections"]]), 2)
           for k in rounds["sections"][0]}
    row = {"setup": f"{op} S={S}", "config": str(kern.config),
           "launches": len(bc.steps),
           "us": {k: round(statistics.median(v), 2) for k, v in rounds.items()
                  if k != "sections"},
           "sections_us": sec, "sections_sum_us": round(sum(sec.values()), 2),
           "max_err_vs_first_call": float((kern(*args).float() - ref).abs().max())}
    del got_outs
    print(json.dumps(row), flush=True)
    prof = host_profile(whole, 2000, 30)[1]
    prof_sdpa = host_profile(sdpa, 2000, 15)[1]
    return row, prof, prof_sdpa


def main():
    a = arguments()
    rows, texts = [], []
    for op in a.ops:
        row, prof, prof_sdpa = probe(op, a.S)
        rows.append(row)
        texts.append(f"== {row['setup']} ({row['config']}): ours\n{prof}\n== sdpa\n{prof_sdpa}")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
        Path(a.out).with_suffix(".prof.txt").write_text("\n".join(texts))
    else:
        print("\n".join(texts))


if __name__ == "__main__":
    main()

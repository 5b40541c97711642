"""Where a split-k decode's partials let their dependent combine launch: never (the combine
launched plainly), at their end (the implicit release: the product as called in session
51), first thing (the product since session 52), or just before they store their fold
states -- timed graphed and as called, and run many times to look for session 24's stall.

Session 24 had the partials signal ``griddepcontrol.launch_dependents`` first thing: every
two-launch GQA config ran 4-7% faster as called on an H100, but three runs stalled on the
device and the change was reverted without a cause found.  Session 40 measured the
dependent combine without an early signal 0.976-0.997x the plain one inside a CUDA graph;
session 51 launched it dependent as called only.  This probe asks again, with a time limit
around each step, whether an explicit signal (first thing, or before the stores) moves the
graphed call, and whether it stalls.

The variants are the chosen tiles' two-launch form built from the generated module with
one line added to the partials kernel (``if PDL: tl.extra.cuda.gdc_launch_dependents()``);
every variant's output is compared bit for bit with the plain launch's.

    python bench/probe/decode_trigger.py --ops gqa-dc causal-dc --seqs 2048 8192 --out DIR
Writes DIR/decode_trigger.json (after every row) and prints each row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import doc_mask_gpu as dm  # noqa: E402  (imports neptune_eq first)
import neptune_ops as ops  # noqa: E402
import torch  # noqa: E402

import neptune_eq as ne  # noqa: E402
from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402

SIGNAL = "tl.extra.cuda.gdc_launch_dependents()"


def with_signal(source: str, name: str, where: str) -> str:
    """The module with the partials kernel ``name``_partial signalling its dependents
    ``where`` ("first": its first statement; "store": before it stores its fold states)."""
    start = source.index(f"def {name}_partial(")
    body = source.index("):\n", start) + 3
    end = source.find("\n@triton.jit", body)
    kernel = source[body:end]
    line = f"    if PDL:\n        {SIGNAL}\n"
    if where == "first":
        kernel = line + kernel
    else:
        at = kernel.index("    # split-k: store this chunk's fold states")
        kernel = kernel[:at] + line + kernel[at:]
    return source[:body] + kernel + source[end:]


def built(la, config, pdl: bool, where: str | None):
    """The tiles ``config`` built with the combine dependent (``pdl``) and the partials'
    signal at ``where`` (None: none, the implicit one at their end)."""
    ks = la.ks if where is None else replace(la.ks, source=with_signal(la.ks.source, la.ks.name,
                                                                       where))
    os.environ["NEPTUNE_EQ_PDL"] = "1" if pdl else "0"
    os.environ["NEPTUNE_EQ_PDL_COMBINE"] = "1" if pdl else "0"
    try:
        return make_launcher(la.program, ks, la.target, config, la.size_args)
    finally:
        os.environ.pop("NEPTUNE_EQ_PDL")
        os.environ.pop("NEPTUNE_EQ_PDL_COMBINE")


VARIANTS = {"plain": (False, None), "end": (True, None), "first": (True, "first"),
            "store": (True, "store")}


def measure(op: str, S: int, splits: int | None, calls: int, passes: int) -> dict:
    from triton.testing import do_bench
    out, _, work, _ = ops.build(op, S)
    kern = ne.superoptimize(out, target="cuda")
    la = make_launcher(kern.program, kern.kernel_source, kern.target, kern.config)
    row = {"op": op, "S": S, "chosen": str(la.config)}
    if not la.ks.split_extent or not la.config.splits:
        return {**row, "skipped": "the chosen kernel is not split-k"}
    two = replace(la.config, fused=False, **({"splits": splits} if splits else {}))
    row["timed"] = str(two)
    prog = la.program
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = {ph.name: (torch.randn(prog.shape_of(ph.name), generator=g, device="cuda") / 8)
              .to(getattr(torch, prog.dtype_of(ph.name))) for ph in prog.inputs}
    runs, outs, buffers = {}, {}, {}
    for key, (pdl, where) in VARIANTS.items():
        t = built(la, two, pdl, where)
        mine = {**inputs, **{n: torch.empty(prog.shape_of(n), device="cuda",
                                            dtype=getattr(torch, prog.dtype_of(n)))
                             for n in prog.outputs}}
        t(mine)
        torch.cuda.synchronize()
        outs[key] = mine[prog.outputs[0]].clone()
        buffers[key] = mine
        runs[key] = (lambda t=t, x=mine: t(x))
        row[f"dependent_{key}"] = bool(getattr(t, "pdl_combine", False))
    row["same_output"] = {k: bool(torch.equal(outs["plain"], o)) for k, o in outs.items()}
    for key, ts in dm.alternated_graph_ms(runs, passes).items():
        row[f"us_graph_{key}"] = 1e3 * statistics.median(ts)
        row[f"us_graph_{key}_all"] = [round(1e3 * x, 3) for x in ts]
    for _ in range(2):  # as called, alternated
        for key, fn in runs.items():
            row.setdefault(f"us_call_{key}_all", []).append(
                round(1e3 * do_bench(fn, return_mode="median"), 3))
    for key in runs:
        row[f"us_call_{key}"] = statistics.median(row[f"us_call_{key}_all"])
    row["tbps_graph"] = {k: work / (row[f"us_graph_{k}"] * 1e-6) for k in runs}
    # many calls back to back, each variant, then the output again: a stall shows as the
    # command's time limit; a race as a changed output
    for key, fn in runs.items():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        row[f"stress_{key}_s"] = round(time.perf_counter() - t0, 3)
    row["same_after_stress"] = {key: bool(torch.equal(x[prog.outputs[0]], outs["plain"]))
                                for key, x in buffers.items()}
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", nargs="*", default=["gqa-dc", "causal-dc"])
    ap.add_argument("--seqs", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--splits", type=int, nargs="*", default=[0],
                    help="split factors to time (0: the chosen one)")
    ap.add_argument("--calls", type=int, default=5000, help="back-to-back calls per variant")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out", default=str(dm.RESULTS))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for S in a.seqs:
        for op in a.ops:
            for sp in a.splits:
                try:
                    rows.append(measure(op, S, sp or None, a.calls, a.passes))
                except Exception as e:  # noqa: BLE001 - a row that fails is reported
                    rows.append({"op": op, "S": S, "splits": sp,
                                 "skipped": f"{type(e).__name__}: {e}"})
                print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_all")}),
                      flush=True)
                (out / "decode_trigger.json").write_text(json.dumps(
                    {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

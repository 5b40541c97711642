"""A call's first launch dependent on the kernel before it in the stream, off against on,
in one process (``NEPTUNE_EQ_PDL_FIRST``, or the switch ``--env`` names;
``lowering/dependent_launch.wait_then_release``).

For each operator of ``bench/neptune_ops.py`` and length, the bench builds the launcher
the chosen config runs with twice -- the first launch plain, and dependent (its kernel
waits for the kernel before it first thing) -- checks both give the same output bit for
bit, and times, in alternated passes (median of ``--passes``), per call:

* ``graph``: 20 calls replayed from one CUDA graph, back to back (the kernel before a
  call is the last call's);
* ``after``: the same, each call after an unrelated torch kernel (a multiply over 16 MiB,
  as a model's last op before attention), the torch kernel's own graphed time taken off;
* ``tiny``: the same after a multiply over 16 KiB (the inputs stay in L2);
* the peers (SDPA, FlexAttention) the same two ways, for the ratio.

    python bench/probe/first_launch.py --ops gqa-dc causal-dc global-dc --seqs 2048 8192
Writes bench/results/<out>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import neptune_eq as ne  # noqa: E402
import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

import neptune_ops as nops  # noqa: E402
from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
CALLS = 20


ENV = "NEPTUNE_EQ_PDL_FIRST"  # what off / on toggles (``--env``)


def twin(la, first: bool):
    """``la``'s config built again with ``ENV`` on (``first``) or off."""
    old = os.environ.get(ENV)
    os.environ[ENV] = "1" if first else "0"
    try:
        return make_launcher(la.program, la.ks, la.target, la.config, la.size_args)
    finally:
        if old is None:
            os.environ.pop(ENV)
        else:
            os.environ[ENV] = old


def graphed(fn, before=None) -> float:
    """ms per call of ``CALLS`` calls of ``fn`` captured in one graph (each after
    ``before`` where given), median of ``do_bench_cudagraph``."""
    def calls():
        for _ in range(CALLS):
            if before is not None:
                before()
            fn()
    return do_bench_cudagraph(calls, rep=100, return_mode="median") / CALLS


def measure(op: str, S: int, passes: int) -> dict:
    out, spec, work, unit = nops.build(op, S)
    q, k, v, slopes, args = nops.make_inputs(spec)
    kern = ne.superoptimize(out, target="cuda", top_k=2)
    bound, la = kern._bind_static(args, {})  # (a static-size kernel: its one launcher)
    row = {"op": op, "S": S, "config": str(la.config), "unit": unit}
    fns, results = {}, {}
    for first in (False, True):
        t = twin(la, first)
        tensors = {n: (x.clone() if n in kern.program.outputs else x) for n, x in bound.items()}
        t(tensors)
        torch.cuda.synchronize()
        results[first] = tensors[kern.program.outputs[0]].clone()
        row[f"first_{'on' if first else 'off'}_launch_pdl"] = bool(getattr(t, "pdl_first", False))
        fns["on" if first else "off"] = (lambda t=t, x=tensors: t(x))
    row["same_output"] = bool(torch.equal(results[False], results[True]))
    for name, f in nops.peers(spec, q, k, v, slopes).items():
        if name in ("sdpa", "flex"):
            fns[name] = f
    # an unrelated kernel before each call: a multiply over 16 MiB (it also evicts part of
    # the inputs from L2), or over 16 KiB (the inputs stay in L2: the launch alone)
    x, tiny = torch.randn(4 * 2 ** 20, device="cuda"), torch.randn(4096, device="cuda")
    befores = {"after": lambda: x.mul_(1.0), "tiny": lambda: tiny.mul_(1.0)}
    times = {f"{k}_{m}": [] for k in fns for m in ("graph", *befores)}
    times.update({f"before_alone_{m}": [] for m in befores})
    for _ in range(passes):
        for m, before in befores.items():
            times[f"before_alone_{m}"].append(graphed(before))
        for key, f in fns.items():
            times[f"{key}_graph"].append(graphed(f))
            for m, before in befores.items():
                times[f"{key}_{m}"].append(graphed(f, before) - times[f"before_alone_{m}"][-1])
    for key, ts in times.items():
        row[f"ms_{key}"] = statistics.median(ts)
        row[f"ms_{key}_all"] = ts
    peers = [p for p in ("sdpa", "flex") if f"ms_{p}_graph" in row]
    for m in ("graph", *befores):
        best = min(row[f"ms_{p}_{m}"] for p in peers) if peers else None
        for key in ("off", "on"):
            row[f"x_best_peer_{key}_{m}"] = best / row[f"ms_{key}_{m}"] if best else None
        row[f"on_over_off_{m}"] = row[f"ms_off_{m}"] / row[f"ms_on_{m}"]
    return row


def write(rows: list[dict], out: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    path = RESULTS / out
    path.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# {ENV}=0 / 1: a call's launches dependent on the kernel before, off / on "
             f"({meta['device']}, torch {meta['torch']})", "",
             f"us per call, {CALLS} calls from one CUDA graph: back to back (graph) and each "
             "after an unrelated 16 MiB / 16 KiB torch multiply, its own time taken off "
             "(after / tiny). x best "
             "peer: the best of SDPA and Flex timed the same way over ours.", "",
             "| op | S | graph off | graph on | x peer off | x peer on | after off | after on "
             "| x peer off | x peer on | tiny off | tiny on | x peer off | x peer on "
             "| same output | config |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['op']} | {r['S']} | skipped: {r['skipped']} |")
            continue

        def x(key):
            return f"{r[key]:.3f}" if r.get(key) else "n/a"
        cells = [f"{1e3 * r[f'ms_{k}_{m}']:.2f}" if f"ms_{k}_{m}" in r else "n/a"
                 for m in ("graph", "after", "tiny") for k in ("off", "on")]
        peer = [x(f"x_best_peer_{k}_{m}") for m in ("graph", "after", "tiny") for k in ("off", "on")]
        cols = [c for m in range(3) for c in cells[2 * m:2 * m + 2] + peer[2 * m:2 * m + 2]]
        lines.append(f"| {r['op']} | {r['S']} | " + " | ".join(cols)
                     + f" | {r['same_output']} | {r['config']} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main():
    global ENV
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", nargs="*", default=["gqa-dc", "causal-dc"])
    ap.add_argument("--seqs", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out", default="first_launch")
    ap.add_argument("--env", default=ENV, help="the switch off / on toggles (e.g. "
                    "NEPTUNE_EQ_PDL_COMBINE: the split-k combine launched dependent)")
    a = ap.parse_args()
    ENV = a.env
    rows = []
    for op in a.ops:
        for S in a.seqs:
            try:
                rows.append(measure(op, S, a.passes))
            except Exception as e:  # noqa: BLE001 - a row that fails is reported, not fatal
                rows.append({"op": op, "S": S, "skipped": f"{type(e).__name__}: {e}"})
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_all")}),
                  flush=True)
            write(rows, a.out)


if __name__ == "__main__":
    main()

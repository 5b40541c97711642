"""Probe (session 51): the Gluon replay's prepared launches, right and how much host they save.

    python bench/probe/gluon_replay_check.py [--S 4096] [--out FILE]

``GluonBoundCall`` now launches a checked call's kernels -- the data mask's pre-pass, a
dynamic walk's ranges kernel, the form -- through raw calls prepared once per stream
(``_launch_plan``), where it went through ``GluonLauncher._fast`` per call.  For
document and jagged masks at three Gluon configs each (two consumers, heads first, the
dynamic walk), this builds the product's launcher and its replay, then:

- calls the replay on fresh data three times and compares each output with the
  launcher's own call on the same data (bit for bit: the same kernels);
- captures a replayed call in a CUDA graph, replays it on new data copied into its
  inputs, and compares;
- times the replay's host time per call (a loop without sync), with the plan and with it
  turned off (``_launch_plan`` returning None: the ``_fast`` path), alternated 5 times.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gluon_probe"))
import gluon_validate as gv  # noqa: E402
from neptune_eq.runtime.gluon_launch import GluonBoundCall, make_launcher  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig  # noqa: E402

CONFIGS = {"two consumers": {}, "heads first": {"heads_first": True},
           "dynamic walk": {"dynamic": True}}


def host_us(fn, calls=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def check(case: str, S: int, name: str, opts: dict) -> dict:
    mods, _, captured = gv.data_case(case, 1, S)
    captured = {n: t.cuda() for n, t in captured.items()}
    prog, ks = gv.derive(case, 1, 16, S, 128, "float16", None, mods)
    cfg = TileConfig({f"B_{ks.block_axis}": 128, "B_L": 64}, 4, 2, gluon_ws=True, **opts)
    la = make_launcher(prog, ks, "cuda", cfg)
    names = [ph.name for ph in prog.inputs]
    (oname,) = prog.outputs
    shape = prog.shape_of("q")

    def fresh():
        ins = {n: (captured[n] if n in captured else
                   torch.randn(prog.shape_of(n), device="cuda", dtype=torch.float16))
               for n in names}
        return ins, {**ins, oname: torch.empty(prog.shape_of(oname), device="cuda",
                                              dtype=torch.float16)}

    ins, tensors = fresh()
    la(dict(tensors))
    la(dict(fresh()[1]))  # (the first call checks the fast launch under its key)
    bc = GluonBoundCall(la, names, tensors, [oname])
    row = {"case": f"{case} S={S}", "config": str(cfg), "equal": []}
    for _ in range(3):
        ins, tensors = fresh()
        got = bc([ins[n] for n in names])[0]
        la(tensors)
        row["equal"].append(bool(torch.equal(got, tensors[oname])))
    row["planned"] = bool(bc._plans) and all(p[1] is not None for p in bc._plans.values())
    # a replayed call captured in a CUDA graph, replayed on new data
    static_ins, _ = fresh()
    static = [static_ins[n] for n in names]
    bc(static)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout = bc(static)[0]
    graph_equal = []
    for _ in range(2):
        ins, tensors = fresh()
        for n, t in zip(names, static):
            if n not in captured:
                t.copy_(ins[n])
        g.replay()
        la({**{n: t for n, t in zip(names, static)}, oname: tensors[oname]})
        torch.cuda.synchronize()
        graph_equal.append(bool(torch.equal(gout, tensors[oname])))
    row["graph_equal"] = graph_equal
    # host time per call: the plan against ``_fast``
    args = [ins[n] for n in names]
    plan_of = bc._launch_plan
    times = {"planned": [], "fast": []}
    for _ in range(5):
        bc._launch_plan = plan_of
        times["planned"].append(host_us(lambda: bc(args)))
        bc._launch_plan = lambda ck, stream: None
        times["fast"].append(host_us(lambda: bc(args)))
    bc._launch_plan = plan_of
    row["host_us"] = {k: round(statistics.median(v), 2) for k, v in times.items()}
    row["ok"] = all(row["equal"]) and all(graph_equal) and row["planned"]
    row["q_shape"] = list(shape)
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--cases", nargs="+", default=["doc13", "jagged"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [check(c, a.S, n, o) for c in a.cases for n, o in CONFIGS.items()]
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

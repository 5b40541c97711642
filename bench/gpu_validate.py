"""Correctness of generated kernels on the GPU (the CPU tests use the interpreter).

    python bench/gpu_validate.py [--out bench/results]

Every program is superoptimized for CUDA and compared with the fp64 reference
interpreter on fresh random inputs, including odd sizes and large-magnitude scores.
Writes gpu_validate.json; exits non-zero on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

import neptune_eq as ne
from neptune_eq import examples
from neptune_eq.interp import evaluate

TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


def case(name, out, scale=1.0):
    t0 = time.perf_counter()
    kern = ne.superoptimize(out, target="cuda")
    prog = kern.input_program
    ins = {ph.name: (torch.randn(ph.shape, dtype=torch.float64) * scale).to(getattr(torch, ph.dtype))
           for ph in prog.inputs}
    if name.startswith("chain:"):
        ins = {k: (v.double().abs() + 0.1).to(v.dtype) for k, v in ins.items()}
    dt = prog.dtype_of(prog.outputs[0])
    ok, err, bound = True, 0.0, 0.0
    # Three calls: keywords (the checked path), positional (fast launch once checked),
    # and positional with the first input as a non-contiguous view (new strides).
    for call in range(3):
        if call:
            ins = {k: (v.double() * 1.01).to(v.dtype) for k, v in ins.items()}
        dev = {k: v.cuda() for k, v in ins.items()}
        if call == 2:
            first = prog.inputs[0].name
            dev[first] = dev[first].transpose(-1, -2).contiguous().transpose(-1, -2)
        got = (kern(**dev) if call == 0 else kern(*[dev[p.name] for p in prog.inputs])).cpu()
        ref = evaluate(prog, ins)[prog.outputs[0]]
        e = (got.double() - ref).abs().max().item()
        b = TOL[dt] * max(1.0, ref.abs().max().item())
        ok &= bool(torch.isfinite(got).all()) and e <= b
        err, bound = max(err, e), max(bound, b)
    la = kern._launcher
    return {"case": name, "ok": ok, "max_abs_err": err, "bound": bound,
            "passes": kern.plan.n_passes, "config": str(kern.config),
            "launches": len(kern.launches), "fast_launch": la.fast_ok, "fast_note": la.fast_reason,
            "seconds": round(time.perf_counter() - t0, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    rows = []
    for n, m in ((5, 37), (64, 1000), (3, 4099)):
        rows.append(case(f"softmax {n}x{m}", examples.softmax(n, m)))
    rows.append(case("softmax scores ±1e4", examples.softmax(16, 300), scale=1e4))
    for shape, dt in (((1, 2, 20, 37, 24), "float16"), ((2, 3, 129, 257, 64), "float16"),
                      ((1, 2, 77, 300, 128), "bfloat16"), ((1, 1, 33, 65, 32), "float32")):
        rows.append(case(f"attention {shape} {dt}", examples.attention(*shape, dt)))
    rows.append(case("attention scores x30", examples.attention(1, 2, 64, 200, 64, "float16"), 30.0))
    causal = lambda b, h, i, j: j <= i + 999  # noqa: E731 - decode: the query is the last key
    for kvh in (8, 2):  # decode (split-k candidates), plain and GQA-packed
        rows.append(case(f"decode kv_heads={kvh}", ne.attention(1, 8, 1, 1000, 64, "float16",
                                                                 kv_heads=kvh, mask_mod=causal)))
    for c in examples.CHAINS:
        rows.append(case(f"chain:{c}", examples.reduction_chain(c, 40, 333, 48)))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "cases": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_validate.json").write_text(json.dumps(res, indent=2))
    for r in rows:
        print(f"{'ok ' if r['ok'] else 'BAD'} {r['case']:<40} err={r['max_abs_err']:.2e} "
              f"passes={r['passes']} launches={r['launches']} fast={r['fast_launch']} "
              f"{r['fast_note']} {r['seconds']}s")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()

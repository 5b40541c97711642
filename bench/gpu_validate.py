"""Correctness of generated kernels on the GPU (the CPU tests use the interpreter).

    python bench/gpu_validate.py [--out bench/results] [--only decode chain ...]

Every program is superoptimized for CUDA and compared with the fp64 reference
interpreter on fresh random inputs, including odd sizes and large-magnitude scores.
Split-k kernels are also run in the form not chosen (two launches / one launch), and a
kernel with a CUDA-core contraction form (a one- or two-row decode) in each of its configs.
Writes gpu_validate.json after every case; exits non-zero on any mismatch.
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
from neptune_eq.frontend import examples
from neptune_eq.interp import evaluate

TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


def compared(got, prog, ins: dict) -> tuple[bool, float, float]:
    """(right, max abs error, its bound) of output ``got`` against the fp64 reference on
    ``ins``: finite everywhere and within ``TOL`` of the output dtype, relative to the
    reference's magnitude where that exceeds 1."""
    ref = evaluate(prog, ins)[prog.outputs[0]]
    e = (got.double() - ref).abs().max().item()
    b = TOL[prog.dtype_of(prog.outputs[0])] * max(1.0, ref.abs().max().item())
    return bool(torch.isfinite(got).all()) and e <= b, e, b


def graph_replays(kern, prog, ins: dict, ok: bool, err: float) -> tuple[bool, float]:
    """The call captured in a CUDA graph, replayed over three fresh inputs copied into its
    static ones: each replay against the reference (a replay must see every partial of
    its own inputs, and the one-launch form's counters must be zero again)."""
    static = {k: v.cuda() for k, v in ins.items()}
    args = [static[p.name] for p in prog.inputs]
    kern(*args)  # warm: compiled and checked before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kern(*args)
    for k in range(3):
        fresh = {n: (v.double() * (0.5 + k) + k).to(v.dtype) for n, v in ins.items()}
        for n, v in fresh.items():
            static[n].copy_(v)
        g.replay()
        torch.cuda.synchronize()
        right, e, _ = compared(out.cpu(), prog, fresh)
        ok, err = ok and right, max(err, e)
    return ok, err


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
        right, e, b = compared(got, prog, ins)
        ok, err, bound = ok and right, max(err, e), max(bound, b)
    la = kern._launcher
    from dataclasses import replace
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import vector_dot_configs
    if kern.config.splits:  # replayed from a CUDA graph: each replay reads its own inputs
        ok, err = graph_replays(kern, prog, ins, ok, err)
    # the split-k form not chosen, and every CUDA-core config offered, checked too
    alts = [replace(kern.config, fused=not kern.config.fused)] if kern.config.splits else []
    alts += [c for c in vector_dot_configs(kern.kernel_source) if c != kern.config]
    checked = []
    for cfg in alts:
        alt = Launcher(kern.program, kern.kernel_source, "cuda", cfg)
        dev = {k: v.cuda() for k, v in ins.items()}
        for _ in range(3):  # slow launch + check, then the direct launch twice
            outs = {n: torch.empty(prog.shape_of(n), dtype=getattr(torch, dt), device="cuda")
                    for n in prog.outputs}
            alt({**dev, **outs})
            right, e, _ = compared(outs[prog.outputs[0]].cpu(), prog, ins)
            ok, err = ok and right, max(err, e)
        checked.append(f"{cfg} (fast {alt.fast_ok})")
    other = "; ".join(checked) + (" also checked" if checked else "")
    return {"case": name, "ok": ok, "max_abs_err": err, "bound": bound, "also": other,
            "passes": kern.plan.n_passes, "config": str(kern.config),
            "launches": len(kern.launches), "fast_launch": la.fast_ok, "fast_note": la.fast_reason,
            "seconds": round(time.perf_counter() - t0, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--only", nargs="*", default=None, help="run cases whose name has one of these")
    a = ap.parse_args()
    rows = _Rows(a.out, a.only)
    for n, m in ((5, 37), (64, 1000), (3, 4099)):
        rows.append((f"softmax {n}x{m}", lambda n=n, m=m: examples.softmax(n, m), 1.0))
    rows.append(("softmax scores ±1e4", lambda: examples.softmax(16, 300), 1e4))
    for shape, dt in (((1, 2, 20, 37, 24), "float16"), ((2, 3, 129, 257, 64), "float16"),
                      ((1, 2, 77, 300, 128), "bfloat16"), ((1, 1, 33, 65, 32), "float32")):
        rows.append((f"attention {shape} {dt}", lambda shape=shape, dt=dt: examples.attention(*shape, dt),
                     1.0))
    rows.append(("attention scores x30", lambda: examples.attention(1, 2, 64, 200, 64, "float16"), 30.0))
    causal = lambda b, h, i, j: j <= i + 999  # noqa: E731 - decode: the query is the last key
    for kvh in (8, 2):  # decode (split-k candidates), plain and GQA-packed
        rows.append((f"decode kv_heads={kvh}", lambda kvh=kvh: ne.attention(
            1, 8, 1, 1000, 64, "float16", kv_heads=kvh, mask_mod=causal), 1.0))
    # the CUDA-core form's shapes: two packed rows in bf16, large scores, a row that sees
    # no key (zero, not NaN), 512 keys where it is chosen
    rows.append(("decode kv_heads=4 S=777 bf16", lambda: ne.attention(
        1, 8, 1, 777, 128, "bfloat16", kv_heads=4, mask_mod=lambda b, h, i, j: j <= i + 776), 1.0))
    rows.append(("decode scores x30 S=513", lambda: ne.attention(
        1, 4, 1, 513, 64, "float16", mask_mod=lambda b, h, i, j: j <= i + 512), 30.0))
    rows.append(("decode fully masked S=300", lambda: ne.attention(
        1, 4, 1, 300, 64, "float16", mask_mod=lambda b, h, i, j: j > i + 400), 1.0))
    rows.append(("decode 32 heads S=512 fp16", lambda: ne.attention(
        1, 32, 1, 512, 128, "float16", mask_mod=lambda b, h, i, j: j <= i + 511), 1.0))
    rows.append(("decode 32 heads S=4099 fp16", lambda: ne.attention(
        1, 32, 1, 4099, 128, "float16", mask_mod=lambda b, h, i, j: j <= i + 4098), 1.0))
    for c in examples.CHAINS:
        rows.append((f"chain:{c}", lambda c=c: examples.reduction_chain(c, 40, 333, 48), 1.0))
    sys.exit(0 if all(r["ok"] for r in rows.rows) else 1)


class _Rows:
    """Cases run as they are appended; the JSON is rewritten after each (a run cut short
    by a time limit keeps what it measured)."""

    def __init__(self, out: str, only):
        self.out, self.only, self.rows = Path(out), only, []

    def append(self, thunk):
        name, build, scale = thunk
        if self.only and not any(o in name for o in self.only):
            return
        r = case(name, build(), scale)
        self.rows.append(r)
        print(f"{'ok ' if r['ok'] else 'BAD'} {r['case']:<40} err={r['max_abs_err']:.2e} "
              f"passes={r['passes']} launches={r['launches']} fast={r['fast_launch']} "
              f"{r['fast_note']} {r['seconds']}s {r['also']}", flush=True)
        res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "cases": self.rows}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_validate.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

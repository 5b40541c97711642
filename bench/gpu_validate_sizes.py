"""Symbolic-size kernels on the GPU: one superoptimize per structure, checked at many
sizes (odd ones, decode and prefill buckets, large-magnitude scores) against the fp64
reference interpreter, and one call captured in a CUDA graph and replayed.

    python bench/gpu_validate_sizes.py [--out bench/results]

Writes gpu_validate_sizes.json; exits non-zero on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
from neptune_eq.frontend import examples  # noqa: E402
from neptune_eq.interp import evaluate  # noqa: E402
from neptune_eq.sizes import bind  # noqa: E402

TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


def structures():
    slopes = ne.placeholder((8,), "float32", "slopes")
    yield "causal prefill S", ne.attention(1, 8, "S", "S", 64, "float16",
                                           mask_mod=lambda b, h, i, j: j <= i), \
        [{"S": s} for s in (1, 17, 100, 257, 1000, 2049)]
    yield "GQA decode T, batch B", ne.attention("B", 8, 1, "T", 128, "float16", kv_heads=2), \
        [{"B": b, "T": t} for b, t in ((1, 5), (2, 300), (1, 4099), (3, 20000))]
    yield "ALiBi+softcap prefill Sq x Skv (bf16)", ne.attention(
        1, 8, "Sq", "Skv", 128, "bfloat16",
        score_mod=lambda s, b, h, i, j: ne.tanh((s + slopes[h] * (j - i)) / 30) * 30), \
        [{"Sq": a, "Skv": b} for a, b in ((33, 65), (128, 1000), (1, 333))]
    yield "softmax N x M (fp32)", examples.softmax("N", "M", "float32"), \
        [{"N": n, "M": m} for n, m in ((3, 5), (64, 1000), (7, 4099))]


def run_structure(name, out, sizes, scale_cases=(1.0, 30.0)):
    t0 = time.perf_counter()
    kern = ne.superoptimize(out, target="cuda", cache=False, sizes=sizes[0])
    cold = time.perf_counter() - t0
    rows, ok = [], True
    for values in sizes:
        prog = bind(kern.input_program, values)
        for scale in scale_cases:
            ins = {ph.name: (torch.randn(ph.shape, dtype=torch.float64) * scale).to(getattr(torch, ph.dtype))
                   for ph in prog.inputs}
            got = kern(*[ins[p.name].cuda() for p in prog.inputs]).cpu()
            ref = evaluate(prog, ins)[prog.outputs[0]]
            dt = prog.dtype_of(prog.outputs[0])
            err = (got.double() - ref).abs().max().item()
            bound = TOL[dt] * max(1.0, ref.abs().max().item())
            good = bool(torch.isfinite(got).all()) and err <= bound
            ok &= good
            rows.append({"sizes": values, "scale": scale, "max_abs_err": err, "bound": bound, "ok": good})
    # one call captured in a CUDA graph, replayed on new data of the same size
    values = sizes[-1]
    prog = bind(kern.input_program, values)
    ins = [torch.randn(ph.shape, device="cuda").to(getattr(torch, ph.dtype)) for ph in prog.inputs]
    kern(*ins)  # warm: compile and launcher outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_g = kern(*ins)
    for t in ins:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    g.replay()
    torch.cuda.synchronize()
    ref = evaluate(prog, {ph.name: t.cpu() for ph, t in zip(prog.inputs, ins)})[prog.outputs[0]]
    gerr = (out_g.cpu().double() - ref).abs().max().item()
    gok = gerr <= TOL[prog.dtype_of(prog.outputs[0])] * max(1.0, ref.abs().max().item())
    return {"structure": name, "cold_s": cold, "saturations": kern.saturations,
            "bucket_choices": kern._dispatch.bucket_choices, "buckets": kern.buckets,
            "checks": rows, "cuda_graph": {"sizes": values, "max_abs_err": gerr, "ok": gok},
            "ok": ok and gok}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    import triton
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "results": []}
    path = Path(args.out) / "gpu_validate_sizes.json"
    for name, out, sizes in structures():
        try:
            res = run_structure(name, out, sizes)
        except Exception as e:  # noqa: BLE001 - record and go on: the report is the point
            res = {"structure": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        report["results"].append(res)
        print(json.dumps({k: v for k, v in res.items() if k not in ("checks", "buckets")}), flush=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(0 if all(r["ok"] for r in report["results"]) else 1)


if __name__ == "__main__":
    main()

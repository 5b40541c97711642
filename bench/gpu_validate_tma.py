"""GPU check of the lowering variants: every pointer / TMA / warp-specialised tile config
of the chosen kernel, each against the fp64 reference, on odd sizes too.

    python bench/gpu_validate_tma.py [--out $OUT] [--only causal gqa ...] [--all-configs]
                                     [--symbolic]

For each case the kernel is superoptimized for CUDA; then the configs the timer may pick
(``prune_configs`` with generous quotas, or every config with ``--all-configs``) are
compiled on threads and each one is launched into fresh NaN-filled outputs and compared
with the reference interpreter in fp64.  A config that fails to compile is recorded with
its reason (that is the timer's job to skip); a config that compiles and differs is BAD.
Also checks the pointer fallback: a TMA config called on a K view whose row stride is
not a 16-byte multiple.  ``--symbolic`` runs the cases whose sizes are named ("S"):
each config of the bucket chosen at the first size is launched at every listed size of
that bucket with the sizes passed at run time -- the check warp specialisation needs
before it is on by default.  Writes gpu_validate_tma.json after each case; exit 1 on
any BAD.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

import neptune_eq as ne
from neptune_eq.choosing import choose as ch
from neptune_eq.choosing.costmodel import device_for
from neptune_eq.frontend import examples
from neptune_eq.interp import evaluate
from neptune_eq.runtime.launcher import Launcher
from neptune_eq.runtime.tile_configs import candidate_configs
from neptune_eq.runtime.tuning import compile_in_parallel
from neptune_eq.sizes import bind

TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


def cases():
    causal = lambda off: (lambda b, h, i, j: j <= i + off)  # noqa: E731
    return [
        ("global fp16 B=2 H=4 S=1000 D=128", lambda: ne.attention(2, 4, 1000, 1000, 128, "float16"), 1.0),
        ("global bf16 B=3 H=2 S=3000 D=64", lambda: ne.attention(3, 2, 3000, 3000, 64, "bfloat16"), 1.0),
        ("causal fp16 H=4 S=777 D=128", lambda: ne.attention(1, 4, 777, 777, 128, "float16",
                                                             mask_mod=causal(0)), 1.0),
        ("causal bf16 rows without keys S=300", lambda: ne.attention(1, 2, 300, 300, 64, "bfloat16",
                                                                     mask_mod=causal(-7)), 1.0),
        ("gqa fp16 8/2 heads S=1029 D=128", lambda: ne.attention(1, 8, 1029, 1029, 128, "float16",
                                                                 kv_heads=2), 1.0),
        ("gqa causal bf16 16/2 heads S=515 D=64", lambda: ne.attention(2, 16, 515, 515, 64, "bfloat16",
                                                                       kv_heads=2, mask_mod=causal(0)), 1.0),
        ("global fp16 scores x30 S=333 D=64", lambda: ne.attention(1, 2, 333, 333, 64, "float16"), 30.0),
        ("decode fp16 32/8 heads S=4099", lambda: ne.attention(1, 32, 1, 4099, 128, "float16", kv_heads=8,
                                                               mask_mod=causal(4098)), 1.0),
        ("attention fp16 H=2 20x37 D=24", lambda: examples.attention(1, 2, 20, 37, 24, "float16"), 1.0),
        ("softmax fp32 64x1000", lambda: examples.softmax(64, 1000), 1.0),
        ("softmax fp16 37x4100", lambda: examples.softmax(37, 4100), 1.0),
    ]


def symbolic_cases():
    """(name, build, sizes, causal): the first size chooses the bucket, the others share
    it.  Non-causal, one-pass kernels: the form warp specialisation is offered for."""
    return [
        ("global fp16 H=16 S D=128", lambda: ne.attention(1, 16, "S", "S", 128, "float16"),
         [{"S": s} for s in (6000, 4500, 5001, 7777, 8000)], False),
        ("gqa bf16 16/4 heads S D=128", lambda: ne.attention(
            1, 16, "S", "S", 128, "bfloat16", kv_heads=4),
         [{"S": s} for s in (6000, 4500, 5003, 7001)], False),
        ("causal fp16 H=16 S D=128", lambda: ne.attention(
            1, 16, "S", "S", 128, "float16", mask_mod=lambda b, h, i, j: j <= i),
         [{"S": s} for s in (6000, 4500, 7001)], True),
    ]


def torch_reference(ins: dict, causal: bool) -> torch.Tensor:
    """Plain attention in fp64 with torch matmuls (the interpreter's fp64 reference
    broadcasts S x S x D: 50+ GB at these sizes)."""
    q, k, v = (ins[n].double() for n in ("q", "k", "v"))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def run_symbolic_case(name, build, sizes, causal, all_configs):
    """Every config of the first size's bucket, at each size the bucket's guards admit,
    against plain attention in fp64."""
    t0 = time.perf_counter()
    kern = ne.superoptimize(build(), target="cuda", cache=False, sizes=sizes[0])
    (choice,) = [c for cs in kern._dispatch.buckets.values() for c in cs]
    row = choice.row
    configs = candidate_configs(row.kernel.concrete(sizes[0]), "cuda")
    if not all_configs:
        ch.TMA_KEEP, ch.WS_KEEP = 4, 6
        configs = ch.prune_configs(row.plan, configs, device_for(torch.cuda.get_device_name()))
    rows = []
    for values in sizes:
        if not choice.guards.hold(values):
            rows.append({"sizes": values, "status": "outside the bucket (not run)"})
            continue
        prog = bind(kern.input_program, values)
        ins = {ph.name: torch.randn(ph.shape, dtype=torch.float64).to(getattr(torch, ph.dtype))
               for ph in prog.inputs}
        ref = torch_reference(ins, causal)
        dt = prog.dtype_of(prog.outputs[0])
        ks = row.kernel.concrete(values)
        run_prog = bind(row.program, values)
        size_args = tuple(values[s] for s in ks.size_params)
        rows += [check_row({"sizes": values, "config": str(cfg)}, run_prog, ks, cfg.at(values),
                           ins, ref, dt, size_args) for cfg in configs]
    return {"case": name, "ok": not any(r["status"] == "BAD" for r in rows),
            "chosen": str(choice.config), "guards": str(choice.guards), "configs": rows,
            "fallback": None, "seconds": round(time.perf_counter() - t0, 1)}


def check(prog, ks, cfg, ins, ref, dt, tensors_override=None, size_args=()):
    """One config launched into NaN-filled outputs (checked launch, then the direct one)
    against ``ref``: (ok, max error, the launcher)."""
    outs = {n: torch.full(prog.shape_of(n), float("nan"), dtype=getattr(torch, prog.dtype_of(n)),
                          device="cuda") for n in prog.outputs}
    dev = {k: v.cuda() for k, v in ins.items()}
    dev.update(tensors_override or {})
    la = Launcher(prog, ks, "cuda", cfg, size_args)
    for _ in range(2):  # the checked launch, then the direct one
        la({**dev, **outs})
    torch.cuda.synchronize()
    got = outs[prog.outputs[0]].cpu()
    err = (got.double() - ref).abs().max().item()
    ok = bool(torch.isfinite(got).all()) and err <= TOL[dt] * max(1.0, ref.abs().max().item())
    return ok, err, la


def check_row(row: dict, prog, ks, cfg, ins, ref, dt, size_args=()) -> dict:
    """``row`` with the outcome of ``check``: ok / BAD with the error, or why the config
    did not compile (that is the timer's to skip, not a wrong result)."""
    try:
        ok, err, la = check(prog, ks, cfg, ins, ref, dt, size_args=size_args)
        return {**row, "status": "ok" if ok else "BAD", "err": err,
                "tma_used": la.tma and la._pointer_twin is None}
    except Exception as e:  # noqa: BLE001 - a config that does not compile: recorded
        msg = [x for x in str(e).strip().splitlines() if x.strip()]
        return {**row, "status": "compile failed",
                "reason": (msg[-1] if msg else type(e).__name__)[:300]}


def run_case(name, build, scale, all_configs, all_candidates=False):
    """The chosen kernel's configs -- or, with ``all_candidates``, every config of every
    candidate that lowered: the timer may pick any of them."""
    t0 = time.perf_counter()
    kern = ne.superoptimize(build(), target="cuda", cache=False)
    prog = kern.input_program
    ins = {ph.name: (torch.randn(ph.shape, dtype=torch.float64) * scale).to(getattr(torch, ph.dtype))
           for ph in prog.inputs}
    ref = evaluate(prog, ins)[prog.outputs[0]]
    dt = prog.dtype_of(prog.outputs[0])
    kernels = ([(r.description, r.program, r.kernel, r.plan) for r in kern.candidates if r.kernel]
               if all_candidates else [("chosen", kern.program, kern.kernel_source, kern.plan)])
    dev = {k: v.cuda() for k, v in ins.items()}
    outs = {n: torch.empty(prog.shape_of(n), dtype=getattr(torch, prog.dtype_of(n)), device="cuda")
            for n in prog.outputs}
    rows, fallback = [], None
    for which, kprog, ks, plan in kernels:
        configs = candidate_configs(ks, "cuda")
        if not all_configs:
            ch.TMA_KEEP, ch.WS_KEEP = 4, 6
            configs = ch.prune_configs(plan, configs, device_for(torch.cuda.get_device_name()))
        compile_in_parallel([(kprog, ks, c) for c in configs], "cuda", {**dev, **outs})
        rows += [check_row({"candidate": which, "config": str(cfg)}, kprog, ks, cfg, ins, ref, dt)
                 for cfg in configs]
        tma_cfgs = [c for c in configs if c.tma]
        k_in = prog.inputs[1].name if len(prog.inputs) > 1 else None
        if fallback is None and tma_cfgs and k_in and len(prog.shape_of(k_in)) == 4:
            kk = ins[k_in]  # a K view with a 2-element pad per row
            wide = torch.zeros(*kk.shape[:-1], kk.shape[-1] + 2, dtype=kk.dtype, device="cuda")
            view = wide[..., :kk.shape[-1]]
            view.copy_(kk.cuda())
            ok, err, la = check(kprog, ks, tma_cfgs[0], ins, ref, dt, {k_in: view})
            fallback = {"ok": ok, "err": err, "pointer_twin": la._pointer_twin is not None}
    bad = [r for r in rows if r["status"] == "BAD"] + ([fallback] if fallback and not fallback["ok"] else [])
    return {"case": name, "ok": not bad, "chosen": str(kern.config), "configs": rows,
            "fallback": fallback, "seconds": round(time.perf_counter() - t0, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--only", nargs="*", default=None, help="cases whose name has one of these")
    ap.add_argument("--all-configs", action="store_true", help="every config, not the pruned set")
    ap.add_argument("--all-candidates", action="store_true",
                    help="every candidate that lowered, not only the chosen one")
    ap.add_argument("--symbolic", action="store_true",
                    help="the named-size cases (sizes passed at run time) instead")
    a = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "cases": []}
    todo = ([(n, lambda n=n, b=b, s=s, c=c: run_symbolic_case(n, b, s, c, a.all_configs))
             for n, b, s, c in symbolic_cases()] if a.symbolic else
            [(n, lambda n=n, b=b, s=s: run_case(n, b, s, a.all_configs, a.all_candidates))
             for n, b, s in cases()])
    for name, run in todo:
        if a.only and not any(o in name for o in a.only):
            continue
        r = run()
        res["cases"].append(r)
        n = {s: sum(c["status"] == s for c in r["configs"]) for s in ("ok", "BAD", "compile failed")}
        tma_ok = sum(c["status"] == "ok" and c.get("tma_used") for c in r["configs"])
        ws_ok = sum(c["status"] == "ok" and "warp-specialized" in c.get("config", "") for c in r["configs"])
        print(f"{'ok ' if r['ok'] else 'BAD'} {name:<42} {n} tma-ok={tma_ok} ws-ok={ws_ok} "
              f"fallback={r['fallback']} chosen [{r['chosen']}] {r['seconds']}s", flush=True)
        for c in r["configs"]:
            if c["status"] != "ok":
                print(f"      {c['status']}: {c.get('candidate', '')} [{c.get('config', c.get('sizes'))}] "
                      f"{c.get('reason', c.get('err'))}", flush=True)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / ("gpu_validate_tma_symbolic.json" if a.symbolic
                        else "gpu_validate_tma.json")).write_text(json.dumps(res, indent=1))
    sys.exit(0 if all(r["ok"] for r in res["cases"]) else 1)


if __name__ == "__main__":
    main()

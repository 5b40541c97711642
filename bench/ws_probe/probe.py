"""GPU probe: why do warp-specialised (WS) TMA global-attention kernels return NaN?

    python bench/ws_probe/probe.py --out $OUT [--budget 420]

Runs the sources ``gen_sources.py`` wrote (kernels/<shape>_<variant>.py) directly through
Triton -- no neptune_eq runtime -- over a matrix of tile configs, each part in its own
subprocess (a compiler abort or a hung kernel loses one part only).  Per (shape, variant,
config): compile status, shared memory, a summary of the TTGIR (did the Hopper WS pass
data-partition?), then three launches -- into a 1000.0-filled output (elements left at
1000.0 were never stored) and twice into NaN-filled outputs (bitwise determinism) --
checked against torch SDPA in fp32: NaN/inf counts, max error over finite elements, and
where the bad elements are (row blocks, columns).  Part P times the working variants at
B=1 H=32 S=8192 D=128 fp16 against SDPA in the same process.
Results: <out>/results.jsonl (one JSON per line), <out>/ttgir.txt, <out>/probe.log.
Run ``gen_sources.py`` first (it writes kernels/).  Findings: bench/results/ws_probe/README.md.
Since the fix the generated loop holds the WS ring at 2 (``descriptors.main_loop_header``),
so parts A-E no longer reproduce the NaN; part M (``mini_fa.py`` at DEPTH 3-4) still does.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
KDIR = HERE / "kernels"

# (B_i, B_L, warps, stages, loop_stages (0: = stages), tma, ws)
WS = lambda bi, bl, w, s, ls=0: (bi, bl, w, s, ls, True, True)  # noqa: E731
TMA = lambda bi, bl, w, s: (bi, bl, w, s, 0, True, False)  # noqa: E731
PTR = lambda bi, bl, w, s: (bi, bl, w, s, 0, False, False)  # noqa: E731

CFG_A = [WS(64, 64, 4, 3), WS(64, 64, 4, 3, 4), WS(64, 128, 4, 2), WS(64, 64, 8, 3),
         WS(128, 64, 4, 3), WS(128, 64, 4, 3, 4), WS(128, 64, 8, 3), WS(128, 128, 4, 2),
         WS(128, 128, 8, 2), WS(32, 128, 4, 3), WS(128, 32, 4, 3), WS(64, 128, 8, 2, 3),
         WS(64, 64, 4, 2), WS(64, 32, 4, 3)]
CFG_B = [WS(64, 128, 4, 2, 3), WS(64, 128, 4, 2), WS(64, 64, 4, 3), WS(128, 64, 4, 3),
         WS(128, 128, 4, 2), WS(128, 128, 4, 2, 3), WS(64, 64, 8, 3), WS(64, 64, 4, 2),
         WS(64, 128, 4, 3)]
CFG_C = [WS(64, 128, 4, 2, 3), WS(64, 64, 4, 3), WS(128, 64, 4, 3), WS(128, 128, 4, 2, 3)]
CFG_E = [WS(64, 64, 4, 3), WS(64, 64, 4, 3, 4), WS(64, 128, 4, 2, 3), WS(128, 64, 4, 3),
         WS(128, 128, 4, 2)]
CFG_P = [PTR(128, 64, 8, 3), TMA(128, 64, 8, 3), TMA(128, 128, 8, 2),
         WS(128, 128, 4, 2), WS(128, 128, 4, 2, 3), WS(128, 64, 4, 3), WS(128, 64, 4, 3, 4),
         WS(128, 64, 8, 3), WS(128, 128, 8, 2), WS(64, 64, 4, 3), WS(64, 128, 4, 2)]

ALL4 = ("base", "peel", "accdot", "both")
PARTS = {  # part -> (shape, [(variant, cfg)], input scale, timed?)
    "A": ("A", [(v, c) for v in ALL4 for c in CFG_A], 1.0, False),
    "P": ("P", [("base", c) for c in CFG_P] + [("accdot", c) for c in CFG_P if c[6]], 1.0, True),
    "E": ("E", [("base", c) for c in CFG_E] + [("accdot", c) for c in CFG_E], 1.0, False),
    "B": ("B", [(v, c) for v in ALL4 for c in CFG_B], 1.0, False),
    "C": ("C", [(v, c) for v in ALL4 for c in CFG_C], 30.0, False),
}
# run 2: the generated loop now holds a WS ring of 2 whatever LOOP_STAGES says
# (descriptors.main_loop_header), so "s=3" below is kernel num_stages 3 with a ring of 2.
FIX = [WS(128, 64, 4, 2), WS(128, 128, 4, 2), WS(128, 32, 4, 2), WS(128, 64, 4, 3),
       WS(128, 128, 4, 3)]
FIX_P = [PTR(128, 64, 8, 3), TMA(128, 64, 8, 3)] + FIX
PARTS.update({
    "FA": ("A", [("base", c) for c in FIX] + [("base", WS(64, 64, 4, 2))], 1.0, False),
    "FB": ("B", [("base", c) for c in FIX], 1.0, False),
    "FC": ("C", [("base", c) for c in FIX], 30.0, False),
    "FE": ("E", [("base", c) for c in FIX], 1.0, False),
    "K": ("K", [("base", c) for c in (WS(64, 64, 8, 3), WS(128, 128, 8, 2), WS(128, 64, 8, 3),
                                       WS(128, 64, 4, 2), TMA(64, 64, 4, 3))], 1.0, False),
    "P2": ("P", [("base", c) for c in FIX_P] + [("accdot", c) for c in FIX], 1.0, True),
})
ORDER = ["FA", "FB", "FC", "FE", "K", "M", "P2"]
PART_LIMIT = {"A": 170, "P": 150, "E": 80, "B": 120, "C": 70, "FA": 60, "FB": 60, "FC": 50,
              "FE": 50, "K": 60, "M": 70, "P2": 120}
CAUSAL = {"K"}
TOL = {"float16": 3e-3, "bfloat16": 2e-2}
DUMP = {("A", "base", WS(64, 64, 4, 2)), ("A", "base", WS(128, 64, 4, 2)),
        ("K", "base", WS(128, 64, 8, 3))}


def cfg_str(c):
    bi, bl, w, s, ls, tma, ws = c
    return (f"B_i={bi} B_L={bl} w={w} s={s}" + (f" ls={ls}" if ls else "")
            + (" tma" if tma else " ptr") + (" WS" if ws else ""))


def load(shape, variant, kname):
    spec = importlib.util.spec_from_file_location(f"ws_{shape}_{variant}", KDIR / f"{shape}_{variant}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, kname)


def run_part(part: str, out: Path) -> None:
    import torch
    import triton
    from triton.testing import do_bench

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    man = json.loads((KDIR / "manifest.json").read_text())
    shape, jobs, scale, timed = PARTS[part]
    m = man[shape]
    b, h, s, d, dt = m["shape"]
    tdt = getattr(torch, dt)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = ((torch.randn(b, h, s, d, device="cuda", generator=g) * scale).to(tdt) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=shape in CAUSAL)
    tol = TOL[dt] * max(1.0, ref.abs().max().item())
    fns = {var: load(shape, var, m["kernel"]) for var in {j[0] for j in jobs}}
    log = open(out / "probe.log", "a")

    def say(msg):
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    def call_args(c, o):
        bi, bl, w, st, ls, tma, ws = c
        t = {"q": q, "k": k, "v": v, "o": o}
        strides = [t[n].stride(i) for n, i in m["stride_params"]]
        consts = dict(m["tunables"])
        consts.update(B_i=bi, B_L=bl, TMA=tma, WS=ws, LOOP_STAGES=ls or st)
        for flag, (blk, ext) in m["even_flags"].items():
            consts[flag] = all(e % consts[blk] == 0 for e in ext)
        grid = (triton.cdiv(m["row_extent"], bi), m["grid_size"])
        return [q, k, v, o, *strides], consts, grid, dict(num_warps=w, num_stages=st)

    o0 = torch.empty_like(q)

    def compile_one(job):
        var, c = job
        args, consts, grid, opts = call_args(c, o0)
        t0 = time.perf_counter()
        try:
            ck = fns[var].warmup(*args, grid=grid, **consts, **opts)
            return job, ck, None, time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            msg = [x for x in str(e).strip().splitlines() if x.strip()]
            return job, None, (msg[-1] if msg else type(e).__name__)[:400], time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        compiled = list(pool.map(compile_one, jobs))
    say(f"[{part}] compiled {len(jobs)} kernels in {time.perf_counter() - t0:.1f}s")
    sdpa_ms = None
    if timed:
        qf, kf, vf = q, k, v
        sdpa_ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qf, kf, vf))
        flops = 4 * b * h * s * s * d
        say(f"[{part}] SDPA {sdpa_ms:.3f} ms = {flops / sdpa_ms / 1e9:.1f} TFLOP/s")
    for (var, c), ck, err, secs in compiled:
        row = {"part": part, "shape": shape, "variant": var, "config": cfg_str(c), "cfg": c,
               "compile_s": round(secs, 1)}
        if ck is None:
            row.update(status="compile failed", reason=err)
            say(f"[{part}] {var:6s} {cfg_str(c):36s} COMPILE FAILED: {err}")
            _write(out, row)
            continue
        ttgir = ck.asm.get("ttgir", "")
        row.update(shared=ck.metadata.shared, ttgir_summary=_summary(ttgir))
        if (shape, var, c) in DUMP:
            with open(out / "ttgir.txt", "a") as f:
                f.write(f"\n\n===== {shape} {var} {cfg_str(c)} =====\n{ttgir}\n")
        outs = []
        try:
            for fill in (1000.0, float("nan"), float("nan")):
                o = torch.full_like(q, fill)
                args, consts, grid, opts = call_args(c, o)
                fns[var][grid](*args, **consts, **opts)
                torch.cuda.synchronize()
                outs.append(o)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at launch
            msg = [x for x in str(e).strip().splitlines() if x.strip()]
            row.update(status="launch failed", reason=(msg[-1] if msg else type(e).__name__)[:300])
            say(f"[{part}] {var:6s} {cfg_str(c):36s} LAUNCH FAILED: {row['reason']}")
            _write(out, row)
            continue
        row.update(_diagnose(outs, ref, tol, c[0], torch))
        if timed and row["ok"]:
            args, consts, grid, opts = call_args(c, o0)
            ms = do_bench(lambda: fns[var][grid](*args, **consts, **opts))
            row.update(ms=ms, tflops=4 * b * h * s * s * d / ms / 1e9, vs_sdpa=sdpa_ms / ms)
        say(f"[{part}] {var:6s} {cfg_str(c):36s} {'ok ' if row['ok'] else 'BAD'} "
            f"nan={row['nan']} inf={row['inf']} unstored={row['unstored']} err={row['err_finite']:.2e} "
            f"det={row['deterministic']} bad_rowblocks={row['bad_rowblocks']} bad_cols={row['bad_cols']} "
            f"smem={row['shared']} {row['ttgir_summary']}"
            + (f" {row['tflops']:.1f} TF/s {row['vs_sdpa']:.3f}x SDPA" if 'ms' in row else ""))
        _write(out, row)


def run_mini(out: Path) -> None:
    """The from-scratch kernel (mini_fa.py) at ring depths 2, 3, 4: is a deep ring wrong
    whatever neptune_eq emits?  Then its speed at the timed shape, ring 2."""
    import math
    import torch
    import triton
    from triton.testing import do_bench
    sys.path.insert(0, str(HERE))
    from mini_fa import mini_fa
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    log = open(out / "probe.log", "a")

    def say(msg):
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()
    jobs = [(b, h, n, d, bm, bn, w, dep, ws) for (b, h, n, d) in ((2, 4, 1024, 128), (2, 4, 1024, 64))
            for (bm, bn) in ((128, 64), (128, 128)) for w in (4,) for dep in (2, 3, 4) for ws in (True,)]
    jobs += [(1, 32, 8192, 128, 128, bn, 4, 2, True) for bn in (64, 128)]
    jobs += [(1, 32, 8192, 128, 128, bn, 8, 3, False) for bn in (64, 128)]
    data = {}

    def tensors(b, h, n, d):
        if (b, h, n, d) not in data:
            g = torch.Generator(device="cuda").manual_seed(2)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).half() for _ in range(3))
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v) if n == 8192 else \
                torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
            data[(b, h, n, d)] = (q, k, v, ref)
        return data[(b, h, n, d)]

    def launch(job, o, warm=False):
        b, h, n, d, bm, bn, w, dep, ws = job
        q, k, v, _ = tensors(b, h, n, d)
        args = (q, k, v, o, 1.4426950408889634 / math.sqrt(d))
        kw = dict(N=n, D=d, BM=bm, BN=bn, DEPTH=dep, WSP=ws, num_warps=w, num_stages=dep)
        grid = (n // bm, b * h)
        if warm:
            return mini_fa.warmup(*args, grid=grid, **kw)
        return mini_fa[grid](*args, **kw)
    for job in jobs:
        tensors(*job[:4])

    def comp(job):
        try:
            return job, launch(job, torch.empty_like(tensors(*job[:4])[0]), warm=True), None
        except Exception as e:  # noqa: BLE001
            msg = [x for x in str(e).strip().splitlines() if x.strip()]
            return job, None, (msg[-1] if msg else type(e).__name__)[:300]
    with ThreadPoolExecutor(16) as pool:
        compiled = list(pool.map(comp, jobs))
    sdpa = None
    for job, ck, err in compiled:
        b, h, n, d, bm, bn, w, dep, ws = job
        name = f"mini B={b} H={h} N={n} D={d} BM={bm} BN={bn} w={w} depth={dep} ws={ws}"
        row = {"part": "M", "config": name}
        if ck is None:
            row.update(status="compile failed", reason=err)
            say(f"[M] {name}: COMPILE FAILED {err}")
            _write(out, row)
            continue
        q, k, v, ref = tensors(b, h, n, d)
        try:
            outs = []
            for fill in (1000.0, float("nan"), float("nan")):
                o = torch.full_like(q, fill)
                launch(job, o)
                torch.cuda.synchronize()
                outs.append(o)
        except Exception as e:  # noqa: BLE001
            row.update(status="launch failed", reason=str(e).strip().splitlines()[-1][:300])
            say(f"[M] {name}: LAUNCH FAILED {row['reason']}")
            _write(out, row)
            continue
        row.update(_diagnose(outs, ref.float(), 3e-3 * max(1.0, ref.abs().max().item()), bm, torch),
                   ttgir_summary=_summary(ck.asm.get("ttgir", "")), shared=ck.metadata.shared)
        extra = ""
        if n == 8192 and row["ok"]:
            if sdpa is None:
                sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
            o = torch.empty_like(q)
            ms = do_bench(lambda: launch(job, o))
            fl = 4 * b * h * n * n * d
            row.update(ms=ms, tflops=fl / ms / 1e9, vs_sdpa=sdpa / ms, sdpa_tflops=fl / sdpa / 1e9)
            extra = f" {row['tflops']:.1f} TF/s {row['vs_sdpa']:.3f}x SDPA ({row['sdpa_tflops']:.1f})"
        say(f"[M] {name}: {'ok ' if row['ok'] else 'BAD'} nan={row['nan']} unstored={row['unstored']} "
            f"err={row['err_finite']:.2e} det={row['deterministic']} rowblocks={row['bad_rowblocks']} "
            f"{row['ttgir_summary']}{extra}")
        _write(out, row)


def _summary(ttgir: str) -> str:
    import re
    tw = re.search(r'"ttg\.total-num-warps" = (\d+)', ttgir)
    nw = re.search(r'"ttg\.num-warps" = (\d+)', ttgir)
    keys = {"wgdot": "ttng.warp_group_dot ", "ws": "ttg.warp_specialize", "task": "async_task_id",
            "wait_bar": "ttng.wait_barrier", "arrive": "ttng.arrive_barrier",
            "dot_wait": "ttng.warp_group_dot_wait", "regalloc": "setmaxnreg"}
    parts = [f"warps={nw.group(1) if nw else '?'}/{tw.group(1) if tw else '-'}"]
    parts += [f"{k}={ttgir.count(s)}" for k, s in keys.items()]
    return " ".join(parts)


def _diagnose(outs, ref, tol, bi, torch):
    o1, o2, o3 = (x.float() for x in outs)
    unstored = int((o1 == 1000.0).sum())
    bad_any = torch.zeros_like(ref, dtype=torch.bool)
    nan = inf = 0
    errf = 0.0
    for o in (o1, o2, o3):
        fin = torch.isfinite(o)
        nan += int(torch.isnan(o).sum())
        inf += int(torch.isinf(o).sum())
        e = torch.where(fin, (o - ref).abs(), torch.zeros_like(ref))
        errf = max(errf, float(e.max()))
        bad_any |= ~fin | (e > tol)
    det = bool(((o2 == o3) | (torch.isnan(o2) & torch.isnan(o3))).all())
    rows = bad_any.any(dim=-1)                      # [B, H, S]
    blocks = sorted({int(i) // bi for i in rows.nonzero()[:, 2].tolist()})
    bh = int(rows.any(dim=-1).sum())
    cols = bad_any.flatten(0, 2).any(dim=0).nonzero().flatten().tolist()
    colsum = (f"{len(cols)} cols [{cols[0]}..{cols[-1]}]" if cols else "none")
    nblocks = -(-ref.shape[2] // bi)
    return {"ok": not bool(bad_any.any()), "nan": nan, "inf": inf, "unstored": unstored,
            "err_finite": errf, "deterministic": det,
            "bad_rowblocks": f"{len(blocks)}/{nblocks} {blocks[:6]}{'...' if len(blocks) > 6 else ''}",
            "bad_heads": bh, "bad_cols": colsum, "bad_frac": float(bad_any.float().mean())}


def _write(out: Path, row: dict) -> None:
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws_probe"))
    ap.add_argument("--budget", type=float, default=420.0)
    ap.add_argument("--part", default=None)
    ap.add_argument("--parts", nargs="*", default=ORDER)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.part == "M":
        run_mini(out)
        return
    if a.part:
        run_part(a.part, out)
        return
    t0 = time.perf_counter()
    for part in a.parts:
        left = a.budget - (time.perf_counter() - t0)
        if left < 30:
            print(f"[{part}] skipped: {left:.0f}s of the budget left", flush=True)
            continue
        lim = min(PART_LIMIT[part], left)
        try:
            r = subprocess.run([sys.executable, __file__, "--out", str(out), "--part", part], timeout=lim)
            if r.returncode:
                print(f"[{part}] exited with {r.returncode}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"[{part}] killed after {lim:.0f}s (hang or slow compile)", flush=True)
        print(f"[{part}] done at {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()

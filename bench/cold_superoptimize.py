"""The first call of a new structure (issue 14: under 30 s on a GPU; issue 16: 15 s):
cold ``ne.superoptimize`` per structure, each in a fresh process with an empty Triton
cache and ``cache=False``, with the configs compiled one at a time and on threads
(``NEPTUNE_EQ_COMPILE_THREADS``).  Prints where the time went (``Kernel.build_stages``).

    python bench/cold_superoptimize.py [--threads 1 8]   # writes bench/results/cold_superoptimize.{json,md}
    python bench/cold_superoptimize.py --ops window-pf:8192 causal-dc:8192 --out DIR

``--ops`` takes bench/neptune_ops.py's operators at a length (``op:S``), built as that
benchmark builds them (``top_k=2``), and splits the choice's time into compiling (the
thread pool, ``runtime.tuning.compile_in_parallel``) and timing (``time_configs``: the
first launch of each config, its checks and its timed replays).  ``--backward
variant:S`` times a first training step of bench/backward_gpu.py's variant (bf16, B=2,
H=16, D=128) through ``ne.flex_attention``, kernel by kernel (each ``superoptimize`` it
makes: the forward, the row statistics, dQ, dK/dV and the fused form).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"

STRUCTURES = {
    "causal prefill (L=S symbolic), 32 heads, D=128, fp16":
        'ne.attention(1, 32, "L", "L", 128, "float16", mask_mod=lambda b, h, i, j: j <= i)',
    "GQA decode (T symbolic), 32/8 heads, D=128, fp16":
        'ne.attention(1, 32, 1, "T", 128, "float16", kv_heads=8)',
    "global prefill S=4096, 32 heads, D=128, fp16":
        'ne.attention(1, 32, 4096, 4096, 128, "float16")',
}

# Both children clock the choice's two stages (the compile pool, the timing) alike.
CLOCK = """split = {"compile": 0.0, "time": 0.0}

def _clocked(name, fn):  # how long the choice spends compiling vs timing
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            split[name] += time.perf_counter() - t
    return run

_choose.compile_in_parallel = _clocked("compile", _choose.compile_in_parallel)
_choose.time_configs = _clocked("time", _choose.time_configs)
"""

CHILD = """
import json, sys, time
import neptune_eq as ne
from neptune_eq.choosing import choose as _choose
{clock}sys.path.insert(0, "bench")
{setup}
t0 = time.perf_counter()
kern = ne.superoptimize({expr}, target="cuda", cache=False, top_k={top_k})
total = time.perf_counter() - t0
timed = sum(len(r.timings) for r in kern.candidates)
print("RESULT " + json.dumps({{"total_s": total, "stages": kern.build_stages, "configs_timed": timed,
                              "split": split, "chosen": kern.chosen_row.description,
                              "config": str(kern.config)}}))
"""


BACKWARD_CHILD = """
import json, sys, time
import torch
import neptune_eq as ne
from neptune_eq import api
from neptune_eq.choosing import choose as _choose
sys.path.insert(0, "bench")
import backward_gpu as bg
kernels = []
{clock}_superoptimize = api.superoptimize

def logged(program, *a, **k):
    before = dict(split)
    t = time.perf_counter()
    kern = _superoptimize(program, *a, **k)
    kernels.append({{"outputs": list(kern.program.outputs), "s": time.perf_counter() - t,
                     "compile": split["compile"] - before["compile"],
                     "time": split["time"] - before["time"],
                     "configs_timed": sum(len(r.timings) for r in kern.candidates),
                     "config": str(kern.config)}})
    return kern

api.superoptimize = logged
kw, q, k, v, g = bg.step_tensors({variant!r}, {S})
t0 = time.perf_counter()
bg.step(lambda q, k, v: ne.flex_attention(q, k, v, **kw), q, k, v, g)
torch.cuda.synchronize()
total = time.perf_counter() - t0
print("RESULT " + json.dumps({{"total_s": total, "kernels": kernels, "split": split}}))
"""


def one(expr: str, threads: int, setup: str = "", top_k: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "NEPTUNE_EQ_COMPILE_THREADS": str(threads),
               "NEPTUNE_EQ_CACHE": cache, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        r = subprocess.run([sys.executable, "-c", CHILD.format(expr=expr, setup=setup, top_k=top_k, clock=CLOCK)], capture_output=True,
                           text=True, env=env, cwd=ROOT)
    return _result(r)


def _result(r) -> dict:
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:]}
    return json.loads(line[len("RESULT "):])


def backward_step(variant: str, S: int, threads: int) -> dict:
    """A first fwd+bwd step in a fresh process: seconds in all and per kernel built."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "NEPTUNE_EQ_COMPILE_THREADS": str(threads),
               "NEPTUNE_EQ_CACHE": cache, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        r = subprocess.run([sys.executable, "-c", BACKWARD_CHILD.format(variant=variant, S=S, clock=CLOCK)],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    return _result(r)


def main():
    import argparse
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, max(1, min(16, os.cpu_count() or 1))])
    ap.add_argument("--ops", nargs="+", default=None,
                    help="bench/neptune_ops.py operators at a length, op:S (e.g. gqa-pf:32768)")
    ap.add_argument("--backward", nargs="+", default=None,
                    help="bench/backward_gpu.py variants at a length, variant:S (e.g. causal:8192)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.backward:
        return backward_main(args)
    if args.ops:
        jobs = [(o, "import neptune_ops as ops\nprogram = ops.build(%r, %d)[0]" % (o.split(":")[0],
                 int(o.split(":")[1])), "program", 2) for o in args.ops]
    else:
        jobs = [(name, "", expr, 3) for name, expr in STRUCTURES.items()]
    rows = []
    for name, setup, expr, top_k in jobs:
        for threads in args.threads:
            res = {"structure": name, "threads": threads, **one(expr, threads, setup, top_k)}
            rows.append(res)
            print(json.dumps(res), flush=True)
    out = {"device": torch.cuda.get_device_name(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_superoptimize.json").write_text(json.dumps(out, indent=1))
    command = " ".join(["python bench/cold_superoptimize.py"] + sys.argv[1:])
    lines = [f"# Cold superoptimize per structure ({out['device']})", "",
             f"Command: `{command}` (fresh process, empty Triton cache, "
             "`cache=False`; threads = configs compiled at once; `compile` and `time` split "
             "the choice's stage: the thread pool's compiles, and each config's first launch, "
             "checks and timed runs).", "",
             "| structure | threads | total s | saturate | extract | lower, compile, time "
             "| (compile) | (time) | validate | configs timed | chosen config |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['structure']} | {r['threads']} | error: {r['error']} | | | | | | | | |")
            continue
        s, sp = r["stages"], r.get("split", {})
        lines.append(f"| {r['structure']} | {r['threads']} | {r['total_s']:.1f} | {s.get('saturate', 0):.1f} | "
                     f"{s.get('extract', 0):.1f} | {s.get('lower, compile and time', 0):.1f} | "
                     f"{sp.get('compile', 0):.1f} | {sp.get('time', 0):.1f} | "
                     f"{s.get('validate', 0):.1f} | {r['configs_timed']} | {r.get('config', '')} |")
    (args.out / "cold_superoptimize.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def backward_main(args) -> None:
    import torch
    rows = []
    for spec in args.backward:
        variant, S = spec.rsplit(":", 1)
        res = {"step": spec, "threads": args.threads[-1], **backward_step(variant, int(S), args.threads[-1])}
        rows.append(res)
        print(json.dumps(res), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_backward_step.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    command = " ".join(["python bench/cold_superoptimize.py"] + sys.argv[1:])
    lines = [f"# A first training step, kernel by kernel ({torch.cuda.get_device_name()})", "",
             f"Command: `{command}` (fresh process, empty caches; bf16, B=2, H=16, D=128; "
             "each row a `superoptimize` the step made).", "",
             "| step | total s | kernel (its outputs) | s | compile | time | configs timed | chosen config |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['step']} | error: {r['error']} | | | | | | |")
            continue
        for n, k in enumerate(r["kernels"]):
            head = f"| {r['step']} | {r['total_s']:.1f} " if n == 0 else "| | "
            lines.append(head + f"| {', '.join(k['outputs'])} | {k['s']:.1f} | {k['compile']:.1f} "
                         f"| {k['time']:.1f} | {k['configs_timed']} | {k['config']} |")
    (args.out / "cold_backward_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""How a cold choice's compiles scale: the configs ``choose`` would compile for an
operator, compiled on 1..N threads (what ``runtime.tuning.compile_in_parallel`` does)
and on N worker processes, each mode in a fresh process with an empty Triton cache.

    python bench/compile_scaling.py --ops causal-dc:8192 gqa-pf:2048 --modes t1 t16 p8 p16 --out DIR
    python bench/compile_scaling.py --save-jobs DIR --ops ...   # on CPU: the jobs, pickled
    python bench/compile_scaling.py --jobs DIR --ops ...        # on the GPU: compile them

(The jobs come from a choice in the interpreter; where the GPU machine's Triton cannot run
its interpreter, build them on a CPU machine with ``--save-jobs`` and carry them over.)

A thread spends part of each compile in Triton's Python front end (holding the GIL);
processes do not share it but pay their start-up (importing torch and Triton, a CUDA
context).  ``p`` modes report that start-up apart from the compiles.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def jobs_of(op: str, S: int) -> list:
    """(program, kernel source, config) for every config a cold choice of ``op`` at
    length ``S`` compiles (the top two candidates, pruned as ``choose`` prunes)."""
    import neptune_ops as ops
    import neptune_eq as ne
    from neptune_eq.choosing.choose import PRUNE_RATIO, prune_configs
    from neptune_eq.choosing.costmodel import DEFAULT_DEVICE, DEVICES
    from neptune_eq.runtime.tile_configs import candidate_configs
    kern = ne.superoptimize(ops.build(op, S)[0], target="interpreter", cache=False)
    rows = [r for r in kern.candidates if r.kernel is not None][:2]
    out = []
    for r in rows:
        if r.predicted_us <= PRUNE_RATIO * rows[0].predicted_us:
            for c in prune_configs(r.plan, candidate_configs(r.kernel, "cuda", 132),
                                   DEVICES[DEFAULT_DEVICE]):
                out.append((r.program, r.kernel, c))
    return out


def _compile_one(job) -> float:
    from neptune_eq.runtime.gluon_launch import make_launcher
    from neptune_eq.runtime.timing import timing_tensors
    program, ks, cfg = job
    t = time.perf_counter()
    make_launcher(program, ks, "cuda", cfg).compile(timing_tensors(program, None))
    return time.perf_counter() - t


def _warm_worker(_=None) -> float:
    """A process pool worker's start-up: the imports and a CUDA context."""
    t = time.perf_counter()
    import importlib
    import torch
    importlib.import_module("neptune_eq")
    torch.zeros(1, device="cuda")
    return time.perf_counter() - t


def run_mode(jobs_file: str, mode: str) -> dict:
    """Compile every job in ``mode`` (``tN``: N threads, ``pN``: N processes)."""
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
    import multiprocessing as mp
    from neptune_eq.runtime.launcher import load_kernel
    jobs = pickle.loads(Path(jobs_file).read_bytes())
    n = int(mode[1:])
    for ks in {id(k): k for _, k, _ in jobs}.values():
        load_kernel(ks, False)
    t0 = time.perf_counter()
    if mode[0] == "t":
        with ThreadPoolExecutor(n) as pool:
            each = list(pool.map(_compile_one, jobs))
        return {"mode": mode, "wall_s": time.perf_counter() - t0, "start_s": 0.0,
                "per_compile_s": sorted(each)[len(each) // 2], "compiles": len(jobs)}
    with ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_warm_worker, range(n)))
        started = time.perf_counter() - t0
        each = list(pool.map(_compile_one, jobs))
    return {"mode": mode, "wall_s": time.perf_counter() - t0, "start_s": started,
            "per_compile_s": sorted(each)[len(each) // 2], "compiles": len(jobs)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="+", default=["causal-dc:8192"])
    ap.add_argument("--modes", nargs="+", default=["t1", "t16", "p8", "p16"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--save-jobs", type=Path, default=None)
    ap.add_argument("--jobs", type=Path, default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_mode(*args.child)), flush=True)
        return
    if args.save_jobs:
        args.save_jobs.mkdir(parents=True, exist_ok=True)
        for spec in args.ops:
            op, S = spec.split(":")
            (args.save_jobs / f"{op}_{S}.pkl").write_bytes(pickle.dumps(jobs_of(op, int(S))))
        return
    rows = []
    for spec in args.ops:
        op, S = spec.split(":")
        with tempfile.TemporaryDirectory() as d:
            jobs_file = args.jobs / f"{op}_{S}.pkl" if args.jobs else Path(d) / "jobs.pkl"
            if not args.jobs:
                # the e-graph in the interpreter's mode: the jobs are what a GPU choice compiles
                env = {**os.environ, "TRITON_INTERPRET": "1"}
                subprocess.run([sys.executable, "-c",
                                "import pickle,sys; sys.path.insert(0, 'bench'); import compile_scaling as c; "
                                f"open({str(jobs_file)!r}, 'wb').write(pickle.dumps(c.jobs_of({op!r}, {int(S)})))"],
                               check=True, env=env, cwd=ROOT)
            for mode in args.modes:
                env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
                env.update(TRITON_CACHE_DIR=tempfile.mkdtemp(dir=d), NEPTUNE_EQ_CACHE=tempfile.mkdtemp(dir=d))
                r = subprocess.run([sys.executable, __file__, "--child", str(jobs_file), mode],
                                   capture_output=True, text=True, env=env, cwd=ROOT)
                line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
                res = (json.loads(line[7:]) if line else
                       {"mode": mode, "error": (r.stderr or r.stdout).strip()[-400:]})
                rows.append({"op": spec, **res})
                print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_scaling.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

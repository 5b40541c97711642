"""The first call of a new structure (issue 14: under 30 s on a GPU; issue 16: 15 s):
cold ``ne.superoptimize`` per structure, each in a fresh process with an empty Triton
cache and ``cache=False``, with the configs compiled one at a time and on threads
(``NEPTUNE_EQ_COMPILE_THREADS``).  Prints where the time went (``Kernel.build_stages``).

    python bench/cold_superoptimize.py [--threads 1 8]   # writes bench/results/cold_superoptimize.{json,md}
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

CHILD = """
import json, sys, time
import neptune_eq as ne
t0 = time.perf_counter()
kern = ne.superoptimize({expr}, target="cuda", cache=False)
total = time.perf_counter() - t0
timed = sum(len(r.timings) for r in kern.candidates)
print("RESULT " + json.dumps({{"total_s": total, "stages": kern.build_stages, "configs_timed": timed,
                              "chosen": kern.chosen_row.description, "config": str(kern.config)}}))
"""


def one(expr: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "NEPTUNE_EQ_COMPILE_THREADS": str(threads),
               "NEPTUNE_EQ_CACHE": cache, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        r = subprocess.run([sys.executable, "-c", CHILD.format(expr=expr)], capture_output=True,
                           text=True, env=env, cwd=ROOT)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:]}
    return json.loads(line[len("RESULT "):])


def main():
    import argparse
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, max(1, min(16, os.cpu_count() or 1))])
    args = ap.parse_args()
    rows = []
    for name, expr in STRUCTURES.items():
        for threads in args.threads:
            res = {"structure": name, "threads": threads, **one(expr, threads)}
            rows.append(res)
            print(json.dumps(res), flush=True)
    out = {"device": torch.cuda.get_device_name(), "rows": rows}
    OUT.mkdir(exist_ok=True)
    (OUT / "cold_superoptimize.json").write_text(json.dumps(out, indent=1))
    lines = [f"# Cold superoptimize per structure ({out['device']})", "",
             f"Command: `python bench/cold_superoptimize.py --threads {' '.join(map(str, args.threads))}` (fresh process, empty Triton cache, "
             "`cache=False`; threads = configs compiled at once).", "",
             "| structure | threads | total s | saturate | extract | lower, compile, time | validate | configs timed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['structure']} | {r['threads']} | error: {r['error']} | | | | | |")
            continue
        s = r["stages"]
        lines.append(f"| {r['structure']} | {r['threads']} | {r['total_s']:.1f} | {s.get('saturate', 0):.1f} | "
                     f"{s.get('extract', 0):.1f} | {s.get('lower, compile and time', 0):.1f} | "
                     f"{s.get('validate', 0):.1f} | {r['configs_timed']} |")
    (OUT / "cold_superoptimize.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

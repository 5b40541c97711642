"""Off-grid prefill sweep: bf16 and fp16, batch 2-8, head dim 64 and 128, lengths that are
not multiples of any block (3000, 5000), GQA groups 2-8, global and causal.

    python bench/offgrid.py [--dtypes bfloat16 float16] [--setups 0 1 2 ...] [--out bench/results]
                            [--merge] [--run NAME]

Peers in the same process, on the same inputs: SDPA restricted to cuDNN, SDPA restricted
to FlashAttention-2 (``torch.nn.attention.sdpa_kernel``), and FlexAttention under
torch.compile (bench/neptune_ops.py's).  Where a backend does not take grouped K/V it gets
K and V expanded to every query head beforehand (outside the timed call; the row says
so).  Every output is checked against ours before timing; TFLOP/s = 4·B·Hq·S²·D (halved
for causal).  Writes offgrid.{csv,json,md} under --out (``--merge`` keeps rows of setups
this run does not repeat).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# (batch, query heads, kv heads, S, head dim, causal): lengths off every block multiple
SETUPS = [
    (2, 32, 32, 3000, 128, False),
    (2, 32, 32, 3000, 128, True),
    (4, 16, 16, 5000, 64, False),
    (4, 16, 16, 5000, 64, True),
    (8, 32, 8, 3000, 128, False),   # GQA group 4
    (2, 32, 4, 5000, 128, True),    # GQA group 8
    (4, 16, 8, 3000, 64, True),     # GQA group 2
    (2, 32, 16, 5000, 64, False),   # GQA group 2
]
PEERS = ("cudnn", "flash", "flex")
KEYS = ["dtype", "B", "Hq", "Hkv", "S", "D", "causal", "neptune_eq", *PEERS, "vs_best_peer",
        "best_peer", "notes", "cold_s", "config", "structure", "run"]


def sdpa_peers(q, k, v, g, causal=False) -> dict:
    """name -> (callable(q, k, v), note) for SDPA restricted to cuDNN and to FlashAttention-2:
    grouped K/V where the backend takes it (tried on these inputs), else "K/V expanded" --
    the callable then wants K and V expanded to every query head, which the caller does
    beforehand, outside the timed call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def grouped(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=g > 1)

        def expanded(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            grouped(q, k, v)
            out[name] = (grouped, "")
        except Exception:  # noqa: BLE001 - this backend does not take grouped K/V (or the shape)
            out[name] = (expanded, "K/V expanded")
    return out


def peers(q, k, v, causal, g):
    """name -> (callable, note) for SDPA/cuDNN, SDPA/flash and FlexAttention."""
    import neptune_ops as nb
    out = {}
    ke, ve = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) if g > 1 else (k, v)
    for name, (fn, note) in sdpa_peers(q, k, v, g, causal).items():
        out[name] = ((lambda fn=fn: fn(q, ke, ve)) if note else (lambda fn=fn: fn(q, k, v)), note)
    if nb.FLEX is not None:
        bm = nb.create_block_mask(lambda b, h, i, j: j <= i, 1, 1, q.shape[2], k.shape[2],
                                  device="cuda") if causal else None
        out["flex"] = (lambda: nb.FLEX(q, k, v, block_mask=bm, enable_gqa=g > 1), "")
    return out


def run_setup(setup, dtype, run):
    import torch
    from triton.testing import do_bench
    import neptune_eq as ne
    b, hq, hkv, s, d, causal = setup
    g = hq // hkv
    torch.manual_seed(0)
    tdt = getattr(torch, dtype)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=tdt)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=tdt)
    v = torch.randn_like(k)
    prog = ne.attention(b, hq, s, s, d, dtype, kv_heads=hkv,
                        mask_mod=(lambda bb, h, i, j: j <= i) if causal else None)
    t0 = time.perf_counter()
    kern = ne.superoptimize(prog, target="cuda", top_k=2)
    cold = time.perf_counter() - t0
    ours = kern(q, k, v)
    work = 4 * b * hq * s * s * d / (2 if causal else 1) / 1e12
    row = {"dtype": dtype, "B": b, "Hq": hq, "Hkv": hkv, "S": s, "D": d, "causal": causal,
           "cold_s": round(cold, 1), "config": str(kern.config), "structure": kern.chosen_row.structure,
           "run": run, "notes": "",
           # every config the cold choice timed (the JSON only): where a row trails its
           # best peer, which forms were near
           "timings": [(str(c), None if ms is None else round(ms * 1e3, 1), (err or "")[:120])
                       for c, ms, err in kern.timings]}
    row["neptune_eq"] = work / (do_bench(lambda: kern(q, k, v), warmup=25, rep=100,
                                         return_mode="median") / 1e3)
    notes = []
    tol = 3e-2 if dtype == "bfloat16" else 1e-2
    for name, (fn, note) in peers(q, k, v, causal, g).items():
        try:
            diff = (fn().float() - ours.float()).abs().max().item()
            if not diff < tol:
                row[name] = f"mismatch {diff:.2e}"
                continue
            row[name] = work / (do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3)
            if note:
                notes.append(f"{name}: {note}")
        except Exception as ex:  # noqa: BLE001 - a peer that cannot run this shape
            row[name] = f"failed: {type(ex).__name__}"
        torch.cuda.empty_cache()
    nums = {p: row[p] for p in PEERS if isinstance(row.get(p), float)}
    if nums:
        best = max(nums, key=nums.get)
        row["best_peer"], row["vs_best_peer"] = best, row["neptune_eq"] / nums[best]
    row["notes"] = "; ".join(notes)
    print(f"{dtype:<8} B={b} {hq}/{hkv} S={s} D={d} {'causal' if causal else 'global'}: ours "
          f"{row['neptune_eq']:.0f} " + " ".join(f"{p} {x:.0f}" for p, x in nums.items())
          + f" TFLOP/s  vs best {row.get('vs_best_peer') or 0:.2f}x  cold {cold:.1f}s [{row['config']}]",
          flush=True)
    return row


def _key(r):
    return (r["dtype"], int(r["B"]), int(r["Hq"]), int(r["Hkv"]), int(r["S"]), int(r["D"]),
            str(r["causal"]) in ("True", "1", "true"))


def write(out: Path, rows: list[dict], meta: dict, merge: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if merge and (out / "offgrid.csv").exists():
        # the JSON keeps the rows' types (the CSV's are all strings)
        kept = (json.loads((out / "offgrid.json").read_text())["rows"]
                if (out / "offgrid.json").exists() else csv.DictReader(open(out / "offgrid.csv")))
        old = {_key(r): r for r in kept}
        old.update({_key(r): r for r in rows})
        rows = [old[k] for k in sorted(old)]
    with open(out / "offgrid.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, KEYS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "offgrid.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))

    def f(x):
        try:
            return f"{float(x):.2f}" if x not in (None, "") else "—"
        except (TypeError, ValueError):
            return str(x)
    md = [f"# Off-grid prefill on {meta['gpu']} (torch {meta['torch']}, triton {meta['triton']}, "
          f"{meta['date']})", "", f"Command: `{meta['command']}`", "",
          "TFLOP/s (4·B·Hq·S²·D, halved for causal); peers in the same process on the same inputs."
          + (f" The process's one-time start (CUDA context, first compiles) took "
             f"{meta['process_warmup_s']} s before the rows." if meta.get("process_warmup_s")
             else ""),
          "", "| dtype | B | Hq/Hkv | S | D | mask | neptune_eq | cuDNN | flash | Flex | vs best peer "
          "| notes | chosen config | run |", "|" + " --- |" * 14]
    for r in rows:
        mask = "causal" if str(r["causal"]) in ("True", "1", "true") else "global"
        md.append(f"| {r['dtype']} | {r['B']} | {r['Hq']}/{r['Hkv']} | {r['S']} | {r['D']} | {mask} | "
                  + " | ".join(f(r.get(k)) for k in ("neptune_eq", "cudnn", "flash", "flex", "vs_best_peer"))
                  + f" | {r.get('notes') or ''} | {r.get('config', '')} | {r.get('run', '')} |")
    ratios = [float(r["vs_best_peer"]) for r in rows if r.get("vs_best_peer") not in (None, "")]
    if ratios:
        md += ["", f"Geomean vs best peer: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x "
               f"over {len(ratios)} setups; below 0.95x: "
               f"{sum(x < 0.95 for x in ratios)}."]
    (out / "offgrid.md").write_text("\n".join(md) + "\n")


def sweep_args(doc: str, setups: list[str]) -> argparse.Namespace:
    """The command line of an off-grid sweep (this one and ``offgrid_decode.py``):
    ``setups`` describes each setup for --help."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"],
                    choices=["bfloat16", "float16"])
    ap.add_argument("--setups", type=int, nargs="+", default=list(range(len(setups))),
                    help="indices into SETUPS: " + "; ".join(
                        f"{n}: {what}" for n, what in enumerate(setups)))
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--merge", action="store_true", help="keep rows of setups not rerun")
    ap.add_argument("--run", default=time.strftime("run-%H%M"), help="label of this run's rows")
    return ap.parse_args()


def cold_process(name: str) -> dict:
    """A sweep's process made cold and its table's header: empty neptune_eq and Triton
    caches (every build a miss: no compile of an earlier run reused), and the process's
    one-time start (CUDA context, first compiles) paid before the rows and reported apart,
    as neptune_ops does -- each row's cold_s is its operator's own build (the first row of
    session 47's run took 19.6 s, the same shape in the other dtype 13.8)."""
    import os
    import tempfile
    import torch
    import triton
    os.environ["NEPTUNE_EQ_CACHE"] = tempfile.mkdtemp(prefix=f"neptune_eq_{name}_")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton_{name}_")
    from neptune_ops import process_warmup
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
            "command": "python " + " ".join(sys.argv), "process_warmup_s": process_warmup()}


def sweep(a: argparse.Namespace, name: str, setups: list, run_setup, write, failed_row) -> None:
    """Run an off-grid sweep's chosen setups in each dtype in a cold process
    (``cold_process``), writing the table after every row; a setup that fails is
    recorded (``failed_row(setup, dtype, exception, run)``) and the sweep goes on."""
    import torch
    meta = cold_process(name)
    rows = []
    for dtype in a.dtypes:
        for n in a.setups:
            try:
                rows.append(run_setup(setups[n], dtype, a.run))
            except Exception as ex:  # noqa: BLE001 - record and go on
                print(f"{dtype} setup {n}: FAILED {type(ex).__name__}: {ex}", flush=True)
                rows.append(failed_row(setups[n], dtype, ex, a.run))
            torch.cuda.empty_cache()
            write(Path(a.out), rows, meta, a.merge)


def _failed(setup, dtype, ex, run) -> dict:
    b, hq, hkv, s, d, c = setup
    return {"dtype": dtype, "B": b, "Hq": hq, "Hkv": hkv, "S": s, "D": d, "causal": c,
            "neptune_eq": f"failed: {type(ex).__name__}", "run": run}


def main():
    a = sweep_args(__doc__, [f"B={b} {hq}/{hkv} S={s} D={d}{' causal' if c else ''}"
                             for b, hq, hkv, s, d, c in SETUPS])
    sweep(a, "offgrid", SETUPS, run_setup, write, _failed)


if __name__ == "__main__":
    main()

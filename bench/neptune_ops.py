"""Neptune's ten attention operators vs SDPA, FlexAttention and torch.compile, same process.

    python bench/neptune_ops.py [--ops causal-dc gqa-pf ...] [--seqs 512 2048 8192 32768]
                                [--out bench/results] [--accuracy-max-s 2048] [--merge --run NAME]

Every neptune_eq kernel is derived by ``ne.attention`` + the rules (nothing templated),
checked against each peer's output on the same inputs before anything is timed, and
timed with ``triton.testing.do_bench`` (median).  Prefill TFLOP/s = 4·B·Hq·Sq·Skv·D
(halved for causal; Window counts min(S, W) keys); decode TB/s = bytes of K+V / time.
Peers: SDPA (cuDNN/flash; an explicit bias for ALiBi), FlexAttention under
torch.compile, and torch.compile of the plain PyTorch code (skipped where its S² scores
would not fit).  Also records cold and warm ``superoptimize`` times (warm = cache hit).
Setups with S <= --accuracy-max-s also get RMS / max error vs an fp64 reference for ours
and every peer on the same inputs (accuracy.{csv,md}).  Writes neptune_ops.{csv,json,md}
under --out; ``--merge`` keeps the rows of setups this run does not repeat (the ``run``
column says which run measured a row).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

import neptune_eq as ne
from neptune_eq.runtime.timing import copy_inputs, device_ms, input_copies, l2_bytes

torch._dynamo.config.recompile_limit = 10_000  # every shape compiles Flex/plain afresh, never eager
torch._dynamo.config.cache_size_limit = 10_000
try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    FLEX = torch.compile(flex_attention)
except Exception:  # pragma: no cover - torch without FlexAttention
    FLEX = None

D, CAP, WINDOW = 128, 50.0, 4096
OPS = {  # name: heads q/kv, decode?, causal?, alibi?, softcap?, window?
    "global-pf": (32, 32, False, False, False, False, False),
    "causal-pf": (32, 32, False, True, False, False, False),
    "alibi-pf": (32, 32, False, False, True, False, False),
    "gqa-pf": (64, 8, False, False, False, False, False),
    "softcap-pf": (32, 16, False, False, False, True, False),
    "window-pf": (32, 8, False, False, False, True, True),
    "causal-dc": (32, 32, True, True, False, False, False),
    "alibi-dc": (32, 32, True, True, True, False, False),
    "gqa-dc": (64, 8, True, True, False, False, False),
    "softcap-dc": (32, 16, True, True, False, True, False),
}


def alibi_slopes(h):
    return torch.tensor([2.0 ** (-8.0 * (k + 1) / h) for k in range(h)], dtype=torch.float32)


def build(op, S):
    """The plain program (ne), the torch score/mask mods, and the work per call."""
    hq, hkv, decode, causal, alibi, softcap, window = OPS[op]
    sq, skv = (1, S) if decode else (S, S)
    off = skv - sq  # query i sits at position i + off
    slopes = ne.placeholder((hq,), "float32", "slopes") if alibi else None

    score_mod, mask_mod = make_mods(off, alibi, softcap, window, slopes, ne.tanh)
    out = ne.attention(1, hq, sq, skv, D, "float16", kv_heads=hkv,
                       score_mod=score_mod if (alibi or softcap) else None,
                       mask_mod=mask_mod if (causal or window) else None)
    if decode:
        work, unit = 2 * 1 * hkv * skv * D * 2 / 1e12, "TB/s"
    else:
        keys = min(S, WINDOW) if window else S
        work, unit = 4 * hq * sq * keys * D / 1e12 / (2 if causal else 1), "TFLOP/s"
    return out, (hq, hkv, sq, skv, off, alibi, softcap, causal or window, window), work, unit


def make_mods(off, alibi, softcap, window, slopes, tanh):
    """score_mod / mask_mod of an operator, for ne expressions (tanh=ne.tanh) and for
    FlexAttention (tanh=torch.tanh): one definition, so both sides compute the same thing."""
    def score_mod(s, b, h, i, j):
        if alibi:
            s = s + slopes[h] * (j - (i + off))
        if softcap:
            s = tanh(s / CAP) * CAP
        return s

    def mask_mod(b, h, i, j):
        m = j <= i + off
        return (m & (i + off - j < WINDOW)) if window else m
    return score_mod, mask_mod


def reference(spec, q, k, v, slopes, dtype=torch.float32):
    """Plain attention in ``dtype`` (the fp64 oracle for the accuracy report, and what
    torch.compile gets as the plain code)."""
    hq, hkv, sq, skv, off, alibi, softcap, masked, window = spec
    g = hq // hkv
    kk, vv = k.repeat_interleave(g, 1).to(dtype), v.repeat_interleave(g, 1).to(dtype)
    s = (q.to(dtype) @ kk.transpose(-1, -2)) / math.sqrt(D)
    i = torch.arange(sq, device=q.device)[:, None] + off
    j = torch.arange(skv, device=q.device)[None, :]
    if alibi:
        s = s + slopes.to(dtype)[None, :, None, None] * (j - i)
    if softcap:
        s = torch.tanh(s / CAP) * CAP
    if masked:
        m = j <= i
        if window:
            m = m & (i - j < WINDOW)
        s = s.masked_fill(~m, float("-inf"))
    return (torch.softmax(s, -1) @ vv).to(q.dtype)


def peers(spec, q, k, v, slopes):
    """name -> callable for every peer that supports the operator."""
    hq, hkv, sq, skv, off, alibi, softcap, masked, window = spec
    out = {}
    g = hq // hkv
    if not softcap and (not alibi or sq * skv * hq * 2 <= 16 * 2 ** 30):  # SDPA+bias: S² bias
        if alibi:
            i = torch.arange(sq, device="cuda")[:, None] + off
            j = torch.arange(skv, device="cuda")[None, :]
            bias = (slopes[None, :, None, None] * (j - i)).to(q.dtype)
            if masked:
                bias = bias.masked_fill(~(j <= i), float("-inf"))
            out["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            causal = masked and sq > 1
            out["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                 enable_gqa=g > 1)
    if FLEX is not None:
        score_mod, mask_mod = make_mods(off, alibi, softcap, window, slopes, torch.tanh)
        bm = create_block_mask(mask_mod, 1, 1, sq, skv, device="cuda") if masked else None
        sm = score_mod if (alibi or softcap) else None
        out["flex"] = lambda: FLEX(q, k, v, score_mod=sm, block_mask=bm, enable_gqa=g > 1)
    if sq * skv * hq * 4 <= 8 * 2 ** 30:  # the plain code materialises S² scores
        plain = torch.compile(lambda q, k, v, s: reference(spec, q, k, v, s), dynamic=False)
        out["compile"] = lambda: plain(q, k, v, slopes)
    return out


def make_inputs(spec) -> tuple:
    """Seeded fp16 inputs of an operator on the GPU: q, k, v, slopes, and the call's args."""
    hq, hkv, sq, skv = spec[:4]
    torch.manual_seed(0)
    q = torch.randn(1, hq, sq, D, device="cuda", dtype=torch.float16)
    k = torch.randn(1, hkv, skv, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    slopes = alibi_slopes(hq).cuda()
    return q, k, v, slopes, ((q, k, v, slopes) if spec[5] else (q, k, v))


def run_op(op, S, rows, acc_rows, accuracy, run):
    out, spec, work, unit = build(op, S)
    q, k, v, slopes, args = make_inputs(spec)
    t0 = time.perf_counter()
    kern = ne.superoptimize(out, target="cuda", top_k=2)    # a miss: builds and caches
    cold = time.perf_counter() - t0
    assert kern.cache_status == "miss", kern.cache_status
    t0 = time.perf_counter()
    warm_k = ne.superoptimize(out, target="cuda", top_k=2)  # a cache hit
    warm = time.perf_counter() - t0
    ours = kern(*args)
    row = {"op": op, "S": S, "unit": unit, "neptune_eq": None, "run": run, "cold_s": round(cold, 1),
           "warm_s": round(warm, 3), "cache": warm_k.cache_status,
           "chosen": kern.chosen_row.description, "structure": kern.chosen_row.structure,
           "config": str(kern.config), "spearman": kern.ranking_spearman,
           "candidates": [(c.description, c.structure, round(c.predicted_us, 1),
                           None if c.measured_ms is None else round(c.measured_ms * 1e3, 1))
                          for c in kern.candidates]}
    if S <= accuracy:
        ref = reference(spec, q, k, v, slopes, torch.float64).double()
        for name, fn in [("neptune_eq", lambda: kern(*args))] + list(peers(spec, q, k, v, slopes).items()):
            try:
                e = fn().double() - ref
                acc_rows.append({"op": op, "S": S, "impl": name, "rms": e.pow(2).mean().sqrt().item(),
                                 "max": e.abs().max().item()})
            except Exception as ex:  # noqa: BLE001
                acc_rows.append({"op": op, "S": S, "impl": name, "rms": None, "max": None,
                                 "note": type(ex).__name__})
        del ref
        torch.cuda.empty_cache()
    row["neptune_eq"] = work / (do_bench(lambda: kern(*args), warmup=25, rep=100,
                                         return_mode="median") / 1e3)
    graphed = {"neptune_eq": lambda: kern(*args)} if unit == "TB/s" else {}
    for name, fn in peers(spec, q, k, v, slopes).items():
        try:
            theirs = fn()
            diff = (ours.float() - theirs.float()).abs().max().item()
            row[f"{name}_diff"] = diff
            if not diff < 2e-2:
                row[name] = f"mismatch {diff:.2e}"
                continue
            row[name] = work / (do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3)
            if graphed:
                graphed[name] = fn
        except Exception as ex:  # noqa: BLE001 - a peer that cannot run this shape
            row[name] = f"failed: {type(ex).__name__}"
        torch.cuda.empty_cache()
    # Decode as serving engines run it: captured in a CUDA graph, no host launch cost --
    # with the inputs left in L2 (graph_*: the same K/V every call) and read from DRAM
    # (cold_*: calls rotate over copies of the inputs larger than L2, as a model's layers
    # each read their own K/V cache; the measure tile configs are chosen by).
    copies = copy_inputs(list(args), input_copies(list(args), l2_bytes(q.device))) if graphed else []
    for name, fn in graphed.items():
        try:
            row[f"graph_{name}"] = work / (do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3)
            fns = ([lambda a=a: kern(*a) for a in copies] if name == "neptune_eq" else
                   [peers(spec, *a[:3], slopes)[name] for a in copies])
            row[f"cold_{name}"] = work / (device_ms(lambda a: a[0](), [[f] for f in fns]) / 1e3)
        except Exception as ex:  # noqa: BLE001 - an implementation that cannot be captured
            row[f"graph_{name}"] = f"failed: {type(ex).__name__}"
    for m in ("graph", "cold"):
        gnums = [row[f"{m}_{p}"] for p in ("sdpa", "flex", "compile")
                 if isinstance(row.get(f"{m}_{p}"), float)]
        if isinstance(row.get(f"{m}_neptune_eq"), float) and gnums:
            row[f"{m}_vs_best_peer"] = row[f"{m}_neptune_eq"] / max(gnums)
    nums = {p: row[p] for p in ("sdpa", "flex", "compile") if isinstance(row.get(p), float)}
    comp = {p: x for p, x in nums.items() if p in ("flex", "compile")}
    row["vs_best_peer"] = row["neptune_eq"] / max(nums.values()) if nums else None
    row["vs_best_compiler"] = row["neptune_eq"] / max(comp.values()) if comp else None
    rows.append(row)
    print(f"{op:<11} S={S:<6} ours {row['neptune_eq']:8.2f} {unit:<7} "
          + " ".join(f"{p} {x:8.2f}" for p, x in nums.items())
          + f"  best-peer {row['vs_best_peer'] or 0:.2f}x  cold {cold:.1f}s warm {warm:.3f}s "
          f"[{row['structure']}; {row['config']}]"
          + (f"  graphed: ours {row['graph_neptune_eq']:.2f} vs best {row['graph_vs_best_peer']:.2f}x"
             if isinstance(row.get("graph_vs_best_peer"), float) else ""), flush=True)


def _sci(x):
    return "—" if x is None else f"{x:.2e}"


def _read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for r in csv.DictReader(open(path)):
        for k, v in r.items():
            try:
                r[k] = float(v) if k not in ("op", "unit", "structure", "config", "run", "impl",
                                             "note") and v not in ("", None) else v
            except ValueError:
                pass
        r["S"] = int(r["S"])
        out.append(r)
    return out


def _merged(old: list[dict], new: list[dict], key) -> list[dict]:
    """Old rows, each replaced by this run's row for the same setup; order by op then S."""
    by = {key(r): r for r in old}
    by.update({key(r): r for r in new})
    order = {op: n for n, op in enumerate(OPS)}
    return sorted(by.values(), key=lambda r: (order.get(r["op"], 99), r["S"], r.get("impl", "")))


def write(out: Path, rows, acc_rows, meta, merge=False):
    out.mkdir(parents=True, exist_ok=True)
    if merge:
        # old rows from the JSON where it is there: the CSV lacks the per-candidate times
        # (bench/grid_evidence.py reads them)
        old_json = out / "neptune_ops.json"
        old = (json.loads(old_json.read_text())["rows"] if old_json.exists()
               else _read_csv(out / "neptune_ops.csv"))
        rows = _merged(old, rows, lambda r: (r["op"], r["S"]))
        acc_rows = _merged(_read_csv(out / "accuracy.csv"), acc_rows,
                           lambda r: (r["op"], r["S"], r["impl"]))
    if acc_rows:
        with open(out / "accuracy.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, ["op", "S", "impl", "rms", "max", "note"], extrasaction="ignore")
            w.writeheader()
            w.writerows(acc_rows)
        md = [f"# Accuracy vs fp64 on {meta['gpu']} ({meta['date']})", "",
              "Same random inputs for every implementation (q, k, v ~ N(0, 1), fp16).", "",
              "| op | S | impl | RMS error | max error |", "| --- | --- | --- | --- | --- |"]
        md += [f"| {r['op']} | {r['S']} | {r['impl']} | {_sci(r['rms'])} | {_sci(r['max'])} |"
               for r in acc_rows]
        (out / "accuracy.md").write_text("\n".join(md) + "\n")
    if not rows:
        return
    (out / "neptune_ops.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    keys = ["op", "S", "unit", "neptune_eq", "sdpa", "flex", "compile", "vs_best_peer",
            "vs_best_compiler", "cold_s", "warm_s", "cache", "structure", "config", "spearman", "run",
            "graph_neptune_eq", "graph_sdpa", "graph_flex", "graph_compile", "graph_vs_best_peer",
            "cold_neptune_eq", "cold_sdpa", "cold_flex", "cold_compile", "cold_vs_best_peer"]
    with open(out / "neptune_ops.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    def f(x):
        return f"{x:.2f}" if isinstance(x, float) else ("—" if x is None else str(x))
    md = [f"# Neptune's operators on {meta['gpu']} (torch {meta['torch']}, triton {meta['triton']}, "
          f"{meta['date']})", "", "| op | S | unit | neptune_eq | SDPA | Flex | compile | vs best peer "
          "| vs best compiler | cold s | warm s | chosen | run |", "|" + " --- |" * 13]
    md += [f"| {r['op']} | {r['S']} | {r['unit']} | " + " | ".join(f(r.get(k)) for k in keys[3:11])
           + f" | {r.get('structure', '—')} | {r.get('run', '—')} |" for r in rows]
    ratios = [r["vs_best_peer"] for r in rows if r.get("vs_best_peer")]
    comp = [r["vs_best_compiler"] for r in rows if r.get("vs_best_compiler")]
    if ratios:
        md += ["", f"Geomean vs best peer: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x "
               f"over {len(ratios)} setups; vs best compiler peer: "
               f"{math.exp(sum(map(math.log, comp)) / len(comp)):.2f}x over {len(comp)}."]
    for m, title in (("graph", "Decode captured in a CUDA graph, K/V left in L2 (no host launch "
                      "cost; the same K/V every call)"),
                     ("cold", "Decode captured in a CUDA graph, K/V read from DRAM (calls rotate "
                      "over copies of the inputs larger than L2, as a model's layers each read "
                      "their own cache)")):
        graphed = [r for r in rows if isinstance(r.get(f"{m}_neptune_eq"), float)]
        if not graphed:
            continue
        md += ["", f"## {title}", "", "| op | S | neptune_eq TB/s | SDPA | Flex | compile | "
               "vs best peer | run |", "|" + " --- |" * 8]
        md += [f"| {r['op']} | {r['S']} | " + " | ".join(f(r.get(f"{m}_{k}")) for k in (
            "neptune_eq", "sdpa", "flex", "compile", "vs_best_peer")) + f" | {r.get('run', '—')} |"
            for r in graphed]
        g = [r[f"{m}_vs_best_peer"] for r in graphed if isinstance(r.get(f"{m}_vs_best_peer"), float)]
        if g:
            md += ["", f"Geomean ({m} decode) vs best peer: "
                   f"{math.exp(sum(map(math.log, g)) / len(g)):.2f}x over {len(g)} setups."]
    (out / "neptune_ops.md").write_text("\n".join(md) + "\n")


def process_warmup() -> float:
    """Seconds of a first, tiny build: the CUDA context, Triton's and Gluon's first
    compiles and imports, paid once per process.  Done before the table's rows, so each
    row's ``cold_s`` is its operator's own cold build (its kernels compile from scratch:
    their sources differ from the warm-up's)."""
    t0 = time.perf_counter()
    ne.superoptimize(ne.attention(1, 2, 128, 128, 64, "float16"), target="cuda", top_k=1,
                     cache=False)
    return round(time.perf_counter() - t0, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--accuracy-max-s", type=int, default=2048,
                    help="also measure accuracy vs fp64 for setups up to this S (0: never)")
    ap.add_argument("--merge", action="store_true", help="keep rows of setups not rerun")
    ap.add_argument("--run", default=time.strftime("run-%H%M"), help="label of this run's rows")
    a = ap.parse_args()
    import os
    import tempfile
    os.environ["NEPTUNE_EQ_CACHE"] = tempfile.mkdtemp(prefix="neptune_eq_bench_")  # cold = miss
    # ... and no Triton compile from an earlier run on this machine is reused (a warm
    # machine's cache made a cold build look 3.7 s where it is 12.6, session 35)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_bench_")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
            "process_warmup_s": process_warmup()}
    rows, acc_rows = [], []
    for S in a.seqs:
        for op in a.ops:
            try:
                run_op(op, S, rows, acc_rows, a.accuracy_max_s, a.run)
            except Exception as ex:  # noqa: BLE001 - record and go on to the next setup
                print(f"{op} S={S}: FAILED {type(ex).__name__}: {ex}", flush=True)
                rows.append({"op": op, "S": S, "unit": "", "run": a.run,
                             "neptune_eq": f"failed: {type(ex).__name__}"})
            torch.cuda.empty_cache()
            write(Path(a.out), rows, acc_rows, meta, a.merge)


if __name__ == "__main__":
    main()

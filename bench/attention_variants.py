"""Attention variants vs PyTorch SDPA and FlexAttention (torch.compile), same process.

    python bench/attention_variants.py [--seqs 2048 8192] [--out bench/results]

Each neptune_eq kernel is derived from the plain program by ne.attention + the rules, is
checked against SDPA/Flex on the same inputs before it is timed, and timed with
triton.testing.do_bench (median).  Prefill TFLOP/s = 4·B·Hq·Sq·Skv·D (halved for causal);
decode TB/s = bytes of K+V read / time.  Writes attention_variants.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import neptune_eq as ne

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    FLEX = torch.compile(flex_attention)
except Exception:  # pragma: no cover - older torch
    FLEX = None


def ops(S):
    D = 128
    cap = 50.0
    return {
        "global-pf": dict(b=1, hq=32, hkv=32, sq=S, skv=S, kw={}, causal=False),
        "causal-pf": dict(b=1, hq=32, hkv=32, sq=S, skv=S, kw={"mask_mod": lambda b, h, i, j: i >= j}, causal=True),
        "gqa-pf": dict(b=1, hq=64, hkv=8, sq=S, skv=S, kw={}, causal=False),
        "softcap-pf": dict(b=1, hq=32, hkv=16, sq=S, skv=S,
                           kw={"score_mod": lambda s, b, h, i, j: ne.tanh(s / cap) * cap}, causal=False, cap=cap),
        "causal-dc": dict(b=1, hq=32, hkv=32, sq=1, skv=S, kw={}, causal=False, decode=True),
    }, D


def peer(name, cfg, q, k, v):
    """Best available peer output and its callable."""
    group = cfg["hq"] // cfg["hkv"]
    kk, vv = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if group > 1 else (k, v)
    if "cap" in cfg and FLEX is not None:
        cap = cfg["cap"]
        fn = lambda: FLEX(q, k, v, score_mod=lambda s, b, h, i, j: torch.tanh(s / cap) * cap,
                          enable_gqa=group > 1)
        return "flex", fn
    fn = lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=cfg["causal"])
    return "sdpa", fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    rows = []
    for S in a.seqs:
        table, D = ops(S)
        for name, cfg in table.items():
            torch.manual_seed(0)
            q = torch.randn(cfg["b"], cfg["hq"], cfg["sq"], D, device="cuda", dtype=torch.float16)
            k = torch.randn(cfg["b"], cfg["hkv"], cfg["skv"], D, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            t0 = time.perf_counter()
            kern = ne.superoptimize(ne.attention(cfg["b"], cfg["hq"], cfg["sq"], cfg["skv"], D,
                                                 "float16", kv_heads=cfg["hkv"], **cfg["kw"]),
                                    target="cuda")
            t_opt = time.perf_counter() - t0
            pname, pfn = peer(name, cfg, q, k, v)
            ours, ref = kern(q, k, v), pfn()
            err = (ours.float() - ref.float()).abs().max().item()
            ok = bool(torch.isfinite(ours).all()) and err < 2e-2
            ms = do_bench(lambda: kern(q, k, v), warmup=25, rep=200, return_mode="median")
            ms_p = do_bench(pfn, warmup=25, rep=200, return_mode="median")
            if cfg.get("decode"):
                unit, work = "TB/s", 2 * k.numel() * k.element_size() / 1e12
            else:
                unit = "TFLOP/s"
                work = 4 * cfg["b"] * cfg["hq"] * cfg["sq"] * cfg["skv"] * D / 1e12 / (2 if cfg["causal"] else 1)
            rows.append({"op": name, "S": S, "unit": unit, "neptune_eq": work / (ms / 1e3),
                         "peer": pname, "peer_value": work / (ms_p / 1e3), "ratio": ms_p / ms,
                         "max_abs_diff_vs_peer": err, "ok": ok, "superoptimize_s": round(t_opt, 1),
                         "passes": kern.plan.n_passes, "config": str(kern.config)})
            r = rows[-1]
            print(f"{name:<11} S={S:<6} ours {r['neptune_eq']:8.2f} {unit:<7} {pname} {r['peer_value']:8.2f}"
                  f"  ratio {r['ratio']:.2f}  ok={ok} diff={err:.1e} ({r['config']})", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_variants.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    md = [f"# Attention variants on {meta['gpu']} (torch {meta['torch']}, triton {meta['triton']}, {meta['date']})",
          "", "| op | S | neptune_eq | peer | peer value | ratio | checked |", "| --- | --- | --- | --- | --- | --- | --- |"]
    md += [f"| {r['op']} | {r['S']} | {r['neptune_eq']:.2f} {r['unit']} | {r['peer']} | "
           f"{r['peer_value']:.2f} | {r['ratio']:.2f}x | {'ok' if r['ok'] else 'MISMATCH'} |" for r in rows]
    (out / "attention_variants.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

"""Unusual FlexAttention mods and inputs through ``ne.flex_attention``, forward and
backward, against an fp64 dense reference evaluated from the same mods.

    python bench/probe/mod_battery.py [--device cuda] [--L 37 --S 53] [--only NAME ...] [--out DIR]

The CPU tests cover each case at interpreter sizes; this runs them where the kernels
are the GPU's (Gluon / TMA forms, tensor-core products, other tile configs) and at odd
lengths.  Each row: the case, max error of the output and of every gradient relative to
the reference's largest value, or the error raised.  Writes DIR/mod_battery.json and
exits non-zero when a number is off (an error raised is recorded, not a failure: some
cases are refused by design, with their message)."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

import neptune_eq as ne


def dense(q, k, v, score_mod=None, mask_mod=None):
    """fp64 attention with the mods evaluated on broadcast index tensors (as torch's
    flex_attention's vmap does); a row that sees no key gives 0."""
    B, Hq, L, E = q.shape
    g = Hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(E)
    dev = q.device
    b, h = torch.arange(B, device=dev).view(B, 1, 1, 1), torch.arange(Hq, device=dev).view(1, Hq, 1, 1)
    i = torch.arange(L, device=dev).view(1, 1, L, 1)
    j = torch.arange(k.shape[2], device=dev).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).double().expand_as(s)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j).expand_as(s), float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    return torch.exp(s - lse).nan_to_num(0.0) @ v


def cases(L: int, S: int, dev: str):
    """(name, heads q / kv, make(tables) -> (score_mod, mask_mod), learnable tables)."""
    T = 2 * max(L, S)
    rel = torch.randn(T, device=dev)
    tab = torch.randn(max(L, S) + 3, device=dev)
    slopes = torch.rand(4, device=dev)
    t5 = torch.randn(4, 32, device=dev)
    yield "causal L!=S", 4, 4, lambda t: (None, lambda b, h, i, j: i >= j), []
    yield "sigmoid gate", 4, 4, lambda t: (lambda s, b, h, i, j: s * torch.sigmoid(s), None), []
    yield "clamp", 4, 4, lambda t: (lambda s, b, h, i, j: torch.clamp(s, -1.0, 1.0), None), []
    yield "xor mask", 4, 4, lambda t: (None, lambda b, h, i, j: (i > 5) ^ (j > 5)), []
    yield "rows masked by b,h", 4, 4, lambda t: (
        None, lambda b, h, i, j: ((b + h + i + j) % 3 != 0) & (i % 7 != 0)), []
    yield "gqa 4/2 softcap", 4, 2, lambda t: (lambda s, b, h, i, j: 5 * torch.tanh(s / 5), None), []
    yield "learnable slopes", 4, 4, lambda t: (lambda s, b, h, i, j: s + t[0][h] * (j - i), None), [slopes]
    yield "learnable rel table", 4, 4, lambda t: (
        lambda s, b, h, i, j: s + t[0][i - j + max(L, S)], None), [rel]
    yield "learnable table at q and kv", 4, 4, lambda t: (
        lambda s, b, h, i, j: s + t[0][i] - 2 * t[0][j], None), [tab]
    yield "learnable t5 buckets, gqa 4/2, causal", 4, 2, lambda t: (
        lambda s, b, h, i, j: s + t[0][h, t5_bucket(i, j)], lambda b, h, i, j: i >= j), [t5]


def t5_bucket(i, j, buckets: int = 32, max_distance: int = 128):
    """T5's bidirectional relative bucket: half exact, half log-spaced."""
    n = (i - j).abs()
    exact = buckets // 2
    far = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (buckets - exact)).to(torch.int64)
    return torch.where(n < exact, n, torch.clamp(far, max=buckets - 1))


def run_case(name, hq, hkv, make, tables, B, L, S, E, dtype, dev):
    torch.manual_seed(0)
    q = torch.randn(B, hq, L, E, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, hkv, S, E, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    ts = [t.clone().requires_grad_() for t in tables]
    sm, mm = make(ts)
    out = ne.flex_attention(q, k, v, sm, mask_mod=mm, enable_gqa=hq != hkv)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *ts), go)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v, *ts)]
    sm2, mm2 = make(ref_in[3:])
    ref = dense(*ref_in[:3], sm2, mm2)
    want = torch.autograd.grad(ref, ref_in, go.double())
    rel = lambda a, r: float((a.double() - r).abs().max()) / max(1.0, float(r.abs().max()))  # noqa: E731
    return {"out": rel(out, ref), **{n: rel(a, r) for n, a, r in zip(
        ["d_q", "d_k", "d_v"] + [f"d_t{n}" for n in range(len(ts))], got, want)}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--L", type=int, default=37)
    ap.add_argument("--S", type=int, default=53)
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--only", nargs="*", default=None, help="cases whose name has one of these")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    bound = {"float32": 2e-4, "float16": 2e-2, "bfloat16": 6e-2}
    rows, bad = [], 0
    for dt in a.dtypes:
        for name, hq, hkv, make, tables in cases(a.L, a.S, a.device):
            if a.only and not any(o in name for o in a.only):
                continue
            t0 = time.perf_counter()
            try:
                errs = run_case(name, hq, hkv, make, tables, 2, a.L, a.S, a.E,
                                getattr(torch, dt), a.device)
                ok = all(e <= bound[dt] for e in errs.values())
                row = {"case": name, "dtype": dt, "ok": ok, "errors": errs}
            except Exception as e:  # noqa: BLE001 - recorded: a refusal has its message
                ok, row = True, {"case": name, "dtype": dt, "ok": None,
                                 "raised": f"{type(e).__name__}: {str(e)[:400]}"}
            row["seconds"] = round(time.perf_counter() - t0, 1)
            bad += not ok
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "mod_battery.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
         "torch": torch.__version__, "L": a.L, "S": a.S, "E": a.E, "rows": rows}, indent=1))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

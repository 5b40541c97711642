"""GPU check of the warp-specialised Gluon form of the backward's dK/dV pass
(``lowering/gluon_sums.py``) against fp64 autograd, and its time beside the ``tl`` form.

    python bench/gluon_backward_validate.py --out DIR     # on a Hopper GPU (H100 / H200)

The dK/dV kernel is the one ``ne.flex_attention``'s backward builds (``flex_backward``:
the plain backward program, fused by the rules; dQ's kernel apart, the row dots
``Σ_e dO·O`` read as an input).  Per variant and shape its Gluon form and a ``tl`` config
are launched on the same inputs -- q, k, v, the lse and dO of an fp64 forward -- and dK,
dV compared with fp64 autograd of the plain attention: odd lengths, D = 64 and 128, fp16
and bf16, scores x8, rows that see no key (their gradients must be 0, never NaN).  Then
both forms are timed (``triton.testing.do_bench``) at B=2 H=16 D=128 bf16, S = 2048 and
8192, as TFLOP/s of the pass's four products (the visible pairs only under causal).

Writes DIR/gluon_backward_validate.json and prints each row.
"""
import argparse
import json
import math
import os
import sys

import torch

import neptune_eq as ne  # before triton: on a CPU machine it selects the interpreter
import triton
from neptune_eq.dropin import flex, flex_backward
from neptune_eq.runtime.gluon_launch import make_launcher
from neptune_eq.runtime.launcher import TileConfig
from neptune_eq.sizes import Guards, bind, specialise

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the harness's own check, tl only
TARGET = "cuda" if DEV == "cuda" else "interpreter"

VARIANTS = {  # name -> (score_mod(s, b, h, q, kv) for ne and torch, mask_mod(b, h, q, kv))
    "plain": (None, None),
    "causal": (None, lambda b, h, q, kv: q >= kv),
    "softcap": (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), lambda b, h, q, kv: q >= kv),
    "alibi": (lambda s, b, h, q, kv: s + (kv - q) * (h + 1) * -0.0625, None),
    "window": (None, lambda b, h, q, kv: (q >= kv) & (q - kv < 256)),
    # rows 0..4 see no key: their P is 0, so they add nothing to any dK, dV row
    "masked-rows": (None, lambda b, h, q, kv: (q >= kv) & (q >= 5)),
}
NE_SCORE = {"softcap": lambda s, b, h, q, kv: 30.0 * ne.tanh(s / 30.0)}


KERNELS = {}  # (variant, d, dtype, heads) -> dK/dV kernel


def dkdv_kernel(variant, d, dtype, h):
    """The drop-in's dK/dV kernel for ``variant`` (built once per structure)."""
    if (variant, d, dtype, h) in KERNELS:  # (a structure's head count is fixed)
        return KERNELS[variant, d, dtype, h]
    score, mask = VARIANTS[variant]
    score = NE_SCORE.get(variant, score)
    q = torch.randn(1, h, 64, d, device=DEV, dtype=dtype)
    before = set(flex.STRUCTURES)
    flex.flex_attention(q, q, q, score_mod=score, mask_mod=mask)
    (skey,) = set(flex.STRUCTURES) - before  # the structure this call traced
    st = flex.STRUCTURES[skey]
    _, kern, *_ = flex_backward.backward_kernel(st, ("k", "v"), {"B": 1, "L": 64, "S": 64},
                                                shared=True, lse_grad=False)
    KERNELS[variant, d, dtype, h] = kern
    return kern


def reference(variant, q, k, v, d_o):
    """(lse, Σ_e dO·O, dK, dV) of the plain attention in fp64 (a row that sees no key:
    P = 0, lse = -inf)."""
    score, mask = VARIANTS[variant]
    q, k, v, d_o = (t.double().requires_grad_(t is not d_o) for t in (q, k, v, d_o))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    b_, h_, n, m = s.shape
    qi = torch.arange(n, device=s.device)[:, None]
    kj = torch.arange(m, device=s.device)[None, :]
    hh = torch.arange(h_, device=s.device)[:, None, None]
    if score is not None:
        s = score(s, 0, hh, qi, kj)
    if mask is not None:
        s = s.masked_fill(~mask(0, hh, qi, kj), float("-inf"))
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx)
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    o = p @ v
    (o * d_o).sum().backward()
    lse = (mx + torch.log(den)).squeeze(-1)
    return lse, (d_o * o).sum(-1).detach(), k.grad, v.grad


def launchers(kern, values):
    """(program, Gluon launcher, tl launcher) of the kernel at concrete sizes."""
    ks = kern.kernel_source
    if ks.gluon is None and DEV == "cuda":
        raise RuntimeError(f"no Gluon form: {ks.gluon_why}")
    prog = bind(specialise(kern.program, values, Guards()), values)
    conc = ks.concrete(values)
    size_args = tuple(values[s] for s in ks.size_params)
    g = None if DEV == "cpu" else make_launcher(prog, conc, "cuda", TileConfig({f"B_{ks.block_axis}": 128, "B_L": 64}, 4, 2,
                                                      gluon_ws=True), size_args)
    t = make_launcher(prog, conc, TARGET, TileConfig({f"B_{ks.block_axis}": 128, "B_L": 64}, 8, 3),
                      size_args)
    return prog, g, t


def inputs(kern, variant, b, h, s, d, dtype, big=False, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(b, h, s, d, device=DEV, dtype=dtype) * (8 if big else 1)
    k = torch.randn(b, h, s, d, device=DEV, dtype=dtype)
    v = torch.randn(b, h, s, d, device=DEV, dtype=dtype)
    d_o = torch.randn(b, h, s, d, device=DEV, dtype=dtype)
    lse, dots, dk, dv = reference(variant, q, k, v, d_o)
    names = {ph.name for ph in kern.program.inputs}
    t = {"q": q, "k": k, "v": v, "d_o": d_o, "mx": lse.float()}
    stat = [n for n in names if n not in t]  # the row dots' input (its sign from the adjoint)
    return t, stat, dots.float(), dk, dv


def check(variant, b, h, s, d, dtype, big=False):
    dt = getattr(torch, dtype)
    row = {"case": "correctness", "variant": variant, "B": b, "H": h, "S": s, "D": d,
           "dtype": dtype, "large_scores": big}
    kern = dkdv_kernel(variant, d, dt, h)
    prog, g, t = launchers(kern, {"B": b, "L": s, "S": s})
    ins, stat, dots, dk, dv = inputs(kern, variant, b, h, s, d, dt, big)
    tol = 5e-2 if dtype == "bfloat16" else 1e-2
    for sign in (-1.0, 1.0):  # the adjoint reads the row dots as ±Σ dO·O: the tl form tells
        ins.update({n: sign * dots for n in stat})
        out_t = {n: torch.full_like(ins["k"], float("nan")) for n in ("d_k", "d_v")}
        t({**ins, **out_t})
        scale = max(dk.abs().max().item(), dv.abs().max().item(), 1.0)
        if max((out_t["d_k"].double() - dk).abs().max().item(),
               (out_t["d_v"].double() - dv).abs().max().item()) < tol * scale:
            break
    out_g = {n: torch.full_like(ins["k"], float("nan")) for n in ("d_k", "d_v")}
    if g is None:  # no GPU: the harness checks itself on the tl form
        out_g = out_t
    else:
        g({**ins, **out_g})
        torch.cuda.synchronize()
    for form, out in (("tl", out_t), ("gluon", out_g)):
        row[f"{form}_err_dk"] = (out["d_k"].double() - dk).abs().max().item()
        row[f"{form}_err_dv"] = (out["d_v"].double() - dv).abs().max().item()
        row[f"{form}_nan"] = bool(torch.isnan(out["d_k"]).any() or torch.isnan(out["d_v"]).any())
    row["scale"] = scale
    row["gluon_ran"] = g is not None and g._twin is None  # not the tl twin's fallback
    row["ok"] = (not row["gluon_nan"] and max(row["gluon_err_dk"], row["gluon_err_dv"]) < tol * scale
                 and max(row["gluon_err_dk"], row["gluon_err_dv"])
                 <= 2 * max(row["tl_err_dk"], row["tl_err_dv"]) + 1e-6)
    return row


def timing(variant, b, h, s, d, dtype):
    dt = getattr(torch, dtype)
    kern = dkdv_kernel(variant, d, dt, h)
    prog, g, t = launchers(kern, {"B": b, "L": s, "S": s})
    ins = {n: torch.randn(b, h, s, d, device=DEV, dtype=dt) for n in ("q", "k", "v", "d_o")}
    for ph in kern.program.inputs:
        if ph.name not in ins:  # row vectors: the lse and the row dots
            ins[ph.name] = torch.randn(b, h, s, device=DEV, dtype=torch.float32).abs() + 5
    outs = {n: torch.empty_like(ins["k"]) for n in ("d_k", "d_v")}
    frac = 0.5 if VARIANTS[variant][1] is not None and variant != "masked-rows" else 1.0
    if variant == "window":
        frac = 256 / s
    fl = 4 * 2 * b * h * s * s * d * frac  # four products of 2·S²·D each
    row = {"case": "timing", "variant": variant, "B": b, "H": h, "S": s, "D": d, "dtype": dtype}
    for form, la in (("tl", t), ("gluon", g)):
        la({**ins, **outs})
        ms = triton.testing.do_bench(lambda: la({**ins, **outs}), warmup=25, rep=200)
        row[f"{form}_ms"] = ms
        row[f"{form}_tflops"] = fl / ms / 1e9
    row["speedup"] = row["tl_ms"] / row["gluon_ms"]
    row["gluon_ran"] = g._twin is None
    return row


def write(rows, out):
    with open(os.path.join(out, "gluon_backward_validate.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                   "torch": torch.__version__, "triton": triton.__version__,
                   "argv": sys.argv, "rows": rows}, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--timing-variants", nargs="*", default=["plain", "causal", "softcap"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []

    def run(fn, *a, **kw):
        try:
            row = fn(*a, **kw)
        except Exception as e:  # recorded; the next case still runs
            row = {"case": fn.__name__, "args": repr(a), "error": repr(e)[-800:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(rows, args.out)  # each row as it comes: a run cut short keeps what it had

    for variant in args.variants:
        run(check, variant, 1, 2, 1000, 128, "float16")
        run(check, variant, 2, 2, 777, 128, "bfloat16", big=True)
        run(check, variant, 1, 2, 300, 64, "float16")
    for variant in [] if args.skip_timing else args.timing_variants:
        for s in (8192, 2048):
            run(timing, variant, 2, 16, s, 128, "bfloat16")


if __name__ == "__main__":
    main()

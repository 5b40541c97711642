"""GPU check of the warp-specialised Gluon forms of the backward's dK/dV pass and dQ's
kernel (``lowering/gluon_sums.py``) against fp64 autograd, and their time beside the ``tl``
forms.

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
from dataclasses import replace

import torch

import neptune_eq as ne  # before triton: on a CPU machine it selects the interpreter
import triton
from neptune_eq.dropin import flex, flex_backward
from neptune_eq.lowering import gluon_sums
from neptune_eq.runtime.gluon_launch import make_launcher
from neptune_eq.runtime.tile_configs import TileConfig
from neptune_eq.sizes import Guards, bind, specialise
from backward_gpu import doc_ids as bench_doc_ids  # noqa: E402 (bench/: the script's directory)
from gluon_validate import row_runner  # noqa: E402

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


def doc_ids(s: int) -> torch.Tensor:
    """13 documents of random lengths over ``s`` positions (bench/backward_gpu.py's)."""
    return bench_doc_ids(s).to(torch.int32).to(DEV)


# a mask over captured document ids, causal inside each: traced with 64 positions (the
# structure's lengths stay named; its input is named DOC after this global), called with
# ``doc_ids`` of each case's length
DOC = doc_ids(64)
VARIANTS["documents"] = (None, lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv))


def mask_at(variant: str, n: int):
    """The variant's mask over ``n`` positions (the documents' ids at that length)."""
    if variant != "documents":
        return VARIANTS[variant][1]
    ids = doc_ids(n)
    return lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)


STRUCTS = {}  # (variant, d, dtype, heads) -> the drop-in's structure (its heads are fixed)
GROUPS = {"kv": ("k", "v"), "q": ("q",),  # dK/dV alone, dQ's own kernel,
          "kvq": ("k", "v", "q")}  # all three, dQ added atomically


def structure(variant, d, dtype, h):
    """The drop-in's structure of ``variant`` at head dim ``d``, ``h`` heads (traced once)."""
    key = (variant, d, dtype, h)
    if key not in STRUCTS:
        score, mask = VARIANTS[variant]
        q = torch.randn(1, h, 64, d, device=DEV, dtype=dtype)
        before = set(flex.STRUCTURES)
        flex.flex_attention(q, q, q, score_mod=NE_SCORE.get(variant, score), mask_mod=mask)
        (skey,) = set(flex.STRUCTURES) - before  # the structure this call traced
        STRUCTS[key] = flex.STRUCTURES[skey]
    return STRUCTS[key]


def backward_kernel(variant, d, dtype, h, group):
    """The structure's backward kernel for ``group``: ``kv`` and ``q`` beside each other
    (``shared``: dK/dV reads the row dots dQ's kernel returns), ``kvq`` the fused one
    adding dQ atomically.  (``flex_backward`` keeps each structure's kernels: built once.)"""
    return flex_backward.backward_kernel(structure(variant, d, dtype, h),
                                         GROUPS.get(group, (group,)), {"B": 1, "L": 64, "S": 64},
                                         shared=group != "kvq", lse_grad=False)[1]


def reference(variant, q, k, v, d_o):
    """(lse, Σ_e dO·O, dK, dV, dQ) of the plain attention in fp64 (a row that sees no key:
    P = 0, lse = -inf)."""
    score, mask = VARIANTS[variant][0], mask_at(variant, q.shape[2])
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
    return lse, (d_o * o).sum(-1).detach(), k.grad, v.grad, q.grad


def one_program_per_tile(kern):
    """The kernel's source with its Gluon form generated as one program per tile
    (``gluon_sums.PERSISTENT`` off), or None where the form is not persistent."""
    ks = kern.kernel_source
    if ks.gluon is None or not ks.gluon.persistent:
        return None
    was, gluon_sums.PERSISTENT = gluon_sums.PERSISTENT, False
    try:
        return replace(ks, gluon=gluon_sums.generate(kern.plan, ks.gluon.name))
    finally:
        gluon_sums.PERSISTENT = was


def launchers(kern, values, gluon=True, ks=None):
    """(program, Gluon launcher, tl launcher) of the kernel at concrete sizes (``ks``:
    another source of the same kernel, e.g. ``one_program_per_tile``)."""
    ks = ks or kern.kernel_source
    if ks.gluon is None and DEV == "cuda" and gluon:
        raise RuntimeError(f"no Gluon form: {ks.gluon_why}")
    prog = bind(specialise(kern.program, values, Guards()), values)
    conc = ks.concrete(values)
    size_args = tuple(values[s] for s in ks.size_params)
    g = None if DEV == "cpu" or not gluon else make_launcher(prog, conc, "cuda", TileConfig({f"B_{ks.block_axis}": 128, "B_L": 64}, 4, 2,
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
    lse, dots, *grads = reference(variant, q, k, v, d_o)
    names = {ph.name for ph in kern.program.inputs}
    t = {"q": q, "k": k, "v": v, "d_o": d_o, "mx": lse.float()}
    if "DOC" in names:
        t["DOC"] = doc_ids(s)
    stat = [n for n in names if n not in t]  # the row dots' input (its sign from the adjoint)
    return t, stat, dots.float(), dict(zip(("d_k", "d_v", "d_q"), grads))


def fresh_outputs(prog, fill=float("nan")):
    """The outputs of ``prog`` (bound to the call's sizes), ``fill``-ed (a fused dQ: fp32,
    zeroed by the launcher)."""
    return {n: torch.full(tuple(prog.shape_of(n)), fill, device=DEV,
                          dtype=getattr(torch, prog.dtype_of(n))) for n in prog.outputs}


def check(variant, b, h, s, d, dtype, big=False, group="kv"):
    dt = getattr(torch, dtype)
    row = {"case": "correctness", "variant": variant, "B": b, "H": h, "S": s, "D": d,
           "dtype": dtype, "large_scores": big}
    row["group"] = group
    kern = backward_kernel(variant, d, dt, h, group)
    prog, g, t = launchers(kern, {"B": b, "L": s, "S": s})
    ins, stat, dots, ref = inputs(kern, variant, b, h, s, d, dt, big)
    names = list(kern.program.outputs)
    tol = 5e-2 if dtype == "bfloat16" else 1e-2
    scale = max(max(ref[n].abs().max().item() for n in names), 1.0)

    def err(out):
        return max((out[n].double() - ref[n]).abs().max().item() for n in names)
    for sign in (-1.0, 1.0):  # the adjoint reads the row dots as ±Σ dO·O: the tl form tells
        ins.update({n: sign * dots for n in stat})
        out_t = fresh_outputs(prog)
        t({**ins, **out_t})
        if err(out_t) < tol * scale:
            break
    out_g = fresh_outputs(prog)
    if g is None:  # no GPU: the harness checks itself on the tl form
        out_g = out_t
    else:
        g({**ins, **out_g})
        torch.cuda.synchronize()
    for form, out in (("tl", out_t), ("gluon", out_g)):
        for n in names:
            row[f"{form}_err_{n}"] = (out[n].double() - ref[n]).abs().max().item()
        row[f"{form}_nan"] = any(bool(torch.isnan(out[n]).any()) for n in names)
    row["scale"] = scale
    row["gluon_ran"] = g is not None and g._twin is None  # not the tl twin's fallback
    row["gluon_walk"] = ("persistent" if g is not None and g.form.persistent else "per tile")
    row["ok"] = (not row["gluon_nan"] and err(out_g) < tol * scale
                 and err(out_g) <= 2 * err(out_t) + 1e-6)
    return row


def timing(variant, b, h, s, d, dtype):
    """dK/dV alone (tl, Gluon), dQ's own kernel (tl), and the fused kernel (tl, Gluon)."""
    dt = getattr(torch, dtype)
    ins = {n: torch.randn(b, h, s, d, device=DEV, dtype=dt) for n in ("q", "k", "v", "d_o")}
    ins["mx"] = torch.randn(b, h, s, device=DEV, dtype=torch.float32).abs() + 5
    frac = 0.5 if VARIANTS[variant][1] is not None and variant != "masked-rows" else 1.0
    if variant == "window":
        frac = 256 / s
    if variant == "documents":  # the visible pairs: causal inside each document
        ins["DOC"] = doc_ids(s)
        sizes = torch.bincount(ins["DOC"].long()).double()
        frac = float((sizes * (sizes + 1) / 2).sum()) / (s * s)
    pair = 2 * b * h * s * s * d * frac  # one product of 2·S²·D (visible pairs)
    row = {"case": "timing", "variant": variant, "B": b, "H": h, "S": s, "D": d, "dtype": dtype}
    for group, products in (("kv", 4), ("q", 3), ("kvq", 5)):
        kern = backward_kernel(variant, d, dt, h, group)
        prog, g, t = launchers(kern, {"B": b, "L": s, "S": s})
        for ph in prog.inputs:
            if ph.name not in ins:  # the row dots (dK/dV's), O (dQ's kernel computes them)
                ins[ph.name] = torch.randn(tuple(ph.shape), device=DEV,
                                           dtype=getattr(torch, ph.dtype))
        outs = fresh_outputs(prog, 0.0)
        # the walk: persistent programs (the form as built), the same kernel launched one
        # program per tile (``TileConfig.per_tile``), and a form generated per tile
        single = one_program_per_tile(kern) if g is not None else None
        gs = launchers(kern, {"B": b, "L": s, "S": s}, ks=single)[1] if single else None
        gp = (make_launcher(prog, g.ks, "cuda", replace(g.config, per_tile=True), g.size_args)
              if single else None)
        got = {}
        for form, la in (("tl", t), ("gluon", g), ("gluon_per_tile", gp), ("gluon_single", gs)):
            if la is None:
                continue
            la({**ins, **outs})
            got[form] = {n: o.clone() for n, o in outs.items()}
            ms = triton.testing.do_bench(lambda: la({**ins, **outs}), warmup=25, rep=200)
            row[f"{group}_{form}_ms"] = ms
            row[f"{group}_{form}_tflops"] = products * pair / ms / 1e9
        for form in ("gluon_per_tile", "gluon_single"):  # the walk moves no number
            if form in got and group != "kvq":
                row[f"{group}_{form}_bit_identical"] = all(
                    torch.equal(got[form][n], got["gluon"][n]) for n in got["gluon"])
        if g is not None:  # (dQ's kernel reads the row dots a row kernel computes first)
            row[f"{group}_gluon_ran"] = g._twin is None
    best = {grp: min(row.get(f"{grp}_{f}_ms", math.inf) for f in ("tl", "gluon"))
            for grp in ("kv", "q", "kvq")}
    row["two_kernels_tl_ms"] = row["kv_tl_ms"] + row["q_tl_ms"]
    row["two_kernels_best_ms"] = best["kv"] + best["q"]
    row["fused_best_ms"] = best["kvq"]
    return row


def write(rows, out):
    with open(os.path.join(out, "gluon_backward_validate.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                   "torch": torch.__version__, "triton": triton.__version__,
                   "argv": sys.argv, "rows": rows}, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--timing-variants", nargs="*", default=["plain", "causal", "softcap"])
    ap.add_argument("--many-tiles", action="store_true",
                    help="check only at B=2 H=16 S=2100 bf16 (544 tiles: persistent programs "
                         "walk several each) instead of the three small shapes")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 2048])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []

    # each row written as it comes: a run cut short keeps what it had
    run = row_runner(rows, lambda rows: write(rows, args.out))

    for variant in args.variants:
        for group in args.groups:
            if args.many_tiles:  # more tiles than SMs: persistent programs walk several
                run(check, variant, 2, 16, 2100, 128, "bfloat16", group=group)
                continue
            run(check, variant, 1, 2, 1000, 128, "float16", group=group)
            run(check, variant, 2, 2, 777, 128, "bfloat16", big=True, group=group)
            run(check, variant, 1, 2, 300, 64, "float16", group=group)
    for variant in [] if args.skip_timing else args.timing_variants:
        for s in args.lengths:
            run(timing, variant, 2, 16, s, 128, "bfloat16")


if __name__ == "__main__":
    main()

"""GPU check of the warp-specialised Gluon form (lowering/gluon_ws.py) inside the product.

    python bench/gluon_validate.py --out DIR        # on a Hopper GPU (H100 / H200)

1. **Correctness**, per variant and shape: the variant is derived (saturate, extract,
   plan -- no timing), its Gluon form launched through ``runtime.gluon_launch`` and
   compared with an fp32 torch reference; odd lengths, D = 64 and 128, bf16 with scores
   x8, a mask that leaves rows fully masked (their output must be 0), GQA; and masks
   over captured tensors (``DATA``): sorted documents with padding rows that see nothing,
   the same ids shuffled (the nondecreasing flag is false: no skipping, still right),
   jagged sequences from offsets, prefix-LM with a per-sample prefix; each at its value
   width's key block and at the other one (64 keys at D=128, 128 at D=64).
2. **The choice**: ``ne.superoptimize`` on the GPU at the timing shape, cold: which config
   the timer chose, the timer's own times of the best Gluon and the best tl config (same
   process, same inputs), and the chosen kernel's TFLOP/s beside cuDNN SDPA where it runs.
3. **The drop-in**: ``ne.flex_attention(..., return_lse=True)`` at named sizes: chosen
   config, output and lse against SDPA / torch.

``--only-key-blocks``: the Gluon form's time at each key block and ring depth (one process).
Writes DIR/gluon_validate.json (one row per case) and prints each row.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

import neptune_eq as ne
from neptune_eq.egraph.extract import EGraphView, extract_program
from neptune_eq.egraph.saturate import EGraphStage
from neptune_eq.lowering.kernelgen import generate
from neptune_eq.lowering.lower import plan
from neptune_eq.runtime.gluon_launch import make_launcher
from neptune_eq.runtime.tile_configs import TileConfig

MODS = {  # variant -> (ne mods, torch score_mod(s, h, q, kv), torch mask_mod(q, kv))
    "global": ({}, None, None),
    "causal": ({"mask_mod": lambda b, h, q, kv: q >= kv}, None, lambda q, kv: q >= kv),
    "alibi": ({"score_mod": lambda s, b, h, q, kv: s + (kv - q) * (h + 1) * -0.0625},
              lambda s, h, q, kv: s + (kv - q) * (h + 1) * -0.0625, None),
    "softcap": ({"score_mod": lambda s, b, h, q, kv: 30.0 * ne.tanh(s / 30.0),
                 "mask_mod": lambda b, h, q, kv: q >= kv},
                lambda s, h, q, kv: 30.0 * torch.tanh(s / 30.0), lambda q, kv: q >= kv),
    "window": ({"mask_mod": lambda b, h, q, kv: (q >= kv) & (q - kv < 256)}, None,
               lambda q, kv: (q >= kv) & (q - kv < 256)),
    # rows 0..4 see no key at all: their output must be 0, never NaN
    "masked-rows": ({"mask_mod": lambda b, h, q, kv: (q >= kv) & (q >= 5)}, None,
                    lambda q, kv: (q >= kv) & (q >= 5)),
}

# the three-consumer form's checks (``GluonForm.wide``, head dim 64, 192-row programs): odd
# lengths, a tile count not a multiple of 3 row blocks, both walks and key blocks, rings 2-4
WIDE_CHECKS = [(1, 3, 300, 64, "float16", False, {"key_block": 64}),
               (2, 3, 555, 64, "bfloat16", True, {"key_block": 64, "stages": 3}),
               (2, 2, 777, 64, "bfloat16", True, {"key_block": 64, "per_tile": True}),
               (1, 2, 1000, 64, "float16", False, {"key_block": 128}),
               (1, 2, 2048, 64, "float16", False, {"key_block": 64, "stages": 4})]
DATA = ("doc-pad", "doc-unsorted", "jagged", "jagged-wrap", "prefix-lm")


def data_case(variant, b, s, seed=0):
    """(ne mods, torch mask_mod(q, kv) or per-batch list of them, captured tensors) of a
    mask over captured tensors, with fresh random data of length ``s``: 7 documents, or
    ``docN``: N documents, sorted, causal within each (bench/doc_mask_gpu.py's cases)."""
    g = torch.Generator().manual_seed(seed)
    n = int(variant[3:]) if variant[3:].isdigit() else 7
    cuts = torch.sort(torch.randperm(s - 1, generator=g)[:n - 1] + 1).values
    offs = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([s])])
    ids = torch.repeat_interleave(torch.arange(n), offs.diff())
    if variant == "prefix-lm":
        pre = torch.randint(1, s, (b,), generator=g, dtype=torch.int32)
        prefix = ne.placeholder((b,), "int32", "prefix")
        mods = {"mask_mod": lambda b_, h, q, kv: (kv < prefix[b_]) | (q >= kv)}
        masks = [lambda q, kv, p=int(p): (kv < p) | (q >= kv) for p in pre]
        return mods, masks, {"prefix": pre.cuda()}
    doc = ne.placeholder((s,), "int32", "doc")
    if variant == "jagged-wrap":  # ids read as indices under torch's rule: padding -1
        # (offsets[-1] = s: the row sees nothing) and ids counting back from the end
        ids = torch.where(torch.rand(s, generator=g) < 0.2, ids - n, ids)
        ids[-100:] = -1
        variant = "jagged"
    if variant == "jagged":
        offsets = ne.placeholder((8,), "int32", "offsets")
        mods = {"mask_mod": lambda b_, h, q, kv: (kv >= offsets[doc[q]]) & (q >= kv)}
        o = offs.cuda()
        i = ids.cuda()
        return mods, lambda q, kv: (kv >= o[i[q]]) & (q >= kv), {
            "doc": ids.to(torch.int32).cuda(), "offsets": offs.to(torch.int32).cuda()}
    if variant == "doc-pad":  # the first 100 tokens are padding (id -1): rows that see nothing
        ids = torch.cat([torch.full((100,), -1), ids[100:]])
    elif variant[3:].isdigit():
        pass
    else:  # shuffled: not nondecreasing
        ids = ids[torch.randperm(s, generator=g)]
    mods = {"mask_mod": lambda b_, h, q, kv: (doc[q] == doc[kv]) & (doc[kv] >= 0) & (q >= kv)}
    i = ids.cuda()
    return mods, lambda q, kv: (i[q] == i[kv]) & (i[kv] >= 0) & (q >= kv), {
        "doc": ids.to(torch.int32).cuda()}


def derive(variant, b, h, s, d, dtype, kv_heads=None, mods=None):
    mods = MODS[variant][0] if mods is None else mods
    out = ne.attention(b, h, s, s, d, dtype, kv_heads=kv_heads, **mods)
    p = ne.build_program(out)
    st = EGraphStage(p, ne.rules.shipped_rule_files())
    st.saturate()
    prog = extract_program(EGraphView.from_json(st.serialize()), p).program
    return prog, generate(plan(prog))


def reference(variant, q, k, v, mask_mod=None):
    score_mod = MODS[variant][1] if variant in MODS else None
    mask_mod = mask_mod or (MODS[variant][2] if variant in MODS else None)
    if isinstance(mask_mod, list):  # one mask per batch element
        return torch.cat([reference(variant, q[i:i + 1], k[i:i + 1], v[i:i + 1], m)
                          for i, m in enumerate(mask_mod)])
    b, h, s, d = q.shape
    g = h // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    qi = torch.arange(s, device=q.device)[:, None]
    kj = torch.arange(s, device=q.device)[None, :]
    for hh in range(h):
        sc = q[:, hh].float() @ k[:, hh // g].float().transpose(-1, -2) / math.sqrt(d)
        if score_mod:
            sc = score_mod(sc, hh, qi, kj)
        if mask_mod:
            sc = sc.masked_fill(~mask_mod(qi, kj), float("-inf"))
        p = torch.softmax(sc, -1).nan_to_num(0.0)  # a fully masked row: 0
        out[:, hh] = p @ v[:, hh // g].float()
    return out


def gluon_launcher(prog, ks, key_block=128, ring=2, per_tile=False, rows=128, dynamic=False):
    """The Gluon form of ``ks`` at one key block and ring depth (``rows``-row programs:
    128, two consumer warpgroups, or 64, the one-consumer form ``GluonForm.solo``);
    ``per_tile``: a persistent form launched one program per tile; ``dynamic``: a data
    mask's dynamic walk (``GluonForm.dynamic``)."""
    return make_launcher(prog, ks, "cuda", TileConfig(
        {f"B_{ks.block_axis}": rows, "B_L": key_block}, 4, ring, gluon_ws=True,
        per_tile=per_tile, dynamic=dynamic))


def check(variant, b, h, s, d, dtype, big=False, kv_heads=None, stages=2, key_block=None,
          rows=128, dynamic=False, per_tile=False):
    key_block = key_block or d  # default: the key block as wide as the value
    row = {"case": "correctness", "variant": variant, "B": b, "H": h, "S": s, "D": d,
           "dtype": dtype, "large_scores": big, "kv_heads": kv_heads, "stages": stages,
           "key_block": key_block, "rows": rows, "dynamic": dynamic, "per_tile": per_tile}
    mods, tmask, captured = data_case(variant, b, s) if variant in DATA else (None, None, {})
    prog, ks = derive(variant, b, h, s, d, dtype, kv_heads, mods)
    if ks.gluon is None:
        row["error"] = f"no Gluon form: {ks.gluon_why}"
        return row
    if ks.gluon.form_for(rows) is None:
        row["error"] = (f"no {rows}-row Gluon form (the one-consumer form is a data mask's, "
                        "the three-consumer form a head-dim-64 plan's)")
        return row
    dt = getattr(torch, dtype)
    hk = kv_heads or h
    q = torch.randn(b, h, s, d, device="cuda", dtype=dt) * (8 if big else 1)
    k = torch.randn(b, hk, s, d, device="cuda", dtype=dt)
    v = torch.randn(b, hk, s, d, device="cuda", dtype=dt)
    o = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=dt)
    if per_tile and not ks.gluon.form_for(rows).persistent:
        row["error"] = "per_tile: the form runs one program per tile already"
        return row
    la = gluon_launcher(prog, ks, key_block, stages, per_tile, rows=rows, dynamic=dynamic)
    la({"q": q, "k": k, "v": v, "o": o, **captured})
    first = o.clone()
    la({"q": q, "k": k, "v": v, "o": o, **captured})  # the checked direct launch (FastLaunch)
    torch.cuda.synchronize()
    row["fast_launch"] = (bool(la._checked), la.fast_reason)
    row["repeat_bit_identical"] = bool(torch.equal(first, o))
    ref = reference(variant, q, k, v, tmask)
    row["max_err"] = (o.float() - ref).abs().max().item()
    row["nan"] = bool(torch.isnan(o).any())
    row["ok"] = (row["max_err"] < (3e-2 if dtype == "bfloat16" else 5e-3) and not row["nan"]
                 and row["repeat_bit_identical"])
    if variant in ("masked-rows", "doc-pad", "jagged-wrap"):
        rows = {"masked-rows": slice(0, 5), "doc-pad": slice(0, 100)}.get(variant, slice(-100, None))
        row["masked_rows_zero"] = bool((o[:, :, rows] == 0).all())
        row["ok"] = row["ok"] and row["masked_rows_zero"]
    return row


def flops(variant, b, h, s, d):
    """4·D flops per visible (query, key) pair: half the square for causal, a band of 256
    keys for the window."""
    dense = 4 * b * h * s * s * d
    if variant == "window":  # row i sees min(i + 1, 256) keys
        w = min(s, 256)
        return 4 * b * h * d * (w * (w + 1) // 2 + (s - w) * w)
    return dense / 2 if variant in ("causal", "softcap") else dense


def cudnn_attention(q, k, v, causal: bool):
    """SDPA restricted to cuDNN on the same inputs: a callable (the peer these rows name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def choice(variant, b, h, s, d, dtype):
    """A cold superoptimize on the GPU: what the timer chose and the times it saw."""
    row = {"case": "choice", "variant": variant, "B": b, "H": h, "S": s, "D": d, "dtype": dtype}
    t0 = time.time()
    kern = ne.superoptimize(ne.attention(b, h, s, s, d, dtype, **MODS[variant][0]),
                            target="cuda", cache=False)
    row["cold_s"] = time.time() - t0
    row["chosen"] = str(kern.config)
    timed = [(c, ms) for r in kern.candidates for c, ms, _ in r.timings if ms is not None]
    gl = [ms for c, ms in timed if c.gluon_ws]
    tl = [ms for c, ms in timed if not c.gluon_ws]
    row["timer_best_gluon_ms"] = min(gl) if gl else None
    row["timer_best_tl_ms"] = min(tl) if tl else None
    row["gluon_failures"] = [s for r in kern.candidates for c, ms, s in r.timings
                             if c.gluon_ws and ms is None]
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
    ms = triton.testing.do_bench(lambda: kern(q, k, v), warmup=25, rep=200)
    row["tflops"] = flops(variant, b, h, s, d) / ms / 1e9
    if variant in ("global", "causal"):
        fn = cudnn_attention(q, k, v, variant == "causal")
        ms_c = triton.testing.do_bench(fn, warmup=25, rep=200)
        ref = fn()
        row["cudnn_tflops"] = flops(variant, b, h, s, d) / ms_c / 1e9
        row["x_cudnn"] = ms_c / ms
        row["max_diff_vs_cudnn"] = (kern(q, k, v).float() - ref.float()).abs().max().item()
    return row


def dropin(b, h, s, d, dtype):
    row = {"case": "flex-dropin", "B": b, "H": h, "S": s, "D": d, "dtype": dtype}
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
    causal = lambda b_, h_, qi, kv: qi >= kv  # noqa: E731
    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(causal, None, None, s, s, device="cuda")
    t0 = time.time()
    out, lse = ne.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    row["cold_s"] = time.time() - t0
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    sc = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d)
    sc = sc.masked_fill(torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    row["max_err"] = (out.float() - ref).abs().max().item()
    row["lse_err"] = (lse - torch.logsumexp(sc, -1)).abs().max().item()
    from neptune_eq.dropin.flex import STRUCTURES
    row["chosen"] = [str(la.config) for st in STRUCTURES.values() if st.kernel is not None
                     for la in st.kernel._dispatch.launchers.values()]
    return row


def dropin_wide(b, h, s, d, dtype, key_block, causal=True):
    """The drop-in's kernel (sizes named, passed at run time) launched with its
    three-consumer form (``GluonForm.wide``) whatever the timer chose, against fp32."""
    from neptune_eq.dropin import flex as ne_flex
    from neptune_eq.runtime.launcher import check_inputs
    from neptune_eq.sizes import bind, sizes_of
    row = {"case": "dropin-wide", "B": b, "H": h, "S": s, "D": d, "dtype": dtype,
           "key_block": key_block, "causal": causal}
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
    spec = ne_flex.check(q, k, v, None, False, False)
    sizes = {"B": b, "L": s, "S": s}
    mask = (lambda b_, h_, qi, kv: qi >= kv) if causal else None
    st, _ = ne_flex.trace(spec, None, mask, sizes)
    kern = st.kernel_at(sizes)
    prog = kern.input_program
    bound = check_inputs(prog, (q, k, v), {}, "cuda", symbolic=True)
    values = sizes_of(prog, bound)
    # the unsplit candidate (the timer may have chosen a split-k one), bound as the
    # drop-in's dispatch binds a bucket's kernel at a call's sizes
    cand = next((r for r in kern.candidates if r.kernel is not None and r.kernel.gluon
                 is not None and r.kernel.gluon.wide is not None), None)
    if cand is None:
        row["error"] = "no three-consumer form"
        return row
    ks = cand.kernel.concrete(values)
    wide = make_launcher(bind(cand.program, values), ks, "cuda", TileConfig(
        {f"B_{ks.block_axis}": 192, "B_L": key_block}, 4, 2, gluon_ws=True),
        tuple(values[n] for n in ks.size_params))
    bp = bind(cand.program, values)  # the outputs: o, and the lse where returned
    outs = {n: torch.full(bp.shape_of(n), float("nan"), device="cuda",
                          dtype=getattr(torch, bp.dtype_of(n))) for n in bp.outputs}
    out = next(t for t in outs.values() if t.dim() == 4)
    for _ in range(2):  # the checked launch, then the direct one
        wide({**bound, **outs})
    torch.cuda.synchronize()
    ref = reference("causal" if causal else "global", q, k, v)
    row["max_err"] = (out.float() - ref).abs().max().item()
    row["ok"] = row["max_err"] < (3e-2 if dtype == "bfloat16" else 5e-3)
    return row


def tanh_forms(s_time=8192):
    """Softcap (+ causal) with each of gluon_ws.TANH_FORMS: max error against the fp32
    reference at S=1000 (scores x8: the cap is reached) and TFLOP/s at S=s_time."""
    from neptune_eq.lowering import gluon_ws
    rows, was = [], gluon_ws.TANH
    try:
        for form in gluon_ws.TANH_FORMS:
            gluon_ws.TANH = form
            row = {"case": "tanh-form", "form": form}
            for s, h, big in ((1000, 2, True), (s_time, 32, False)):
                prog, ks = derive("softcap", 1, h, s, 128, "float16")
                torch.manual_seed(0)
                q, k, v = (torch.randn(1, h, s, 128, device="cuda", dtype=torch.float16)
                           for _ in range(3))
                q = q * 8 if big else q
                o = torch.empty_like(q)
                la = gluon_launcher(prog, ks)
                t = {"q": q, "k": k, "v": v, "o": o}
                la(t)
                if s == s_time:
                    ms = triton.testing.do_bench(lambda: la(t), warmup=25, rep=200)
                    row["tflops"] = flops("softcap", 1, h, s, 128) / ms / 1e9
                else:
                    row["max_err"] = (o.float() - reference("softcap", q, k, v)).abs().max().item()
                    tl = make_launcher(prog, ks, "cuda", TileConfig(
                        {f"B_{ks.block_axis}": 128, "B_L": 64}, 8, 2))
                    o2 = torch.empty_like(q)
                    tl({**t, "o": o2})
                    row["tl_form_max_err"] = (o2.float() - reference("softcap", q, k, v)).abs().max().item()
            rows.append(row)
    finally:
        gluon_ws.TANH = was
    return rows


PERSISTENCE_CASES = {  # head dim -> (variant, B, H, S, kv heads)
    128: (("global", 1, 32, 2048, None), ("global", 1, 64, 2048, 8), ("causal", 1, 32, 2048, None),
          ("causal", 2, 32, 3000, None), ("causal", 1, 32, 8192, None),
          ("causal", 1, 64, 2048, 8), ("softcap", 1, 32, 2048, None), ("window", 1, 32, 8192, None)),
    # head dim 64: the Gluon form's causal run took 0.63-0.67 of its global one at S=5000
    # where the tl forms took 0.57-0.58 and cuDNN 0.48-0.50 (bench/results/ragged_s26)
    64: (("global", 4, 16, 5000, None), ("causal", 4, 16, 5000, None),
         ("global", 4, 32, 4096, None), ("causal", 4, 32, 4096, None))}


DATA_PERSISTENCE_CASES = (  # (variant, B, H, S): masks over captured tensors, D=128
    ("doc4", 1, 16, 8192), ("doc13", 1, 16, 8192), ("doc64", 1, 16, 8192),
    ("jagged", 1, 16, 8192), ("doc13", 1, 16, 32768), ("jagged", 1, 16, 32768),
    ("doc64", 1, 16, 32768), ("prefix-lm", 2, 16, 8192))


def data_persistence(cases=None, tags=None):
    """The data masks' dynamic walk (``TileConfig.dynamic``: programs taking tiles from a
    counter, heads first or one head after another -- ``gluon_tiles.DYNAMIC_HEADS_FIRST``)
    against one program per tile (row-major and heads first), one process, same inputs:
    ms per call (pre-pass and ranges kernel included) and replayed from a CUDA graph, and
    whether the outputs are bit-identical to one program per tile's.  ``cases``: only
    these ``variant:S`` cases; ``tags``: only these walks (and the reference,
    ``per_tile_keys64``)."""
    from neptune_eq.lowering import gluon_tiles
    rows, was = [], gluon_tiles.DYNAMIC_HEADS_FIRST
    walks = {  # tag: (heads-first order of the dynamic walk, key block, config options)
        "per_tile_keys64": (was, 64, {}),
        "per_tile_heads_first_keys64": (was, 64, {"heads_first": True}),
        "per_tile_heads_first_keys128": (was, 128, {"heads_first": True}),
        "dynamic_heads_first_keys64": (True, 64, {"dynamic": True}),
        "dynamic_row_major_keys64": (False, 64, {"dynamic": True}),
        "dynamic_heads_first_keys128": (True, 128, {"dynamic": True})}
    if tags:
        walks = {t: w for t, w in walks.items() if t in tags or t == "per_tile_keys64"}
    try:
        for variant, b, h, s in DATA_PERSISTENCE_CASES:
            if cases and f"{variant}:{s}" not in cases:
                continue
            row = {"case": "data-persistence", "variant": variant, "B": b, "H": h, "S": s,
                   "D": 128}
            mods, _, captured = data_case(variant, b, s)
            q, k, v = (torch.randn(b, h, s, 128, device="cuda", dtype=torch.float16)
                       for _ in range(3))
            outs, derived = {}, {}
            for tag, (hf, bl, opts) in walks.items():
                gluon_tiles.DYNAMIC_HEADS_FIRST = hf
                if hf not in derived:
                    derived[hf] = derive(variant, b, h, s, 128, "float16", None, mods)
                prog, ks = derived[hf]
                la = make_launcher(prog, ks, "cuda", TileConfig(
                    {f"B_{ks.block_axis}": 128, "B_L": bl}, 4, 2, gluon_ws=True, **opts))
                t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q), **captured}
                la(t)
                la(t)  # the checked direct launch
                outs[tag] = t["o"].clone()
                row[f"ms_{tag}"] = triton.testing.do_bench(lambda: la(t), warmup=25, rep=200)
                row[f"ms_graph_{tag}"] = triton.testing.do_bench_cudagraph(lambda: la(t), rep=200)
            for tag in walks:
                row[f"bit_identical_{tag}"] = bool(torch.equal(outs[tag], outs["per_tile_keys64"])) \
                    if tag.endswith("keys64") else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        gluon_tiles.DYNAMIC_HEADS_FIRST = was
    return rows


def persistence(d: int = 128):
    """``gluon_ws.PERSISTENT`` on and off in one process: the Gluon form's time per call
    (``do_bench``, host included) and replayed from a CUDA graph (device only), and
    whether both forms' outputs are bit-identical; at head dim ``d``."""
    from neptune_eq.lowering import gluon_ws
    rows, was = [], gluon_ws.PERSISTENT
    try:
        for variant, b, h, s, kv in PERSISTENCE_CASES[d]:
            row = {"case": "persistence", "variant": variant, "B": b, "H": h, "S": s, "D": d,
                   "kv_heads": kv}
            q = torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
            k, v = (torch.randn(b, kv or h, s, d, device="cuda", dtype=torch.float16)
                    for _ in range(2))
            outs = {}
            # the persistent form, the same kernel launched one program per tile
            # (``TileConfig.per_tile``: the walk as a launch choice), a form made per tile
            for on in (True, "launched per tile", False):
                gluon_ws.PERSISTENT = bool(on)
                prog, ks = derive(variant, b, h, s, d, "float16", kv)
                la = gluon_launcher(prog, ks, per_tile=on == "launched per tile")
                t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q)}
                la(t)
                la(t)  # the checked direct launch
                outs[on] = t["o"].clone()
                tag = {True: "persistent", False: "per_tile"}.get(on, "persistent_per_tile")
                row[f"{tag}_is"] = ks.gluon.persistent
                ms = triton.testing.do_bench(lambda: la(t), warmup=25, rep=200)
                row[f"tflops_{tag}_called"] = flops(variant, b, h, s, d) / ms / 1e9
                try:
                    ms = triton.testing.do_bench_cudagraph(lambda: la(t), rep=200)
                    row[f"tflops_{tag}_graph"] = flops(variant, b, h, s, d) / ms / 1e9
                except Exception as e:  # noqa: BLE001 - recorded, the row still counts
                    row[f"graph_error_{tag}"] = repr(e)[-300:]
            if variant in ("global", "causal") and kv is None:  # the peer, same inputs
                ms = triton.testing.do_bench(cudnn_attention(q, k, v, variant == "causal"),
                                             warmup=25, rep=200)
                row["cudnn_tflops_called"] = flops(variant, b, h, s, d) / ms / 1e9
            row["bit_identical"] = bool(torch.equal(outs[True], outs[False]))
            row["launched_per_tile_bit_identical"] = bool(torch.equal(
                outs[True], outs["launched per tile"]))
            row["max_diff_between_forms"] = (outs[True].float() - outs[False].float()).abs().max().item()
            if s <= 3000:  # each form against the fp32 reference, many tiles per program
                ref = reference(variant, q, k, v)
                for on, tag in ((True, "persistent"), (False, "per_tile")):
                    row[f"max_err_{tag}"] = (outs[on].float() - ref).abs().max().item()
            rows.append(row)
    finally:
        gluon_ws.PERSISTENT = was
    return rows


KEY_BLOCK_CASES = (  # (variant, B, H, S, D): head dim 64 and sparse masks at head dim 128
    ("global", 4, 32, 4096, 64), ("causal", 4, 32, 4096, 64), ("global", 2, 16, 3000, 64),
    ("causal", 2, 16, 3000, 64), ("global", 1, 32, 8192, 128), ("causal", 1, 32, 2048, 128),
    ("window", 1, 32, 8192, 128), ("doc-pad", 1, 16, 8192, 128), ("jagged", 1, 16, 8192, 128))


def key_blocks():
    """The Gluon form at each key block and ring depth, one process, same inputs: time per
    call and replayed from a CUDA graph (TFLOP/s on visible pairs for the affine masks;
    ms only for the data masks), and the max difference between the key blocks' outputs."""
    from neptune_eq.lowering.gluon_form import KEY_BLOCKS, SMEM_BYTES
    rows = []
    for variant, b, h, s, d in KEY_BLOCK_CASES:
        row = {"case": "key-block", "variant": variant, "B": b, "H": h, "S": s, "D": d}
        mods, _, captured = data_case(variant, b, s) if variant in DATA else (None, None, {})
        prog, ks = derive(variant, b, h, s, d, "float16", None, mods)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
        outs = {}
        for bl in KEY_BLOCKS:
            for ring in (2, 3):
                if ks.gluon.ring_bytes(bl, ring) > SMEM_BYTES:
                    continue
                la = gluon_launcher(prog, ks, bl, ring)
                t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q), **captured}
                la(t)
                la(t)
                outs[bl] = t["o"].clone()
                tag = f"keys{bl}_ring{ring}"
                ms = triton.testing.do_bench(lambda: la(t), warmup=25, rep=200)
                msg = triton.testing.do_bench_cudagraph(lambda: la(t), rep=200)
                row[f"ms_{tag}"], row[f"ms_graph_{tag}"] = ms, msg
                if variant not in DATA:
                    row[f"tflops_{tag}"] = flops(variant, b, h, s, d) / ms / 1e9
                    row[f"tflops_graph_{tag}"] = flops(variant, b, h, s, d) / msg / 1e9
        row["max_diff_between_key_blocks"] = (outs[64].float() - outs[128].float()).abs().max().item()
        rows.append(row)
    return rows


def row_runner(rows, after=None):
    """``run(fn, *args)``: one case's row (or its error: the next case still runs),
    appended to ``rows`` and printed; then ``after(rows)`` (e.g. write them so far)."""
    def run(fn, *a, **kw):
        try:
            row = fn(*a, **kw)
        except Exception as e:  # recorded; the next case still runs
            row = {"case": fn.__name__, "args": repr(a), "error": repr(e)[-800:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if after is not None:
            after(rows)
    return run


# The dynamic walk's checks (tiles from a counter, heads first, 64-key blocks as offered): (B, H,
# S, D, dtype, scores x8, options); 13 heads: heads first interleaves the row blocks unevenly
DYNAMIC_CHECKS = ((1, 2, 1000, 128, "float16", False, {"key_block": 64}),
                  (2, 3, 777, 128, "bfloat16", True, {"key_block": 64, "stages": 3}),
                  (2, 3, 555, 64, "bfloat16", True, {"key_block": 64}),
                  (1, 13, 2000, 128, "float16", False, {"key_block": 64}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--head-dim", type=int, default=128, choices=sorted(PERSISTENCE_CASES),
                    help="the --only-persistence cases' head dim")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="check only these variants (MODS and DATA names)")
    ap.add_argument("--cases", nargs="+", default=None,
                    help="--only-data-persistence: only these variant:S cases (jagged:32768)")
    ap.add_argument("--walks", nargs="+", default=None,
                    help="--only-data-persistence: only these walks (and per_tile_keys64)")
    for flag, what in (
            ("--skip-choice", "no cold choices at S=8192"),
            ("--only-tanh", "only the softcap tanh forms"), ("--skip-tanh", "no softcap tanh forms"),
            ("--only-persistence", "only the persistent / one-program-per-tile A/B"),
            ("--only-key-blocks", "only the Gluon form at each key block and ring depth"),
            ("--only-data-persistence", "only the data masks' dynamic walk / one-program-per-tile A/B"),
            ("--only-wide", "only the three-consumer form's checks (head dim 64, 192 rows)"),
            ("--only-dynamic", "only the data masks' dynamic walk (GluonForm.dynamic) checks")):
        ap.add_argument(flag, action="store_true", help=what)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    if args.only_data_persistence:
        return write(data_persistence(args.cases, args.walks), args.out)

    run = row_runner(rows)
    if args.only_dynamic:
        for variant in [v for v in DATA if not args.variants or v in args.variants]:
            for case in DYNAMIC_CHECKS:
                run(check, variant, *case[:6], **case[6], dynamic=True)
        return write(rows, args.out)
    if args.only_wide:
        for variant in [v for v in (*MODS, *DATA) if not args.variants or v in args.variants]:
            for case in WIDE_CHECKS:
                run(check, variant, *case[:6], **case[6], rows=192)
        run(check, "causal", 1, 8, 515, 64, "bfloat16", kv_heads=2, key_block=64, rows=192)
        run(dropin_wide, 2, 4, 1537, 64, "bfloat16", 128)  # sizes passed at run time
        run(dropin_wide, 1, 3, 2000, 64, "float16", 64, causal=False)
        run(dropin, 2, 4, 2048, 64, "bfloat16")
        return write(rows, args.out)
    if args.only_persistence or args.only_key_blocks:
        for row in persistence(args.head_dim) if args.only_persistence else key_blocks():
            run(dict, row)  # (appended and printed)
        return write(rows, args.out)
    for row in () if args.skip_tanh else tanh_forms():
        run(dict, row)
    for variant in () if args.only_tanh else [v for v in (*MODS, *DATA)
                                              if not args.variants or v in args.variants]:
        run(check, variant, 1, 2, 1000, 128, "float16")
        run(check, variant, 2, 2, 777, 128, "bfloat16", big=True)
        run(check, variant, 1, 3, 300, 64, "float16", stages=3)
        # the key block apart from the value width: 64 keys at D=128, 128 keys at D=64
        run(check, variant, 1, 2, 1000, 128, "float16", key_block=64)
        run(check, variant, 2, 2, 777, 128, "bfloat16", big=True, key_block=64, stages=3)
        run(check, variant, 1, 3, 300, 64, "float16", key_block=128)
        run(check, variant, 2, 3, 555, 64, "bfloat16", big=True, key_block=128, stages=3)
        if variant in DATA:  # the one-consumer form (64-row programs, a 2-deep ring), which
            # the timer takes on short documents: both widths, both key blocks it offers
            run(check, variant, 1, 2, 1000, 128, "float16", key_block=64, rows=64)
            run(check, variant, 2, 2, 777, 128, "bfloat16", big=True, key_block=64, rows=64)
            run(check, variant, 2, 3, 555, 64, "bfloat16", big=True, key_block=64, rows=64)
            run(check, variant, 1, 3, 300, 64, "float16", key_block=128, rows=64)
            for case in DYNAMIC_CHECKS:  # the dynamic walk (tiles from a counter)
                run(check, variant, *case[:6], **case[6], dynamic=True)
    if not args.only_tanh:
        run(check, "causal", 1, 8, 515, 128, "bfloat16", kv_heads=2)  # GQA (unpacked plans)
        run(dropin, 2, 4, 2048, 128, "bfloat16")
    if not args.skip_choice and not args.only_tanh:
        for variant in ("global", "causal", "alibi"):
            run(choice, variant, 1, 32, 8192, 128, "float16")
    write(rows, args.out)


def write(rows, out):
    with open(os.path.join(out, "gluon_validate.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "argv": sys.argv, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

"""Probe (session 35): ALiBi prefill with its index difference j − i built in fp32 from
fp32 offsets (``lowering.float_index``) against the int form converted once per score
(the I2F issues on sm_90's XU pipe, which exp2 is bound by).

One process, same inputs, each kernel built from the product's own plan at one config
(no timer's choice), the switch flipped between builds; the old form is built and timed
again last to show any drift of the machine.  Beside them: the global Gluon kernel of the
same shape (ALiBi's ceiling: the same work without the bias), cuDNN global and
FlexAttention with the same ALiBi score_mod.  Outputs of the two forms are compared bit
for bit and against an fp32 reference.

    python bench/gluon_probe/float_index_ab.py --out DIR
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402
import triton  # noqa: E402

import gluon_validate as gv  # noqa: E402
import neptune_eq as ne  # noqa: E402
from neptune_eq.lowering import float_index  # noqa: E402
from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig  # noqa: E402

SHAPES = ((1, 32, 8192, 128, "float16"), (1, 32, 2048, 128, "float16"),
          (1, 32, 8192, 128, "bfloat16"), (4, 16, 4096, 64, "bfloat16"))
TL = {128: (128, 64, 8, 3), 64: (64, 64, 4, 3)}


def timed(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def slopes_of(h):
    return torch.tensor([2.0 ** (-8.0 * (k + 1) / h) for k in range(h)], device="cuda")


def build(b, h, s, d, dtype, cfg, fp32_index, alibi=True):
    saved = float_index.FLOAT_INDEX
    try:
        float_index.FLOAT_INDEX = fp32_index
        sl = ne.placeholder((h,), "float32", "slopes")
        mods = {"score_mod": lambda x, bb, hh, i, j: x + sl[hh] * (j - i)} if alibi else {}
        prog, ks = gv.derive("global", b, h, s, d, dtype, None, mods)
        return make_launcher(prog, ks, "cuda", cfg)
    finally:
        float_index.FLOAT_INDEX = saved


def log2_units(la):
    """``la`` (an ALiBi Gluon kernel) rebuilt with its scores made in exp2's units: the
    softmax scale and the slope times log2 e (the slope's per program), the row max over
    those, so exp2's argument is one subtract -- the per-score ``· log2 e`` multiply
    gone.  The measure of what deriving that form would buy (same output up to rounding)."""
    import re
    from dataclasses import replace
    lg = 1.4426950408889634
    form = la.ks.gluon
    src, n = form.source, 0
    src, k = re.subn(r"= qk \* ([0-9.e+-]+)\n", lambda m: f"= qk * {float(m.group(1)) * lg!r}\n", src)
    n += k
    src, k = re.subn(r"= (t\d+)\.to\(gl\.float32\) \* ", rf"= (\1.to(gl.float32) * {lg!r}) * ", src)
    n += k
    src, k = re.subn(rf"= (t\d+(?:\[[^\]]*\])?) \* {re.escape(repr(lg))}\n", r"= \1\n", src)
    n += k
    assert n >= 9, f"only {n} edits"
    ks = replace(la.ks, gluon=replace(form, source=src))
    return make_launcher(la.program, ks, "cuda", la.config)


def shape_rows(b, h, s, d, dtype):
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
    sl = slopes_of(h)
    flops = gv.flops("global", b, h, s, d)
    base = {"B": b, "H": h, "S": s, "D": d, "dtype": dtype}
    rows, outs = [], {}
    ref = None

    def record(name, fn, out=None):
        row = {**base, "kernel": name}
        try:
            ms = timed(fn)
            row.update(ms=ms, tflops=flops / ms / 1e9)
            if out is not None:
                outs[name] = out.clone()
                row["max_err_vs_fp32"] = (out.float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a probe row, never the whole run
            row["error"] = repr(e)[-400:]
        print(json.dumps(row), flush=True)
        rows.append(row)

    def ours(name, cfg, fp32_index, alibi=True, edit=None):
        try:
            la = build(b, h, s, d, dtype, cfg, fp32_index, alibi)
            la = edit(la) if edit else la
        except Exception as e:  # noqa: BLE001
            rows.append({**base, "kernel": name, "error": repr(e)[-400:]})
            print(json.dumps(rows[-1]), flush=True)
            return
        t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q), **({"slopes": sl} if alibi else {})}
        record(name, lambda: la(t), t["o"] if alibi else None)

    ref = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    i, j = torch.arange(s, device="cuda")[:, None], torch.arange(s, device="cuda")[None, :]
    for hh in range(h):  # fp32 reference, one head at a time
        sc = q[:, hh].float() @ k[:, hh].float().transpose(-1, -2) / d ** 0.5 + sl[hh] * (j - i)
        ref[:, hh] = torch.softmax(sc, -1) @ v[:, hh].float()
    record("cudnn global", gv.cudnn_attention(q, k, v, False))
    try:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention)

        def alibi_mod(x, bb, hh, qi, kj):
            return x + sl[hh] * (kj - qi)
        record("flex alibi", lambda: flex(q, k, v, score_mod=alibi_mod))
    except Exception as e:  # noqa: BLE001
        rows.append({**base, "kernel": "flex alibi", "error": repr(e)[-400:]})
    bi, bl, w, st = TL[d]
    g = TileConfig({"B_i": 128, "B_L": 128}, 4, 2, gluon_ws=True)
    tl_cfg = TileConfig({"B_i": bi, "B_L": bl}, w, st)
    ours("gluon global", g, True, alibi=False)
    ours("gluon alibi int index", g, False)
    ours("gluon alibi fp32 index", g, True)
    ours("gluon alibi int index, exp2 units", g, False, edit=log2_units)
    ours("tl alibi int index", tl_cfg, False)
    ours("tl alibi fp32 index", tl_cfg, True)
    ours("gluon alibi int index again", g, False)
    for form in ("gluon", "tl"):
        a, c = outs.get(f"{form} alibi fp32 index"), outs.get(f"{form} alibi int index")
        if a is not None and c is not None:
            rows.append({**base, "kernel": f"{form}: fp32 index == int index",
                         "bit_identical": bool(torch.equal(a, c)),
                         "max_diff": (a.float() - c.float()).abs().max().item()})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", type=int, nargs="*", help="indices into SHAPES")
    a = ap.parse_args()
    rows = []
    for n, sh in enumerate(SHAPES):
        if a.shapes is None or n in a.shapes:
            rows += shape_rows(*sh)
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "float_index_ab.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

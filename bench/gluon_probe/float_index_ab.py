"""Probe (session 35): what ALiBi's block math costs in the Gluon prefill kernel.

* ``fp32 index``: ALiBi's ``j − i`` built from fp32 offsets (the key block's columns
  converted once, plus ``l0``) instead of the int tile the lowering emits, which the
  multiply by the slope converts (``I2F``, on sm_90's XU pipe beside exp2).  Measured
  slower: the compiler already converts only a thread's 34 distinct differences per 64
  scores; in fp32 it cannot merge them (session 35 in bench/results/README.md).  The
  lowering that emitted this form (commit 8d3da3b) was reverted; here it is a source edit.
* ``block shift`` (the lowering's form since session 35, ``lowering.block_shift``): the
  bias split into a loop-invariant tile and a per-block shift that joins the row max and
  exp2's row term; the ``int index`` rows are the form before it.
* ``scores in exp2 units``: the softmax scale and the slope times log2 e, the row max
  over those scores, so exp2's argument loses a multiply per score.

One process, same inputs, each kernel built from the product's own plan at one config
(no timer's choice); the generated form is built and timed again last to show any drift.
Beside them: the global Gluon kernel of the same shape (ALiBi's ceiling: the same work
without the bias), cuDNN global and FlexAttention with the same ALiBi score_mod; every
ALiBi row's error against an fp32 reference.

    python bench/gluon_probe/float_index_ab.py --out DIR [--shapes 0 3 2]
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
from neptune_eq.lowering import block_shift  # noqa: E402
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


def build(b, h, s, d, dtype, cfg, alibi=True, shift=False):
    """The kernel as the lowering makes it, the bias split into a loop-invariant tile and
    a per-block shift (``lowering.block_shift``) or not (``shift``)."""
    saved = block_shift.ENABLED
    try:
        block_shift.ENABLED = shift
        sl = ne.placeholder((h,), "float32", "slopes")
        mods = {"score_mod": lambda x, bb, hh, i, j: x + sl[hh] * (j - i)} if alibi else {}
        prog, ks = gv.derive("global", b, h, s, d, dtype, None, mods)
        return make_launcher(prog, ks, "cuda", cfg)
    finally:
        block_shift.ENABLED = saved


def fp32_index(la):
    """``la`` (an ALiBi Gluon kernel) rebuilt with ``j − i`` made of fp32 offsets: the
    key block's column numbers converted once per consumer, plus the block's start."""
    from dataclasses import replace
    form = la.ks.gluon
    src = form.source
    cols = "    cols = gl.arange(0, B_L, S_COLS)\n"
    n = src.count("offs_L[None, :] - offs_i[:, None]")
    assert cols in src and n >= 3, "no int index difference found"
    src = src.replace(cols, cols + "    colsf = cols.to(gl.float32)\n")
    src = src.replace("offs_L[None, :] - offs_i[:, None]",
                      "(colsf + l0)[None, :] - offs_i.to(gl.float32)[:, None]")
    ks = replace(la.ks, gluon=replace(form, source=src))
    return make_launcher(la.program, ks, "cuda", la.config)


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

    def ours(name, cfg, alibi=True, edit=None, shift=False):
        try:
            la = build(b, h, s, d, dtype, cfg, alibi, shift)
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
    ours("gluon global", g, alibi=False)
    ours("gluon alibi int index", g)
    ours("gluon alibi block shift", g, shift=True)
    ours("gluon alibi fp32 index", g, edit=fp32_index)
    ours("gluon alibi int index, exp2 units", g, edit=log2_units)
    ours("tl alibi int index", tl_cfg)
    ours("tl alibi block shift", tl_cfg, shift=True)
    ours("gluon alibi int index again", g)
    ours("gluon alibi block shift again", g, shift=True)
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

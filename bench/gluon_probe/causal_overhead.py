"""Probe (session 27): where a causal prefill loses to its global twin, at head dims 64
and 128 (issue 16: cuDNN runs causal at its global TFLOP/s, ours at 0.82x of it).

One process, same inputs, each kernel built from the product's own plan and launched
directly (no timer's choice):

* ``tl`` configs, causal and global (a first run also put the diagonal loop before the
  interior loop, FlashAttention-3's order: no change, 340 vs 341 TFLOP/s, so not kept);
* the Gluon form, causal scheduled-persistent (as generated), one program per tile, with
  every block's mask dropped (wrong output: the mask's cost), and global; both with the
  output stored from a row-major layout (session 28: ``coalesced store``);
* cuDNN causal and global;
* session 34: ``raw max`` rows, the row max taken over raw scores and scaled once per row
  (``lower.MAX_BEFORE_SCALE``; every other row is built with it off, as before).

    python bench/gluon_probe/causal_overhead.py --out DIR
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402
import triton  # noqa: E402

import gluon_validate as gv  # noqa: E402
from neptune_eq.lowering import gluon_ws, lower  # noqa: E402
from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig  # noqa: E402

SHAPES = ((4, 16, 5000, 64, None), (4, 16, 3000, 64, 8), (2, 32, 3000, 128, None),
          (1, 32, 8192, 128, None),
          # session 28: the key length halved and doubled at the first shape's tiles, to
          # split a program's time into per-key-block and per-tile parts
          (4, 16, 2560, 64, None), (4, 16, 5120, 64, None), (4, 16, 10240, 64, None),
          # session 33: the prefill rows under 1.0x cuDNN at S=2048 (global; GQA 64/8)
          (1, 32, 2048, 128, None), (1, 64, 2048, 128, 8))
ONLY: tuple = ()  # kernel-name prefixes to run (--only); cuDNN always runs
SKIP: tuple = ()  # kernel-name prefixes not to run (--skip)
TL = {64: ((64, 64, 4, 3), (64, 128, 4, 2)), 128: ((128, 64, 8, 3), (64, 64, 4, 3))}


def timed(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def launcher(variant, b, h, s, d, kv, cfg, persistent=True, raw_max=False):
    """Build (plan -> source; ``gluon_ws.PERSISTENT`` and ``lower.MAX_BEFORE_SCALE`` as
    given), then the launcher.  Rows are built as before session 34 (a row max over the
    scaled scores) unless ``raw_max``: the max over raw scores, scaled once per row."""
    saved = gluon_ws.PERSISTENT, lower.MAX_BEFORE_SCALE
    try:
        gluon_ws.PERSISTENT, lower.MAX_BEFORE_SCALE = persistent, raw_max
        prog, ks = gv.derive(variant, b, h, s, d, "bfloat16", kv)
        return make_launcher(prog, ks, "cuda", cfg)
    finally:
        gluon_ws.PERSISTENT, lower.MAX_BEFORE_SCALE = saved


def coalesced_store(la, d):
    """``la`` rebuilt from its Gluon source with the consumers' output store converted
    to a row-major layout of 16-byte vectors first (the generated store writes from the
    wgmma accumulator layout: 4-byte pieces, 8 rows per warp instruction)."""
    import re
    from dataclasses import replace
    form = la.ks.gluon
    tpw = [32 // (d // 8), d // 8]
    lines = []
    for ln in form.source.splitlines():
        if ln.strip().startswith("P_LAYOUT: gl.constexpr"):
            pad = ln[:len(ln) - len(ln.lstrip())]
            lines += [ln, f"{pad}ST: gl.constexpr = gl.BlockedLayout([1, 8], {tpw}, [4, 1], [1, 0])",
                      f"{pad}ST_ROWS: gl.constexpr = gl.SliceLayout(1, ST)",
                      f"{pad}ST_COLS: gl.constexpr = gl.SliceLayout(0, ST)"]
            continue
        if ln.strip().startswith("gl.store(o_ptr"):
            ln = (ln.replace("gl.convert_layout(offs_i, O_ROWS)", "gl.convert_layout(offs_i, ST_ROWS)")
                  .replace("gl.convert_layout(mask_i, O_ROWS)", "gl.convert_layout(mask_i, ST_ROWS)")
                  .replace("offs_e[None, :]", "gl.convert_layout(offs_e, ST_COLS)[None, :]")
                  .replace("mask_e[None, :]", "gl.convert_layout(mask_e, ST_COLS)[None, :]"))
            ln = re.sub(r", (\(t\d+\)\.to\(gl\.\w+\)), mask=", r", gl.convert_layout(\1, ST), mask=", ln)
        lines.append(ln)
    src = "\n".join(lines) + "\n"
    assert src != form.source and "gl.convert_layout((t" in src, "no output store found"
    ks = replace(la.ks, gluon=replace(form, source=src))
    return make_launcher(la.program, ks, "cuda", la.config)


def single_where(la):
    """``la`` rebuilt with each masked block's second select -- ``p = where(mask,
    exp2(x - m), 0)`` after ``x = where(mask, s, -1e30)`` -- dropped: exp2 of a masked
    score is already 0 wherever the row's running max is finite, which causal rows'
    always is (each row sees its own key).  The select's cost, on a right output."""
    import re
    from dataclasses import replace
    form = la.ks.gluon
    lines, n = form.source.splitlines(), 0
    for k in range(1, len(lines)):
        m = re.match(r"(\s+)(t\d+) = gl\.where\((t\d+), (t\d+), 0\.0\)$", lines[k])
        if m and re.match(rf"\s+{m.group(4)} = gl\.exp2\(", lines[k - 1]):
            lines[k] = f"{m.group(1)}{m.group(2)} = {m.group(4)}"
            n += 1
    assert n, "no second select found"
    ks = replace(la.ks, gluon=replace(form, source="\n".join(lines) + "\n"))
    return make_launcher(la.program, ks, "cuda", la.config)


def releases_together(la):
    """``la`` rebuilt with each block's release of its key slot (``b_empty``) moved down
    beside the release of the last block's value slot (``c_empty``): one place per block
    where a consumer warpgroup synchronises (session 33, ncu: Gluon's ``mbarrier.arrive``
    is one thread's, after a ``bar.sync`` of the warpgroup, and those barriers were a third
    of the consumers' stall cycles at global S=2048; cuDNN's kernel shows none)."""
    import re
    from dataclasses import replace
    form = la.ks.gluon
    lines, out, held, n = form.source.splitlines(), [], None, 0
    for ln in lines:
        if re.match(r"\s+mbarrier\.arrive\(b_empty\.index\(st\), count=1\)$", ln):
            held = ln
            continue
        if held is not None and re.match(r"\s+mbarrier\.arrive\(c_empty\.index\(prev\), count=1\)$", ln):
            out += [held, ln]
            held, n = None, n + 1
            continue
        if held is not None and re.match(r"\s*(for |if |mbarrier\.arrive\(q_empty)", ln):
            out.append(held)  # a block without a value release (the first): kept as it was
            held = None
        out.append(ln)
    assert n and held is None, "no key release moved"
    ks = replace(la.ks, gluon=replace(form, source="\n".join(out) + "\n"))
    return make_launcher(la.program, ks, "cuda", la.config)


def no_mask_fragment():
    """Patch ``gluon_ws.block_fragment``: every block's body without the affine atoms."""
    orig = gluon_ws.block_fragment

    def patched(em, known, whole=False):
        return orig(em, known | em.plan.passes[0].bound_atoms, whole)
    return orig, patched


def shape_rows(b, h, s, d, kv):
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, kv or h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = {c: gv.cudnn_attention(q, k.repeat_interleave(h // (kv or h), 1),
                                 v.repeat_interleave(h // (kv or h), 1), c)
           for c in (True, False)}
    base = {"B": b, "H": h, "S": s, "D": d, "kv": kv}
    rows = []

    def run(name, variant, cfg, **flags):
        if (ONLY and not name.startswith(ONLY)) or (SKIP and name.startswith(SKIP)):
            return
        row = {**base, "kernel": name, "config": str(cfg)}
        try:
            if flags.pop("nomask", False):
                orig, patched = no_mask_fragment()
                gluon_ws.block_fragment = patched
                try:
                    la = launcher(variant, b, h, s, d, kv, cfg, **flags)
                finally:
                    gluon_ws.block_fragment = orig
            else:
                coalesced = flags.pop("coalesced", False)
                one_where = flags.pop("single_where", False)
                together = flags.pop("together", False)
                la = launcher(variant, b, h, s, d, kv, cfg, **flags)
                if coalesced:
                    la = coalesced_store(la, d)
                if one_where:
                    la = single_where(la)
                if together:
                    la = releases_together(la)
            t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q)}
            ms = timed(lambda: la(t))
            row["ms"] = ms
            row["tflops"] = gv.flops(variant, b, h, s, d) / ms / 1e9
            want = ref[variant == "causal"]()
            row["max_diff_vs_cudnn"] = (t["o"].float() - want.float()).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a probe row, never the whole run
            row["error"] = repr(e)[-400:]
        print(json.dumps(row), flush=True)
        rows.append(row)

    for c, name in ((True, "cudnn causal"), (False, "cudnn global")):
        ms = timed(ref[c])
        rows.append({**base, "kernel": name, "ms": ms,
                     "tflops": gv.flops("causal" if c else "global", b, h, s, d) / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    for bi, bl, w, st in TL[d]:
        cfg = TileConfig({"B_i": bi, "B_L": bl}, w, st)
        run("tl causal", "causal", cfg)
        run("tl global", "global", cfg)
        run("tl causal raw max", "causal", cfg, raw_max=True)
        run("tl global raw max", "global", cfg, raw_max=True)
    g = TileConfig({"B_i": 128, "B_L": 128}, 4, 2, gluon_ws=True)
    run("gluon causal", "causal", g)
    run("gluon causal single where", "causal", g, single_where=True)
    run("gluon causal coalesced store", "causal", g, coalesced=True)
    run("gluon global coalesced store", "global", g, coalesced=True)
    run("gluon causal per-tile", "causal", g, persistent=False)
    run("gluon causal no mask (wrong)", "causal", g, nomask=True)
    run("gluon global", "global", g)
    run("gluon global releases together", "global", g, together=True)
    run("gluon causal releases together", "causal", g, together=True)
    run("gluon causal raw max", "causal", g, raw_max=True)
    run("gluon global raw max", "global", g, raw_max=True)
    # the first rows again, last: a drift of the machine over the run shows here
    run("gluon causal again", "causal", g)
    run("gluon global again", "global", g)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--name", default="causal_overhead.json")
    ap.add_argument("--shapes", type=int, nargs="*", help="indices into SHAPES")
    ap.add_argument("--only", nargs="*", default=[], help="kernel-name prefixes, e.g. gluon")
    ap.add_argument("--skip", nargs="*", default=[], help="kernel-name prefixes not to run")
    a = ap.parse_args()
    global ONLY, SKIP
    ONLY, SKIP = tuple(a.only), tuple(a.skip)
    rows = []
    for i, sh in enumerate(SHAPES):
        if a.shapes and i not in a.shapes:
            continue
        rows += shape_rows(*sh)
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.name), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

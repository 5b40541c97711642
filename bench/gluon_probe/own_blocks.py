"""Probe (session 47): each consumer warpgroup computes only the key blocks its rows see.

A Gluon tile's producer streams the key blocks of all of the program's rows, and until
session 47 every consumer warpgroup computed every one of them.  Two kinds of block were
masked whole for a warpgroup and computed all the same:

* under a causal bound, the first warpgroups' rows end before the tile's last keys
  (192-row tiles of 128-key blocks: 1.5 of a tile's ~3 x 20 warpgroup blocks at head dim
  64, S=5000);
* a warpgroup whose rows all lie past the row extent, in the last tile of a length that
  is not a multiple of the tile (S=5000 in 192-row tiles: the 27th holds 8 rows; S=3000
  in 128-row tiles: the 24th holds 56) -- the whole key range, for nothing.

``gluon_tiles.consumer_blocks`` gives each warpgroup its own count and
``skipped_blocks`` releases the rest unread (switches ``gluon_ws.OWN_BLOCKS`` and
``OWN_PAST_ROWS``).  This probe is the product's A/B: each case's form generated under
each setting of the switches (``VARIANTS``), launched as the product launches it,
outputs checked identical, then timed side by side under CUDA graphs, alternating, with
cuDNN SDPA on the same inputs.  Its first run (session 47, at commit 2e4f2a7, where every
form took both skips) is ``bench/results/s47/own_blocks_h200.json``; since, only the
three-consumer causal forms have them, so the other cases time alike.

    python bench/gluon_probe/own_blocks.py [--cases ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import tile_timeline as tt  # noqa: E402  (run_cases)
import gluon_validate as gv  # noqa: E402
from wide_form import cudnn_ms  # noqa: E402
import torch  # noqa: E402

from neptune_eq.lowering import gluon_ws  # noqa: E402
from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig  # noqa: E402

CASES = {  # name: (variant, B, H, S, D, kv heads, dtype, rows, key block, ring, options)
    "causal-d64-wide128": ("causal", 4, 16, 5000, 64, None, "bfloat16", 192, 128, 2, {}),
    "causal-d64-wide64": ("causal", 4, 16, 5000, 64, None, "bfloat16", 192, 64, 2, {}),
    "causal-d64-two64": ("causal", 4, 16, 5000, 64, None, "bfloat16", 128, 64, 3, {}),
    "gqa16-3000-d64-wide64": ("causal", 4, 16, 3000, 64, 8, "bfloat16", 192, 64, 2, {}),
    "global-d64-wide128": ("global", 4, 16, 5000, 64, None, "bfloat16", 192, 128, 2, {}),
    "causal-d128-3000": ("causal", 2, 32, 3000, 128, None, "float16", 128, 128, 2, {}),
    "global-d128-3000": ("global", 2, 32, 3000, 128, None, "float16", 128, 128, 2, {}),
    "causal-d128-8192": ("causal", 1, 32, 8192, 128, None, "float16", 128, 128, 2, {}),
}


CASES.update({  # masks over captured tensors (gluon_validate.data_case), 64-key blocks
    "doc13-8192-heads-first": ("doc13", 1, 16, 8192, 128, None, "float16", 128, 64, 2,
                               {"heads_first": True}),
    "doc13-8192-dynamic": ("doc13", 1, 16, 8192, 128, None, "float16", 128, 64, 2,
                           {"dynamic": True}),
    "doc64-8192-heads-first": ("doc64", 1, 16, 8192, 128, None, "float16", 128, 64, 2,
                               {"heads_first": True}),
    "window-8192": ("window", 1, 32, 8192, 128, None, "float16", 128, 64, 2, {}),
    # issue 17's long rows (session 48): the forms the cold choice picks between there
    # (jagged: gluon_validate.data_case's 7 documents, not doc_mask_gpu.py's 13)
    "jagged-32768-tile128": ("jagged", 1, 16, 32768, 128, None, "float16", 128, 128, 2,
                             {"heads_first": True}),
    "jagged-32768-dynamic": ("jagged", 1, 16, 32768, 128, None, "float16", 128, 64, 2,
                             {"dynamic": True}),
    "jagged-32768-heads-first": ("jagged", 1, 16, 32768, 128, None, "float16", 128, 64, 2,
                                 {"heads_first": True}),
    "doc13-32768-dynamic": ("doc13", 1, 16, 32768, 128, None, "float16", 128, 64, 2,
                            {"dynamic": True}),
    "doc13-32768-heads-first": ("doc13", 1, 16, 32768, 128, None, "float16", 128, 64, 2,
                                {"heads_first": True}),
})
VARIANTS = {  # name: (OWN_BLOCKS, OWN_PAST_ROWS, OWN_CONSUMERS)
    "every_block": (False, False, 3),  # every warpgroup computes every block of its tile
    "own_blocks": (True, True, 3),     # its own rows' blocks; past the rows, block 0 only
    "own_no_past": (True, False, 3),   # its own rows' blocks; past the rows, every block
    "own_two": (True, True, 2),        # "own_blocks" in the two-consumer forms too
}
DEFAULTS = (gluon_ws.OWN_BLOCKS, gluon_ws.OWN_PAST_ROWS, gluon_ws.OWN_CONSUMERS)


def _launcher(case: str, variant_name: str):
    """The case's product launcher under one setting of the switches."""
    variant, b, h, s, d, kv, dtype, rows, bl, ring, opts = CASES[case]
    mods, captured = None, {}
    if variant.startswith(("doc", "jagged")):
        mods, _, captured = gv.data_case(variant, b, s)
    gluon_ws.OWN_BLOCKS, gluon_ws.OWN_PAST_ROWS, gluon_ws.OWN_CONSUMERS = VARIANTS[variant_name]
    try:
        prog, ks = gv.derive(variant, b, h, s, d, dtype, kv, mods)
    finally:
        gluon_ws.OWN_BLOCKS, gluon_ws.OWN_PAST_ROWS, gluon_ws.OWN_CONSUMERS = DEFAULTS
    form = ks.gluon.form_for(rows, opts.get("dynamic", False))
    print(case, variant_name, form.own_blocks, form.own_past_rows, flush=True)
    cfg = TileConfig({f"B_{ks.block_axis}": rows, "B_L": bl}, 4, ring, gluon_ws=True, **opts)
    return prog, cfg, make_launcher(prog, ks, "cuda", cfg), captured


def measure(case: str, variants: list[str]) -> dict:
    import triton
    built = {v: _launcher(case, v) for v in variants}
    prog, cfg, _, captured = built[variants[0]]
    dtype = CASES[case][6]
    tensors = tt._tensors(prog, dtype, captured)
    (oname,) = prog.outputs
    o = tensors[oname]
    row = {"case": case, "config": str(cfg), "device": torch.cuda.get_device_name()}
    outs = []
    for v in variants:
        o.fill_(float("nan"))
        built[v][2](dict(tensors))
        torch.cuda.synchronize()
        outs.append(o.clone())
    row["identical"] = all(bool(torch.equal(*(torch.nan_to_num(x, 7.0) for x in (outs[0], y))))
                           for y in outs[1:])
    q, k, v_ = (tensors[n] for n in ("q", "k", "v"))
    if not captured:  # (the data masks' forms are checked by gluon_validate.py)
        ref = gv.reference(CASES[case][0], q.float(), k.float(), v_.float())
        row["max_err"] = max(float((y.float() - ref).abs().max()) for y in outs)
    for rnd in range(3):  # alternate, so drift in clock or heat falls on all
        for v in variants:
            la = built[v][2]  # (graphs hold the pre-pass launch too)
            try:
                t = triton.testing.do_bench_cudagraph(lambda: la(dict(tensors)), rep=200) * 1e3
            except Exception:  # (a launch the graph cannot capture: as called)
                t = triton.testing.do_bench(lambda: la(dict(tensors)), return_mode="median") * 1e3
                row["as_called"] = True
            row.setdefault(f"us_{v}", []).append(t)
        if not captured and CASES[case][0] in ("causal", "global"):
            row.setdefault("us_cudnn", []).append(
                cudnn_ms({"q": q, "k": k, "v": v_}, CASES[case][0] == "causal", graph=True) * 1e3)
    for v in variants:
        row[f"every_over_{v}"] = min(row[f"us_{variants[0]}"]) / min(row[f"us_{v}"])
        if "us_cudnn" in row:
            row[f"cudnn_over_{v}"] = min(row["us_cudnn"]) / min(row[f"us_{v}"])
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    tt.run_cases(args.cases, lambda c: measure(c, args.variants),
                 os.path.join(args.out, "own_blocks.json"))


if __name__ == "__main__":
    main()

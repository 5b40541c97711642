"""Ping-pong A/B of the Gluon forward (``lowering/gluon_ws.PINGPONG``), one process.

    python bench/pingpong_ab.py --out DIR [--rounds 3] [--quick | --math-heavy | --causal-walks]

With ping-pong the two consumer warpgroups issue their products in turn
(``gluon_tiles.pingpong_turns``), FlashAttention-3's inter-warpgroup overlap: one
warpgroup's softmax runs while the other's products hold the tensor cores.  It changes
only when products are issued, never the arithmetic, so each case first checks that both
forms' outputs are **bit-identical** (and, at small sizes, the error against an fp32
reference): odd lengths, head dim 64 and 128, bf16 with scores x8, rows that see nothing,
a document mask with padding.  Then, where a case is timed, the two forms alternate for
``--rounds`` rounds on the same inputs -- CUDA-graph replays (device time) and calls
(``do_bench``, host included) -- beside cuDNN SDPA where it runs the case; medians.

Writes DIR/pingpong_ab.json and prints one JSON row per case.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_validate import (DATA, cudnn_attention, data_case, derive, flops,  # noqa: E402
                            gluon_launcher, reference)

from neptune_eq.lowering import gluon_form, gluon_ws  # noqa: E402

# (variant, B, H, S, D, kv heads, dtype, scores x8, timed)
CASES = (
    ("causal", 1, 2, 1000, 128, None, "float16", False, False),
    ("global", 2, 2, 777, 128, None, "bfloat16", True, False),
    ("causal", 1, 3, 300, 64, None, "float16", False, False),
    ("masked-rows", 2, 2, 555, 64, None, "bfloat16", True, False),
    ("doc-pad", 1, 2, 1000, 128, None, "float16", False, False),
    ("window", 1, 2, 1000, 128, None, "bfloat16", True, False),
    # timed: the product's prefill setups (bench/neptune_ops.py) and issue 16's gaps
    ("global", 1, 32, 2048, 128, None, "float16", False, True),
    ("global", 1, 32, 8192, 128, None, "float16", False, True),
    ("causal", 1, 32, 2048, 128, None, "float16", False, True),
    ("causal", 1, 32, 8192, 128, None, "float16", False, True),
    ("global", 1, 64, 512, 128, 8, "float16", False, True),
    ("global", 1, 64, 2048, 128, 8, "float16", False, True),
    ("causal", 4, 16, 5000, 64, None, "bfloat16", False, True),
    ("global", 4, 16, 5000, 64, None, "bfloat16", False, True),
    ("window", 1, 32, 8192, 128, None, "float16", False, True),
    ("doc13", 1, 16, 8192, 128, None, "float16", False, True),
)
QUICK = {0, 4, 6, 9, 10}
# --causal-walks: causal at head dim 128 under both walks (the timer offers the persistent
# one and the same kernel launched one program per tile; the product chose the latter at
# S=8192, bench/results/README.md session 29)
CAUSAL_WALKS = (("causal", 1, 32, 2048, 128, None, "float16", False, True),
                ("causal", 1, 32, 8192, 128, None, "float16", False, True),
                ("causal", 1, 32, 32768, 128, None, "float16", False, True))
# --math-heavy (session 35): variants whose block math is longer than global's (ALiBi's
# bias, softcap's tanh), where one warpgroup's softmax has more to hide behind the other's
# products; global at the same shape as the control
MATH_HEAVY = (("alibi", 1, 32, 8192, 128, None, "float16", False, True),
              ("alibi", 1, 32, 2048, 128, None, "float16", False, True),
              ("alibi", 4, 16, 4096, 64, None, "bfloat16", False, True),
              ("softcap", 1, 32, 8192, 128, None, "float16", False, True),
              ("global", 1, 32, 8192, 128, None, "float16", False, True))


def forms(variant, b, h, s, d, dtype, kv, mods):
    """(plan's program, ks) with ping-pong off and on."""
    out, was = {}, gluon_ws.PINGPONG
    try:
        for on in (False, True):
            gluon_ws.PINGPONG = on
            out[on] = derive(variant, b, h, s, d, dtype, kv, mods)
    finally:
        gluon_ws.PINGPONG = was
    return out


def case(variant, b, h, s, d, kv, dtype, big, timed, rounds, walks=(False,)):
    row = {"variant": variant, "B": b, "H": h, "S": s, "D": d, "kv_heads": kv, "dtype": dtype,
           "large_scores": big}
    data = variant in DATA or variant.startswith("doc")
    mods, tmask, captured = data_case(variant, b, s) if data else (None, None, {})
    fs = forms(variant, b, h, s, d, dtype, kv, mods)
    if any(ks.gluon is None for _, ks in fs.values()):
        row["error"] = f"no Gluon form: {fs[False][1].gluon_why}"
        return row
    row["pingpong_in_source"] = ["turn.index(WHICH)" in ks.gluon.source for _, ks in fs.values()]
    dt = getattr(torch, dtype)
    q = torch.randn(b, h, s, d, device="cuda", dtype=dt) * (8 if big else 1)
    k, v = (torch.randn(b, kv or h, s, d, device="cuda", dtype=dt) for _ in range(2))
    kb = 64 if variant == "window" or data else 128
    configs = [(kb, ring, per_tile) for ring in fs[False][1].gluon.rings(kb)
               if fs[False][1].gluon.ring_bytes(kb, ring) <= gluon_form.SMEM_BYTES
               for per_tile in walks]
    if not timed:
        configs = configs[:1]
    for key_block, ring, per_tile in configs:
        tag = f"keys{key_block}_ring{ring}" + ("_per_tile" if per_tile else "")
        las, ts, outs = {}, {}, {}
        for on, (prog, ks) in fs.items():
            las[on] = gluon_launcher(prog, ks, key_block, ring, per_tile)
            ts[on] = {"q": q, "k": k, "v": v, "o": torch.full_like(q, float("nan")), **captured}
            las[on](ts[on])
            las[on](ts[on])  # the checked direct launch
            outs[on] = ts[on]["o"].clone()
        torch.cuda.synchronize()
        row[f"bit_identical_{tag}"] = bool(torch.equal(outs[False], outs[True]))
        row[f"nan_{tag}"] = bool(torch.isnan(outs[True]).any())
        if s <= 2048 and h <= 4:
            ref = reference(variant, q, k, v, tmask)
            row[f"max_err_pingpong_{tag}"] = (outs[True].float() - ref).abs().max().item()
        if not timed:
            continue
        graph, called = {False: [], True: []}, {False: [], True: []}
        for _ in range(rounds):  # alternated: the machine's drift falls on both forms
            for on in (False, True):
                graph[on].append(triton.testing.do_bench_cudagraph(lambda: las[on](ts[on]),
                                                                   rep=100))
                called[on].append(triton.testing.do_bench(lambda: las[on](ts[on]),
                                                          warmup=10, rep=100))
        fl = flops(variant, b, h, s, d) if not data else None
        for on, name in ((False, "off"), (True, "on")):
            g, c = statistics.median(graph[on]), statistics.median(called[on])
            row[f"ms_graph_{name}_{tag}"], row[f"ms_called_{name}_{tag}"] = g, c
            if fl:
                row[f"tflops_graph_{name}_{tag}"] = fl / g / 1e9
        row[f"graph_ratio_on_over_off_{tag}"] = (statistics.median(graph[False])
                                                 / statistics.median(graph[True]))
    if timed and variant in ("global", "causal") and kv is None:
        ms = triton.testing.do_bench(cudnn_attention(q, k, v, variant == "causal"),
                                     warmup=25, rep=200)
        row["cudnn_tflops_called"] = flops(variant, b, h, s, d) / ms / 1e9
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="five cases")
    ap.add_argument("--untimed", action="store_true", help="only the bit-identity checks")
    ap.add_argument("--causal-walks", action="store_true",
                    help="only causal D=128 at S=2048/8192/32768, both walks")
    ap.add_argument("--math-heavy", action="store_true",
                    help="only ALiBi and softcap (and global as the control)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    cases, walks = (CAUSAL_WALKS, (False, True)) if args.causal_walks else (CASES, (False,))
    cases = MATH_HEAVY if args.math_heavy else cases
    for i, c in enumerate(cases):
        if (args.quick and i not in QUICK) or (args.untimed and c[-1]):
            continue
        try:
            row = case(*c, rounds=args.rounds, walks=walks)
        except Exception as e:  # noqa: BLE001 - recorded; the next case still runs
            row = {"case": repr(c), "error": repr(e)[-800:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "pingpong_ab.json"), "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "argv": sys.argv, "rows": rows}, fh,
                      indent=1)


if __name__ == "__main__":
    main()

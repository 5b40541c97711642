"""The three-consumer Gluon form (192-row programs, head dim 64) against the two-consumer
form and the ``tl`` 64x64 tiles, per case, timed alternately in one process (issue 16).

    python bench/gluon_probe/wide_form.py [--rounds 3] [--cases causal64 gqa64_3000 ...]

At head dim 64 a key block's softmax takes as long as its products (session 45,
``tile_timeline.py``: 1.26 us a 128x128 block where the tensor cores need ~0.55 and the
exp unit ~0.57), and two consumer warpgroups did not overlap them.  FlashAttention-3 runs
three consumer warpgroups there (192-row tiles).  This probe times every Gluon config the
chooser would (``gluon_configs``, which offers the three-consumer form at 64-key blocks,
ring 2), the form at rings 3 and 4 and at 128-key blocks (ptxas spills there: not
offered), and cuDNN SDPA on the same inputs.  Cases are ``solo_form.AFFINE``'s (fp16).
Prints one JSON line per (case, round, config) and a summary of medians per case with
each config's ratio to cuDNN.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import solo_form as sf  # noqa: E402

from neptune_eq.lowering import gluon_ws  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig, gluon_configs  # noqa: E402
from neptune_eq.runtime.tuning import time_configs  # noqa: E402


def cudnn_ms(bound, causal: bool, graph: bool = False) -> float:
    """cuDNN SDPA on the case's inputs (K/V expanded for grouped heads), do_bench median;
    ``graph``: replayed from a CUDA graph (``do_bench_cudagraph``), as probes time the
    product's launches on the GPU alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = bound["q"], bound["k"], bound["v"]
    g = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(g, 1) for t in (k, v))

    def fn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=200)
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["causal64", "gqa64_3000", "global64",
                                                   "gqa64_5000"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--host", action="store_true",
                    help="time each call from the host on a flushed L2, as the chooser times "
                         "calls over 100 us and as bench/offgrid.py measures")
    a = ap.parse_args()
    gluon_ws.WIDE = True  # (read when a form is generated; part of the cache key)
    for name in a.cases:
        la, bound, values, pairs, D, _ = sf.setup(name, 0)
        rows = f"B_{la.ks.block_axis}"
        cfgs = [TileConfig({rows: 64, "B_L": 64}, 4, 3)] + gluon_configs(la.ks)
        wide = la.ks.gluon.wide
        if wide is not None:  # beyond what the chooser offers
            walks = (False, True) if wide.persistent else (False,)
            cfgs += [TileConfig({rows: 192, "B_L": bl}, 4, ring, gluon_ws=True, per_tile=pt)
                     for bl, ring in ((64, 3), (64, 4), (128, 2)) for pt in walks]
        cfgs = [c.at(values) for c in cfgs]
        chosen = la.config.at(values)
        cfgs += [] if chosen in cfgs else [chosen]
        peer = cudnn_ms(bound, sf.AFFINE[name][5])
        print(json.dumps({"case": name, "chosen": str(chosen), "cudnn_ms": peer}), flush=True)
        times: dict = {}
        for rnd in range(a.rounds):
            for c, ms, why in time_configs(la.program, la.ks, "cuda", bound, cfgs, values,
                                         host=a.host):
                times.setdefault(str(c), []).append(ms)
                print(json.dumps({"case": name, "round": rnd, "config": str(c), "ms": ms,
                                  "why": why or ""}), flush=True)
        med = {c: statistics.median(v) for c, v in times.items() if None not in v}
        print(json.dumps({"case": name, "cudnn_ms": peer, "summary": {
            c: [round(m, 4), round(peer / m, 3), round(4 * D * pairs / (m * 1e-3) / 1e12, 1)]
            for c, m in sorted(med.items(), key=lambda kv: kv[1])}}), flush=True)
        print(json.dumps({"case": name, "compiled": sf.compiled(la, bound, cfgs)}), flush=True)


if __name__ == "__main__":
    main()

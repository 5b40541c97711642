"""Probe: the tile shapes a row-wise chain that writes an [N, M] output could run at.

    python bench/probe/rowwise_probe.py log-softmax softmax-one     (writes $OUT or .)

For each chain of ``neptune_eq.frontend.chains.CHAINS`` named, at 4096 x 4099 fp32: every
non-split candidate plan at 1-4 rows x 1024-8192 columns x 4-16 warps x 1 / 3 stages,
each checked against torch fp64 and timed by ``do_bench`` beside torch eager and the
chooser's own pick, in one process.  It found the one-step whole-row tiles that
``runtime/tile_configs.whole_row_shapes`` now offers (session 42, H200:
``bench/results/s42/rowwise_probe_h200.json``).  Writes rowwise_probe.json.
"""
from __future__ import annotations

import itertools
import json
import os
import sys

import triton

import neptune_eq as ne
from neptune_eq.frontend.chains import CHAINS, random_inputs
from neptune_eq.runtime.gluon_launch import make_launcher
from neptune_eq.runtime.tile_configs import TileConfig

SIZES = dict(N=4096, M=4099, E=64, K=1024, V=32003, R=1000)
SHAPES = list(itertools.product((1, 2, 4), (1024, 2048, 4096, 8192), (4, 8, 16), (1, 3)))


def probe(name: str) -> list[dict]:
    ch = CHAINS[name]
    kern = ne.superoptimize(ch.build(SIZES), target="cuda", cache=False)
    prog = kern.input_program
    dev = {k: (v.float() if v.is_floating_point() else v).cuda()
           for k, v in random_inputs(ch, prog, SIZES, 2).items()}
    ref = ch.reference({k: v.double() if v.is_floating_point() else v for k, v in dev.items()})
    torch_us = triton.testing.do_bench(lambda: ch.reference(dev)) * 1e3
    chosen_us = triton.testing.do_bench(lambda: kern(**dev)) * 1e3
    print(name, "torch", round(torch_us, 1), "chosen", round(chosen_us, 1), kern.config, flush=True)
    out = []
    for r in kern.candidates:
        if r.plan is None or r.plan.split:
            continue
        ks = r.kernel
        for bi, bl, w, st in SHAPES:
            if bi * bl > 16384:
                continue
            blocks = {k: (bi if k == f"B_{ks.block_axis}" else bl) for k in ks.tunables}
            cfg = TileConfig(blocks, w, st)
            try:
                la = make_launcher(r.program, ks, "cuda", cfg)
                bound, _ = kern._bind_static(tuple(dev[ph.name] for ph in prog.inputs), {})
                la(bound)
                ok = all((bound[o].double() - ref[o]).abs().max().item()
                         <= 2e-4 * max(1.0, ref[o].abs().max().item()) for o in prog.outputs)
                us = triton.testing.do_bench(lambda: la(bound)) * 1e3
            except Exception as e:  # noqa: BLE001 - a shape that fails is reported, not fatal
                print(name, r.structure, cfg, "FAILED", str(e)[:120], flush=True)
                continue
            out.append(dict(chain=name, plan=r.structure, config=str(cfg), us=us, ok=ok,
                            torch_us=torch_us, chosen_us=chosen_us))
            print(name, r.structure[:30], cfg, round(us, 1), ok, flush=True)
    return out


def main():
    rows = [row for name in sys.argv[1:] for row in probe(name)]
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "rowwise_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

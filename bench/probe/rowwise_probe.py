"""Probe: which tile shapes a row-wise chain that writes an [N, M] output could run at
(4096 x 4099 fp32, H200), beyond the offered ones -- one whole-row tile a step, more warps."""
import itertools, json, os, sys
import torch, triton
import neptune_eq as ne
from neptune_eq.frontend.chains import CHAINS, random_inputs
from neptune_eq.runtime.gluon_launch import make_launcher
from neptune_eq.runtime.tile_configs import TileConfig

sizes = dict(N=4096, M=4099, E=64, K=1024, V=32003, R=1000)
out = []
for name in sys.argv[1:]:
    ch = CHAINS[name]
    kern = ne.superoptimize(ch.build(sizes), target="cuda", cache=False)
    prog = kern.input_program
    dev = {k: (v.float() if v.is_floating_point() else v).cuda()
           for k, v in random_inputs(ch, prog, sizes, 2).items()}
    ref = ch.reference({k: v.double() if v.is_floating_point() else v for k, v in dev.items()})
    torch_us = triton.testing.do_bench(lambda: ch.reference(dev)) * 1e3
    chosen_us = triton.testing.do_bench(lambda: kern(**dev)) * 1e3
    print(name, "torch", round(torch_us, 1), "chosen", round(chosen_us, 1), kern.config, flush=True)
    for r in kern.candidates:
        if r.plan is None or r.plan.split:
            continue
        ks = r.kernel
        for bi, bl, w, st in itertools.product((1, 2, 4), (1024, 2048, 4096, 8192), (4, 8, 16), (1, 3)):
            if bi * bl > 16384:
                continue
            blocks = {k: (bi if k == f"B_{ks.block_axis}" else bl) for k in ks.tunables}
            cfg = TileConfig(blocks, w, st)
            try:
                la = make_launcher(r.program, ks, "cuda", cfg)
                bound, _ = kern._bind_static(tuple(dev[ph.name] for ph in prog.inputs), {})
                la(bound)
                ok = all(((bound[o].double() - ref[o]).abs().max().item()
                          <= 2e-4 * max(1.0, ref[o].abs().max().item())) for o in prog.outputs)
                us = triton.testing.do_bench(lambda: la(bound)) * 1e3
            except Exception as e:  # noqa: BLE001
                print(name, r.structure, cfg, "FAILED", str(e)[:120], flush=True)
                continue
            row = dict(chain=name, plan=r.structure, config=str(cfg), us=us, ok=ok,
                       torch_us=torch_us, chosen_us=chosen_us)
            out.append(row)
            print(name, r.structure[:30], cfg, round(us, 1), ok, flush=True)
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "rowwise_probe.json"), "w"), indent=1)

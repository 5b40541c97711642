"""How much of each form's dense-causal speed a document mask keeps (issue 17): the `tl`
64x64 tiles and the Gluon form, on 13 documents (``doc_mask_gpu.case``) and on plain causal
attention at the same size, fp16 H=16 D=128, each timed over 20 CUDA-graph replays.

    python bench/gluon_probe/doc_vs_causal.py [S] [--forms tl64 gluon] [--masks doc13 causal]
        [--config one-program-per-tile] [--profile]

Masks: ``causal`` and ``doc_mask_gpu``'s cases (doc1, doc4, doc13, doc64, jagged).
``--config TEXT``: the Gluon config whose name holds TEXT (e.g. ``one-program-per-tile``
for the persistent causal form launched one program per tile, the walk a data mask's
form has).  ``--profile``: no graph; each launcher runs twice, then once between
``cudaProfilerStart`` / ``Stop``, so Nsight Compute sees only that launch and not the
cold choice's timing launches, e.g.
``ncu --profile-from-start off --set full -o doc1 python bench/gluon_probe/doc_vs_causal.py
16384 --forms gluon --masks doc1 --profile``.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import doc_mask_gpu as dm  # noqa: E402

from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402
from neptune_eq.runtime.tile_configs import candidate_configs  # noqa: E402
from neptune_eq.sizes import sizes_of  # noqa: E402


def launchers(mask, S, key_block=128, stages=2, config=""):
    """(tl 64x64 launcher, Gluon launcher, bound tensors) of ``mask`` at S; the Gluon one
    the first candidate at ``key_block`` and ``stages`` whose name holds ``config``."""
    q, k, v = (torch.randn(1, dm.H, S, dm.D, device="cuda", dtype=torch.float16) for _ in range(3))
    kern, la, bound = dm.launcher_of(q, k, v, mask)
    values = sizes_of(kern.input_program, bound)
    size_args = tuple(values[s] for s in la.ks.size_params)
    cfgs = candidate_configs(la.ks, "cuda")
    out = {}
    for c in cfgs:
        name = None
        if c.gluon_ws and c.blocks.get("B_L") == key_block and c.num_stages == stages \
                and config in str(c):
            name = "gluon"
        elif not c.gluon_ws and not c.tma and not c.one_loop and c.blocks.get("B_L") == 64 \
                and c.blocks.get(f"B_{la.ks.block_axis}") == 64:
            name = "tl64"
        if name and name not in out:
            out[name] = make_launcher(la.program, la.ks, "cuda", c.at(values), size_args)
    return out, bound


def graphed_ms(fn, reps=20):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("S", type=int, nargs="?", default=32768)
    ap.add_argument("--forms", nargs="*", default=["tl64", "gluon"])
    ap.add_argument("--masks", nargs="*", default=["doc13", "causal"])
    ap.add_argument("--config", default="")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    S = a.S

    def causal(b, h, q, kv):
        return q >= kv
    for name in a.masks:
        mask, vis = (causal, S * (S + 1) / 2) if name == "causal" else dm.case(name, S)[::2]
        las, bound = launchers(mask, S, config=a.config)
        for form, la in las.items():
            if form not in a.forms:
                continue
            if a.profile:
                for _ in range(2):
                    la(dict(bound))
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                la(dict(bound))
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                print(f"{name} S={S} {form} {la.config}: profiled one launch", flush=True)
                continue
            try:
                ms = graphed_ms(lambda: la(dict(bound)))
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"{name} {form}: {type(e).__name__}: {e}", flush=True)
                continue
            tf = 4 * dm.D * vis * dm.H / (ms * 1e-3) / 1e12
            print(f"{name} S={S} {form} {la.config}: {ms:.4f} ms, {tf:.0f} TFLOP/s on visible pairs",
                  flush=True)


if __name__ == "__main__":
    main()

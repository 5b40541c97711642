"""A warm decode call's host time with split-k's scratch kept per stream
(``runtime.bound_call.BoundCall``) against allocated and cut per call, in one process,
alternating three times: ``python bench/decode_host_ab.py`` (GPU).  Host us per call =
wall time of a loop of calls without a sync (the GPU work per call is far shorter)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import neptune_ops as ops
import neptune_eq as ne
from host_profile import NoKeep, loop_us  # the warm loop without a sync, one definition


for op, S in [("gqa-dc", 2048), ("causal-dc", 2048), ("gqa-dc", 8192)]:
    out, spec, work, unit = ops.build(op, S)
    q, k, v, slopes, args = ops.make_inputs(spec)
    kern = ne.superoptimize(out, target="cuda", top_k=2)
    ref = kern(*args).clone()
    res = {"kept": [], "per call": []}
    for _ in range(3):
        for mode in ("kept", "per call"):
            for b in kern._bound.values():
                if b is not None:
                    b._scratch = {} if mode == "kept" else NoKeep()
            res[mode].append(loop_us(lambda: kern(*args), calls=3000, warmup=50))
    same = torch.equal(kern(*args), ref)
    print(op, S, kern.config, {m: [round(x, 1) for x in v] for m, v in res.items()}, "same output", same, flush=True)

"""Where a data-mask call's host time goes, layer by layer (issue 17, session 38).

A short call (0.13 ms on the device at S=8192) is timed by ``do_bench`` after an L2 flush,
so host time past the flush's own device time shows in the figure.  This times the host
side of each layer of ``ne.flex_attention`` on one case, the launches queued but not
waited for (batches of 10 calls, a sync between batches, the sync not counted):

* ``flex``   -- ``ne.flex_attention(q, k, v, mask_mod=...)``, as a user calls it;
* ``run``    -- ``flex.run``: the structure already known (no mod fingerprint);
* ``kernel`` -- ``Kernel.__call__``: the signature's replay looked up;
* ``replay`` -- the replay itself (``BoundCall`` / ``GluonBoundCall``);
* ``launch`` -- the replay's launches alone, arguments prepared once (Gluon only).

    python bench/gluon_probe/host_split.py jagged 8192 [--dtype bfloat16] [--profile]
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import doc_mask_gpu as dm  # noqa: E402

import neptune_eq as ne  # noqa: E402
from neptune_eq.dropin import eager_env, flex  # noqa: E402
from neptune_eq.runtime.launch import current_stream, written_outputs  # noqa: E402


def host_us(fn, batches: int = 30, per: int = 10) -> float:
    """Median host microseconds of one call, launches queued, not waited for."""
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(per):
            fn()
        times.append((time.perf_counter() - t) / per * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("S", type=int)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    mask, B, _ = dm.case(a.case, a.S)
    dt = getattr(torch, a.dtype)
    q, k, v = (torch.randn(B, dm.H, a.S, dm.D, device="cuda", dtype=dt) for _ in range(3))
    ne.flex_attention(q, k, v, mask_mod=mask)
    spec = flex._checked(q, k, v, None, False, False)
    sizes = {flex.SIZES[0]: B, flex.SIZES[1]: a.S, flex.SIZES[2]: a.S}
    skey, captured = eager_env.eager_structure(None, mask, spec, sizes)
    kern = flex.STRUCTURES[skey].kernel
    args = [q, k, v, *captured]
    kern(*args)
    replay = next(r for r in kern._bound.values() if r is not None)
    layers = {"flex": lambda: ne.flex_attention(q, k, v, mask_mod=mask),
              "run": lambda: flex.run(skey, q, k, v, captured, False, False),
              "kernel": lambda: kern(*args),
              "replay": lambda: replay(list(args))}
    la = replay.launcher
    if getattr(la, "gluon", False) and replay.pre:
        outs = written_outputs(replay.out_specs, replay.device)
        tensors = {**dict(zip(replay.names, args)), **dict(zip(replay.outputs, outs))}
        names, _, launch, ints, classes = replay.pre
        sums = replay._new_summaries()
        run = {**tensors, **sums}
        pre = (launch, [tensors[n] for n in names] + list(sums.values()) + ints, classes)
        rest, key = la._rest(run, replay.integers)
        ck = la._checked[key + (pre[2],)]
        stream = current_stream(key[0])
        layers["launch"] = lambda: la._fast(ck, pre, run, rest, stream, reuse=True)
        layers["pre-pass launch"] = lambda: pre[0].fast(ck[0], pre[1], stream)
        layers["form launch"] = lambda: la._launch_form(ck[1], run, rest, stream, True)
    for name, fn in layers.items():
        for _ in range(20):
            fn()
    res = {name: round(host_us(fn), 1) for name, fn in layers.items()}
    print({"case": a.case, "S": a.S, "dtype": a.dtype, "launcher": type(la).__name__,
           "config": str(la.config), "host_us": res}, flush=True)
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            layers["flex"]()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()

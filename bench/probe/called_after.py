"""Probe (session 50): does ours-as-called change after the peers, a graph or a replay?

    python bench/probe/called_after.py [--op gqa-dc] [--S 2048]

``bench/interleaved_ratio.py`` read GQA decode at 2048 as called at 0.24 TB/s where
``neptune_ops.py`` (which times ours first) reads 0.56-0.58.  This times ours as called
(``do_bench``) and its host time per call (no sync, 2000 calls) at each step: right after
the build, after the peers' first calls (Flex compiles), after ``do_bench_cudagraph``, and
after ``device_ms`` over copies; with Triton's launch hooks printed at each step.
"""
import argparse
import json
import sys
from pathlib import Path

from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
import neptune_ops as nops  # noqa: E402
from neptune_eq.runtime.timing import copy_inputs, device_ms, input_copies, l2_bytes  # noqa: E402


def host_us(fn, n=2000):
    """Host microseconds a call (no sync between calls): ``host_split``'s measure."""
    from host_split import per_call_us  # (this folder is on the path when run as a script)
    return per_call_us(fn, n)


def hooks():
    try:
        from triton.compiler import CompiledKernel
        from triton import knobs
        return {"enter": repr(getattr(CompiledKernel, "launch_enter_hook", None)),
                "knobs_enter": repr(getattr(knobs.runtime, "launch_enter_hook", None))}
    except Exception as ex:  # noqa: BLE001
        return {"error": repr(ex)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="gqa-dc")
    ap.add_argument("--S", type=int, default=2048)
    a = ap.parse_args()
    out, spec, work, unit = nops.build(a.op, a.S)
    q, k, v, slopes, args = nops.make_inputs(spec)
    kern = ne.superoptimize(out, target="cuda", top_k=2)
    ours = lambda: kern(*args)  # noqa: E731
    peers = nops.peers(spec, q, k, v, slopes)
    copies = copy_inputs(list(args), input_copies(list(args), l2_bytes(q.device)))

    def step(name):
        row = {"step": name, "called_TBs": work / (do_bench(ours, warmup=25, rep=100,
                                                             return_mode="median") / 1e3),
               "host_us": host_us(ours), "sdpa_host_us": host_us(peers["sdpa"]), **hooks()}
        print(json.dumps(row), flush=True)
    step("after build")
    for n in ("sdpa", "flex"):
        peers[n]()
    step("after the peers' first calls")
    do_bench_cudagraph(ours, rep=50)
    step("after do_bench_cudagraph(ours)")
    device_ms(lambda c: kern(*c), copies)
    step("after device_ms(ours over copies)")
    do_bench(peers["flex"], warmup=10, rep=50)
    step("after do_bench(flex)")


if __name__ == "__main__":
    main()

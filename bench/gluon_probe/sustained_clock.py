"""Probe (session 38): a prefill kernel run back to back for seconds, with the SM clock and
the board power sampled beside it -- does a long run slow down, and does ALiBi slow down
more than global attention?  (issue 16: ALiBi at S=32768 read 570 TFLOP/s in the table's
``do_bench`` and 604-610 by the chooser's timer, which launches fewer times in a row.)

    python bench/gluon_probe/sustained_clock.py [--ops global-pf alibi-pf] [--S 32768] [--seconds 8]

Prints, per op, TFLOP/s and the median SM clock (MHz) and power (W) over the first and
the last second of the run (nvidia-smi sampled every 100 ms).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import neptune_eq as ne  # noqa: E402
import torch  # noqa: E402

import neptune_ops as ops  # noqa: E402
from gpu_clocks import sampled_clocks  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="*", default=["global-pf", "alibi-pf"])
    ap.add_argument("--S", type=int, default=32768)
    ap.add_argument("--seconds", type=float, default=8.0)
    a = ap.parse_args()
    for op in a.ops:
        prog, spec, work, _ = ops.build(op, a.S)
        kern = ne.superoptimize(prog)
        args = ops.make_inputs(spec)[-1]  # (q, k, v[, slopes]), as the table calls it
        kern(*args)
        torch.cuda.synchronize()
        with sampled_clocks() as smi:
            marks = run_for(kern, args, a.seconds)
        clocks = [c for c, _, _ in smi.samples]
        power = [w for _, w, _ in smi.samples]
        if not clocks:
            raise SystemExit(smi.summary()["clock_note"])
        k = max(1, int(len(clocks) / a.seconds))  # samples in a second

        def tf(m):
            return round(work * m[1] / (m[2] * 1e-3), 1)
        print(json.dumps({"op": op, "S": a.S, "config": str(kern.config),
                          "tflops_per_second": [tf(m) for m in marks],
                          "clock_first_last": [statistics.median(clocks[:k]), statistics.median(clocks[-k:])],
                          "power_first_last": [statistics.median(power[:k]), statistics.median(power[-k:])]}),
              flush=True)


def run_for(kern, args, seconds: float) -> list:
    """``kern(*args)`` back to back for ``seconds``: (wall time, calls, GPU ms) per second."""
    t0 = time.time()
    marks = []  # (wall time, calls done, GPU ms of the second)
    while time.time() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        n = 0
        t1 = time.time()
        while time.time() - t1 < 1.0 and n < 200:
            kern(*args)
            n += 1
        end.record()
        end.synchronize()
        marks.append((time.time() - t0, n, start.elapsed_time(end)))
    return marks


if __name__ == "__main__":
    main()

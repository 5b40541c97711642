"""Host time of ``ne.flex_attention`` per call, without the kernels (issues 17 and 18).

At short lengths a call is host-bound: a training step at S = 2048 took 1.1 ms on an H100
for 0.6 ms of GPU time, and a document mask with 64 short documents runs for tens of
microseconds of GPU time.  This measures what the host does around the generated kernels,
on any machine: inputs are small CPU tensors, and the Triton interpreter's kernel bodies
are skipped (``InterpretedFunction.run`` replaced by a no-op), so what is timed is
neptune_eq's Python and the torch ops it issues.  On a GPU each of those torch ops that is
not a view or an allocation is one more kernel launch (5-10 us of host time and a slot on
the stream), so they are counted too (``TorchDispatchMode``: deterministic, unlike
timings on a shared machine).

    python bench/host_overhead.py [--calls 2000] [--out bench/results/host_overhead.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

S, D = 64, 16
# aten ops that launch nothing on a GPU: allocations, views, metadata
FREE = ("empty", "view", "unsqueeze", "squeeze", "expand", "as_strided", "detach", "alias",
        "slice", "select", "permute", "transpose", "unflatten",
        "lift_fresh", "new_empty", "reshape", "_reshape_alias", "unbind", "split")


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def launches(ops: Counter) -> dict:
    return {k: n for k, n in sorted(ops.items()) if not any(k.startswith(f) for f in FREE)}


def cases() -> dict:
    doc = torch.repeat_interleave(torch.arange(8, dtype=torch.int32), torch.full((8,), S // 8))

    def causal(b, h, q, kv):
        return q >= kv

    def documents(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)
    g = torch.Generator().manual_seed(0)

    def qkv(hq, hkv, grad):
        return [torch.randn(1, n, S, D, generator=g).requires_grad_(grad) for n in (hq, hkv, hkv)]

    def forward(mask, hq=2, hkv=2, lse=False):
        q, k, v = qkv(hq, hkv, False)
        return lambda: ne.flex_attention(q, k, v, mask_mod=mask, enable_gqa=hq != hkv,
                                         return_lse=lse)

    def step(mask, hq=2, hkv=2):
        q, k, v = qkv(hq, hkv, True)
        d_out = torch.randn(1, hq, S, D, generator=g)

        def run():
            q.grad = k.grad = v.grad = None  # as optimizer.zero_grad() leaves them
            ne.flex_attention(q, k, v, mask_mod=mask, enable_gqa=hq != hkv).backward(d_out)
        return run
    return {"forward, causal": forward(causal),
            "forward, causal, return_lse": forward(causal, lse=True),
            "forward, 8 documents": forward(documents),
            "forward+backward, causal": step(causal),
            "forward+backward, causal GQA 4:1": step(causal, 4, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_overhead.json"))
    args = ap.parse_args()
    fns = cases()
    for fn in fns.values():  # build every kernel (runs the interpreter once: slow, untimed)
        fn()
    import triton.runtime.interpreter as interp
    interp.InterpretedFunction.run = lambda self, *a, **k: None
    rows = []
    for name, fn in fns.items():
        fn()
        per = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            per.append((time.perf_counter() - t0) / args.calls * 1e6)
        with CountOps() as c:
            fn()
        ops = launches(c.ops)
        rows.append({"case": name, "host_us_min": min(per), "host_us_median": statistics.median(per),
                     "torch_launching_ops": sum(ops.values()), "ops": ops})
        print(f"{name:36s} {min(per):7.1f} us (median {statistics.median(per):.1f}), "
              f"{sum(ops.values())} torch ops that launch on a GPU: {ops}", flush=True)
    out = {"python": platform.python_version(), "machine": platform.machine(),
           "torch": torch.__version__, "calls": args.calls, "S": S, "D": D,
           "note": "CPU, Triton interpreter with kernel bodies skipped: host time only",
           "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

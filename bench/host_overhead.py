"""Host time of ``ne.flex_attention`` per call (issues 16, 17 and 18).

At short lengths a call is host-bound: a training step at S = 2048 took 1.1 ms on an H100
for 0.6 ms of GPU time, and a document mask with 64 short documents runs for tens of
microseconds of GPU time.  This measures what the host does around the generated kernels,
on any machine: inputs are small CPU tensors, and the Triton interpreter's kernel bodies
are skipped (``InterpretedFunction.run`` replaced by a no-op), so what is timed is
neptune_eq's Python and the torch ops it issues.  On a GPU each of those torch ops that is
not a view or an allocation is one more kernel launch (5-10 us of host time and a slot on
the stream), so they are counted too (``TorchDispatchMode``: deterministic, unlike
timings on a shared machine).

With ``--device cuda`` the same cases run on a GPU with their real kernels at these tiny
sizes (a few microseconds of GPU time each), in a loop without synchronisation: the time
per call is then the host's, launches included.  Compiled FlexAttention (prebuilt
BlockMask) runs beside it as the peer.

    python bench/host_overhead.py [--calls 2000] [--device cuda] [--out bench/results/host_overhead.json]
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


def masks(dev: str) -> tuple:
    """The two masks every case uses: causal, and causal within 8 equal documents."""
    doc = torch.repeat_interleave(torch.arange(8, dtype=torch.int32, device=dev),
                                  torch.full((8,), S // 8, device=dev))

    def causal(b, h, q, kv):
        return q >= kv

    def documents(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)
    return causal, documents


def cases(dev: str = "cpu") -> dict:
    causal, documents = masks(dev)
    g = torch.Generator().manual_seed(0)

    def qkv(hq, hkv, grad):
        dt = torch.bfloat16 if dev == "cuda" else torch.float32  # bf16: as training runs
        return [torch.randn(1, n, S, D, generator=g).to(dev, dt).requires_grad_(grad)
                for n in (hq, hkv, hkv)]

    def forward(mask, hq=2, hkv=2, lse=False):
        q, k, v = qkv(hq, hkv, False)
        return lambda: ne.flex_attention(q, k, v, mask_mod=mask, enable_gqa=hq != hkv,
                                         return_lse=lse)

    def step(mask, hq=2, hkv=2):
        q, k, v = qkv(hq, hkv, True)
        d_out = torch.randn(1, hq, S, D, generator=g).to(q)

        def run():
            q.grad = k.grad = v.grad = None  # as optimizer.zero_grad() leaves them
            ne.flex_attention(q, k, v, mask_mod=mask, enable_gqa=hq != hkv).backward(d_out)
        return run
    return {"forward, causal": forward(causal),
            "forward, causal, return_lse": forward(causal, lse=True),
            "forward, 8 documents": forward(documents),
            "forward+backward, causal": step(causal),
            "forward+backward, causal GQA 4:1": step(causal, 4, 1)}


def flex_cases(dev: str) -> dict:
    """The peer on a GPU: torch's flex_attention compiled, BlockMask built once."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention)
    causal, documents = masks(dev)
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, S, D, generator=g).to(dev, torch.bfloat16) for _ in range(3)]
    qg, kg, vg = [x.clone().requires_grad_(True) for x in (q, k, v)]
    d_out = torch.randn_like(q)
    block_masks = {n: create_block_mask(m, 1, 1, S, S, device=dev) for n, m in
             (("causal", causal), ("documents", documents))}

    def step():
        qg.grad = kg.grad = vg.grad = None
        flex(qg, kg, vg, block_mask=block_masks["causal"]).backward(d_out)
    return {"flex compiled: forward, causal": lambda: flex(q, k, v, block_mask=block_masks["causal"]),
            "flex compiled: forward, 8 documents":
                lambda: flex(q, k, v, block_mask=block_masks["documents"]),
            "flex compiled: forward+backward, causal": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_overhead.json"))
    args = ap.parse_args()
    fns = cases(args.device)
    failed = {}
    for name, fn in list(fns.items()):  # build every kernel (the interpreter: slow, untimed)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a case that cannot run is reported, not timed
            failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{name}: failed: {failed[name]}", flush=True)
            del fns[name]
    if args.device == "cpu":
        import triton.runtime.interpreter as interp
        interp.InterpretedFunction.run = lambda self, *a, **k: None
    else:
        fns.update(flex_cases(args.device))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for name, fn in fns.items():
        fn()
        per = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            per.append((time.perf_counter() - t0) / args.calls * 1e6)
            sync()
        ops = {}
        if not name.startswith("flex"):  # (a dispatch mode would recompile the peer)
            with CountOps() as c:
                fn()
            ops = launches(c.ops)
        rows.append({"case": name, "host_us_min": min(per), "host_us_median": statistics.median(per),
                     "torch_launching_ops": sum(ops.values()), "ops": ops})
        print(f"{name:36s} {min(per):7.1f} us (median {statistics.median(per):.1f}), "
              f"{sum(ops.values())} torch ops that launch on a GPU: {ops}", flush=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    out = {"python": platform.python_version(), "machine": platform.machine(),
           "torch": torch.__version__, "calls": args.calls, "S": S, "D": D, "device": gpu,
           "note": ("GPU, real kernels at tiny sizes, no sync in the loop: host time per call"
                    if gpu else "CPU, Triton interpreter with kernel bodies skipped: host time only"),
           "rows": rows, "failed": failed}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""GPU probe: does the two-kernel backward gain from running dQ's kernel *beside*
dK/dV's, on a second CUDA stream, instead of after it?

    python bench/backward_streams_probe.py --out DIR [--lengths 2048,8192]
                                           [--variants 'plain,causal,window(256),doc(13)']

FlexAttention's backward launches its dQ programs and its dK/dV programs in one grid, so
neither waits for the other's last wave; ours launches them as two kernels, one after the
other.  For each variant this builds ne.flex_attention's backward kernels as a training
step does (both forms), then times, on the same tensors, the backward as

* ``fused``      -- the row kernel, dK/dV with dQ added atomically, dQ zeroed before and
                    converted after (the atomic form);
* ``sequential`` -- dQ's kernel (which also returns the row dots), then dK/dV's (the
                    deterministic form as it runs today);
* ``streams``    -- the row kernel, then dQ's kernel on a side stream beside dK/dV's on
                    the main one (``streams_q_first``: dQ's launched first);

called (CUDA events around each backward, median) and replayed from a CUDA graph.  The
gradients of every form are compared with the sequential one's.  One JSON per line in
``DIR/streams.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
from backward_gpu import step_tensors  # noqa: E402
from neptune_eq.dropin import flex, flex_backward  # noqa: E402


def backward_args(kw: dict, q, k, v, g) -> tuple:
    """The arguments ``flex_backward.run_backward`` gets in one training step."""
    seen = {}
    real = flex_backward.run_backward

    def spy(*args):
        seen["args"] = args
        return real(*args)
    flex_backward.run_backward = spy
    try:
        torch.autograd.grad(ne.flex_attention(q, k, v, **kw), (q, k, v), g)
    finally:
        flex_backward.run_backward = real
    return seen["args"]


def forms(args: tuple) -> dict:
    """name -> a function running one backward on the step's tensors (returns dq, dk, dv)."""
    skey, q, k, v, captured, out, lse, d_out, d_lse, _needs = args
    st = flex.STRUCTURES[skey]
    _, _, sizes, env = flex_backward.backward_env(st, q, k, v, captured, out, lse, d_out, d_lse)
    lse_grad = d_lse is not None
    # (built by the step above: on the GPU both forms are, for the timer's choice)
    fbw, fkern, _, _, stats, (first, rows) = flex_backward.backward_kernel(
        st, ("k", "v", "q"), sizes, False, lse_grad, env)
    qbw, qkern = flex_backward.backward_kernel(st, ("q",), sizes, True, lse_grad, env)[:2]
    kvbw, kvkern = flex_backward.backward_kernel(st, ("k", "v"), sizes, True, lse_grad, env)[:2]
    dt = q.dtype

    def args_of(bw, extra):
        e = {**env, **extra}
        return [e[ph.name] for ph in bw.program.inputs]

    def row_dots():
        res = rows(*args_of(first, {}))
        return dict(zip(stats, res if isinstance(res, tuple) else (res,)))

    def fused():
        dk, dv, dq = fkern(*args_of(fbw, row_dots()))
        return dq.to(dt), dk.to(dt), dv.to(dt)

    def sequential():
        dq, *st_ = qkern(*args_of(qbw, {}))
        dk, dv = kvkern(*args_of(kvbw, dict(zip(stats, st_))))
        return dq.to(dt), dk.to(dt), dv.to(dt)

    side = torch.cuda.Stream()

    def streams(q_first: bool):
        def run():
            dots = row_dots()
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            kv_args = args_of(kvbw, dots)
            if not q_first:
                dk, dv = kvkern(*kv_args)
            with torch.cuda.stream(side):
                dq = qkern(*args_of(qbw, {}))[0]
            if q_first:
                dk, dv = kvkern(*kv_args)
            main.wait_stream(side)
            dq.record_stream(main)
            return dq.to(dt), dk.to(dt), dv.to(dt)
        return run
    return {"fused": fused, "sequential": sequential, "streams": streams(False),
            "streams_q_first": streams(True)}


def called_ms(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graphed_ms(fn, reps: int = 30) -> float:
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):
        for _ in range(3):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=cap):
            fn()
    torch.cuda.current_stream().wait_stream(cap)
    return called_ms(graph.replay, reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--variants", default="plain,causal,window(256),doc(13)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for S in [int(s) for s in a.lengths.split(",")]:
        for name in a.variants.split(","):
            row = {"variant": name, "S": S, "device": torch.cuda.get_device_name()}
            try:
                kw, q, k, v, g = step_tensors(name, S)
                fs = forms(backward_args(kw, q, k, v, g))
                ref = fs["sequential"]()
                for form, fn in fs.items():
                    got = fn()
                    row[f"diff_{form}"] = max((x.float() - y.float()).abs().max().item()
                                              for x, y in zip(got, ref))
                    row[f"called_ms_{form}"] = called_ms(fn)
                    row[f"graph_ms_{form}"] = graphed_ms(fn)
            except Exception as e:  # noqa: BLE001 - recorded, the next row runs
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            with open(out / "streams.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

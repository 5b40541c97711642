"""Session 60's two CPU-only checks, run on the GPU: a bucket chosen untimed has its
config checked against the plain launch (``tuning.agreeing_config``), and a tensor past
2^31 element offsets is refused before anything launches (``sizes.check_index_span``).

    python bench/probe/untimed_check_gpu.py [--out DIR]

1. ``ne.flex_attention`` (causal, B=1, H=8, D=64, bf16) first at S=4096 (a timed
   bucket), then at new lengths whose calls the cost model puts under 1 ms (chosen
   untimed): each call's output against fp32 SDPA, and what ``agreeing_config`` saw
   (the config it was given, the one it returned, any warning).
2. A decode over a KV cache whose last element lies at offset 2^31 - 1 (runs: its output
   against fp32 SDPA) and at 2^31 or past (a tensor and a strided view: the error, and
   the GPU kernels that ran meanwhile, from the profiler: none expected).
Writes DIR/untimed_check_gpu.json."""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import neptune_eq as ne
from neptune_eq.choosing import dispatch
from neptune_eq.runtime import tuning


def untimed_buckets(lengths) -> list[dict]:
    seen = []
    real = tuning.agreeing_config

    def recording(program, ks, target, tensors, config, configs, values=None):
        got = real(program, ks, target, tensors, config, configs, values)
        seen.append({"kernel": ks.name, "values": {k: int(v) for k, v in (values or {}).items()},
                     "given": str(config), "returned": str(got)})
        return got
    dispatch.agreeing_config = recording
    rows = []
    causal = lambda b, h, i, j: i >= j  # noqa: E731
    try:
        for S in lengths:
            torch.manual_seed(S)
            q, k, v = (torch.randn(1, 8, S, 64, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            before = len(seen)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                out = ne.flex_attention(q, k, v, mask_mod=causal)
                torch.cuda.synchronize()
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
            rows.append({"S": S, "err": float((out.float() - ref).abs().max()),
                         "checked": seen[before:], "warnings": [str(x.message)[:300] for x in w]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        dispatch.agreeing_config = real
    return rows


def past_offsets() -> list[dict]:
    rows = []
    q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(2 ** 31 + 2 ** 20, device="cuda", dtype=torch.bfloat16)
    n = 2 ** 21  # keys a head: 8 x 2^21 x 128 = 2^31 elements
    cases = {  # the last element at offset 2^31 - 1 (runs, checked), and past it (refused)
        "at the limit: 8 x 2^21 x 128": big[:2 ** 31].view(1, 8, n, 128),
        "past: 8 x (2^21 + 1) x 128": big[:8 * (n + 1) * 128].view(1, 8, n + 1, 128),
        "past, a strided view": big.view(-1, 128)[::4][:8 * (n // 4 + 1)].view(1, 8, n // 4 + 1, 128),
    }
    for name, kv in cases.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            try:
                out = ne.flex_attention(q, kv, kv)
                torch.cuda.synchronize()
                raised = None
            except Exception as e:  # noqa: BLE001 - recorded
                raised = f"{type(e).__name__}: {str(e)[:300]}"
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        rows.append({"case": name, "shape": list(kv.shape), "stride": list(kv.stride()),
                     "raised": raised, "gpu_kernels": len(kernels)})
        if raised is None:  # the last key's offset is 2^31 - 1: right there too?
            ref = F.scaled_dot_product_attention(q.float(), kv.float(), kv.float())
            rows[-1]["err"] = float((out.float() - ref).abs().max())
            rows[-1]["ref_max"] = float(ref.abs().max())
            half = kv[:, :, : kv.shape[2] // 2]  # the same kernel, offsets under 2^30
            o2 = ne.flex_attention(q, half, half)
            r2 = F.scaled_dot_product_attention(q.float(), half.float(), half.float())
            rows[-1]["half_err"] = float((o2.float() - r2).abs().max())
            rows[-1]["half_ref_max"] = float(r2.abs().max())
            del r2
            del ref
        print(json.dumps(rows[-1]), flush=True)
    del big
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--S", type=int, nargs="+", default=[4096, 1000, 1537, 700])
    a = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "untimed": untimed_buckets(a.S), "past_2_31": past_offsets()}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "untimed_check_gpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

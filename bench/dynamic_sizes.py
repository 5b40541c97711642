"""One structure, many sizes (issue 14): a decode whose KV cache grows over N steps, and
prefill at random lengths, against FlexAttention (torch.compile, dynamic=True) and SDPA,
in the same process.  GPU only.

For each system: the time of every call (host wall clock around the call plus a
synchronize, so compiles and bucket choices are included where they happen), the total,
and the median call once warm; neptune_eq's cold superoptimize is reported apart, and its
outputs are checked against SDPA at every size.  Writes bench/results/dynamic_sizes.{json,md}.

    python bench/dynamic_sizes.py [--steps 1000] [--lengths 50] [--max-len 16384]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402

torch._dynamo.config.recompile_limit = 10_000
torch._dynamo.config.cache_size_limit = 10_000
OUT = Path(__file__).parent / "results"


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def summary(times: list[float], warm_from: int = 5) -> dict:
    warm = times[warm_from:] or times
    return {"calls": len(times), "total_s": sum(times), "first_s": times[0],
            "median_warm_ms": statistics.median(warm) * 1e3, "max_s": max(times)}


def decode(args, flex, report):
    hq, hkv, d, dt = 32, 8, 128, torch.float16
    t0 = args.start
    total = t0 + args.steps
    q = torch.randn(1, hq, 1, d, device="cuda", dtype=dt)
    kc = torch.randn(1, hkv, total, d, device="cuda", dtype=dt)
    vc = torch.randn(1, hkv, total, d, device="cuda", dtype=dt)
    cold, kern = timed(lambda: ne.superoptimize(ne.attention(1, hq, 1, "T", d, "float16", kv_heads=hkv),
                                                sizes={"T": t0}, cache=False))
    res = {"cold_superoptimize_s": cold, "structure": "GQA decode 32/8 heads, D=128, fp16"}
    worst = 0.0
    systems = {
        "neptune_eq": lambda t: kern(q, kc[:, :, :t], vc[:, :, :t]),
        "sdpa": lambda t: F.scaled_dot_product_attention(q, kc[:, :, :t], vc[:, :, :t], enable_gqa=True),
        "flex": lambda t: flex(q, kc[:, :, :t], vc[:, :, :t], enable_gqa=True),
    }
    for name, fn in systems.items():
        times = []
        for t in range(t0, total):
            dt_s, out = timed(lambda: fn(t))
            times.append(dt_s)
            if name == "neptune_eq" and (t - t0) % 97 == 0:
                ref = F.scaled_dot_product_attention(q, kc[:, :, :t], vc[:, :, :t], enable_gqa=True)
                worst = max(worst, (out.float() - ref.float()).abs().max().item())
        res[name] = summary(times)
    res["neptune_eq"]["bucket_choices"] = kern._dispatch.bucket_choices
    res["neptune_eq"]["saturations"] = kern.saturations
    res["neptune_eq"]["max_abs_err_vs_sdpa"] = worst
    report["decode"] = res


def prefill(args, flex, report):
    from torch.nn.attention.flex_attention import create_block_mask
    h, d, dt = 32, 128, torch.float16
    rng = random.Random(0)
    lengths = [rng.randint(1, args.max_len) for _ in range(args.lengths)]
    causal = lambda b, hh, i, j: j <= i  # noqa: E731  (the same mask for every system)
    cold, kern = timed(lambda: ne.superoptimize(
        ne.attention(1, h, "S", "S", d, "float16", mask_mod=causal), sizes={"S": 4096}, cache=False))
    res = {"cold_superoptimize_s": cold, "lengths": lengths,
           "structure": "causal prefill 32 heads, D=128, fp16"}
    worst = 0.0

    def flex_call(q, k, v, s):
        bm = create_block_mask(causal, None, None, s, s, device="cuda")
        return flex(q, k, v, block_mask=bm)
    systems = {"neptune_eq": lambda q, k, v, s: kern(q, k, v),
               "sdpa": lambda q, k, v, s: F.scaled_dot_product_attention(q, k, v, is_causal=True),
               "flex": flex_call}
    data = {s: [torch.randn(1, h, s, d, device="cuda", dtype=dt) for _ in range(3)] for s in lengths}
    for name, fn in systems.items():
        first, again = [], []
        for s in lengths:
            q, k, v = data[s]
            t1, out = timed(lambda: fn(q, k, v, s))
            t2, _ = timed(lambda: fn(q, k, v, s))
            first.append(t1)
            again.append(t2)
            if name == "neptune_eq":
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                worst = max(worst, (out.float() - ref.float()).abs().max().item())
        res[name] = {"total_first_calls_s": sum(first), "max_first_call_s": max(first),
                     "median_repeat_ms": statistics.median(again) * 1e3,
                     "total_repeat_s": sum(again)}
    res["neptune_eq"]["bucket_choices"] = kern._dispatch.bucket_choices
    res["neptune_eq"]["buckets"] = kern.buckets
    res["neptune_eq"]["max_abs_err_vs_sdpa"] = worst
    report["prefill"] = res


def write(report):
    OUT.mkdir(exist_ok=True)
    (OUT / "dynamic_sizes.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# One structure, many sizes ({report['device']}, torch {report['torch']}, "
             f"triton {report['triton']}, {report['date']})", "",
             f"Command: `{report['command']}`", ""]
    if "decode" in report:
        r = report["decode"]
        lines += [f"## Growing decode: {r['structure']}, {r['neptune_eq']['calls']} steps", "",
                  f"neptune_eq cold superoptimize {r['cold_superoptimize_s']:.1f} s (saturations: "
                  f"{r['neptune_eq']['saturations']}, bucket choices after it: "
                  f"{r['neptune_eq']['bucket_choices']}); max |err| vs SDPA "
                  f"{r['neptune_eq']['max_abs_err_vs_sdpa']:.2e}", "",
                  "| system | total s (incl. compiles) | first call s | median warm call ms | slowest call s |",
                  "| --- | --- | --- | --- | --- |"]
        for n in ("neptune_eq", "flex", "sdpa"):
            x = r[n]
            lines.append(f"| {n} | {x['total_s']:.3f} | {x['first_s']:.3f} | {x['median_warm_ms']:.3f} "
                         f"| {x['max_s']:.3f} |")
    if "prefill" in report:
        r = report["prefill"]
        lines += ["", f"## Prefill at {len(r['lengths'])} random lengths in 1..{max(r['lengths'])}: "
                  f"{r['structure']}", "",
                  f"neptune_eq cold superoptimize {r['cold_superoptimize_s']:.1f} s; bucket choices "
                  f"after it: {r['neptune_eq']['bucket_choices']}; max |err| vs SDPA "
                  f"{r['neptune_eq']['max_abs_err_vs_sdpa']:.2e}", "",
                  "| system | first calls, total s | slowest first call s | repeat call median ms | repeats total s |",
                  "| --- | --- | --- | --- | --- |"]
        for n in ("neptune_eq", "flex", "sdpa"):
            x = r[n]
            lines.append(f"| {n} | {x['total_first_calls_s']:.2f} | {x['max_first_call_s']:.3f} | "
                         f"{x['median_repeat_ms']:.3f} | {x['total_repeat_s']:.3f} |")
    (OUT / "dynamic_sizes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--start", type=int, default=1024)
    ap.add_argument("--lengths", type=int, default=50)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--only", choices=["decode", "prefill"])
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=True)
    import triton
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": "python bench/dynamic_sizes.py " + " ".join(sys.argv[1:])}
    if args.only in (None, "decode"):
        decode(args, flex, report)
        write(report)
    if args.only in (None, "prefill"):
        prefill(args, flex, report)
    write(report)


if __name__ == "__main__":
    main()

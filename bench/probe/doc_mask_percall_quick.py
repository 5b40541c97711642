"""A short issue-17 row: one cold choice per case through ``ne.flex_attention`` and, in the
same process, ours against FlexAttention with a prebuilt BlockMask and with its mask built
per call (``bench/doc_mask_gpu.py``'s cases and timings, without its profiler, graph and
sweep columns, which take minutes a row at S=32768), with the SM clock and board power
sampled while ours and the prebuilt peer are timed (``gpu_clocks``).  Prints one JSON
line per case as it finishes and writes them to ``--out``.

    python bench/probe/doc_mask_percall_quick.py --S 32768 --cases doc13 jagged --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import doc_mask_gpu as dm  # noqa: E402
from gpu_clocks import sampled_clocks  # noqa: E402
import neptune_eq as ne  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402


def chooser_timings(kern) -> list:
    """[config, ms] of every config the cold choice timed for the chosen candidate, fastest
    first: what the choice saw, beside what the call then measures."""
    rows = []
    for bucket in (kern._dispatch.buckets.values() if kern._dispatch else ()):
        for choice in bucket:
            rows += [r for r in choice.rows if r.chosen] or [choice.row]
    rows = rows or [r for r in kern.candidates if r.chosen]
    timed = [(str(t[0]), t[1]) for r in rows for t in r.timings if t[1] is not None]
    return sorted(timed, key=lambda t: t[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=32768)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--cases", nargs="*", default=["doc13", "jagged"])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    S, dt = args.S, getattr(torch, args.dtype)
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for name in args.cases:
        dm.fresh_start()
        mask, B, pairs = dm.case(name, S)
        q, k, v = (torch.randn(B, dm.H, S, dm.D, device="cuda", dtype=dt) for _ in range(3))
        t0 = time.perf_counter()
        ours = ne.flex_attention(q, k, v, mask_mod=mask)
        torch.cuda.synchronize()
        row = {"case": name, "S": S, "dtype": args.dtype, "cold_s": time.perf_counter() - t0,
               "device": torch.cuda.get_device_name()}
        kern, la, _ = dm.launcher_of(q, k, v, mask)
        row["config"] = str(la.config)
        row["chooser_ms"] = chooser_timings(kern)
        bm = create_block_mask(mask, B, None, S, S, device="cuda")
        row["max_abs_diff_vs_flex"] = (ours.float() - flex(q, k, v, block_mask=bm).float()).abs().max().item()
        with sampled_clocks() as clocks:  # at S=32768 our call meets the power cap
            row["ms_ours"] = dm.do_bench(lambda: ne.flex_attention(q, k, v, mask_mod=mask),
                                         return_mode="median")
        row.update({f"ours_{k}": x for k, x in clocks.summary().items()})
        with sampled_clocks() as clocks:
            row["ms_flex_prebuilt"] = dm.do_bench(lambda: flex(q, k, v, block_mask=bm),
                                                  return_mode="median")
        row.update({f"flex_prebuilt_{k}": x for k, x in clocks.summary().items()})
        row["ms_flex_percall"] = dm.do_bench(
            lambda: flex(q, k, v, block_mask=create_block_mask(mask, B, None, S, S, device="cuda")),
            warmup=2, rep=20, return_mode="median")
        row["tflops_ours"] = 4.0 * dm.D * pairs * dm.H / (row["ms_ours"] * 1e-3) / 1e12
        row["x_prebuilt"] = row["ms_flex_prebuilt"] / row["ms_ours"]
        row["x_percall"] = row["ms_flex_percall"] / row["ms_ours"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"doc_mask_percall_quick_{S}_{args.dtype}.json").write_text(
            json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

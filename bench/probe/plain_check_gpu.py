"""What the timer's plain-launch check (``runtime.tuning``: every config's outputs must
agree with the plain launch's on the timing inputs) rejects, and what a cold build costs
with it: a few structures built cold on the GPU, each candidate's configs listed with
their status.

    python bench/probe/plain_check_gpu.py [--out DIR]

Writes DIR/plain_check_gpu.json."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import neptune_eq as ne

STRUCTURES = {
    "global prefill S=4096, 32 heads, D=128, fp16":
        lambda: ne.attention(1, 32, 4096, 4096, 128, "float16"),
    "causal prefill S=8192, 32 heads, D=128, bf16":
        lambda: ne.attention(1, 32, 8192, 8192, 128, "bfloat16", mask_mod=lambda b, h, i, j: j <= i),
    "GQA decode S=8192, 32/8 heads, D=128, fp16":
        lambda: ne.attention(1, 32, 1, 8192, 128, "float16", kv_heads=8),
    "prefill S=1024, 8 heads, D=64, bf16 (T5's shape, no mod)":
        lambda: ne.attention(1, 8, 1024, 1024, 64, "bfloat16"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    rows = []
    for name, build in STRUCTURES.items():
        t0 = time.perf_counter()
        row = {"structure": name}
        try:
            kern = ne.superoptimize(build(), target="cuda", cache=False, top_k=2)
            row["build_s"] = round(time.perf_counter() - t0, 1)
            row["chosen"] = f"{kern.chosen_row.description}; {kern.config}"
            statuses = [(r.description[:40], str(c), why) for r in kern.candidates
                        for c, _, why in (getattr(r, "timings", None) or [])]
            row["configs"] = len(statuses)
            row["rejected"] = [s for s in statuses if "plain launch" in s[2]]
            row["other_failures"] = [s for s in statuses
                                     if s[2] != "ok" and "plain launch" not in s[2]]
        except Exception as e:  # noqa: BLE001 - recorded
            row["raised"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "plain_check_gpu.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

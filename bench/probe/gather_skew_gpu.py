"""Is ``tl.gather``'s skew of a tile right on this GPU?  The table gradient's diagonal
sums (``lowering/scatter_code._along_diagonals``) skew each [R × K] score tile with
``y[r, t] = x[r, (r − t) mod K]``; on an H200 (Triton 3.6) its T5 gradient came back
wrong at 32 × 128 tiles, 3 stages, and right at 64 × 64.  This probe takes the skew
alone, in the two settings the product has it:

* ``plain``: x loaded, skewed, stored;
* ``loop``: inside a software-pipelined key loop (``tl.range(num_stages=…)``) after two
  ``tl.dot``s, as the backward has it, the skewed tile's column sums accumulated.

    python bench/probe/gather_skew_gpu.py [--out DIR]

Writes DIR/gather_skew_gpu.json: for each (R, K, warps, stages, setting) the largest
error against torch, or what raised."""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def skew_plain(x_ptr, y_ptr, R: tl.constexpr, K: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, K)[None, :]
    x = tl.load(x_ptr + r * K + c)
    u = r - c + K
    y = tl.gather(x, u % K, 1)
    tl.store(y_ptr + r * K + c, y)


@triton.jit
def skew_loop(q_ptr, k_ptr, out_ptr, n_iter, R: tl.constexpr, K: tl.constexpr,
              D: tl.constexpr, STAGES: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, K)[None, :]
    d = tl.arange(0, D)
    q = tl.load(q_ptr + r * D + d[None, :])
    u = r - c + K
    acc = tl.zeros([K], tl.float32)
    for it in tl.range(0, n_iter, num_stages=STAGES):
        kt = tl.load(k_ptr + (it * K + tl.arange(0, K))[:, None] * D + d[None, :])
        s = tl.dot(q, tl.trans(kt))
        p = tl.dot(q, tl.trans(kt)) * s
        y = tl.gather(p, u % K, 1)
        for lv in tl.static_range((R - 1) // K + 2):
            acc += tl.sum(tl.where(u // K == lv, y, 0.0), 0) * (lv + 1)
    tl.store(out_ptr + tl.arange(0, K), acc)


def skew_ref(x: torch.Tensor) -> torch.Tensor:
    R, K = x.shape
    r = torch.arange(R, device=x.device)[:, None]
    t = torch.arange(K, device=x.device)[None, :]
    return torch.gather(x, 1, (r - t) % K)


def loop_ref(q, k, R, K, n_iter) -> torch.Tensor:
    r = torch.arange(R, device=q.device)[:, None]
    t = torch.arange(K, device=q.device)[None, :]
    lv = torch.div(r - t + K, K, rounding_mode="floor")
    acc = torch.zeros(K, device=q.device, dtype=torch.float64)
    for it in range(n_iter):
        s = q.double() @ k[it * K:(it + 1) * K].double().T
        y = torch.gather(s * s, 1, (r - t) % K)
        acc += (y * (lv + 1)).sum(0)
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    rows = []
    torch.manual_seed(0)
    for (R, K), warps in itertools.product(
            [(16, 128), (32, 128), (64, 128), (128, 128), (32, 64), (64, 64), (128, 64),
             (64, 32), (128, 32)], (4, 8)):
        row = {"R": R, "K": K, "warps": warps}
        try:
            x = torch.randn(R, K, device="cuda")
            y = torch.empty_like(x)
            skew_plain[(1,)](x, y, R, K, num_warps=warps)
            row["plain_err"] = float((y - skew_ref(x)).abs().max())
        except Exception as e:  # noqa: BLE001 - recorded
            row["plain"] = f"{type(e).__name__}: {str(e)[:200]}"
        for stages in (1, 3):
            try:
                n_iter, D = 4, 64
                q = torch.randn(R, D, device="cuda", dtype=torch.bfloat16) / 4
                k = torch.randn(n_iter * K, D, device="cuda", dtype=torch.bfloat16) / 4
                out = torch.empty(K, device="cuda")
                skew_loop[(1,)](q, k, out, n_iter, R, K, D, stages, num_warps=warps,
                                num_stages=stages)
                want = loop_ref(q, k, R, K, n_iter)
                row[f"loop_err_s{stages}"] = float((out.double() - want).abs().max()
                                                   / want.abs().max())
            except Exception as e:  # noqa: BLE001 - recorded
                row[f"loop_s{stages}"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "gather_skew_gpu.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

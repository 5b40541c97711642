"""Learnable tables a score_mod reads, trained: ne.flex_attention's fwd+bwd beside
FlexAttention's (compiled), and the table's gradient against fp64 autograd.

    python bench/probe/table_grad_gpu.py [--S 1024 2048] [--out DIR]

Two mods, B=1, H=8, D=64, bf16 (self-attention, L = S):
* ``at q and kv``: ``score + t[q_idx] - t[kv_idx]`` -- the gradient's two row-wise
  partials, one kernel each (``flex_backward._partial_pieces``);
* ``relative``: ``score + rel[q_idx - kv_idx + S]`` -- a computed index, whose gradient
  kernel recomputes the scores per block of table entries (work ~ table x L x S).
Writes DIR/table_grad_gpu.json; prints one row per (mod, S)."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention
from triton.testing import do_bench

import neptune_eq as ne

FLEX = torch.compile(flex_attention)


def mods(S: int, t):
    return {"at q and kv": lambda s, b, h, i, j: s + t[i] - t[j],
            "relative": lambda s, b, h, i, j: s + t[i - j + S]}


def table(name: str, S: int, dev) -> torch.Tensor:
    return torch.randn(S if name == "at q and kv" else 2 * S, device=dev, requires_grad=True)


def dense_grad(q, k, v, mod, go):
    """fp64 autograd of the plain attention with ``mod`` on broadcast indices."""
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    S = q.shape[2]
    i = torch.arange(S, device=q.device).view(1, 1, S, 1)
    j = torch.arange(S, device=q.device).view(1, 1, 1, S)
    s = mod(qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5, None, None, i, j)
    return torch.softmax(s, -1) @ vd


def run(name: str, S: int, dev="cuda", dtype=torch.bfloat16) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, S, 64, device=dev, dtype=dtype, requires_grad=True)
               for _ in range(3))
    t = table(name, S, dev)
    go = torch.randn(1, 8, S, 64, device=dev, dtype=dtype)
    row = {"mod": name, "S": S}
    t0 = time.perf_counter()
    out = ne.flex_attention(q, k, v, mods(S, t)[name])
    (g_t,) = torch.autograd.grad(out, (t,), go)
    row["first_s"] = round(time.perf_counter() - t0, 1)
    td = t.detach().double().requires_grad_()
    ref = dense_grad(q, k, v, mods(S, td)[name], go)
    (want,) = torch.autograd.grad(ref, (td,), go.double())
    row["grad_err"] = float((g_t.double() - want).abs().max() / want.abs().max())

    def step(fn):
        def go_once():
            o = fn(q, k, v, mods(S, t)[name])
            torch.autograd.grad(o, (q, k, v, t), go)
        return go_once
    row["ms_ours"] = do_bench(step(ne.flex_attention), warmup=3, rep=20)
    try:
        row["ms_flex"] = do_bench(step(FLEX), warmup=3, rep=20)
    except Exception as e:  # noqa: BLE001 - recorded
        row["flex"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--mods", nargs="+", default=["at q and kv", "relative"])
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    rows = []
    for S in a.S:
        for name in a.mods:
            try:
                row = run(name, S)
            except Exception as e:  # noqa: BLE001 - recorded
                row = {"mod": name, "S": S, "raised": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "table_grad_gpu.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
        indent=1))


if __name__ == "__main__":
    main()

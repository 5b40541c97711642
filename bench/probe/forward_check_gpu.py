"""ne.flex_attention's forward (out and lse) against fp64, with the forward kernel's
chosen tiles per size bucket: for finding which form returns a wrong result.

Session 60: T5's forward at S = 1024 (B=1, H=8, D=64, bf16) came back wrong in every row
on an H200, right at 512 and 4096.  Run once per setting of the lowering switches (each
in its own process: ``NEPTUNE_EQ_PDL=0``, ``NEPTUNE_EQ_TMA=0`` ...).

    python bench/probe/forward_check_gpu.py --S 1024 --mods t5 none [--out DIR --tag T]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import neptune_eq as ne
from neptune_eq.dropin import flex as flex_mod

from table_grad_gpu import dense_scores, mods, table


def check(name: str, S: int, dev: str = "cuda", dtype=torch.bfloat16) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, S, 64, device=dev, dtype=dtype) for _ in range(3))
    t = table(name, S, dev).detach() if name != "none" else None
    mod = (lambda s, b, h, i, j: s) if name == "none" else mods(S, t)[name]
    out, lse = ne.flex_attention(q, k, v, mod, return_lse=True)
    qd, kd, vd = (x.double() for x in (q, k, v))
    sc = dense_scores(qd, kd, (lambda s, b, hh, ii, jj: s) if name == "none"
                      else mods(S, t.double())[name])
    ref_o, ref_lse = torch.softmax(sc, -1) @ vd, torch.logsumexp(sc, -1)
    do = (out.double() - ref_o).abs().nan_to_num(float("inf")).amax(-1)
    dl = (lse.double() - ref_lse).abs().nan_to_num(float("inf"))
    row = {"mod": name, "S": S, "o_err": float(do.max()), "o_rows_off": int((do > 0.05).sum()),
           "lse_err": float(dl.max()), "lse_rows_off": int((dl > 0.05).sum())}
    row["buckets"] = [b for st in flex_mod.STRUCTURES.values() if st.kernel is not None
                      for b in st.kernel.buckets]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, nargs="+", default=[1024])
    ap.add_argument("--mods", nargs="+", default=["t5", "none"])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="default")
    ap.add_argument("--dump", action="store_true", help="write the forward kernels' sources")
    a = ap.parse_args()
    rows = []
    for S in a.S:
        for name in a.mods:
            try:
                row = check(name, S)
            except Exception as e:  # noqa: BLE001 - recorded
                row = {"mod": name, "S": S, "raised": f"{type(e).__name__}: {str(e)[:300]}"}
            row["tag"], row["env"] = a.tag, {k: v for k, v in os.environ.items()
                                             if k.startswith("NEPTUNE_EQ_")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(out, f"forward_check_{a.tag}.json").write_text(json.dumps(rows, indent=1))
    if a.dump:
        for n, st in enumerate(flex_mod.STRUCTURES.values()):
            if st.kernel is not None:
                Path(out, f"forward_{a.tag}_{n}.py").write_text(st.kernel.kernel_source.source)


if __name__ == "__main__":
    main()

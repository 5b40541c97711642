"""T5's buckets with and without the far key loops (``lowering.saturated_index``), timed in
turn in one process, beside FlexAttention, with errors from fp64.

    python bench/probe/far_index_gpu.py [--S 1024 4096] [--mods t5 relative] [--out DIR]

B=1, H=8, D=64, bf16, L = S (``table_grad_gpu``'s mods).  For each (mod, S) and each
setting (``NEPTUNE_EQ_FAR_INDEX`` off / on, flipped in this process, structures
forgotten between: the switch is in the kernel cache's key), twice in turn: the forward
alone, fwd+bwd with the table detached, fwd+bwd training the table (ms, the better of
the two readings); the output's and the table gradient's error from fp64.  Flex (compiled)
is timed beside: forward and detached step (its table gradient is not asked).  A
``relative`` table never stops moving: its two settings build the same kernels (a
control for the run-to-run spread).  Writes DIR/far_index_gpu.json."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from triton.testing import do_bench

import neptune_eq as ne
from neptune_eq.dropin import eager_env
from neptune_eq.lowering import saturated_index

from table_grad_gpu import FLEX, dense_grad, mods, table


def chosen() -> dict:
    """Each built kernel's chosen form and tiles, and whether it has far loops."""
    from neptune_eq.dropin import flex
    got = {}
    for st in flex.STRUCTURES.values():
        kerns = [("forward", st.kernel)] + [
            (str(key[0]), val[1]) for key, val in st.backward.items()
            if isinstance(val, tuple) and len(val) > 1]
        for name, kern in kerns:
            src = getattr(getattr(kern, "kernel_source", None), "source", "")
            got[name] = {"buckets": getattr(kern, "buckets", None),
                         "far_loops": "keys far below" in src, "gluon": "gl.warp_specialize" in src}
    return got


def run(name: str, S: int, dtype=torch.bfloat16, rounds: int = 2) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, S, 64, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    t = table(name, S, "cuda")
    go = torch.randn(1, 8, S, 64, device="cuda", dtype=dtype)
    tdet = t.detach()
    td = t.detach().double().requires_grad_()
    ref = dense_grad(q, k, v, mods(S, td)[name], go)
    (want,) = torch.autograd.grad(ref, (td,), go.double())
    row = {"mod": name, "S": S}

    def fwd(fn, tab):
        def f():
            with torch.no_grad():
                fn(q, k, v, mods(S, tab)[name])
        return f

    def step(fn, tab, grads):
        def f():
            o = fn(q, k, v, mods(S, tab)[name])
            torch.autograd.grad(o, grads, go)
        return f

    def keep(key, ms):
        row[key] = round(min(ms, row.get(key, ms)), 4)

    for _ in range(rounds):
        for setting in ("off", "on"):
            saturated_index.ENABLED = setting == "on"
            eager_env.forget()
            t0 = time.perf_counter()
            out = ne.flex_attention(q, k, v, mods(S, t)[name])
            (g,) = torch.autograd.grad(out, (t,), go)
            row[f"out_err_{setting}"] = float((out.double() - ref.detach()).abs().max())
            row[f"grad_err_{setting}"] = float((g.double() - want).abs().max() / want.abs().max())
            row[f"kernels_{setting}"] = chosen()
            row.setdefault(f"first_s_{setting}", round(time.perf_counter() - t0, 1))
            print(f"  {name} S={S} {setting}: built and checked in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            keep(f"fwd_ms_{setting}", do_bench(fwd(ne.flex_attention, tdet), warmup=3, rep=20))
            keep(f"detached_ms_{setting}", do_bench(step(ne.flex_attention, tdet, (q, k, v)),
                                                    warmup=3, rep=20))
            keep(f"trained_ms_{setting}", do_bench(step(ne.flex_attention, t, (q, k, v, t)),
                                                   warmup=3, rep=20))
        try:
            keep("flex_fwd_ms", do_bench(fwd(FLEX, tdet), warmup=3, rep=20))
            keep("flex_detached_ms", do_bench(step(FLEX, tdet, (q, k, v)), warmup=3, rep=20))
        except Exception as e:  # noqa: BLE001 - recorded
            row["flex"] = f"{type(e).__name__}: {str(e)[:200]}"
    saturated_index.ENABLED = True
    eager_env.forget()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--mods", nargs="+", default=["t5", "relative"])
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
            Path(a.out, "far_index_gpu.json").write_text(json.dumps(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Learnable tables a score_mod reads, trained: ne.flex_attention's fwd+bwd beside
FlexAttention's (compiled), and the table's gradient against fp64 autograd.

    python bench/probe/table_grad_gpu.py [--S 1024 2048] [--mods ...] [--out DIR]

Three mods, B=1, H=8, D=64, bf16 (self-attention, L = S):
* ``at q and kv``: ``score + t[q_idx] - t[kv_idx]`` -- the gradient's two row-wise
  partials, one kernel each (``flex_backward._partial_pieces``);
* ``relative``: ``score + rel[q_idx - kv_idx + S]`` -- a computed index: each score's
  gradient added into the table where its index points (``lowering.index_scatter``);
* ``t5``: T5's log-spaced relative buckets, one row of 32 per head
  (``rel[h, bucket(q_idx - kv_idx)]``): many scores meet one entry.
Each row also times fwd+bwd with the table detached (q, k, v gradients only), so the
table gradient's own cost reads off; ``--forms per-score per-diagonal per-entry`` also
times the step with each form of the table's adds (one per score; one per diagonal of a
tile; a tile's diagonals summed per entry of a small table), in turn, each rebuilt in the
same process.  Writes DIR/table_grad_gpu.json; prints one row per (mod, S)."""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention
from triton.testing import do_bench

import neptune_eq as ne

FLEX = torch.compile(flex_attention)


def t5_bucket(i, j, buckets: int = 32, max_distance: int = 128, itype=torch.int64):
    """T5's relative-position bucket (bidirectional; half the buckets exact, the rest
    log-spaced up to ``max_distance``), as users write it in a score_mod."""
    n = (i - j).abs()
    exact = buckets // 2
    far = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (buckets - exact)).to(itype)
    return torch.where(n < exact, n, torch.clamp(far, max=buckets - 1))


def mods(S: int, t):
    return {"at q and kv": lambda s, b, h, i, j: s + t[i] - t[j],
            "relative": lambda s, b, h, i, j: s + t[i - j + S],
            "t5": lambda s, b, h, i, j: s + t[h, t5_bucket(i, j)],
            # (the log bucket cast to int32: session 60's probes of the int64 form)
            "t5 int32": lambda s, b, h, i, j: s + t[h, t5_bucket(i, j, itype=torch.int32)]}


def table(name: str, S: int, dev) -> torch.Tensor:
    shape = {"at q and kv": (S,), "relative": (2 * S,), "t5": (8, 32), "t5 int32": (8, 32)}[name]
    return torch.randn(*shape, device=dev, requires_grad=True)


def dense_scores(q, k, mod):
    """The scores ``mod(q·kᵀ/√D)`` in the inputs' precision (fp64 for a reference), the
    mod called on broadcast indices."""
    L, S = q.shape[2], k.shape[2]
    i = torch.arange(L, device=q.device).view(1, 1, L, 1)
    j = torch.arange(S, device=q.device).view(1, 1, 1, S)
    h = torch.arange(q.shape[1], device=q.device).view(1, -1, 1, 1)
    return mod(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, None, h, i, j)


def dense_grad(q, k, v, mod, go):
    """fp64 autograd of the plain attention with ``mod`` on broadcast indices."""
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    return torch.softmax(dense_scores(qd, kd, mod), -1) @ vd


# a table gradient's forms: (index_scatter.DIAGONALS, index_scatter.ENTRY_SUMS)
FORMS = {"per-score": (False, False), "per-diagonal": (True, False), "per-entry": (True, True)}


def table_kernels(dump: Path | None) -> list[str]:
    """The chosen tiles of every backward kernel that adds into a table (its source under
    ``dump`` when given)."""
    from neptune_eq.dropin import flex as flex_mod
    got = []
    for st in flex_mod.STRUCTURES.values():
        for key, val in st.backward.items():
            kern = val[1] if isinstance(val, tuple) and len(val) > 1 else None
            src = getattr(getattr(kern, "kernel_source", None), "source", "")
            if "tl.atomic_add(d_" not in src:
                continue
            got += kern.buckets
            if dump:
                dump.mkdir(parents=True, exist_ok=True)
                Path(dump, f"kernel_{len(got)}.py").write_text(src)
    return got


def run(name: str, S: int, dev="cuda", dtype=torch.bfloat16, flex: bool = True,
        forms: tuple = (), dump: str | None = None) -> dict:
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
    row["grad_nans"] = int(torch.isnan(g_t).sum())
    row["table_kernels"] = table_kernels(dump and Path(dump, f"{name}_{S}"))

    tdet = t.detach()
    try:  # FlexAttention's own table gradient, against the same fp64 reference
        if not flex:
            raise RuntimeError("not run (--no-flex)")
        (g_f,) = torch.autograd.grad(FLEX(q, k, v, mods(S, t)[name]), (t,), go)
        row["flex_grad_err"] = float((g_f.double() - want).abs().max() / want.abs().max())
    except Exception as e:  # noqa: BLE001 - recorded
        row["flex_grad"] = f"{type(e).__name__}: {str(e)[:200]}"

    def step(fn, table_grad=True):
        def go_once():
            o = fn(q, k, v, mods(S, t if table_grad else tdet)[name])
            torch.autograd.grad(o, (q, k, v, t) if table_grad else (q, k, v), go)
        return go_once
    for who, fn in (("ours", ne.flex_attention), ("flex", FLEX))[:2 if flex else 1]:
        try:  # (in turn: one then the other, twice, each figure the better of its two)
            for _ in range(2):
                for key, grad in ((f"ms_{who}", True), (f"ms_{who}_detached", False)):
                    ms = do_bench(step(fn, grad), warmup=3, rep=20)
                    row[key] = round(min(ms, row.get(key, ms)), 4)
        except Exception as e:  # noqa: BLE001 - recorded
            row[who] = f"{type(e).__name__}: {str(e)[:200]}"
    if forms:  # the same step with each form of the table's adds, in turn
        from neptune_eq.dropin import eager_env
        from neptune_eq.lowering import index_scatter

        def timed(form: str) -> float:
            # (both switches are in the kernel cache's key)
            index_scatter.DIAGONALS, index_scatter.ENTRY_SUMS = FORMS[form]
            eager_env.forget()
            # its build (cold the first time, then from disk), and its gradient checked
            (g,) = torch.autograd.grad(ne.flex_attention(q, k, v, mods(S, t)[name]), (t,), go)
            tag = form.replace('-', '_')
            row[f"grad_err_{tag}"] = float((g.double() - want).abs().max() / want.abs().max())
            row[f"table_kernels_{tag}"] = table_kernels(dump and Path(dump, f"{name}_{S}_{tag}"))
            return do_bench(step(ne.flex_attention), warmup=3, rep=20)
        try:
            for _ in range(2):
                for form in forms:
                    key = f"ms_ours_{form.replace('-', '_')}"
                    ms = timed(form)
                    row[key] = round(min(ms, row.get(key, ms)), 4)
        except Exception as e:  # noqa: BLE001 - recorded
            row["forms"] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            index_scatter.DIAGONALS, index_scatter.ENTRY_SUMS = True, True
            eager_env.forget()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--mods", nargs="+", default=["at q and kv", "relative", "t5"])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--no-flex", action="store_true", help="time ours alone")
    ap.add_argument("--forms", nargs="+", default=[], choices=sorted(FORMS),
                    help="also time the step with each form of the table's adds (one per "
                         "score, per diagonal, per entry), in turn, in this process")
    ap.add_argument("--dump", help="write each table kernel's source under this folder")
    a = ap.parse_args()
    rows = []
    for S in a.S:
        for name in a.mods:
            try:
                row = run(name, S, flex=not a.no_flex, forms=tuple(a.forms), dump=a.dump)
            except Exception as e:  # noqa: BLE001 - recorded
                row = {"mod": name, "S": S, "raised": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(a.out).mkdir(parents=True, exist_ok=True)  # (after each row: a run cut
            Path(a.out, "table_grad_gpu.json").write_text(json.dumps(  # short keeps its rows)
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

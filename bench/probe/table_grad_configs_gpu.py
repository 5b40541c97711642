"""A learnable table's gradient kernel at every tile config, against fp64 autograd.

Session 60 found T5's gradient wrong on an H200 at S = 1024 (NaN in 64 entries with the
per-entry sums, 2.1 relative error with the per-diagonal adds) with the tiles the timer
chose there (32 × 128, 3 stages), and right at 4096 (64 × 64).  This probe runs the
training step once per form, records the call of the kernel that adds into the table,
and relaunches that kernel on the same inputs at each config of a grid.

    python bench/probe/table_grad_configs_gpu.py [--S 1024] [--forms per-entry per-diagonal]

Writes DIR/table_grad_configs_gpu.json."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch

import neptune_eq as ne
from neptune_eq import api
from neptune_eq.dropin import eager_env
from neptune_eq.lowering import index_scatter
from neptune_eq.runtime.launcher import Launcher

from table_grad_gpu import FORMS, dense_grad, dense_scores, mods, table

CALLS: list = []  # [(kernel, its call's arguments)]: the first call recorded
MARK = {"text": "dg_"}  # what the recorded kernel's source holds


def _record(mark: str = "dg_"):
    """Record the first call of a kernel whose source holds ``mark`` in ``CALLS`` (the
    probes relaunch it on the same inputs)."""
    MARK["text"] = mark
    orig = api.Kernel.__call__

    def call(self, *args, **kwargs):
        if MARK["text"] in self.kernel_source.source and not CALLS:
            CALLS.append((self, args))
        return orig(self, *args, **kwargs)
    api.Kernel.__call__ = call


def recorded(first_row: dict, what: str):
    """(kernel, its arguments, the launcher it chose) of the recorded call, its config
    written into ``first_row``; None, with a note there, where no such kernel ran."""
    if not CALLS:
        first_row["note"] = f"no {what} kernel was called"
        return None
    kern, args = CALLS[0]
    chosen = kern._bind_symbolic(args, {})[1]
    first_row["chosen"] = str(chosen.config)
    return kern, args, chosen


def run(name: str, S: int, form: str, dev: str = "cuda", grid=None) -> list[dict]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, S, 64, device=dev, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    t = table(name, S, dev)
    go = torch.randn(1, 8, S, 64, device=dev, dtype=torch.bfloat16)
    index_scatter.DIAGONALS, index_scatter.ENTRY_SUMS = FORMS[form]
    eager_env.forget()
    CALLS.clear()
    (g_t,) = torch.autograd.grad(ne.flex_attention(q, k, v, mods(S, t)[name]), (t,), go)
    td = t.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(dense_grad(q, k, v, mods(S, td)[name], go), (td,),
                                  go.double())

    def err(g):
        return float((g.double() - want).abs().max() / want.abs().max())
    rows = [{"form": form, "S": S, "config": "as called", "err": err(g_t),
             "nans": int(torch.isnan(g_t).sum())}]
    got = recorded(rows[0], "diagonal-sum")
    if got is None:
        return rows
    kern, args, chosen = got
    # the kernel's inputs from the forward (its output o and row statistic mx, the lse)
    # against fp64: a wrong input makes every config's gradient wrong alike
    qd, kd, vd = (x.detach().double() for x in (q, k, v))
    sc = dense_scores(qd, kd, mods(S, t.detach().double())[name])
    ref = {"o": torch.softmax(sc, -1) @ vd, "mx": torch.logsumexp(sc, -1)}
    for ph, x in zip(kern.input_program.inputs, args):
        if ph.name in ref:
            d = (x.double() - ref[ph.name]).abs().nan_to_num(float("inf"))
            if ph.name == "o":
                d = d.amax(-1)  # (per row)
            rows[0][f"{ph.name}_err"] = float(d.max())
            rows[0][f"{ph.name}_rows_off"] = int((d > 0.05).sum())
    out = kern.program.outputs[0]
    blocks = dict(chosen.config.blocks)
    row_block = f"B_{chosen.ks.block_axis}"
    for R, K, warps, stages in grid if grid is not None else itertools.product((32, 64, 128), (64, 128), (4, 8),
                                                         (1, 3)):
        cfg = dataclasses.replace(chosen.config, blocks={**blocks, row_block: R, "B_L": K},
                                  num_warps=warps, num_stages=stages, loop_stages=0)
        row = {"form": form, "S": S, "config": str(cfg)}
        try:
            env, _ = kern._bind_symbolic(args, {})
            env[out].zero_()
            Launcher(chosen.program, chosen.ks, kern.target, cfg, chosen.size_args)(env)
            if dev == "cuda":
                torch.cuda.synchronize()
            g = env[out]
            while g.dim() > want.dim():  # (a kernel's trailing copies, summed after)
                g = g.sum(-1)
            row["err"], row["nans"] = err(g), int(torch.isnan(g).sum())
        except Exception as e:  # noqa: BLE001 - recorded
            row["raised"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, nargs="+", default=[1024])
    ap.add_argument("--mods", nargs="+", default=["t5"])
    ap.add_argument("--forms", nargs="+", default=["per-entry", "per-diagonal"],
                    choices=sorted(FORMS))
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--no-grid", action="store_true", help="the call as made only")
    a = ap.parse_args()
    _record()
    rows = []
    for S, name, form in itertools.product(a.S, a.mods, a.forms):
        got = run(name, S, form, grid=[] if a.no_grid else None)
        for r in got:
            r["mod"] = name
            print(json.dumps(r), flush=True)
        rows += got
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "table_grad_configs_gpu.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

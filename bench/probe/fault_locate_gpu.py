"""Name the launch that faults: every kernel launch of a step is followed by a
synchronise, and the first that raises is reported with its kernel, config and sizes.

    python bench/probe/fault_locate_gpu.py [--L 300 --S 517] [--out DIR]
        [--plan shipped:forward:200 no_gluon:forward:100 ...]

Each (environment, step) runs in its own process, so a dead CUDA context does not
take the later ones with it.  Steps: the relative-table forward, the q/k/v gradients
with the table detached, the table's gradient.  Environments: as shipped, without
tensor descriptors (NEPTUNE_EQ_TMA=0), without the Gluon form (NEPTUNE_EQ_GLUON=0).
Each launch is announced before it runs and a hung child prints its stack every 40 s,
so the last lines name a launch that never returns, or whose fault surfaced later (in a
timing graph's replay, where no synchronise can be put between launches).  Cheaper than
CUDA_LAUNCH_BLOCKING=1, which also serialises every timing launch of a cold choice.
Writes DIR/fault_locate.jsonl, and the faulting kernel's source beside it."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

STEPS = ("forward", "qkv", "table")
VARIANTS = {"shipped": {}, "no_tma": {"NEPTUNE_EQ_TMA": "0"},
            "no_gluon": {"NEPTUNE_EQ_GLUON": "0"}}


_LAST = [""]


def _wrap(cls, out: Path, what: str):
    """``cls.__call__`` followed by a synchronise outside graph capture; the first launch
    that raises is written to ``out`` and the process exits (its context is dead)."""
    import torch
    inner = cls.__call__

    def call(self, *a, **kw):
        la = getattr(self, "launcher", None) or self
        line = f"-> {what}: {getattr(getattr(la, 'ks', None), 'name', '?')} {getattr(la, 'config', '?')}"
        if line != _LAST[0] and not torch.cuda.is_current_stream_capturing():
            print(line, flush=True)  # the last line names a hang (repeats not printed)
            _LAST[0] = line
        res = inner(self, *a, **kw)
        if not torch.cuda.is_current_stream_capturing():
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - the point is to say which
                ks = getattr(la, "ks", None)
                info = {"fault": what, "kernel": getattr(ks, "name", "?"),
                        "config": str(getattr(la, "config", "?")),
                        "error": str(e).splitlines()[0]}
                if isinstance(a[0] if a else None, dict):
                    info["tensors"] = {n: list(t.shape) for n, t in a[0].items()
                                       if hasattr(t, "shape")}
                if ks is not None:
                    (out.parent / f"fault_{ks.name}.py").write_text(ks.source)
                    if getattr(ks, "gluon", None) is not None:
                        info["gluon_form"] = True
                with open(out, "a") as f:
                    f.write(json.dumps(info) + "\n")
                print(json.dumps(info), flush=True)
                traceback.print_exc()
                os._exit(3)
        return res
    cls.__call__ = call


def child(step: str, L: int, S: int, out: Path, variant: str):
    import faulthandler

    import torch
    faulthandler.dump_traceback_later(40, repeat=True)  # where a hang waits

    import neptune_eq as ne
    from neptune_eq.runtime import bound_call, gluon_launch, launcher
    for cls, what in ((launcher.Launcher, "tl launch"), (gluon_launch.GluonLauncher, "gluon launch"),
                      (bound_call.BoundCall, "tl replay"),
                      (gluon_launch.GluonBoundCall, "gluon replay")):
        _wrap(cls, out, f"{what} ({variant}, {step})")
    torch.manual_seed(0)
    q = torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 4, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    rel = torch.randn(2 * max(L, S), device="cuda", requires_grad=True)
    n = max(L, S)
    t0 = time.time()
    if step == "forward":
        with torch.no_grad():
            ne.flex_attention(q, k, v, lambda s, b, h, i, j: s + rel[i - j + n])
    elif step == "qkv":
        torch.autograd.grad(ne.flex_attention(
            q, k, v, lambda s, b, h, i, j: s + rel.detach()[i - j + n]).sum(), (q, k, v))
    else:
        torch.autograd.grad(ne.flex_attention(
            q, k, v, lambda s, b, h, i, j: s + rel[i - j + n]).sum(), (q, k, v, rel))
    torch.cuda.synchronize()
    with open(out, "a") as f:
        f.write(json.dumps({"ok": f"{variant}, {step}", "seconds": round(time.time() - t0, 1)}) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=300)
    ap.add_argument("--S", type=int, default=517)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--plan", nargs="+", default=["shipped:forward:200", "shipped:table:250"],
                    help="VARIANT:STEP:SECONDS, each in its own process")
    ap.add_argument("--child", nargs=2, metavar=("STEP", "VARIANT"))
    a = ap.parse_args()
    out = Path(a.out) / "fault_locate.jsonl"
    if a.child:
        return child(a.child[0], a.L, a.S, out, a.child[1])
    for item in a.plan:
        variant, step, seconds = item.split(":")
        env = {**os.environ, **VARIANTS[variant]}
        try:
            r = subprocess.run([sys.executable, __file__, "--L", str(a.L), "--S", str(a.S),
                                "--out", a.out, "--child", step, variant],
                               env=env, timeout=float(seconds))
            print(f"{variant}/{step}: rc {r.returncode}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{variant}/{step}: timed out after {seconds} s", flush=True)
            with open(out, "a") as f:
                f.write(json.dumps({"timed_out": f"{variant}, {step}", "seconds": seconds}) + "\n")

if __name__ == "__main__":
    main()

"""The reduction chains beyond attention (issue 15) on the GPU: correctness and time.

    python bench/gpu_validate_chains.py [--out bench/results] [--only layernorm ...] [--small] [--compile]
                                        [--fp32-precision highest|high|medium]

Every chain of ``neptune_eq.frontend.chains.CHAINS`` is superoptimized for CUDA at a
small odd size and at a realistic one, compared with its torch fp64 reference on fresh
inputs (unit scale and scores at scale 300), and timed against the same reference run
by torch in fp32 (eager).  Writes gpu_validate_chains.json and .md after every case;
exits non-zero on any mismatch.  ``--small`` runs the odd sizes only (a quick check).
A chain that gathers at ids (``x[i, t[i]]``) runs a launch that asserts them first; its
row also says what that launch adds to a graphed call (``guard_cost``).
``--fp32-precision`` sets ``torch.set_float32_matmul_precision`` for the whole run: under
"high" both our fp32 contractions and torch's matmuls use TF32, and a chain with a
contraction is held to fp16's tolerance (TF32 has fp16's 10-bit mantissa), as
translation validation holds it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import neptune_eq as ne  # noqa: E402
from neptune_eq.frontend.chains import CHAINS, random_inputs

SMALL = dict(N=5, M=37, E=7, K=11, V=29, R=13)
# Realistic sizes: rows x columns of a norm/softmax, a vocabulary for the linear chains
# (K = 1024 > 256: the contraction loops in chunks inside the vocabulary loop).
LARGE = dict(N=4096, M=4099, E=64, K=1024, V=32003, R=1000)
LARGE_LINEAR = dict(N=512, K=1024, V=32003)
TOL = 2e-4   # fp32 kernels vs fp64, relative to the largest reference value
TF32_TOL = 1e-2  # a chain with a contraction under TF32 (fp16's tolerance)


def _sizes(name: str, small: bool) -> list[dict]:
    if small:
        return [SMALL]
    return [SMALL, LARGE_LINEAR if name.startswith("linear") else LARGE]


def run_case(name: str, sizes: dict, compiled: bool = False) -> dict:
    chain = CHAINS[name]
    t0 = time.perf_counter()
    kern = ne.superoptimize(chain.build(sizes), target="cuda", cache=False)
    build_s = time.perf_counter() - t0
    prog = kern.input_program
    row = dict(chain=name, sizes=dict(sizes),
               launches=len(kern.launches), passes=kern.plan.n_passes,
               expected_passes=chain.passes, build_s=round(build_s, 1),
               chosen=kern.chosen_row.structure if kern.chosen_row else "",
               config=str(kern.config), ok=True,
               max_err=0.0, bound=0.0)
    for seed, scale in [(0, 1.0), (1, 300.0)]:
        ins = random_inputs(chain, prog, sizes, seed, scale)
        dev = {k: (v.float() if v.is_floating_point() else v).cuda() for k, v in ins.items()}
        got = kern(**dev)
        got = got if isinstance(got, tuple) else (got,)
        ref = chain.reference({k: v.cuda() for k, v in ins.items()})
        for out, g in zip(prog.outputs, got):
            r = ref[out]
            err = (g.double() - r).abs().max().item()
            tol = TF32_TOL if _tf32(kern) else TOL
            bound = tol * max(1.0, r.abs().max().item())
            row["ok"] &= bool(torch.isfinite(g).all()) and err <= bound
            row["max_err"] = max(row["max_err"], err)
            row["bound"] = max(row["bound"], bound)
    dev = {k: (v.float() if v.is_floating_point() else v).cuda()
           for k, v in random_inputs(chain, prog, sizes, 2).items()}
    args = [dev[ph.name] for ph in prog.inputs]
    row["neptune_us"] = triton.testing.do_bench(lambda: kern(*args)) * 1e3
    row["torch_eager_us"] = triton.testing.do_bench(lambda: chain.reference(dev)) * 1e3
    row["speedup"] = row["torch_eager_us"] / row["neptune_us"]
    if kern.launches[0].endswith("_check_ids"):  # it gathers at ids: what their check costs
        row.update(guard_cost(kern, args))
    if compiled:  # torch.compile of the same reference (Inductor fuses it its own way)
        ref = torch.compile(chain.reference)
        ref(dev)
        row["torch_compile_us"] = triton.testing.do_bench(lambda: ref(dev)) * 1e3
    row["tf32"] = _tf32(kern)
    return row


def _tf32(kern) -> bool:
    return 'input_precision="tf32"' in kern.source


def guard_cost(kern, args: list) -> dict:
    """What the launch that asserts the gathered ids costs the call on the device: 20
    calls replayed from a CUDA graph against the chain's kernel alone (its inputs checked
    once beforehand), medians of 5 alternated passes (``doc_mask_gpu``'s helpers)."""
    import statistics

    import doc_mask_gpu as dm
    bound, la = kern._bind_static(tuple(args), {})
    la(bound)
    runs = {"call": lambda: kern(*args), "kernel_alone": dm.main_only(la, bound)}
    times = {k: statistics.median(v) * 1e3 for k, v in dm.alternated_graph_ms(runs, 5).items()}
    return {"guard_pdl": bool(getattr(la, "pdl", False)), "us_graphed_call": times["call"],
            "us_graphed_kernel_alone": times["kernel_alone"],
            "us_guard_added": times["call"] - times["kernel_alone"]}


def _markdown(rows: list[dict], device: str) -> str:
    lines = [f"# Reduction chains beyond attention on {device}", "",
             "fp32 inputs; error vs torch fp64 at scales 1 and 300; time by triton.testing.do_bench "
             "(median, us); torch eager runs the same reference in fp32 (torch.compile us in the "
             f"JSON with --compile); float32 matmul precision "
             f"{torch.get_float32_matmul_precision()!r}.", "",
             "| chain | sizes | ok | max err / bound | launches | passes (expected) | neptune us | "
             "torch eager us | speedup | chosen |", "| --- " * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['chain']} | {r['sizes']} | {'yes' if r['ok'] else '**NO**'} | "
                     f"{r['max_err']:.2e} / {r['bound']:.2e} | {r['launches']} | {r['passes']} "
                     f"({r['expected_passes']}) | {r['neptune_us']:.1f} | {r['torch_eager_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['chosen']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--only", nargs="*", default=None, help="chain names (default: all)")
    ap.add_argument("--small", action="store_true", help="odd small sizes only")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the reference")
    ap.add_argument("--fp32-precision", choices=("highest", "high", "medium"), default=None,
                    help="torch.set_float32_matmul_precision for the run (default: torch's)")
    a = ap.parse_args()
    if a.fp32_precision:
        torch.set_float32_matmul_precision(a.fp32_precision)
    if not torch.cuda.is_available():
        print("gpu_validate_chains needs a CUDA GPU.", file=sys.stderr)
        return 2
    names = a.only or list(CHAINS)
    unknown = [n for n in names if n not in CHAINS]
    if unknown:
        print(f"Unknown chains {unknown}; expected some of {list(CHAINS)}.", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    rows, failed = [], []
    for name in names:
        for sizes in _sizes(name, a.small):
            try:
                row = run_case(name, sizes, a.compile)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                row = dict(chain=name, sizes=sizes, ok=False, error=f"{type(e).__name__}: {e}"[:400],
                           launches=0, passes=0, expected_passes=CHAINS[name].passes, max_err=0.0,
                           bound=0.0, neptune_us=0.0, torch_eager_us=0.0, speedup=0.0, chosen="")
            rows.append(row)
            if not row["ok"]:
                failed.append(f"{name} {sizes}")
            print(f"{name:22s} {str(sizes):60s} ok={row['ok']} err={row['max_err']:.2e} "
                  f"{row.get('neptune_us', 0):.1f}us vs torch {row.get('torch_eager_us', 0):.1f}us "
                  f"{row.get('error', '')}", flush=True)
            meta = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                        float32_matmul_precision=torch.get_float32_matmul_precision())
            (out / "gpu_validate_chains.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
            (out / "gpu_validate_chains.md").write_text(_markdown(rows, device))
    if failed:
        print("MISMATCH: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ptxas makes of the generated kernels for sm_90, per tile config, without a GPU.

Registers per thread, spill bytes, shared memory and whether the products are Hopper
``wgmma`` -- the first things to rule out when a kernel trails its peers (issues 16, 18).
The kernels are derived on CPU exactly as on the GPU (the interpreter only runs the small
checks), their GPU form is regenerated (bf16 products stay bf16), and each candidate
config is compiled for sm_90 by this machine's Triton (``tests/sm90_compile.py``: the
newest Triton's compiler and its bundled ptxas, not the GPU machine's 3.6, so the counts
are indicative: run ``bench/diagnose.py compiled`` there for the real ones).

    python bench/static_sm90.py [--dtype bfloat16] [--head-dim 128] [--out FILE.json]

Kernels: the causal forward, and its backward's dQ and dK/dV kernels (a loss on the
output only, as in training).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # sm90_compile: the cross-compile the tests use
import neptune_eq as ne  # noqa: E402
import torch  # noqa: E402

from neptune_eq.api import make_plan  # noqa: E402
from neptune_eq.dropin import flex  # noqa: E402
from neptune_eq.lowering.dependent_launch import PDL_FLAG  # noqa: E402
from neptune_eq.lowering.kernelgen import generate  # noqa: E402
from neptune_eq.runtime.tile_configs import candidate_configs  # noqa: E402
from neptune_eq.sizes import Guards, specialise  # noqa: E402
from sm90_compile import compile_for_sm90  # noqa: E402

PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "int32": "*i32",
       "int64": "*i64", "bool": "*i1"}


def kernels(dtype: torch.dtype, d: int) -> dict:
    """name -> Kernel: the causal forward and the backward's dQ and dK/dV kernels."""
    def causal(b, h, i, j):
        return j <= i
    q, k, v = (torch.randn(1, 2, 32, d, dtype=dtype, requires_grad=True) for _ in range(3))
    out = ne.flex_attention(q, k, v, mask_mod=causal)
    out.backward(torch.randn_like(out))
    st = next(s for s in flex.STRUCTURES.values() if s.backward and s.shapes["q"][-1] == d)
    found = {"forward": st.kernel_at({"B": 1, "L": 32, "S": 32})}
    for (wrt, *_), (_, kern, *_) in st.backward.items():
        found["backward d" + "/d".join(wrt)] = kern
    return found


def gpu_source(kern):
    """The kernel's GPU form (the interpreter's upcasts of bf16 products left out)."""
    prog = specialise(kern.program, kern.sizes, Guards()) if kern.sizes else kern.program
    return prog, generate(make_plan(prog), bf16_dot_in_fp32=False)


def compile_one(prog, ks, cfg, work: Path, python: str | None = None,
                dump: str | None = None, divisible: tuple = (), kernel: str | None = None) -> dict:
    """``ks`` at ``cfg`` compiled for sm_90 (``tests/sm90_compile.py``); ``dump``: a folder
    for its TTGIR and SASS; ``divisible``: parameters to specialise as multiples of 16,
    as the GPU launch does for such pointers and strides; ``kernel``: one of the module's
    kernels other than ``ks.name`` (a split-k module's ``..._partial``)."""
    consts = {**ks.tunables, **cfg.blocks, **{f: False for f in ks.even_flags},
              "TMA": cfg.tma, "WS": cfg.tma and cfg.warp_specialize,
              "LOOP_STAGES": cfg.loop_stages or cfg.num_stages, "VDOT": cfg.vector_dot,
              "ONE_LOOP": cfg.one_loop}
    if f"{PDL_FLAG}: tl.constexpr" in ks.source:  # launched plainly
        consts[PDL_FLAG] = False
    # Contiguous inputs: the last dim's stride is 1, which Triton specialises into a
    # constant at launch (its address arithmetic then folds); the same here.
    inputs = {ph.name: ph for ph in prog.inputs}
    for t, k in ks.stride_params:
        if t in inputs and k == len(inputs[t].shape) - 1:
            consts[f"{t}_s{k}"] = 1
    # a block summary has its tensor's dtype (booleans are summarised as int32)
    of = {sp.name: sp.tensor for sp in ks.summaries}
    dtypes = {f"{n}_ptr": PTR[prog.dtype_of(of.get(n, n)).replace("bool", "int32")]
              for n in (p[:-4] for p in ks.params)}
    dtypes.update({f"{n}_ptr": "*fp32" for n in ks.scratch})  # split-k's fold states
    path = work / f"k{abs(hash(ks.source))}.py"
    path.write_text(ks.source)
    spec = {"dtypes": dtypes, "constexprs": consts, "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "resources": True,
            "divisible": [n for n in divisible if n not in consts], **({"dump": dump} if dump else {})}
    return compile_for_sm90(path, kernel or ks.name, spec, python=python)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "static_sm90.json"))
    ap.add_argument("--python", default=None,
                    help="compile with this interpreter's Triton (e.g. a venv with 3.6, the GPU's)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kern in kernels(getattr(torch, args.dtype), args.head_dim).items():
            prog, ks = gpu_source(kern)
            for cfg in candidate_configs(ks, "cuda"):
                res = compile_one(prog, ks, cfg, Path(tmp), args.python)
                row = {"kernel": name, "config": str(cfg), **res}
                rows.append(row)
                print(json.dumps(row), flush=True)
    # the compiling Triton's version, as each compile reports it (``--python``: another's)
    version = next((r["triton"] for r in rows if r.get("triton")), "unknown")
    Path(args.out).write_text(json.dumps({
        "triton": version, "target": "sm_90a (cross-compiled, no GPU)",
        "dtype": args.dtype, "head_dim": args.head_dim, "rows": rows}, indent=1) + "\n")
    md = [f"# sm_90 resources per config (Triton {version} cross-compile, "
          f"{args.dtype}, D={args.head_dim})", "",
          f"Command: `python bench/static_sm90.py --dtype {args.dtype} --head-dim {args.head_dim}"
          f"{' --python <venv with triton ' + version + '>' if args.python else ''}`. "
          "Registers per thread (255 = the cap), spill "
          "bytes (stores/loads), shared memory and whether ptxas serialized the wgmma "
          "pipeline (its C7513 reason) as ptxas reports them.", "",
          "| kernel | config | ok | regs | spill st/ld | shared KiB | wgmma | tma | wgmma serialized |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if not r.get("ok"):
            md.append(f"| {r['kernel']} | {r['config']} | no: {r.get('error', '')[:60]} | | | | | | |")
            continue
        md.append(f"| {r['kernel']} | {r['config']} | yes | {r.get('registers')} | "
                  f"{r.get('spill_stores')}/{r.get('spill_loads')} | {r['shared'] / 1024:.0f} | "
                  f"{'yes' if r['wgmma'] else 'no'} | {'yes' if r['tma'] else 'no'} | "
                  f"{r.get('wgmma_serialized') or 'no'} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

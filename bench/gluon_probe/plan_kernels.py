"""Build attention variants with neptune_eq, derive them (saturate + extract + plan), and
emit the warp-specialised Gluon form with from_plan.generate.  `compile_sm90(name)`
compiles one for sm_90 without a GPU; `launch(...)` runs one on a Hopper GPU."""
from __future__ import annotations

import importlib.util
import math
import os
import sys
import tempfile

import neptune_eq as ne
from neptune_eq.egraph.extract import EGraphView, extract_program
from neptune_eq.egraph.saturate import EGraphStage
from neptune_eq.frontend.attention import attention
from neptune_eq.lowering.lower import plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import from_plan  # noqa: E402

VARIANTS = {
    "global": {},
    "causal": {"mask_mod": lambda b, h, q, kv: q >= kv},
    "alibi": {"score_mod": lambda s, b, h, q, kv: s + (kv - q) * (h + 1) * -0.0625},
    "softcap": {"score_mod": lambda s, b, h, q, kv: 30.0 * ne.tanh(s / 30.0),
                "mask_mod": lambda b, h, q, kv: q >= kv},
    "window": {"mask_mod": lambda b, h, q, kv: (q >= kv) & (q - kv < 256)},
}


def derive(variant, b, h, s, d, dtype="float16", kv_heads=None):
    out = attention(b, h, s, s, d, dtype, kv_heads=kv_heads, **VARIANTS[variant])
    p = ne.build_program(out)
    st = EGraphStage(p, ne.rules.shipped_rule_files())
    st.saturate()
    cand = extract_program(EGraphView.from_json(st.serialize()), p)
    return cand.program, plan(cand.program)


def module(variant, b, h, s, d, dtype="float16", kv_heads=None):
    prog, tp = derive(variant, b, h, s, d, dtype, kv_heads)
    src = from_plan.generate(tp, "neptune_ws")
    path = os.path.join(tempfile.mkdtemp(), f"ws_{variant}.py")
    with open(path, "w") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location(f"ws_{variant}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return prog, mod, src


def compile_sm90(variant, s=1000, d=128, dtype="float16"):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    prog, mod, src = module(variant, 1, 4, s, d, dtype)
    short = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
    gdt = getattr(gl, dtype)
    fn = mod.neptune_ws

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gdt)
        return f"tensordesc<{short}[{rows}, {d}],{layout!r}>"
    sig = {}
    for name in fn.arg_names:
        if name == "a_desc":
            sig[name] = desc(from_plan.ROWS)
        elif name in ("b_desc", "c_desc"):
            sig[name] = desc(128 if d == 128 else 64)
        elif name.endswith("_ptr"):
            t = name[:-4]
            sig[name] = "*" + {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
                               "int32": "i32", "int64": "i64"}[prog.dtype_of(t)]
        elif name in ("B_L", "STAGES"):
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    consts = {(fn.arg_names.index("B_L"),): d, (fn.arg_names.index("STAGES"),): 2}
    return triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4}), src


def launch(mod, prog, tensors, block_keys, stages=2):
    """tensors: name -> torch tensor (inputs then outputs), contiguous, 16-bit streamed."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    gdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16

    def desc(t, rows):
        flat = t.reshape(-1, t.shape[-1])
        lay = gl.NVMMASharedLayout.get_default_for([rows, t.shape[-1]], gdt)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, t.shape[-1]], lay)
    args = [desc(q, from_plan.ROWS), desc(k, block_keys), desc(v, block_keys)]
    names = [ph.name for ph in prog.inputs] + list(prog.outputs)
    args += [tensors[n] for n in names]
    args += [st for n in names for st in tensors[n].stride()]
    s = q.shape[2]
    grid = (math.ceil(s / (2 * from_plan.ROWS)), q.shape[0] * q.shape[1])
    mod.neptune_ws[grid](*args, B_L=block_keys, STAGES=stages, num_warps=4)

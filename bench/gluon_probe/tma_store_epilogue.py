"""Probe (session 45): the Gluon form's epilogue through shared memory and a TMA store.

``tile_timeline.py`` (first run on an H200, session 45, ``bench/results/s45/``) put the
per-tile fixed cost at 1-2.7 us, not the 3-6 us of session 28's fit, and the largest part
of it in the epilogue: 2.4 us of a 61 us tile at causal D=128 S=8192, 1.6 of 9 us at GQA
64/8 S=512 (18% of the program's time), 1.3 of 12 us on 13 documents.  The generated
epilogue stores the output from the wgmma accumulator's registers with pointer stores:
two 16-bit elements per thread per store (``STG.E``, 32 a thread at D=128, each warp's
store touching 8 rows at half a sector each; offline SASS, Triton 3.6).  FlashAttention-3
writes the tile to shared memory and lets the TMA engine store it while the warpgroup
goes on to its next tile.

This probe patches the product's generated form (its plan and source, launched as the
product launches it) that way -- ``o_smem`` per consumer, ``tma.store_wait(0)`` before the
buffer is rewritten and before the program ends, a pointer store kept for a tile that
runs past the rows -- and times plain and patched side by side under CUDA graphs, after
checking the outputs are identical.  Not generated code: a probe of whether the lowering
should emit it.

    python bench/gluon_probe/tma_store_epilogue.py [--cases ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(__file__))
import tile_timeline as tt  # noqa: E402  (its cases and builders)
import torch  # noqa: E402

from neptune_eq.runtime.gluon_launch import load_gluon, make_launcher  # noqa: E402

CASES = ["causal-d128-8192", "gqa-512", "doc13-8192", "doc13-8192-dynamic", "causal-d64",
         "global-d64"]
STORE = re.compile(r"gl\.store\((?P<out>\w+)_ptr \+ (?P<base>.*?) \+ gl\.convert_layout\(offs_i, "
                   r"O_ROWS\)\[:, None\] \* \w+_s2 \+ offs_e\[None, :\] \* \w+_s3, "
                   r"(?P<val>\(\w+\)\.to\(gl\.\w+\)), mask=")


def patch(src: str, name: str) -> str:
    """``src`` with its consumers' output store through ``o_smem`` and a TMA store."""
    lines, out, region, extent = src.splitlines(), [], None, None
    for ln in lines:
        st, pad = ln.strip(), ln[:len(ln) - len(ln.lstrip())]
        m = re.fullmatch(r"mask_i = offs_i < (.+)", st)
        if m:
            extent = m.group(1)
        if st.startswith("@gluon.jit") and region == "_consumer":
            while out and not out[-1].strip():
                out.pop()
            out += ["    tma.store_wait(0)  # the last tile's store has read its buffer", "", ""]
        if st.startswith(("def _consumer(", f"def {name}(")):
            region = st[4:st.index("(")]
            out.append(ln[:ln.rindex("):")] + ", o_desc" + (", o_smem" if region == "_consumer"
                                                             else "") + "):")
            continue
        if st.startswith("def "):
            region = st[4:st.index("(")]
        if st.startswith("(_consumer, ("):
            out.append(ln[:ln.rindex(")),")] + ", o_desc, o_smem)),")
            continue
        if st.startswith("c_bufs = gl.allocate_shared_memory") and region == name:
            out += [ln, f"{pad}o_smem = gl.allocate_shared_memory(DTYPE, [2, 64, o_desc.block_type.shape[1]], "
                        "o_desc.layout)"]
            continue
        m = STORE.match(st) if region == "_consumer" else None
        if m:
            base = m.group("base")
            row = f"({base}) // {m.group('out')}_s2"
            out += [f"{pad}if my_first + 64 <= {extent}:  # a whole tile: through shared memory",
                    f"{pad}    tma.store_wait(0)  # this buffer's last store has read it",
                    f"{pad}    o_smem.index(WHICH).store({m.group('val')})",
                    f"{pad}    fence_async_shared()",
                    f"{pad}    tma.async_copy_shared_to_global(o_desc, [{row} + my_first, 0], "
                    "o_smem.index(WHICH))",
                    f"{pad}else:",
                    f"{pad}    {st}"]
            continue
        out.append(ln)
    text = "\n".join(out) + "\n"
    text = text.replace("from triton.experimental.gluon.language.nvidia.hopper import ",
                        "from triton.experimental.gluon.language.nvidia.hopper import "
                        "fence_async_shared, ", 1)
    if "async_copy_shared_to_global" not in text or extent is None:
        raise SystemExit(f"patch: no output store found in {name}")
    return text


def measure(case: str) -> dict:
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    prog, ks, cfg, captured = tt.build(case)
    la = make_launcher(prog, ks, "cuda", cfg)
    tensors = tt._tensors(prog, tt.CASES[case][6], captured)
    plain = load_gluon(la.form)
    fn = load_gluon(replace(la.form, source=patch(la.form.source, la.form.name)))
    (oname,) = prog.outputs
    o = tensors[oname]
    flat = o.view(-1, o.shape[-1])
    gdt = getattr(gl, str(o.dtype).split(".")[-1])
    layout = gl.NVMMASharedLayout.get_default_for([64, o.shape[-1]], gdt)
    o_desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [64, o.shape[-1]], layout)
    run_t, pre = la._summarised(dict(tensors))
    if pre:
        pre[0].slow(pre[1])
    args = la._descriptors(run_t) + la._rest(run_t)[0]

    def launch(patched: bool):
        if la._ranges is not None:
            la._ranges.slow(args[len(la.form.descs):])
        if patched:
            fn[la.grid](*args, **la.consts, **la.options, o_desc=o_desc)
        else:
            plain[la.grid](*args, **la.consts, **la.options)
    o.fill_(float("nan"))
    launch(False)
    ref = o.clone()
    o.fill_(float("nan"))
    launch(True)
    torch.cuda.synchronize()
    same = bool(torch.equal(torch.nan_to_num(o, 7.0), torch.nan_to_num(ref, 7.0)))
    row = {"case": case, "config": str(cfg), "device": torch.cuda.get_device_name(),
           "identical": same, "max_abs_diff": float((o.float() - ref.float()).abs().nan_to_num(1e9).max())}
    for rnd in range(3):  # alternate, so drift in clock or heat falls on both
        for patched in (False, True):
            key = "us_tma_store" if patched else "us_plain"
            t = triton.testing.do_bench_cudagraph(lambda: launch(patched), rep=200) * 1e3
            row.setdefault(key, []).append(t)
    row["ratio_plain_over_tma"] = min(row["us_plain"]) / min(row["us_tma_store"])
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=CASES)
    ap.add_argument("--out", default=".")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--python", default=None)
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args.cases, args.python)
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for case in args.cases:
        try:
            rows.append(measure(case))
        except Exception as exc:  # one case failing must not lose the others
            rows.append({"case": case, "error": f"{type(exc).__name__}: {exc}"[:3000]})
        print(json.dumps(rows[-1]), flush=True)
        with open(os.path.join(args.out, "tma_store_epilogue.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


def compile_only(cases, python):
    import tempfile

    from sm90_compile import compile_for_sm90

    from neptune_eq.runtime.gluon_launch import sm90_spec
    torch.Tensor.cuda = lambda self, *a, **k: self
    ok = True
    for case in cases:
        prog, ks, cfg, _ = tt.build(case)
        form = ks.gluon.form_for(128, cfg.dynamic)
        spec = sm90_spec(prog, ks, cfg.num_stages, cfg.blocks["B_L"], form)
        (oname,) = prog.outputs
        spec["descs"]["o_desc"] = [64, prog.shape_of(oname)[-1], form.dtype]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"{form.name}.py")
            with open(path, "w") as fh:
                fh.write(patch(form.source, form.name))
            res = compile_for_sm90(path, form.name, spec, python=python)
        ok &= bool(res["ok"])
        print(json.dumps({"case": case, "ok": res["ok"], "shared": res.get("shared"),
                          "error": res.get("error")}), flush=True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

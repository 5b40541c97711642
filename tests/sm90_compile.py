"""Compile a generated module for sm_90 on a machine without a GPU (a subprocess helper).

    python tests/sm90_compile.py MODULE.py KERNEL JSON_SPEC

Triton compiles for a named target without a driver (``triton.compile`` with a
``GPUTarget``) down to PTX and cubin (its bundled ptxas), so the GPU form of a kernel --
tensor descriptors, warp-specialised loops -- is checked for structure on CPU.  It must
run without ``TRITON_INTERPRET`` (which turns ``@triton.jit`` into the interpreter), hence
a subprocess.  JSON_SPEC: {"dtypes": {param: "*fp16" | "i32"}, "constexprs": {...},
"num_warps": 4, "num_stages": 3, "options": {more of Triton's options, e.g. maxnreg},
"dump": DIR (optional: write KERNEL.ttgir, .ptx and .sass there), "divisible": [params
Triton's launch would specialise as multiples of 16]}.  Prints one JSON line: ok, error, and what the PTX
uses; with ``"resources": true`` in the spec also registers per thread, spill bytes and
whether ptxas serialized the wgmma pipeline (its C7513 reason, else None), from ``ptxas -v`` (the one Triton compiles sm_90 with) on that PTX (``bench/static_sm90.py``).
This is the installed Triton's compiler (the line names its version), by default not
the GPU machine's 3.6: ``compile_for_sm90(..., python=...)`` runs it under another
environment's, and the GPU run of bench/gpu_validate_tma.py validates there.  Tests and benches call ``compile_for_sm90``,
which runs this file so.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path


def compile_for_sm90(path, kernel: str, spec: dict, timeout: int = 600,
                     python: str | None = None) -> dict:
    """Run this file on kernel ``kernel`` of module ``path``: its JSON line, or
    ``{"ok": False, "error": <the end of stderr>}`` when it printed none.  ``python``: the
    interpreter to run it with (another venv's: another Triton's compiler and ptxas)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([python or sys.executable, str(Path(__file__)), str(path), kernel, json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=timeout)
    line = [x for x in r.stdout.splitlines() if x.startswith("{")]
    return json.loads(line[-1]) if line else {"ok": False, "error": r.stderr.strip()[-2000:]}


def main():
    path, kernel, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    mod_spec = importlib.util.spec_from_file_location("sm90_mod", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    fn = getattr(mod, kernel)
    sig = {n: spec["dtypes"].get(n, "constexpr" if n in spec["constexprs"] else "i32")
           for n in fn.arg_names}
    if spec.get("gluon"):  # a Gluon kernel (runtime/gluon_launch.sm90_spec): TMA descriptors
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonASTSource
        short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
        for name, (rows, width, dt) in spec["descs"].items():
            layout = gl.NVMMASharedLayout.get_default_for([rows, width], getattr(gl, dt))
            sig[name] = f"tensordesc<{short[dt]}[{rows}, {width}],{layout!r}>"
        consts = {(fn.arg_names.index(k),): v for k, v in spec["constexprs"].items()}
        src = GluonASTSource(fn, sig, consts)
    else:  # "divisible": parameters the GPU launch specialises as multiples of 16
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n in spec.get("divisible", ())}
        src = ASTSource(fn, signature=sig, constexprs=spec["constexprs"], attrs=attrs)
    try:
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"],
                                     **spec.get("options", {})})
    except Exception as e:  # noqa: BLE001 - reported to the test
        msg = [x for x in str(e).strip().splitlines() if x.strip()]
        # the last lines: Triton's compile errors end with the source line and a caret
        print(json.dumps({"ok": False, "error": "\n".join(msg[-14:]) if msg else type(e).__name__}))
        return
    ptx = ck.asm["ptx"]
    out = {"ok": True, "triton": triton.__version__,
           "tma": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma" in ptx,
           "setmaxnreg": "setmaxnreg" in ptx, "shared": ck.metadata.shared,
           "asserts": "__assertfail" in ptx,
           # programmatic dependent launch: the wait for the kernel before, the early release
           "pdl_wait": "griddepcontrol.wait" in ptx,
           "pdl_launch_dependents": "griddepcontrol.launch_dependents" in ptx,
           "launch_pdl": bool(getattr(ck.metadata, "launch_pdl", False))}
    if spec.get("resources"):
        out.update(ptxas_resources(ptx, ck.metadata.name))
    if spec.get("dump"):  # the TTGIR and SASS, to read what the loop became
        from triton.tools.disasm import get_sass
        dump = Path(spec["dump"])
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{kernel}.ttgir").write_text(ck.asm["ttgir"])
        (dump / f"{kernel}.ptx").write_text(ptx)
        (dump / f"{kernel}.sass").write_text(get_sass(ck.asm["cubin"]))
        out["dumped"] = str(dump)
    print(json.dumps(out))


def ptxas_resources(ptx: str, name: str) -> dict:
    """Registers per thread and spill bytes of kernel ``name``, as ptxas reports them."""
    import re
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path  # the ptxas Triton itself compiles sm_90 with
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    # C7513: ptxas found a wgmma's input written while it may be in flight, and waits for
    # each wgmma before the next -- in the whole kernel (17% on a data mask, session 38)
    serial = re.search(r"wgmma.mma_async instructions are serialized due to (.*?)(?: in the function|$)",
                       text, re.M)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spill.group(1)) if spill else None,
            "spill_loads": int(spill.group(2)) if spill else None,
            "stack_frame": int(stack.group(1)) if stack else None,
            "wgmma_serialized": serial.group(1) if serial else None}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # (the caller's env has none either)
    main()

"""Probe (session 49): what Triton makes of the one-pass decode kernel's key loop, per
tile config, without a GPU.

Batched GQA decode with no split (B=16, 32/8 heads, S=2000, bf16) ran 0.97x cuDNN from
DRAM, one launch each: our kernel 34.8 us against cuDNN's 33.4, and no config of 64
closed it (bench/results/README.md, session 49).  This compiles the kernel the product
derives for such a setup for sm_90 (``static_sm90.compile_one``; ``--python``: a venv
with the GPU's Triton 3.6) and counts, in one iteration of its key loop (the longest
backward branch of the SASS), the CTA-wide barriers, tensor-core and exp2 instructions,
async copies, shared-memory loads and stores and warp shuffles.

    python bench/probe/decode_static_sm90.py [--setup 16,32,8,2000,128,bfloat16]
        [--configs 64:4 128:3] [--split] [--warps 4] [--python /path/to/venv36/bin/python]
        [--out DIR]

``--split``: the split-k candidate's partials kernel instead (B=1 GQA decode's form).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import static_sm90  # noqa: E402  (puts the repo and tests/ on the path)
import neptune_eq as ne  # noqa: E402
from neptune_eq.lowering.kernelgen import generate  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig  # noqa: E402

COUNTED = {"barriers": r"\bBAR\.SYNC", "tensor_core": r"\bHMMA|\bHGMMA", "exp2": r"MUFU\.EX2",
           "async_copies": r"\bLDGSTS|UTMALDG", "shared_stores": r"\bSTS\b|\bSTS\.",
           "shared_loads": r"\bLDS\b|\bLDS\.|\bLDSM", "shuffles": r"\bSHFL"}


def loop_counts(sass: str) -> dict:
    """The key loop's instruction count and its ``COUNTED`` kinds, from a kernel's SASS."""
    loop = key_loop(sass)
    return {"loop_instructions": len(loop),
            **{k: sum(bool(re.search(p, ln)) for ln in loop) for k, p in COUNTED.items()}}


def key_loop(sass: str) -> list[str]:
    """The instructions of the longest loop: from a label to the last branch back to it."""
    lines = sass.splitlines()
    at = {m.group(1): k for k, ln in enumerate(lines) if (m := re.match(r"(\.?L\w+):", ln.strip()))}
    best = (0, 0)
    for k, ln in enumerate(lines):
        m = re.search(r"BRA `?\(?(\.?L\w+)", ln)
        if m and m.group(1) in at and at[m.group(1)] < k and k - at[m.group(1)] > best[1] - best[0]:
            best = (at[m.group(1)], k)
    return lines[best[0]:best[1] + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", default="16,32,8,2000,128,bfloat16", metavar="B,Hq,Hkv,S,D,dtype")
    ap.add_argument("--configs", nargs="+", default=["64:4", "128:3"], metavar="KEYS:STAGES")
    ap.add_argument("--python", default=None, help="compile with this interpreter's Triton")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--split", action="store_true",
                    help="the split-k candidate's partials kernel, not the one-pass kernel")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_static_sm90"))
    a = ap.parse_args()
    *dims, dtype = a.setup.split(",")
    b, hq, hkv, s, d = map(int, dims)
    prog = ne.attention(b, hq, 1, s, d, dtype, kv_heads=hkv)
    kern = ne.superoptimize(prog, target="interpreter", cache=False, top_k=2)
    row = next((r for r in kern.candidates
                if r.plan is not None and bool(r.plan.split) == a.split), None)
    if row is None:
        raise SystemExit(f"Expected a {'split-k' if a.split else 'one-pass'} candidate for "
                         f"{a.setup}; got {[r.structure for r in kern.candidates]}")
    ks = generate(row.plan, bf16_dot_in_fp32=False)
    name = f"{ks.name}_partial" if a.split else ks.name
    # contiguous tensors of these shapes: which strides the launch sees as multiples of 16
    shapes = {ph.name: ph.shape for ph in row.program.inputs}
    shapes.update({o: row.program.shape_of(o) for o in row.program.outputs})
    divisible = [f"{n}_ptr" for n in shapes] + [
        f"{n}_s{k}" for n, sh in shapes.items()
        for k in range(len(sh)) if math.prod(int(x) for x in sh[k + 1:]) % 16 == 0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in a.configs:
        keys, stages = map(int, c.split(":"))
        cfg = TileConfig({f"B_{ks.block_axis}": 16, "B_L": keys}, a.warps, stages,
                         splits=8 if a.split else 0)
        where = out / f"keys{keys}_stages{stages}_warps{a.warps}"
        with tempfile.TemporaryDirectory() as tmp:
            res = static_sm90.compile_one(row.program, ks, cfg, Path(tmp), a.python, str(where),
                                          tuple(divisible), kernel=name)
        if not res.get("ok"):
            raise SystemExit(f"{cfg}: the sm_90 compile failed: {res.get('error')}")
        got = {"setup": a.setup, "kernel": name, "config": str(cfg), "triton": res.get("triton"),
               "registers": res.get("registers"), "shared": res.get("shared"),
               **loop_counts((where / f"{name}.sass").read_text())}
        rows.append(got)
        print(json.dumps(got), flush=True)
    (out / f"decode_static_sm90_warps{a.warps}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / f"{ks.name}.py").write_text(ks.source)  # the kernel compiled, its GPU form


if __name__ == "__main__":
    main()

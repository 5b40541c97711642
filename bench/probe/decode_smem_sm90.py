"""Probe (session 54): the shared memory a document decode's split-k partial needs on
sm_90, compiled offline (no GPU: ``tests/sm90_compile.py``) at each key block and stage
count, the unit strides specialised as the GPU launch specialises them.  Found that the
loops in both branches of an ``if`` each kept their K/V rings (262 KiB at 128 keys and 3
stages, over the H200's 227); with the two-loop partial, 137 KiB.

    python bench/probe/decode_smem_sm90.py [--S 32768] [--tiles 128x3 128x2 64x3]
        [--python /path/to/venv-with-triton-3.6/bin/python]
"""
import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import neptune_eq as ne  # noqa: E402  (first: picks the Triton interpreter without a GPU)
from sm90_compile import compile_for_sm90  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, default=32768)
    ap.add_argument("--tiles", nargs="*", default=["128x3", "128x2", "64x3"])
    ap.add_argument("--python", default=None, help="an interpreter whose Triton compiles "
                    "(the GPU machine's is 3.6; default: this one's)")
    a = ap.parse_args()
    S = a.S
    doc = ne.placeholder((S,), "int32", "doc")
    kern = ne.superoptimize(ne.attention(1, 64, 1, S, 128, "float16", kv_heads=8,
                                         mask_mod=lambda b, h, i, j: doc[i + S - 1] == doc[j]),
                            target="interpreter", cache=False)
    ks = next(r for r in kern.candidates if r.plan is not None and r.plan.split).kernel
    name = f"{ks.name}_partial"
    params = re.findall(r"def " + name + r"\((.*?)\):", ks.source, re.S)[0]
    names = [p.strip().split(":")[0] for p in params.split(",") if p.strip()]
    path = Path(tempfile.mkdtemp()) / "doc_decode.py"
    path.write_text(ks.source)
    for tile in a.tiles:
        keys, stages = map(int, tile.split("x"))
        consts = {**ks.tunables, "B_i": 16, "B_L": keys, "EVEN_i": False,
                  "EVEN_L": S % keys == 0, "TMA": False, "WS": False, "LOOP_STAGES": 0,
                  "VDOT": False, "ONE_LOOP": False, "PDL": True}
        # a launch specialises an int argument equal to 1 as a constant: the unit strides
        consts.update({n: 1 for n in names if n.endswith("_s3") or n == "doc_s0"})
        dtypes = {n: "*i32" if n == "doc_ptr" else "*fp32" if n.startswith("ws_") else "*fp16"
                  for n in names if n.endswith("_ptr")}
        divisible = [n for n in names if n.endswith("_ptr") or re.match(r"[qkvo]_s[012]$", n)
                     or n == "CHUNK"]
        got = compile_for_sm90(path, name, {
            "dtypes": dtypes, "constexprs": {k: v for k, v in consts.items() if k in names},
            "num_warps": 4, "num_stages": stages, "divisible": divisible,
            "options": {"launch_pdl": True}}, python=a.python)
        print(json.dumps({"S": S, "keys": keys, "stages": stages, "ok": got.get("ok"),
                          "shared_bytes": got.get("shared"), "triton": got.get("triton"),
                          "error": got.get("error")}), flush=True)


if __name__ == "__main__":
    main()

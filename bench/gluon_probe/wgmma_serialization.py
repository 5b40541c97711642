"""Does ptxas keep each Gluon form's wgmma pipeline?  (issues 16, 17; session 38)

ptxas serializes every wgmma of a kernel -- a wait after each product -- when it finds an
in-flight wgmma's input registers written (its info line C7513, "wgmma.mma_async
instructions are serialized due to ...").  On Triton 3.6 every data-mask form and the
window form were so compiled until the deferred P·c's operand was passed through its wait
(``gluon_ws``: ``p_used``): a one-document mask ran 17% slower than causal attention on an
H200.  Nothing at run time shows it but the speed, so this compiles the forms of the
benchmarks' variants for sm_90 on the CPU (``tests/sm90_compile.py``: PTX, then ptxas -v)
and prints, per form and key block: serialized or not, registers, spill bytes.

    python bench/gluon_probe/wgmma_serialization.py [--python /venv-triton-3.6/bin/python]
        [--S 4096 3000] [--out bench/results/s38/wgmma_serialization.jsonl]

``--python``: compile with another environment's Triton (the GPU machine's is 3.6: make a
venv with ``pip install triton==3.6.0``); generation runs here.  Two compiles at a time.
"""
import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
import neptune_eq as ne  # noqa: E402  (first: picks the interpreter without a GPU)
import torch  # noqa: E402

import neptune_ops as ops  # noqa: E402
from sm90_compile import compile_for_sm90  # noqa: E402
from neptune_eq.lowering import gluon_ws  # noqa: E402
from neptune_eq.runtime.gluon_launch import sm90_spec  # noqa: E402

PREFILL = ["global-pf", "causal-pf", "alibi-pf", "gqa-pf", "softcap-pf", "window-pf"]


def data_masks(S: int) -> dict:
    """The issue-17 masks (documents, jagged offsets, prefix-LM) over tensors of length S."""
    g = torch.Generator().manual_seed(0)
    ids = torch.sort(torch.randint(0, 13, (S,), generator=g)).values.to(torch.int32)
    offs = torch.arange(0, S, 300, dtype=torch.int32)
    prefix = torch.tensor([S // 3], dtype=torch.int32)
    return {"documents": lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv),
            "jagged": lambda b, h, q, kv: (kv >= offs[ids[q]]) & (q >= kv),
            "prefix-lm": lambda b, h, q, kv: (kv < prefix[b]) | (q >= kv)}


def forms(sizes: list[int]):
    """(name, kernel, form) of every variant's Gluon forms (the one-consumer form too)."""
    gluon_ws.SOLO = True
    progs = [(f"{op}-{S}", ops.build(op, S)[0]) for S in sizes for op in PREFILL]
    progs += [(f"{m}-d{d}-{S}", ne.attention(1, 2, S, S, d, "float16", mask_mod=fn))
              for S in sizes for d in (64, 128) for m, fn in data_masks(S).items()]
    for name, prog in progs:
        kern = ne.superoptimize(prog, target="interpreter", cache=False)
        form = kern.kernel_source.gluon
        if form is None:
            print(json.dumps({"form": name, "gluon": kern.kernel_source.gluon_why}), flush=True)
            continue
        yield name, kern, form
        if form.solo is not None:
            yield name + "-one-consumer", kern, form.solo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=None)
    ap.add_argument("--S", type=int, nargs="*", default=[4096, 3000])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    with TemporaryDirectory() as d, ThreadPoolExecutor(2) as pool:
        jobs = []
        for name, kern, form in forms(a.S):
            for bl in form.key_blocks:
                path = Path(d) / f"{name}-{bl}.py"
                path.write_text(form.source)
                spec = {**sm90_spec(kern.program, kern.kernel_source, 2, bl, form=form),
                        "resources": True}
                jobs.append((name, bl, pool.submit(compile_for_sm90, path, form.name, spec,
                                                   python=a.python)))
        for name, bl, job in jobs:
            res = job.result()
            row = {"form": name, "key_block": bl, "ok": res["ok"],
                   **{k: res.get(k) for k in ("triton", "wgmma_serialized", "registers", "spill_stores")}}
            if not res["ok"]:
                row["error"] = res["error"][-300:]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = [r["form"] for r in rows if r.get("wgmma_serialized")]
    print(f"{len(rows)} forms compiled, {len(bad)} serialized: {bad}")


if __name__ == "__main__":
    main()

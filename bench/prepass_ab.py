"""The summary pre-pass alone on the GPU: device time per launch of its variants, same
process (issue 17's "pre-pass < 3% of a call").

    python bench/prepass_ab.py [--S 8192 32768] [--old bench/_old_summary_kernel.py]

For a causal document mask's summaries (row blocks, key blocks, the whole-tensor
[min, max, nondecreasing] of ``doc``) and a jagged mask's (row blocks of ``doc``, the
whole of ``offsets``), each with every summary and with the whole-tensor walk alone /
without it, at several (step, warps) settings of ``lowering.summary_kernel`` (and a
module given by ``--old``, to compare a previous form).  Times are the profiler's kernel
durations over 50 launches.  Writes JSON lines to --out.
"""
import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_profile import kernel_times  # noqa: E402

from neptune_eq.lowering import summary_kernel  # noqa: E402
from neptune_eq.lowering.block_predicate import SummarySpec  # noqa: E402
from neptune_eq.runtime.block_summary import SummaryPrepass, summarize  # noqa: E402


def specs_of(case: str, part: str) -> list:
    if case == "doc":
        every = [SummarySpec("bs_doc_row", "doc", 0, "B_i"), SummarySpec("bs_doc_loop", "doc", 0, "B_L"),
                 SummarySpec("bs_doc_all", "doc", None, None)]
    else:
        every = [SummarySpec("bs_doc_row", "doc", 0, "B_i"), SummarySpec("bs_offsets_all", "offsets", None, None)]
    if part == "walk":
        return [s for s in every if s.dim is None]
    if part == "blocks":
        return [s for s in every if s.dim is not None]
    return every


def load(module, specs, dtypes, warps: int, tag: str):
    text, pre = module.prepass_source("t", specs, dtypes.__getitem__, {"doc": 1, "offsets": 1}.__getitem__)
    path = Path(tempfile.mkdtemp()) / f"pre_{tag}.py"
    path.write_text("import triton\nimport triton.language as tl\n" + text)
    spec = importlib.util.spec_from_file_location(f"pre_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return SummaryPrepass(pre, {"B_i": 64, "B_L": 64}, getattr(mod, pre.kernel),
                          {"num_warps": warps, "num_stages": 1})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--old", default=None, help="a previous summary_kernel.py to compare")
    ap.add_argument("--out", default="prepass_ab.jsonl")
    ap.add_argument("--device", default="cuda", help="cpu: the interpreter, no timing (a check)")
    ap.add_argument("--settings", nargs="*", default=["4096:4", "8192:8"],
                    help="CHUNK:warps pairs of summary_kernel to time")
    a = ap.parse_args()
    mods = {"new": summary_kernel}
    if a.old:
        spec = importlib.util.spec_from_file_location("old_summary_kernel", a.old)
        mods["old"] = sys.modules["old_summary_kernel"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods["old"])
    settings = [tuple(int(x) for x in st.split(":")) for st in a.settings]
    out = open(a.out, "w")
    for S in a.S:
        g = torch.Generator().manual_seed(0)
        cuts = torch.sort(torch.randperm(S - 1, generator=g)[:12] + 1).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([S])])
        doc = torch.repeat_interleave(torch.arange(13), offsets.diff()).to(torch.int32)
        data = {"doc": doc.to(a.device), "offsets": offsets.to(torch.int32).to(a.device)}
        for case in ("doc", "jagged"):
            for part in ("all", "walk", "blocks"):
                for name, mod in mods.items():
                    for chunk, warps in settings:
                        was = mod.CHUNK
                        mod.CHUNK = chunk
                        try:
                            drv = load(mod, specs_of(case, part), {"doc": "int32", "offsets": "int32"},
                                       warps, f"{name}_{case}_{part}_{chunk}_{warps}_{S}")
                        finally:
                            mod.CHUNK = was
                        outs, launch, args, ints = drv.prepare(data)

                        def once():
                            launch.fn[launch.grid](*args, *ints, **launch.consts, **launch.options)
                        once()
                        for s in drv.pre.specs:  # right before it is timed
                            want = summarize(data[s.tensor], s.dim, 64 if s.block else 1)
                            assert torch.equal(outs[s.name], want), (s, outs[s.name], want)
                        if a.device == "cpu":
                            continue
                        us = sum(t for n, t, _ in kernel_times(once, calls=50) if n.endswith("_summaries"))
                        row = {"S": S, "case": case, "part": part, "module": name, "chunk": chunk,
                               "warps": warps, "us": round(us, 2), "grid": launch.grid[0]}
                        print(json.dumps(row), flush=True)
                        out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""A split-k decode's combine launched dependent on its partials (programmatic dependent
launch), against launched plainly: same tiles, same process, same output bit for bit.
(Measured here in session 40 on an H200, with the partials releasing the combine at their
end: graphed it ran 0.976-0.997x the plain launch, as called 1.3-1.5 us faster.  Since
session 52 the partials release it first thing and the product launches it dependent in
graphs too (``bench/probe/decode_trigger.py``: GQA decode at 2048 graphed 8.19 -> 7.50
us); ``NEPTUNE_EQ_PDL_COMBINE=0`` turns it off.  This bench builds both launchers itself
and captures them through the general launch path.)

The two-launch split-k decode writes each chunk's fold states, then a combine kernel folds
them.  With PDL (``lowering/dependent_launch.py``) the combine is launched while the
partials run and waits for them before its first read of a fold state.  For each operator
of ``bench/neptune_ops.py`` named, the bench superoptimizes it cold, takes the chosen
split-k tiles in their two-launch form (the chosen config itself where that is two-launch)
and times 20 calls replayed from a CUDA graph with PDL off and on (median of 5 alternated
passes), and each as called (``do_bench``).

    python bench/decode_pdl.py --ops gqa-dc causal-dc --seqs 2048 32768
Writes bench/results/<out>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_mask_gpu as dm  # noqa: E402  (imports neptune_eq first)
import neptune_ops as ops  # noqa: E402
import torch  # noqa: E402

import neptune_eq as ne  # noqa: E402
from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402
from prepass_pdl import REPEATS, twin  # noqa: E402


def measure(op: str, S: int) -> dict:
    from triton.testing import do_bench
    out, spec, work, unit = ops.build(op, S)
    kern = ne.superoptimize(out, target="cuda")
    la = make_launcher(kern.program, kern.kernel_source, kern.target, kern.config)
    prog = la.program
    row = {"op": op, "S": S, "chosen": str(la.config)}
    if not la.ks.split_extent or not la.config.splits:
        return {**row, "skipped": "the chosen kernel is not split-k"}
    two = replace(la.config, fused=False)
    row["timed"] = str(two)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for ph in prog.inputs:
        shape, dt = prog.shape_of(ph.name), getattr(torch, prog.dtype_of(ph.name))
        tensors[ph.name] = (torch.randn(shape, generator=g, device="cuda") / 8).to(dt)
    for name in prog.outputs:
        tensors[name] = torch.empty(prog.shape_of(name), dtype=getattr(torch, prog.dtype_of(name)),
                                    device="cuda")
    runs, outs = {}, {}
    for pdl in (False, True):
        os.environ["NEPTUNE_EQ_PDL_COMBINE"] = "1" if pdl else "0"
        t = twin(la, pdl, two)
        os.environ.pop("NEPTUNE_EQ_PDL_COMBINE")
        mine = {n: (x.clone() if n in prog.outputs else x) for n, x in tensors.items()}
        t(mine)
        torch.cuda.synchronize()
        outs[pdl] = mine[prog.outputs[0]].clone()
        key = "on" if pdl else "off"
        row[f"combine_dependent_{key}"] = bool(t.pdl_combine)
        runs[key] = (lambda t=t, x=mine: t(x))
    row["same_output"] = bool(torch.equal(outs[False], outs[True]))
    for key, ts in dm.alternated_graph_ms(runs, REPEATS).items():
        row[f"ms_graph_{key}"] = statistics.median(ts)
        row[f"ms_graph_{key}_all"] = ts
        row[f"ms_call_{key}"] = do_bench(runs[key], return_mode="median")
        row[f"{unit.replace('/', 'p')}_graph_{key}"] = work / (row[f"ms_graph_{key}"] * 1e-3)
    row["speedup_graph"] = row["ms_graph_off"] / row["ms_graph_on"]
    return row


def write(rows: list[dict], out: str) -> None:
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    path = Path(out) if os.path.isabs(out) else dm.RESULTS / out
    path.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# Split-k decode, combine launched dependent or not ({meta['device']}, "
             f"torch {meta['torch']})", "",
             "ms per call; graph: 20 calls from one CUDA graph (median of 5 alternated passes).", "",
             "| op | S | graph off | graph on | off / on | call off | call on | same output | tiles |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['op']} | {r['S']} | {r['skipped']} | | | | | | {r['chosen']} |")
            continue
        lines.append(f"| {r['op']} | {r['S']} | {r['ms_graph_off']:.4f} | {r['ms_graph_on']:.4f} | "
                     f"{r['speedup_graph']:.3f} | {r['ms_call_off']:.4f} | {r['ms_call_on']:.4f} | "
                     f"{r['same_output']} | {r['timed']} (chosen {r['chosen']}) |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", nargs="*", default=["gqa-dc", "causal-dc"])
    ap.add_argument("--seqs", type=int, nargs="*", default=[2048, 32768])
    ap.add_argument("--out", default="decode_pdl")
    a = ap.parse_args()
    rows = []
    for S in a.seqs:
        for op in a.ops:
            try:
                rows.append(measure(op, S))
            except Exception as e:  # noqa: BLE001 - a row that fails is reported, not fatal
                rows.append({"op": op, "S": S, "chosen": "n/a", "skipped": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
            write(rows, a.out)


if __name__ == "__main__":
    main()

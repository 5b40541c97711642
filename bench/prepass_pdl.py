"""What the summary pre-pass adds to a data-mask call, with and without programmatic
dependent launch (PDL), same tiles, same process (issue 17's "< 3 % of the call").

A data mask's call is two launches: the pre-pass (one launch, O(S)) and the attention
kernel, which reads the summaries.  Launched plainly, the attention kernel starts only
after the pre-pass has finished; with PDL (``lowering/dependent_launch.py``) it is
launched while the pre-pass runs and waits for it only at its first read of a summary.
For each case the bench builds the chosen tiles' launcher twice -- ``NEPTUNE_EQ_PDL=0``
and on -- checks both give the same output (bit for bit) and times:

* ``call``      -- the launcher's own call (host path included), ``do_bench`` median;
* ``graph``     -- 20 calls replayed from one CUDA graph (device only), per call;
* ``main_only`` -- the attention kernel alone from a CUDA graph, the summaries filled
  once beforehand: the call without its pre-pass.
The graphed times are medians of 5 passes alternating the three.

``added = graph - main_only`` is what the pre-pass costs the call on the device, and
``share = added / graph`` the figure against the 3 % goal.  ``--toggle first`` turns only
the pre-pass's own dependent launch (on the kernel before it) off and on.

    python bench/prepass_pdl.py --S 4096 8192 --cases doc13 doc64 jagged
    python bench/prepass_pdl.py --smoke      # CPU: the bench's code paths in the interpreter
Writes bench/results/<out>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_mask_gpu as dm  # noqa: E402  (imports neptune_eq first: the interpreter without a GPU)
import torch  # noqa: E402

from neptune_eq.runtime.gluon_launch import make_launcher  # noqa: E402

REPEATS = 5
main_only = dm.main_only


# What ``--toggle`` turns off and on: every dependent launch (``NEPTUNE_EQ_PDL``), or only
# the call's first launch -- the pre-pass -- dependent on the kernel before it in the
# stream (``NEPTUNE_EQ_PDL_FIRST``, session 56)
TOGGLES = {"pdl": "NEPTUNE_EQ_PDL", "first": "NEPTUNE_EQ_PDL_FIRST"}
TOGGLE = TOGGLES["pdl"]


def twin(la, pdl: bool, config=None):
    """``la``'s tiles (or ``config``) built again with ``TOGGLE``'s dependent launch on or
    off."""
    old = os.environ.get(TOGGLE)
    os.environ[TOGGLE] = "1" if pdl else "0"
    try:
        return make_launcher(la.program, la.ks, la.target, config or la.config, la.size_args)
    finally:
        if old is None:
            os.environ.pop(TOGGLE)
        else:
            os.environ[TOGGLE] = old


def reference(mask, q, k, v):
    """fp32 attention under the mask evaluated on every (query, key) pair of batch 0 --
    rows that see no key give 0, as ours do."""
    S = q.shape[2]
    ar = torch.arange(S, device=q.device)
    vis = mask(torch.tensor(0, device=q.device), torch.tensor(0, device=q.device),
               ar[:, None], ar[None, :])
    s = (q[:1].float() @ k[:1].float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
    return p @ v[:1].float()


def measure(name: str, S: int, dtype: torch.dtype, tl_tiles: bool = False,
            dynamic: bool = False) -> dict:
    from dataclasses import replace
    dm.fresh_start()
    mask, B, _ = dm.case(name, S)
    q, k, v = (torch.randn(B, dm.H, S, dm.D, device="cuda", dtype=dtype) for _ in range(3))
    _, la, bound = dm.launcher_of(q, k, v, mask)
    if la._pre is None:
        return {"case": name, "S": S, "skipped": "no pre-pass (the mask reads no tensor per block)"}
    if tl_tiles:  # the tl kernel's one-loop tiles (the H100's cold choice at S=4096, s39)
        la = make_launcher(la.program, la.ks, la.target,
                           replace(la.config, blocks={"B_i": 64, "B_L": 64}, num_stages=3,
                                   gluon_ws=False, heads_first=False, per_tile=False,
                                   one_loop=bool(la.ks.one_loop), tma=False,
                                   warp_specialize=False), la.size_args)
    if dynamic:  # the Gluon form's dynamic walk (pre-pass, ranges kernel, form)
        from neptune_eq.runtime.tile_configs import dynamic_configs
        la = make_launcher(la.program, la.ks, la.target, dynamic_configs(la.ks)[0], la.size_args)
    out = la.program.outputs[0]
    row = {"case": name, "S": S, "dtype": str(dtype).replace("torch.", ""),
           "config": str(la.config)}
    results, runs = {}, {}
    for pdl in (False, True):
        t = twin(la, pdl)
        tensors = {n: (x.clone() if n in la.program.outputs else x) for n, x in bound.items()}
        t(tensors)
        torch.cuda.synchronize()
        results[pdl] = tensors[out].clone()
        key = "on" if pdl else "off"
        row[f"pdl_{key}_launch_option"] = bool(getattr(t, "pdl", False))
        row[f"first_{key}_launch_option"] = "launch_pdl" in t._pre.options
        runs[key] = (lambda t=t, x=tensors: t(x))
        if not pdl:
            runs["main_only"] = main_only(t, tensors)
    row["same_output"] = bool(torch.equal(results[False], results[True]))
    ref = reference(mask, q, k, v)
    row["max_abs_diff_vs_fp32"] = max((results[p][:1].float() - ref).abs().max().item()
                                      for p in results)
    for key, ts in dm.alternated_graph_ms(runs, REPEATS).items():  # the median of each kept
        row[f"ms_graph_{key}" if key != "main_only" else "ms_main_only"] = statistics.median(ts)
        row[f"ms_graph_{key}_all"] = ts
    from triton.testing import do_bench
    for key in ("off", "on"):
        row[f"ms_call_{key}"] = do_bench(runs[key], return_mode="median")
    for key in ("off", "on"):
        row[f"added_{key}"] = row[f"ms_graph_{key}"] - row["ms_main_only"]
        row[f"share_{key}"] = row[f"added_{key}"] / row[f"ms_graph_{key}"]
    return row


def smoke() -> dict:
    """CPU: the bench's launch paths in the interpreter (no PDL there, no timing)."""
    dm.DEV = "cpu"
    mask, B, _ = dm.case("doc4", 64)
    q, k, v = (torch.randn(B, 2, 64, 16, dtype=torch.float16) for _ in range(3))
    _, la, bound = dm.launcher_of(q, k, v, mask)
    out = la.program.outputs[0]
    full = {n: (x.clone() if n in la.program.outputs else x) for n, x in bound.items()}
    twin(la, True)(full)
    alone = {n: (x.clone() if n in la.program.outputs else x) for n, x in bound.items()}
    main_only(twin(la, False), alone)()
    return {"smoke": True, "pdl_in_interpreter": bool(twin(la, True).pdl),
            "main_only_equal": bool(torch.equal(full[out], alone[out]))}


def write(rows: list[dict], out: str) -> None:
    dm.RESULTS.mkdir(exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    path = Path(out) if os.path.isabs(out) else dm.RESULTS / out
    path.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# The pre-pass's cost, {TOGGLE}=0 / 1 ({meta['device']}, torch {meta['torch']}, "
             f"H={dm.H}, D={dm.D})", "",
             "ms per call. graph: 20 calls from one CUDA graph; main only: the attention kernel "
             "alone, graphed; added = graph - main only; share = added / graph.", "",
             "| case | S | dtype | call off | call on | graph off | graph on | main only "
             "| added off | added on | share off % | share on % | same output | max diff vs fp32 "
             "| tiles |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            continue
        lines.append(f"| {r['case']} | {r['S']} | {r['dtype']} | {r['ms_call_off']:.4f} | "
                     f"{r['ms_call_on']:.4f} | {r['ms_graph_off']:.4f} | {r['ms_graph_on']:.4f} | "
                     f"{r['ms_main_only']:.4f} | {r['added_off'] * 1e3:.2f} us | "
                     f"{r['added_on'] * 1e3:.2f} us | {100 * r['share_off']:.2f} | "
                     f"{100 * r['share_on']:.2f} | {r['same_output']} | "
                     f"{r['max_abs_diff_vs_fp32']:.1e} | {r['config']} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--dtype", nargs="*", default=["float16"])
    ap.add_argument("--cases", nargs="*", default=["doc4", "doc13", "doc64", "jagged"])
    ap.add_argument("--out", default="prepass_pdl")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--toggle", choices=sorted(TOGGLES), default="pdl",
                    help="pdl: every dependent launch off / on; first: only the pre-pass's "
                         "own launch dependent on the kernel before it")
    ap.add_argument("--tl", action="store_true",
                    help="time the tl kernel's one-loop tiles (B_i=B_L=64), not the chosen ones")
    ap.add_argument("--dynamic", action="store_true",
                    help="time the Gluon form's dynamic walk, not the chosen tiles")
    a = ap.parse_args()
    global TOGGLE
    TOGGLE = TOGGLES[a.toggle]
    if a.smoke:
        print(json.dumps(smoke()))
        return
    rows = []
    for S in a.S:
        for dt in a.dtype:
            for name in a.cases:
                try:
                    rows.append(measure(name, S, getattr(torch, dt), a.tl, a.dynamic))
                except Exception as e:  # noqa: BLE001 - a row that fails is reported, not fatal
                    rows.append({"case": name, "S": S, "dtype": dt, "skipped": f"{type(e).__name__}: {e}"})
                print(json.dumps(rows[-1]), flush=True)
                write(rows, a.out)


if __name__ == "__main__":
    main()

"""Why a decode config is chosen: every tile config of the chosen decode kernels, timed
as called and on the GPU alone, beside SDPA and FlexAttention in the same process.

    python bench/decode_configs.py [--ops gqa-dc causal-dc] [--seqs 2048 8192]
                                   [--offgrid B,Hq,Hkv,S,D[,dtype] ...]
                                   [--sweep] [--kernels] [--combine-tile N] [--out DIR]

At decode lengths a call is host-bound: ``do_bench`` of a call measures the host's launch
path, so every config times alike and a choice made that way is noise.  Three times per
row: ``called`` (``do_bench``, host included), ``cold`` (``runtime.timing.device_ms``:
replayed from a CUDA graph over copies of the inputs larger than L2 -- how the choice
times configs, and how a model's decode step reads its K/V cache) and, for the peers and
the chosen kernel, ``warm`` (``do_bench_cudagraph``: the same inputs every call, left in
L2 -- bench/neptune_ops.py's graphed column).  Each config ``choose`` timed is listed,
and with ``--sweep`` a wider grid of key blocks x split factors x one/two launches (x
the tensor-core and CUDA-core contraction forms), to see whether the offered grid holds
the best config.  Writes decode_configs.{json,md}
under --out.  Decode TB/s = bytes of K+V / time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
import neptune_ops as ops  # noqa: E402  - the operators and peers, one definition

import neptune_eq as ne  # noqa: E402
from neptune_eq.runtime.timing import timing_tensors  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig  # noqa: E402
from neptune_eq.runtime.tuning import compile_in_parallel, time_configs  # noqa: E402
from neptune_eq.runtime.timing import copy_inputs, device_ms, input_copies  # noqa: E402


def sweep(ks, template: TileConfig, S: int) -> list[TileConfig]:
    """Key blocks 32..256 x split factors 2..64 (chunks of at least one key block) x one
    and two launches, at 4 warps / 3 stages, in the tensor-core form, and one-warp
    programs at 16..64 keys x 8..128 splits; where the kernel has a CUDA-core form (one or
    two rows, ``codegen.VDOT``), that form at 16..128 keys x 4 and 8 warps x split factors
    4..128 too, in programs of exactly the kernel's rows."""
    out = []
    rows = f"B_{ks.block_axis}"
    for bl in (32, 64, 128, 256):
        for sp in (2, 4, 8, 16, 32, 64):
            if S // sp < bl:
                continue
            blocks = {k: (bl if k == "B_L" else 16 if k == rows else v)
                      for k, v in template.blocks.items()}
            for fused in (False, True):
                out.append(TileConfig(blocks, 8 if bl == 256 else 4, 3, sp, fused=fused))
    # one warp a program, four times the splits: no warps to exchange a block's row max,
    # sum and P across -- 2 CTA barriers a key block against 9 at four warps (Triton 3.6,
    # sm_90, bench/probe/decode_static_sm90.py; session 49)
    for bl in (16, 32, 64):
        for sp in (8, 16, 32, 64, 128):
            if S // sp >= bl:
                blocks = {k: (bl if k == "B_L" else 16 if k == rows else v)
                          for k, v in template.blocks.items()}
                out.append(TileConfig(blocks, 1, 3, sp))
    if not ks.vector_dot:
        return out
    for bl, w in ((16, 4), (32, 4), (32, 8), (64, 8), (128, 8)):
        for sp in (4, 8, 16, 32, 64, 128):
            if S // sp < bl:
                continue
            blocks = {k: (bl if k == "B_L" else max(1, ks.row_extent) if k == rows else v)
                      for k, v in template.blocks.items()}
            for fused in (False, True):
                out.append(TileConfig(blocks, w, 3, sp, fused=fused, vector_dot=True))
    return out


def rolling_sweep(template: TileConfig, S: int) -> list[TileConfig]:
    """The one-pass (not split-k) decode kernel's wider grid: key blocks 32..256 x 2..5
    stages x 4 and 8 warps, pointer loads and tensor descriptors -- where a batch fills
    the GPU without splitting the keys, what its loop's depth and block are worth."""
    out = []
    for bl in (32, 64, 128, 256):
        if bl > max(32, S):
            continue
        for st in (2, 3, 4, 5):
            for w in (4, 8):
                for tma in (False, True):
                    blocks = {k: (bl if k == "B_L" else v) for k, v in template.blocks.items()}
                    out.append(TileConfig(blocks, w, st, tma=tma))
    return out


def device_kernels(fns: list) -> list[dict]:
    """Each kernel's GPU microseconds per call (torch profiler), the calls rotating over
    the copies of the inputs as the cold column does: where the time of a call goes."""
    from host_profile import kernel_times, loop_us
    it = iter(range(1 << 30))

    def call():
        return fns[next(it) % len(fns)]()
    rows = [{"kernel": n[:90], "us": us, "launches": c} for n, us, c in kernel_times(call, 40, 5)]
    return rows + [{"kernel": "(host us per call, warm loop without sync)", "us": loop_us(call, 200),
                    "launches": 0}]


def offgrid_setup(text: str):
    """(program, inputs, TB of K+V, peers of a copy of the inputs) of an off-grid decode
    ``B,Hq,Hkv,S,D[,dtype]``: one query per sequence at the cache's end, as
    ``bench/offgrid_decode.py`` runs it, with its peers (cuDNN, flash, Flex)."""
    import offgrid_decode
    parts = text.split(",")
    dtype = "float16" if parts[-1].isdigit() else parts.pop()
    b, hq, hkv, s, d = map(int, parts)
    g = hq // hkv
    prog, (q, k, v) = offgrid_decode.decode_of((b, hq, hkv, s, d), dtype)

    def peers_of(a):
        out = {}
        for name, (fn, note) in offgrid_decode.peers(*a, g).items():
            out[name] = lambda fn=fn, ea=offgrid_decode.peer_args(a, g, note): fn(*ea)
        return out
    work = 2 * b * hkv * s * d * k.element_size() / 1e12
    return prog, (q, k, v), work, peers_of


def one(op: str, S: int, wide: bool, kernels: bool = False) -> dict:
    if op.startswith("offgrid:"):
        out, args, work, peers_of = offgrid_setup(op[len("offgrid:"):])
        S = args[1].shape[2]
    else:
        out, spec, work, unit = ops.build(op, S)
        q, k, v, slopes, args = ops.make_inputs(spec)

        def peers_of(a):
            return {n: f for n, f in ops.peers(spec, *a[:3], slopes).items() if n != "compile"}
    kern = ne.superoptimize(out, target="cuda", top_k=2)
    ours = kern(*args)
    row = {"op": op, "S": S, "chosen": str(kern.config), "structure": kern.chosen_row.structure,
           "peers": {}, "configs": []}
    copies = copy_inputs(list(args), input_copies(list(args), torch.cuda.get_device_properties(0).L2_cache_size))
    fns = {"neptune_eq (chosen)": [lambda a=a: kern(*a) for a in copies]}
    for a in copies:  # each peer once per copy of the inputs (its block mask included)
        for name, fn in peers_of(a).items():
            fns.setdefault(name, []).append(fn)
    for name, fn in fns.items():
        try:
            if (fn[0]().float() - ours.float()).abs().max().item() > 2e-2:
                row["peers"][name] = "mismatch"
                continue
            row["peers"][name] = {
                "called": work / (do_bench(fn[0], warmup=25, rep=100, return_mode="median") / 1e3),
                "warm": work / (do_bench_cudagraph(fn[0], rep=100, return_mode="median") / 1e3),
                "cold": work / (device_ms(lambda a: a[0](), [[f] for f in fn]) / 1e3)}
            if kernels:
                row["peers"][name]["kernels"] = device_kernels(fn)
        except Exception as ex:  # noqa: BLE001 - a peer that cannot run this shape
            row["peers"][name] = f"failed: {type(ex).__name__}"
    if kernels:  # where the host time of our call goes (as called is host-bound here)
        from host_profile import host_profile
        row["host_profile"] = host_profile(fns["neptune_eq (chosen)"][0], 200, 16)[1]
    for r in kern.candidates:
        if not r.timings:
            continue
        tensors = timing_tensors(r.program, dict(zip([p.name for p in r.program.inputs], args)))
        configs = [c for c, ms, _ in r.timings if ms is not None]
        if wide and (r.config.splits or r.chosen):
            seen = {str(c) for c in configs}
            more = sweep(r.kernel, r.config, S) if r.config.splits else rolling_sweep(r.config, S)
            configs += [c for c in more if str(c) not in seen]
            compile_in_parallel([(r.program, r.kernel, c) for c in configs], "cuda", tensors)
        called = time_configs(r.program, r.kernel, "cuda", tensors, configs, host=True)
        cold = time_configs(r.program, r.kernel, "cuda", tensors, configs)
        for (c, ms, st), (_, gms, gst) in zip(called, cold):
            row["configs"].append({
                "candidate": r.structure, "config": str(c), "chosen": r.chosen and c == r.config,
                "offered": any(c == x for x, _, _ in r.timings),
                "called": work / (ms / 1e3) if ms else st,
                "cold": work / (gms / 1e3) if gms else gst})
    best = max((c for c in row["configs"] if isinstance(c["cold"], float)),
               key=lambda c: c["cold"], default=None)
    print(f"{op} S={S}: chosen {row['chosen']}; best cold {best and best['config']} "
          f"{best and round(best['cold'], 2)} TB/s; peers {row['peers']}", flush=True)
    return row


def write(out: Path, rows: list[dict], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_configs.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))

    def f(x):
        return f"{x:.2f}" if isinstance(x, float) else str(x)
    md = [f"# Decode tile configs, as called and graphed ({meta['gpu']}, torch {meta['torch']}, "
          f"triton {meta['triton']}, {meta['date']})", "",
          "TB/s = bytes of K+V / median time. called: `do_bench` (host included); cold: "
          "replayed from a CUDA graph over copies of the inputs larger than L2 (how configs "
          "are chosen); warm: `do_bench_cudagraph`, inputs left in L2. `offered`: in "
          "`candidate_configs`' grid; `chosen`: what `superoptimize` chose.", ""]
    for r in rows:
        md += [f"## {r['op']} S={r['S']}", "", "| kernel | called | warm | cold |",
               "| --- | --- | --- | --- |"]
        md += [f"| {n} | {f(p['called'])} | {f(p['warm'])} | {f(p['cold'])} |" if isinstance(p, dict)
               else f"| {n} | {p} | | |" for n, p in r["peers"].items()]
        for n, p in r["peers"].items():
            if isinstance(p, dict) and p.get("kernels"):
                md += ["", f"{n}: device us per call by kernel", ""]
                md += [f"- {k['kernel']}: {k['us']:.2f} us x{k['launches']}" for k in p["kernels"]]
        if r.get("host_profile"):
            md += ["", "neptune_eq's host side per call (cProfile, 200 calls):", "", "```",
                   r["host_profile"].strip(), "```"]
        md += ["", "| candidate | config | offered | chosen | called TB/s | cold TB/s |",
               "| --- | --- | --- | --- | --- | --- |"]
        md += [f"| {c['candidate']} | {c['config']} | {'yes' if c['offered'] else ''} | "
               f"{'<-' if c['chosen'] else ''} | {f(c['called'])} | {f(c['cold'])} |"
               for c in sorted(r["configs"], key=lambda c: -(c["cold"] if isinstance(
                   c["cold"], float) else 0))]
        md.append("")
    (out / "decode_configs.md").write_text("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="*", default=["gqa-dc", "causal-dc", "alibi-dc", "softcap-dc"])
    ap.add_argument("--seqs", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--sweep", action="store_true", help="also a wider grid than the offered one")
    ap.add_argument("--kernels", action="store_true",
                    help="also each kernel's device time per call, ours and the peers'")
    ap.add_argument("--combine-tile", type=int, default=None,
                    help="values a combine step folds (runtime.launcher.COMBINE_TILE): fewer "
                         "spread the two-launch combine over more programs")
    ap.add_argument("--offgrid", nargs="*", default=[], metavar="B,Hq,Hkv,S,D[,dtype]",
                    help="also off-grid decodes as bench/offgrid_decode.py runs them "
                         "(e.g. 16,32,8,2000,128,bfloat16)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = ap.parse_args()
    a.ops += [f"offgrid:{x}" for x in a.offgrid]
    for op in a.ops:
        if op.startswith("offgrid:"):
            continue
        if op not in ops.OPS or not ops.OPS[op][2]:
            ap.error(f"expected decode operators of bench/neptune_ops.py "
                     f"({[o for o, s in ops.OPS.items() if s[2]]}), got {op!r}")
    if a.combine_tile:
        from neptune_eq.runtime import launcher
        launcher.COMBINE_TILE = a.combine_tile
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "date": __import__("time").strftime("%Y-%m-%d"),
            "command": "python bench/decode_configs.py " + " ".join(sys.argv[1:])}
    rows = []
    for op in a.ops:
        for S in ([0] if op.startswith("offgrid:") else a.seqs):
            rows.append(one(op, S, a.sweep, a.kernels))
            write(a.out, rows, meta)  # after each setup: a cut-off run keeps what it measured


if __name__ == "__main__":
    main()

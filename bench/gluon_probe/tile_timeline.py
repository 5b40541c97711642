"""Probe (session 44): where a Gluon tile's time goes, read from clocks inside the kernel.

Several issue-16/17 gaps have been put down to a fixed cost per tile of the
warp-specialised form (about 3-4 us a tile at head dim 64, session 28's fit of program
time against key blocks): head-dim-64 causal prefill (0.84x cuDNN), GQA 64/8 at S=512
(0.81x), short documents.  A fit cannot say which part of a tile it is.  This probe
patches the generated form (the product's plan and source, launched as the product
launches it) with reads of ``%globaltimer`` and ``%clock64`` at each phase of each tile,
per consumer warpgroup and for the producer warp, and reports per tile:

* ``rows_wait``: tile start to its query rows in shared memory (``a_bar``);
* ``first_block``: block 0's score product and its softmax (nothing overlaps them);
* ``per_block``: each later block (the steady state);
* ``drain``: the rows released to the last P·V retired;
* ``epilogue``: the normalisation and the output store;
* ``gap``: one tile's store to the next tile's start (the walk's own work);
* the producer's wait for the consumers to release the rows before it loads the next.

The instrumented kernel is timed beside the plain one, so the probe's own cost shows.
First run (session 45, H200, bench/results/s45/tile_timeline_h200.json): the fixed cost is
1-2.7 us a tile, the epilogue its largest part (since then stored by TMA,
``lowering/gluon_epilogue``), and at head dim 64 the steady loop is 90-96% of a tile at
1.26 us a block -- the softmax and the products of the two warpgroups not overlapped.

Not generated code: a probe of it.  ``--compile-only`` cross-compiles every patched case
for sm_90 on a machine without a GPU (``tests/sm90_compile.py``).

    python bench/gluon_probe/tile_timeline.py [--cases causal-d64 gqa-512 ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import torch  # noqa: E402

import gluon_validate as gv  # noqa: E402
from neptune_eq.runtime.gluon_launch import load_gluon, make_launcher, sm90_spec  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig  # noqa: E402

EVENTS = ("start", "rows_ready", "first_block", "loop_done", "last_product", "stored")
N_EV = 8          # slots per (tile, lane): the events, then n_blocks in the last slot
LANES = 3         # consumer warpgroup 0, 1, the producer warp
CASES = {  # name: (variant, B, H, S, D, kv heads, dtype, key block, ring, config options)
    "causal-d64": ("causal", 4, 16, 5000, 64, None, "bfloat16", 128, 2, {}),
    "causal-d64-per-tile": ("causal", 4, 16, 5000, 64, None, "bfloat16", 128, 2,
                            {"per_tile": True}),
    "global-d64": ("global", 4, 16, 5000, 64, None, "bfloat16", 128, 2, {}),
    "gqa-512": ("global", 1, 64, 512, 128, 8, "float16", 128, 2, {}),
    "causal-d128-8192": ("causal", 1, 32, 8192, 128, None, "float16", 128, 2, {}),
    "doc13-8192": ("doc13", 1, 16, 8192, 128, None, "float16", 64, 2, {"heads_first": True}),
    "doc13-8192-dynamic": ("doc13", 1, 16, 8192, 128, None, "float16", 64, 2,
                           {"dynamic": True}),
}


def _clock(pad: str, lane: str, ev: int, max_tiles: int) -> list[str]:
    """Gluon lines storing (globaltimer, clock64) at event ``ev`` of this tile and lane."""
    slot = (f"(((gl.program_id(0) + gl.program_id(1) * gl.num_programs(0)) * {max_tiles} + it)"
            f" * {LANES} + {lane}) * {N_EV} + {ev}")
    read = 'gl.inline_asm_elementwise("mov.u64 $0, %{}; // {}", "=l", [], dtype=gl.int64, is_pure=False, pack=1)'
    return [f"{pad}_slot = {slot}",
            f"{pad}gl.store(timeline_ptr + 2 * _slot, {read.format('globaltimer', ev)})",
            f"{pad}gl.store(timeline_ptr + 2 * _slot + 1, {read.format('clock64', ev)})"]


def instrument(src: str, name: str, max_tiles: int) -> str:
    """``src`` (a generated Gluon module) with a ``timeline_ptr`` parameter and clock reads
    at each tile's phases (``EVENTS``) in both partitions."""
    out, region, seen_first, stored = [], None, False, False

    def end_of_tile(pad: str) -> list[str]:
        return [*_clock(pad, "WHICH", 5, max_tiles), *_clock(pad, "WHICH", N_EV - 1, max_tiles)[:1],
                f"{pad}gl.store(timeline_ptr + 2 * _slot, n_blocks)"]
    for ln in src.splitlines():
        st, pad = ln.strip(), ln[:len(ln) - len(ln.lstrip())]
        if region == "_consumer" and st.startswith("@gluon.jit") and not stored:
            # one tile per program: the tile ends with the consumer's body
            while out and not out[-1].strip():
                out.pop()
            out += [*end_of_tile("    "), "", ""]
            stored = True
        if st.startswith(("def _consumer(", "def _producer(", f"def {name}(")):
            region = st[4:st.index("(")]
            out.append(ln[:ln.rindex("):")] + ", timeline_ptr):")
            continue
        if st.startswith(("(_consumer, (", "(_producer, (")):
            out.append(ln[:ln.rindex(")),")] + ", timeline_ptr)),")
            continue
        lane = "WHICH" if region == "_consumer" else "2"
        if region == "_consumer" and st.startswith("mbarrier.wait(a_bar, it & 1)"):
            seen_first = False
            out += [*_clock(pad, lane, 0, max_tiles), ln, *_clock(pad, lane, 1, max_tiles)]
            continue
        if region == "_consumer" and st == "qk = warpgroup_mma_wait(0, deps=(qk, ))" \
                and not seen_first:
            seen_first = True
            out += [ln, *_clock(pad, lane, 2, max_tiles)]
            continue
        if region == "_consumer" and st.startswith("mbarrier.arrive(q_empty, count=1)"):
            out += [*_clock(pad, lane, 3, max_tiles), ln]
            continue
        m = re.fullmatch(r"(\w+) = warpgroup_mma_wait\(0, deps=\(\1, \)\)", st)
        if region == "_consumer" and m and m.group(1) != "qk":
            out += [ln, *_clock(pad, lane, 4, max_tiles)]
            continue
        if region == "_consumer" and st == "base += n_blocks":
            out += [*end_of_tile(pad), ln]
            stored = True
            continue
        if region == "_producer" and st.startswith("mbarrier.wait(q_empty"):
            out += [*_clock(pad, lane, 0, max_tiles), ln, *_clock(pad, lane, 1, max_tiles)]
            continue
        out.append(ln)
    text = "\n".join(out) + "\n"
    for need in ("%globaltimer; // 5", "%globaltimer; // 2", "%globaltimer; // 4"):
        if need not in text:
            raise SystemExit(f"instrument: no insertion point for {need!r} in {name}")
    return text


def build(case: str):
    """(program, kernel source, config, captured tensors) of a case (CPU work only)."""
    variant, b, h, s, d, kv, dtype, bl, ring, opts = CASES[case]
    mods, captured = None, {}
    if variant.startswith("doc"):
        mods, _, captured = gv.data_case(variant, b, s)
    prog, ks = gv.derive(variant, b, h, s, d, dtype, kv, mods)
    cfg = TileConfig({f"B_{ks.block_axis}": 128, "B_L": bl}, 4, ring, gluon_ws=True, **opts)
    return prog, ks, cfg, captured


def compile_only(cases: list[str], python: str | None) -> list[dict]:
    """Cross-compile each patched case for sm_90 (no GPU)."""
    from sm90_compile import compile_for_sm90
    rows = []
    if not torch.cuda.is_available():  # the data cases' tensors stay on the CPU here
        torch.Tensor.cuda = lambda self, *a, **k: self
    for case in cases:
        prog, ks, cfg, _ = build(case)
        form = ks.gluon.form_for(128, cfg.dynamic)
        src = instrument(form.source, form.name, 4)
        spec = sm90_spec(prog, ks, cfg.num_stages, cfg.blocks["B_L"], form)
        spec["dtypes"]["timeline_ptr"] = "*i64"
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"{form.name}.py")
            with open(path, "w") as fh:
                fh.write(src)
            res = compile_for_sm90(path, form.name, spec, python=python)
        rows.append({"case": case, "ok": res["ok"], "error": res.get("error")})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _tensors(prog, dtype, captured) -> dict:
    t = {ph.name: torch.randn(prog.shape_of(ph.name), device="cuda", dtype=getattr(torch, dtype))
         for ph in prog.inputs if ph.name not in captured}
    t.update(captured)
    for o in prog.outputs:
        t[o] = torch.empty(prog.shape_of(o), device="cuda", dtype=getattr(torch, dtype))
    return t


def _summary(buf: torch.Tensor, programs: int, max_tiles: int) -> dict:
    """Per-tile phase times (us, medians over tiles and consumer warpgroups) from the
    clocks: clock64 differences converted at each program's own clock rate."""
    t = buf.view(programs, max_tiles, LANES, N_EV, 2).cpu().double().numpy()
    ns, clk = t[..., 0], t[..., 1]
    ph = {k: [] for k in ("rows_wait", "first_block", "per_block", "drain", "epilogue",
                          "tile", "fixed", "gap", "producer_rows_wait")}
    spans, shares = [], {k: 0.0 for k in ("rows_wait", "first_block", "loop", "drain",
                                          "epilogue", "gap")}
    starts, ends = [], []  # each program's first tile start and last tile end (ns)
    for p in range(programs):
        tiles = [i for i in range(max_tiles) if ns[p, i, 0, 0] > 0]
        if not tiles:
            continue
        first, last = tiles[0], tiles[-1]
        span_ns = ns[p, last, 0, 5] - ns[p, first, 0, 0]
        span_clk = clk[p, last, 0, 5] - clk[p, first, 0, 0]
        rate = span_ns / span_clk if span_clk > 0 else 0.5  # ns per cycle
        spans.append(span_ns / 1e3)
        starts.append(ns[p, first, 0, 0])
        ends.append(max(ns[p, last, lane, 5] for lane in (0, 1)))
        for i in tiles:
            for lane in (0, 1):
                c = clk[p, i, lane] * rate / 1e3  # us
                nb = int(ns[p, i, lane, N_EV - 1])
                seg = {"rows_wait": c[1] - c[0], "first_block": c[2] - c[1],
                       "loop": c[3] - c[2], "drain": c[4] - c[3], "epilogue": c[5] - c[4]}
                for k in ("rows_wait", "first_block", "drain", "epilogue"):
                    ph[k].append(seg[k])
                if nb > 2:
                    ph["per_block"].append(seg["loop"] / (nb - 1))
                ph["tile"].append(c[5] - c[0])
                nxt = next((j for j in tiles if j > i), None)
                gap = (clk[p, nxt, lane, 0] * rate / 1e3 - c[5]) if nxt is not None else 0.0
                if nxt is not None:
                    ph["gap"].append(gap)
                for k in seg:
                    shares[k] += seg[k] / 2
                shares["gap"] += gap / 2
                ph.setdefault("_nb", []).append(nb)
            ph["producer_rows_wait"].append((clk[p, i, 2, 1] - clk[p, i, 2, 0]) * rate / 1e3)
    per_block = statistics.median(ph["per_block"]) if ph["per_block"] else 0.0
    ph["fixed"] = [tile - nb * per_block for tile, nb in zip(ph["tile"], ph["_nb"])]
    total = sum(shares.values()) or 1.0
    out = {f"{k}_us_median": statistics.median(v) for k, v in ph.items() if v and k != "_nb"}
    out.update({f"share_{k}": v / total for k, v in shares.items()})
    out["tiles_timed"] = len(ph["tile"]) // 2
    out["program_span_us_median"] = statistics.median(spans) if spans else None
    out["blocks_per_tile_median"] = statistics.median(ph["_nb"]) if ph.get("_nb") else None
    if starts:  # the walk's balance: how far apart programs start and finish (globaltimer)
        t0 = min(starts)
        out["tiles_span_us"] = (max(ends) - t0) / 1e3  # first tile start to last tile end
        out["start_spread_us"] = (max(starts) - t0) / 1e3
        out["end_spread_us"] = (max(ends) - min(ends)) / 1e3
        out["end_after_median_us"] = (max(ends) - statistics.median(ends)) / 1e3
    return out


def measure(case: str) -> dict:
    """One case on the GPU: the plain and the instrumented kernel timed, then the clocks."""
    import triton
    prog, ks, cfg, captured = build(case)
    la = make_launcher(prog, ks, "cuda", cfg)
    tensors = _tensors(prog, CASES[case][6], captured)
    programs = la.grid[0] * (la.grid[1] if len(la.grid) > 1 else 1)
    n_tiles = -(-ks.row_extent // 128) * ks.grid_size
    max_tiles = -(-n_tiles // programs) + 2 if la.form.persistent and not cfg.per_tile else 1
    fn = load_gluon(replace(la.form, source=instrument(la.form.source, la.form.name, max_tiles)))
    buf = torch.zeros(programs * max_tiles * LANES * N_EV * 2, dtype=torch.int64, device="cuda")

    def run(instrumented: bool):
        run_t, pre = la._summarised(dict(tensors))
        if pre:
            pre[0].slow(pre[1])
        args = la._descriptors(run_t) + la._rest(run_t)[0]
        if la._ranges is not None:
            la._ranges.slow(args[len(la.form.descs):])
        if instrumented:
            fn[la.grid](*args, **la.consts, **la.options, timeline_ptr=buf)
        else:
            la._launch.slow(args)
    row = {"case": case, "config": str(cfg), "programs": programs, "tiles": n_tiles,
           "device": torch.cuda.get_device_name()}
    row["ms_plain"] = triton.testing.do_bench(lambda: run(False), return_mode="median")
    row["ms_instrumented"] = triton.testing.do_bench(lambda: run(True), return_mode="median")
    buf.zero_()
    run(True)
    torch.cuda.synchronize()
    row.update(_summary(buf, programs, max_tiles))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--out", default=".")
    ap.add_argument("--compile-only", action="store_true",
                    help="cross-compile the patched forms for sm_90 (no GPU)")
    ap.add_argument("--python", default=None, help="the Python whose Triton compiles them")
    args = ap.parse_args()
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; expected some of {list(CASES)}")
    if args.compile_only:
        rows = compile_only(args.cases, args.python)
        raise SystemExit(0 if all(r["ok"] for r in rows) else 1)
    run_cases(args.cases, measure, os.path.join(args.out, "tile_timeline.json"))


def run_cases(cases: list[str], measure, path: str) -> list[dict]:
    """``measure`` each case, printing its row and rewriting ``path`` after each: one case
    failing records its error and must not lose the others' rows."""
    rows = []
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for case in cases:
        try:
            rows.append(measure(case))
        except Exception as exc:
            rows.append({"case": case, "error": f"{type(exc).__name__}: {exc}"[:3000]})
        print(json.dumps(rows[-1]), flush=True)
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()

"""Block sparsity derived from data (issue 17) on the GPU: masks over captured tensors,
ne.flex_attention against torch's compiled flex_attention, same process.

Cases: document masks with 1, 4, 13 and 64 documents (causal inside each), jagged
sequences from offsets (a nested read ``offsets[doc[q]]``), prefix-LM with a per-sample
prefix.  Columns:

* ``ms_ours``        -- ne.flex_attention per call (summaries rebuilt every call);
* ``ms_prepass``     -- the summary pre-pass alone (its one launch, as a call makes it:
                        allocation + direct launch) at the kernel's tiles;
* ``ms_prepass_device`` / ``ms_main_device`` -- device time of the pre-pass kernel and of
                        the attention kernel inside real calls (torch.profiler, 20 calls):
                        what the pre-pass adds to a call whose launches are queued back to
                        back; ``prepass_share`` is the pre-pass's device time over the call's;
* ``ms_flex_prebuilt`` -- torch flex_attention (compiled) with a BlockMask built once;
* ``ms_flex_percall``  -- create_block_mask + flex_attention per call (mask rebuilt);
* TFLOP/s counted on visible pairs only (4·D flops per pair), as FlexAttention reports.

    python bench/doc_mask_gpu.py                      # all cases, S 4096..32768, fp16+bf16
    python bench/doc_mask_gpu.py --S 8192 --dtype float16 --cases doc13
    python bench/doc_mask_gpu.py --dtype bfloat16 --S 8192 32768 --out doc_mask_bf16
    python bench/doc_mask_gpu.py --smoke               # CPU: tiny sizes, interpreter, no timing
Writes bench/results/<out>.json and bench/results/<out>.md (rows are written as they
finish, so a partial run keeps what it measured).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402  (first: picks the Triton interpreter without a GPU)
import torch  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from neptune_eq.dropin import flex as ne_flex  # noqa: E402
from neptune_eq.runtime.launch import current_stream  # noqa: E402
from neptune_eq.runtime.launcher import check_inputs  # noqa: E402
from neptune_eq.sizes import sizes_of  # noqa: E402

H, D = 16, 128
DEV = "cuda"
RESULTS = Path(__file__).parent / "results"
GRAPH_CALLS = 20  # calls per CUDA graph in ``graph_ms``


def do_bench(fn, **kw):
    from triton.testing import do_bench as bench
    return bench(fn, **kw)


def doc_ids(S: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted document ids of ``n`` random-length documents covering S, and their offsets."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(S - 1, generator=g)[: n - 1] + 1).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([S])])
    ids = torch.repeat_interleave(torch.arange(n), offsets.diff())
    return ids.to(torch.int32).to(DEV), offsets.to(torch.int32).to(DEV)


def case(name: str, S: int):
    """(mask_mod, batch, visible pairs summed over the batch) of one case."""
    if name.startswith("doc"):
        doc, offsets = doc_ids(S, int(name[3:]))
        lens = offsets.diff().double()

        def mask(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)
        return mask, 1, float((lens * (lens + 1) / 2).sum())
    if name == "jagged":
        doc, offsets = doc_ids(S, 13, seed=1)
        lens = offsets.diff().double()

        def mask(b, h, q, kv):
            return (kv >= offsets[doc[q]]) & (q >= kv)
        return mask, 1, float((lens * (lens + 1) / 2).sum())
    if name == "prefix_lm":
        prefix = torch.tensor([S // 4, S // 2], dtype=torch.int32, device=DEV)

        def mask(b, h, q, kv):
            return (kv < prefix[b]) | (q >= kv)
        pairs = sum(p * p + (S * (S + 1) - p * (p + 1)) / 2 for p in (S // 4, S // 2))
        return mask, 2, float(pairs)
    raise SystemExit(f"unknown case {name!r}; expected doc1/doc4/doc13/doc64/jagged/prefix_lm")


def launcher_of(q, k, v, mask, score=None, enable_gqa=False):
    """The launcher ne.flex_attention runs at these sizes, and its bound inputs."""
    spec = ne_flex.check(q, k, v, None, enable_gqa, False)
    sizes = {"B": q.shape[0], "L": q.shape[2], "S": k.shape[2]}
    st, captured = ne_flex.trace(spec, score, mask, sizes)
    kern = st.kernel_at(sizes)
    prog = kern.input_program
    bound = check_inputs(prog, (q, k, v, *captured.values()), {}, DEV, symbolic=True)
    values = sizes_of(prog, bound)
    la = kern._dispatch.launcher(values) if kern._dispatch else kern._launcher
    for name in prog.outputs:  # as a call binds them (a sweep times whole launches)
        dims = [values[n.name] if hasattr(n, "name") else n for n in prog.shape_of(name)]
        bound[name] = torch.empty(dims, dtype=getattr(torch, prog.dtype_of(name)), device=DEV)
    return kern, la, bound


def prepass_ms(q, k, v, mask) -> float | None:
    """Time of the summary pre-pass alone as a call runs it (allocate the summaries, one
    direct launch), at the tiles the kernel runs with at these sizes."""
    try:
        _, la, bound = launcher_of(q, k, v, mask)
        if la._pre is None:
            return 0.0
        sums, launch, args, ints = la._pre.prepare(bound)
        ck = launch.slow(args + ints)   # Triton's own launch picks the compiled kernel
        stream = current_stream(torch.cuda.current_device())

        def once():
            _, fl, a, i = la._pre.prepare(bound)
            fl.fast(ck, a + i, stream)
        return do_bench(once, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a measurement, never a crash of the table
        print(f"  pre-pass not measured: {e}", file=sys.stderr)
        return None


# The pre-pass kernel's name: it builds summaries, or (a mask that needs none, such as
# jagged offsets read at the rows' own ids) only checks the ids that index a table
PREPASS_NAMES = ("_summaries", "_check_ids")


def device_ms(q, k, v, mask, calls: int = 20) -> tuple[float, float]:
    """(pre-pass, attention) kernel device time per call, from the profiler over real
    calls: a lone timed launch of the pre-pass mostly measures launch latency, which a
    call hides behind the host's work on the next launch."""
    from host_profile import kernel_times
    pre = main = 0.0
    for name, us, _ in kernel_times(lambda: ne.flex_attention(q, k, v, mask_mod=mask), calls):
        if name.startswith("neptune_") and name.endswith(PREPASS_NAMES):
            pre += us
        elif name.startswith("neptune_"):  # kernels are named after their outputs
            main += us
    return pre / 1e3, main / 1e3


def config_sweep(q, k, v, mask) -> dict:
    """The tile config ours runs with here, and every candidate config timed on THIS
    case's data (the chooser timed them once, on the first data of the structure)."""
    from neptune_eq.runtime.tile_configs import candidate_configs
    from neptune_eq.runtime.tuning import time_configs
    kern, la, bound = launcher_of(q, k, v, mask)
    sizes = sizes_of(kern.input_program, bound)
    timed = time_configs(la.program, la.ks, DEV, bound, candidate_configs(la.ks, DEV), sizes)
    ok = sorted((ms, str(c)) for c, ms, _ in timed if ms is not None)
    return {"config": str(la.config),
            "best_config": ok[0][1] if ok else None,
            "ms_best_config": ok[0][0] if ok else None,
            "configs_timed": [[str(c), ms, why] for c, ms, why in timed]}


def smoke_one(name: str, S: int, dtype: torch.dtype) -> dict:
    """CPU: one case at a tiny size through the Triton interpreter, against torch's eager
    flex_attention with the same mask (no timing; checks the bench's own code paths)."""
    mask, B, pairs = case(name, S)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(3))
    ours = ne.flex_attention(q, k, v, mask_mod=mask)
    bm = create_block_mask(mask, B, None, S, S, device="cpu")
    ref = flex_attention(q.float(), k.float(), v.float(), block_mask=bm)
    kern, la, _ = launcher_of(q, k, v, mask)
    return {"case": name, "S": S, "dtype": str(dtype).replace("torch.", ""), "B": B,
            "density": pairs / (B * S * S), "launches": kern.launches,
            "branch_free_loops": "if mono" in kern.source or "(else: skipped)" not in kern.source,
            "max_abs_diff_vs_flex": (ours.float() - ref).abs().max().item()}


def host_profile(name: str, S: int, dtype: torch.dtype, calls: int = 500) -> str:
    """Host time per call (a loop without sync) and its cProfile: where a call whose
    device time is below its host time spends the host's."""
    from host_profile import NoKeep, host_profile as profile_host, loop_us
    mask, B, _ = case(name, S)
    q, k, v = (torch.randn(B, H, S, D, device=DEV, dtype=dtype) for _ in range(3))
    host, table = profile_host(lambda: ne.flex_attention(q, k, v, mask_mod=mask), calls, top=30)
    # the peer's host time per call, the same way: compiled flex_attention, prebuilt mask
    flex = torch.compile(flex_attention)
    bm = create_block_mask(mask, B, None, S, S, device=DEV)
    flex_host = loop_us(lambda: flex(q, k, v, block_mask=bm), calls=calls, warmup=10)
    # the replay's summaries kept per stream (runtime/bound_call.py) against allocated per
    # call, alternated three times in this process
    bound = [b for st in ne_flex.STRUCTURES.values() if st.kernel is not None
             for b in st.kernel._bound.values() if b is not None and getattr(b, "pre", None)]
    ab = {"kept": [], "per call": []}
    for _ in range(3 if bound else 0):
        for mode in ab:
            for b in bound:
                b._summaries = {} if mode == "kept" else NoKeep()
            ab[mode].append(loop_us(lambda: ne.flex_attention(q, k, v, mask_mod=mask),
                                    calls=calls, warmup=10))
    for b in bound:
        b._summaries = {}
    kept = ", ".join(f"{m} {' / '.join(f'{x:.0f}' for x in xs)}" for m, xs in ab.items())
    return (f"{name} S={S} {dtype}: host {host:.0f} us per call (FlexAttention with a "
            f"prebuilt BlockMask: {flex_host:.0f} us); summaries {kept or 'n/a'} us\n" + table)


def fresh_start() -> None:
    """Forget every structure and cached winner, as a new process with an empty cache:
    each case then chooses its tiles on its own first call's data, as a user whose
    batches look like that case would (doc1..doc64 share one structure, and the first
    case's data would otherwise choose for all of them)."""
    import os
    import tempfile
    from neptune_eq.dropin import eager_env
    eager_env.forget()
    os.environ["NEPTUNE_EQ_CACHE"] = tempfile.mkdtemp(prefix="neptune_eq_case_")


def run_one(name: str, S: int, dtype: torch.dtype, flex, sweep: bool = False,
            fresh: bool = True) -> dict:
    if fresh:
        fresh_start()
    mask, B, pairs = case(name, S)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(3))
    t0 = time.perf_counter()
    ours = ne.flex_attention(q, k, v, mask_mod=mask)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    bm = create_block_mask(mask, B, None, S, S, device="cuda")
    ref = flex(q, k, v, block_mask=bm)
    flops = 4.0 * D * pairs * H

    def percall():
        return flex(q, k, v, block_mask=create_block_mask(mask, B, None, S, S, device="cuda"))
    row = {"case": name, "S": S, "dtype": str(dtype).replace("torch.", ""), "B": B, "H": H,
           "D": D, "density": pairs / (B * S * S), "first_call_s": first,
           "max_abs_diff_vs_flex": (ours.float() - ref.float()).abs().max().item(),
           "ms_ours": do_bench(lambda: ne.flex_attention(q, k, v, mask_mod=mask),
                               return_mode="median"),
           "ms_prepass": prepass_ms(q, k, v, mask),
           "ms_flex_prebuilt": do_bench(lambda: flex(q, k, v, block_mask=bm), return_mode="median"),
           "ms_flex_percall": do_bench(percall, warmup=2, rep=20, return_mode="median")}
    for key in ("ours", "flex_prebuilt", "flex_percall"):
        row[f"tflops_{key}"] = flops / (row[f"ms_{key}"] * 1e-3) / 1e12
    row["speedup_vs_prebuilt"] = row["ms_flex_prebuilt"] / row["ms_ours"]
    row["speedup_vs_percall"] = row["ms_flex_percall"] / row["ms_ours"]
    row["ms_prepass_device"], row["ms_main_device"] = device_ms(q, k, v, mask)
    # Device-only: both calls replayed from a CUDA graph (no host launch path; L2 warm).
    # At S=4096 a call is ~50 us of kernels against ~50-60 us of host time on either side,
    # so ``do_bench``'s ratio moves with host jitter (13 documents: 1.07-1.24x, session 39).
    row["ms_ours_graph"] = graphed_ms(lambda: ne.flex_attention(q, k, v, mask_mod=mask))
    row["ms_flex_prebuilt_graph"] = graphed_ms(lambda: flex(q, k, v, block_mask=bm))
    row["speedup_vs_prebuilt_graph"] = (row["ms_flex_prebuilt_graph"] / row["ms_ours_graph"]
                                        if row["ms_ours_graph"] and row["ms_flex_prebuilt_graph"]
                                        else None)
    row["prepass_share"] = row["ms_prepass_device"] / (row["ms_prepass_device"] + row["ms_main_device"])
    kern, la, bound = launcher_of(q, k, v, mask)
    row.update(prepass_added(la, bound))
    if sweep:
        row.update(config_sweep(q, k, v, mask))
    else:
        row["config"] = str(la.config)
    row["chooser_timed"] = chooser_timings(kern, bound)
    return row


def prepass_added(la, bound: dict, passes: int = 3) -> dict:
    """What the pre-pass adds to a call on the device: 20 calls replayed from a CUDA graph
    against the attention kernel alone (its summaries filled beforehand), the median of
    ``passes`` alternated passes each.  With the kernel launched dependent on the pre-pass
    (PDL, session 40) the two kernels overlap, so the profiler's per-kernel device times
    (``prepass_share``) no longer add up to the call; this is the figure for the goal."""
    if la._pre is None:
        return {}
    try:
        tensors = {n: (x.clone() if n in la.program.outputs else x) for n, x in bound.items()}
        runs = {"call": lambda: la(tensors), "main": main_only(la, tensors)}
        ts = alternated_graph_ms(runs, passes)
        call, main = statistics.median(ts["call"]), statistics.median(ts["main"])
        return {"ms_call_graph20": call, "ms_main_only_graph20": main,
                "ms_prepass_added": call - main, "prepass_added_share": (call - main) / call}
    except Exception as e:  # noqa: BLE001 - a measurement, never a crash of the table
        print(f"  pre-pass cost not measured: {type(e).__name__}: {e}", file=sys.stderr)
        return {}


def chooser_timings(kern, bound: dict) -> list | None:
    """The cold choice's own timings of this call's size bucket (``launcher_of``'s kernel
    and bound inputs), [config, ms] per timed config: what a near tie between forms looked
    like to the chooser (at S=4096 jagged took the one-consumer Gluon form in one run and
    the tl tiles in another, session 39)."""
    try:
        rows = (kern.candidates if kern._dispatch is None else
                kern._dispatch.choice_for(sizes_of(kern.input_program, bound)).rows)
        return [[str(c), ms] if ms is not None else [str(c), None, why]  # (why not timed)
                for r in rows for c, ms, why in r.timings]
    except Exception as e:  # noqa: BLE001 - a diagnostic, never a crash of the table
        print(f"  chooser timings not read: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def graphed_ms(fn) -> float | None:
    """``do_bench_cudagraph`` of ``fn`` (median ms), or None where it cannot be captured."""
    from triton.testing import do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a measurement, never a crash of the table
        print(f"  not captured in a CUDA graph: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def main_only(la, tensors: dict):
    """(a function launching only ``la``'s attention kernel, its summaries filled once by
    one pre-pass launch here)."""
    if getattr(la, "gluon", False):
        run, pre = la._summarised(dict(tensors))
        pre[0].slow(pre[1])
        args = la._descriptors(run) + la._rest(run)[0]
        if la._ranges is not None:  # a dynamic walk: its ranges kernel zeroes the tile
            # counter a call starts from (without it the walk reads an unfilled buffer)
            rest = args[len(la.form.descs):]
            return lambda: (la._ranges.slow(rest), la._launch.slow(args))
        return lambda: la._launch.slow(args)
    lists, _, _, steps = la._arg_lists(dict(tensors))
    steps[0].slow(lists[0])
    return lambda: [fl.slow(a) for fl, a in zip(steps[1:], lists[1:])]


def graph_ms(fn) -> float:
    """Per-call ms of ``GRAPH_CALLS`` calls of ``fn`` replayed from one CUDA graph."""
    from triton.testing import do_bench
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn()
    return do_bench(g.replay, return_mode="median") / GRAPH_CALLS


def alternated_graph_ms(runs: dict, passes: int) -> dict[str, list[float]]:
    """``graph_ms`` of each of ``runs`` (key -> function), ``passes`` times, the runs
    alternated within each pass: differences of ~1 us on calls of 50-200 us, which one
    pass each moved by about as much (session 40).  Key -> its times in pass order."""
    times = {key: [] for key in runs}
    for _ in range(passes):
        for key, fn in runs.items():
            times[key].append(graph_ms(fn))
    return times


def write(rows: list[dict], out: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    (RESULTS / f"{out}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# Data-derived block sparsity ({meta['device']}, torch {meta['torch']}, H={H}, D={D})",
             "", "TFLOP/s on visible pairs.  ours = ne.flex_attention per call (block summaries "
             "rebuilt each call); prebuilt / per-call = torch flex_attention (compiled) with a "
             "BlockMask built once / per call.", "",
             "Goals (issue 17): x prebuilt >= 1.2, x per-call >= 10, pre-pass < 3 % of our call.",
             "", "| case | S | dtype | density | ours ms | ours TF/s | prebuilt TF/s | per-call TF/s "
             "| x prebuilt | x per-call | pre-pass ms (lone launch) | pre-pass ms (device, in calls) "
             "| pre-pass % of device time | pre-pass added, graphed (us, % of call) | max diff "
             "| x prebuilt, both graphed | tiles |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = f"{100 * r['prepass_share']:.2f}" if r.get("prepass_share") is not None else "n/a"
        pre = f"{r['ms_prepass']:.4f}" if r.get("ms_prepass") is not None else "n/a"
        pre += f" | {r['ms_prepass_device']:.4f}" if "ms_prepass_device" in r else " | n/a"
        added = (f"{r['ms_prepass_added'] * 1e3:.2f}, {100 * r['prepass_added_share']:.2f}%"
                 if r.get("ms_prepass_added") is not None else "n/a")
        g = r.get("speedup_vs_prebuilt_graph")
        graphed = f"{g:.2f}" if g else "n/a"
        lines.append(f"| {r['case']} | {r['S']} | {r['dtype']} | {r['density']:.3f} | "
                     f"{r['ms_ours']:.3f} | {r['tflops_ours']:.0f} | {r['tflops_flex_prebuilt']:.0f} | "
                     f"{r['tflops_flex_percall']:.1f} | {r['speedup_vs_prebuilt']:.2f} | "
                     f"{r['speedup_vs_percall']:.1f} | {pre} | {share} | {added} | "
                     f"{r['max_abs_diff_vs_flex']:.1e} | {graphed} | {r.get('config', 'n/a')} |")
    (RESULTS / f"{out}.md").write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="*", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--dtype", nargs="*", default=["float16", "bfloat16"])
    ap.add_argument("--cases", nargs="*",
                    default=["doc1", "doc4", "doc13", "doc64", "jagged", "prefix_lm"])
    ap.add_argument("--out", default="doc_mask",
                    help="results file name under bench/results/ (without .md / .json)")
    ap.add_argument("--sweep-configs", action="store_true",
                    help="also time every candidate tile config on each case's own data "
                         "(json: config, best_config, ms_best_config, configs_timed)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the bench itself: S=64, H=2, D=16 in the Triton "
                         "interpreter against eager flex_attention; writes <out>_smoke.json")
    ap.add_argument("--shared-structure", action="store_true",
                    help="keep one structure (and its tiles, chosen on the first case's data) "
                         "across cases instead of a fresh start per case")
    ap.add_argument("--host-profile", action="store_true",
                    help="only profile the host side of our call for each case (first S and "
                         "dtype); writes <out>_host_profile.txt")
    args = ap.parse_args()
    if args.host_profile:
        text = "\n\n".join(host_profile(c, args.S[0], getattr(torch, args.dtype[0]))
                             for c in args.cases)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.out}_host_profile.txt").write_text(text)
        print(text[:8000])
        return
    for dt in args.dtype:
        if not isinstance(getattr(torch, dt, None), torch.dtype):
            raise SystemExit(f"unknown dtype {dt!r}; expected float16 / bfloat16 / float32")
    if args.smoke:
        return smoke(args)
    if not torch.cuda.is_available():
        raise SystemExit("This benchmark needs a CUDA GPU (torch sees none); --smoke runs a "
                         "tiny CPU check of it.")
    rows = []
    for dt in args.dtype:
        for S in args.S:
            # A fresh compile per dtype and length: each case's mask is a recompile, and
            # past Dynamo's limit flex_attention falls back to its unfused eager path
            # (measured: 7 TFLOP/s for bf16 prefix-LM at S=8192, and an S^2 score matrix
            # of 64 GiB at S=32768) -- a fault of the harness, not of FlexAttention.
            torch._dynamo.reset()
            torch._dynamo.config.recompile_limit = 64
            flex = torch.compile(flex_attention, dynamic=False)
            for name in args.cases:
                row = run_one(name, S, getattr(torch, dt), flex, args.sweep_configs,
                              fresh=not args.shared_structure)
                rows.append(row)
                print(json.dumps(row), flush=True)
                write(rows, args.out)


def smoke(args) -> None:
    global H, D, DEV
    H, D, DEV = 2, 16, "cpu"
    rows = []
    for name in args.cases:
        row = smoke_one(name, 64, torch.float32)
        print(json.dumps(row), flush=True)
        if not row["max_abs_diff_vs_flex"] < 1e-3:
            raise SystemExit(f"{name}: differs from flex_attention by {row['max_abs_diff_vs_flex']}")
        rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}_smoke.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()

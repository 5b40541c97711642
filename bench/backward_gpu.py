"""Training step (forward + backward) of ne.flex_attention on the GPU, next to torch's
flex_attention (compiled) and SDPA (default backend, and cuDNN where it runs): time per
fwd+bwd, and gradient error against fp64 autograd of the plain attention.

    python bench/backward_gpu.py            # H200 goal shapes: bf16, B=2, H=16, D=128
    python bench/backward_gpu.py --quick    # one length, for a smoke run

writes backward.json and backward.md to bench/results (or --out), with the generated
backward kernels' sources beside them.  Every row is measured independently: a variant
that fails records its error instead of stopping the run.  Backward TFLOP/s are counted
as FlashAttention does: 2.5x the forward's 4·B·H·L·S·D (halved when causal), over the
backward's time (fwd+bwd minus fwd, both medians).

``--graph`` also times each fwd+bwd step captured in a CUDA graph (GPU time only, as a
training step under ``torch.compile(mode="reduce-overhead")`` or a hand-captured graph
runs it): at short lengths the called step is host-bound for every implementation, and
the graphed one says how the kernels compare.  Each graph's gradients are checked against
the called step's (a capture that baked in stale pointers would fail there).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CHECK_MAX = 4096  # longest length the gradients are checked at against fp64 autograd
B, H, D = 2, 16, 128
WINDOW, DOCS = 256, 13


def causal(b, h, q, kv):
    return q >= kv


def softcap(score, b, h, q, kv):
    return torch.tanh(score / 30) * 30


def variants(S: int, slopes: torch.Tensor):
    """name -> (kwargs for both flex implementations, Hkv, L, SDPA kwargs or None, fp64 ref)."""
    def alibi(score, b, h, q, kv):
        return score + slopes[h] * (kv - q)

    bm = create_block_mask(causal, None, None, S, S, device="cuda")

    def window(b, h, q, kv):  # causal sliding window of WINDOW keys
        return (q >= kv) & (q - kv < WINDOW)
    # DOCS documents of random lengths (fixed seed), causal within each: the data mask
    # that issue 17 skips blocks of, now in the backward too
    doc = doc_ids(S).to("cuda")

    def document(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)
    wm = create_block_mask(window, None, None, S, S, device="cuda")
    dm = create_block_mask(document, None, None, S, S, device="cuda")
    return {
        "plain": ({}, H, S, {}, dict()),
        "causal": ({"block_mask": bm}, H, S, {"is_causal": True}, dict(causal=True)),
        "causal+softcap": ({"block_mask": bm, "score_mod": softcap}, H, S, None,
                           dict(causal=True, cap=30.0)),
        "causal+gqa(4)": ({"block_mask": bm, "enable_gqa": True}, 4, S,
                          {"is_causal": True, "enable_gqa": True}, dict(causal=True)),
        "alibi": ({"score_mod": alibi}, H, S, None, dict(slopes=slopes)),
        f"window({WINDOW})": ({"block_mask": wm}, H, S, None,
                              dict(mask=window)),
        f"doc({DOCS})": ({"block_mask": dm}, H, S, None,
                         dict(mask=document)),
        "decode(L=1)": ({}, H, 1, {}, dict()),
    }


def doc_ids(S: int, docs: int = DOCS) -> torch.Tensor:
    """Sorted ids of ``docs`` documents of random lengths (fixed seed) over ``S`` positions."""
    cuts = torch.sort(torch.randperm(S - 1, generator=torch.Generator().manual_seed(0))
                      [:docs - 1] + 1).values
    return torch.bucketize(torch.arange(S), cuts, right=True)


def reference(q, k, v, causal=False, cap=None, slopes=None, mask=None):
    """fp64 attention with torch ops (its autograd is the reference)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None]
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if slopes is not None:
        s = s + slopes.double()[None, :, None, None] * (j - i)
    if causal:
        s = s.masked_fill(j > i, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask(0, 0, i, j), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def step(fn, q, k, v, g):
    """One fwd+bwd; returns the gradients."""
    out = fn(q, k, v)
    return torch.autograd.grad(out, (q, k, v), g)


def capture_step(fn, q, k, v, g, warmups: int = 3):
    """(a CUDA graph of one fwd+bwd, its gradient tensors), warmed up and captured on the
    current stream -- call it on a side stream, with leaves made there: leaves whose
    autograd nodes were made on the default stream make the captured backward wait on
    it, which capture refuses."""
    for _ in range(warmups):
        step(fn, q, k, v, g)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
        grads = step(fn, q, k, v, g)
    return graph, grads


def side_capture(fn, q, k, v, g) -> tuple:
    """(a CUDA graph of one fwd+bwd, its gradient tensors, the side stream, the leaves and
    cotangent it was captured on): leaves of its own, made on that stream (see
    ``capture_step``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)] + [g.clone()]
        graph, grads = capture_step(fn, *leaves)
    return graph, grads, side, leaves


def graph_ms(fn, q, k, v, g) -> tuple[float, float]:
    """(median ms of one fwd+bwd replayed from a CUDA graph, max abs difference between
    the replayed gradients and the called step's), on leaves of its own."""
    graph, grads, side, leaves = side_capture(fn, q, k, v, g)
    with torch.cuda.stream(side):
        graph.replay()
        called = step(fn, *leaves)
    torch.cuda.synchronize()
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, called))
    return do_bench(graph.replay, return_mode="median"), diff


def grad_error(fn, ref_kw, Hkv, L, S, dtype):
    """Max abs gradient error vs fp64 autograd at a small length (fp64 fits)."""
    torch.manual_seed(0)
    q = torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
    got = step(fn, q, k, v, g)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(reference(*ins, **ref_kw), ins, g.double())
    return max((a.double() - r).abs().max().item() for a, r in zip(got, ref))


def bench_one(name, S, dtype, slopes, flex_c, check_len, graphed=False):
    kw, Hkv, L, sdpa_kw, ref_kw = variants(S, slopes)[name]
    torch.manual_seed(0)
    q = torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
    row = {"variant": name, "S": S, "L": L, "Hkv": Hkv}
    if "mask" in ref_kw:  # FLOPs on the visible pairs only
        i, j = torch.arange(L, device="cuda")[:, None], torch.arange(S, device="cuda")[None]
        pairs = ref_kw["mask"](0, 0, i, j).sum().item()
    else:
        pairs = L * S * (0.5 if ref_kw.get("causal") else 1.0)
    fwd_flops = 4 * B * H * pairs * D
    row["density"] = pairs / (L * S)
    impls = {"ours": lambda q, k, v: ne.flex_attention(q, k, v, **kw),
             # the same under torch.use_deterministic_algorithms: dQ by a kernel of its
             # own instead of atomic adds in dK/dV's loop (set around the whole step below)
             "ours_det": lambda q, k, v: ne.flex_attention(q, k, v, **kw),
             "flex": lambda q, k, v: flex_c(q, k, v, **kw)}
    if sdpa_kw is not None:
        impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **sdpa_kw)

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, **sdpa_kw)
        impls["cudnn"] = cudnn
    for impl, fn in impls.items():
        torch.use_deterministic_algorithms(impl == "ours_det", warn_only=True)
        try:
            t0 = time.perf_counter()
            step(fn, q, k, v, g)
            torch.cuda.synchronize()
            row[f"first_s_{impl}"] = round(time.perf_counter() - t0, 2)
            row[f"ms_{impl}"] = do_bench(lambda: step(fn, q, k, v, g), return_mode="median")
            row[f"ms_fwd_{impl}"] = do_bench(lambda: fn(q.detach(), k.detach(), v.detach()),
                                             return_mode="median")
            if graphed:
                row[f"graph_ms_{impl}"], row[f"graph_diff_{impl}"] = graph_ms(fn, q, k, v, g)
            bwd = row[f"ms_{impl}"] - row[f"ms_fwd_{impl}"]
            if bwd > 0:
                row[f"bwd_tflops_{impl}"] = 2.5 * fwd_flops / bwd / 1e9
            if S == check_len and S <= CHECK_MAX and impl in ("ours", "ours_det", "flex"):
                # at most CHECK_MAX keys: the fp64 reference's S^2 scores took 16 GiB at
                # 8192 (and the masks' captured tensors and BlockMasks have length S)
                row[f"grad_err_{impl}"] = grad_error(fn, ref_kw, Hkv, L, S, dtype)
        except Exception as e:  # noqa: BLE001 - record it and go on
            row[f"error_{impl}"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        finally:
            torch.use_deterministic_algorithms(False)
    if "ms_ours" in row and "ms_flex" in row:
        row["speedup_vs_flex"] = row["ms_flex"] / row["ms_ours"]
    if "ms_ours" in row and "ms_cudnn" in row:
        row["ratio_vs_cudnn"] = row["ms_cudnn"] / row["ms_ours"]
    for peer in ("flex", "cudnn"):
        if "graph_ms_ours" in row and f"graph_ms_{peer}" in row:
            row[f"graph_vs_{peer}"] = row[f"graph_ms_{peer}"] / row["graph_ms_ours"]
    if "ms_ours_det" in row and "ms_flex" in row:
        row["det_speedup_vs_flex"] = row["ms_flex"] / row["ms_ours_det"]
    print(json.dumps(row), flush=True)
    return row


def profile(S: int, dtype) -> str:
    """Where our fwd+bwd's time goes (kernels vs host gaps), plain attention at ``S``."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    g = torch.randn(B, H, S, D, device="cuda", dtype=dtype)
    fn = lambda q, k, v: ne.flex_attention(q, k, v)  # noqa: E731
    for _ in range(3):
        step(fn, q, k, v, g)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step(fn, q, k, v, g)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


def step_tensors(variant: str, S: int, dtype=torch.bfloat16, batch: int = B) -> tuple:
    """(the variant's flex kwargs, q, k, v needing gradients, an output cotangent g) for
    one training step at length ``S``, seeded."""
    kw, hkv, L, _, _ = variants(S, torch.ones(H, device="cuda"))[variant]
    torch.manual_seed(0)
    q = torch.randn(batch, H, L, D, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, hkv, S, D, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(2))
    return kw, q, k, v, torch.randn(batch, H, L, D, device="cuda", dtype=dtype)


def host_profile(S: int, dtype, variant: str = "causal") -> str:
    """Where the host's time per fwd+bwd goes (cProfile, 200 warm steps) next to the
    device's (kernel time per step from the profiler): is the step host-bound here?"""
    from host_profile import host_profile as profile_host
    kw, q, k, v, g = step_tensors(variant, S, dtype)
    fn = lambda q, k, v: ne.flex_attention(q, k, v, **kw)  # noqa: E731
    flex_c = torch.compile(flex_attention)
    dev_us, kernels = device_kernels(fn, q, k, v, g)
    flex_us, flex_kernels = device_kernels(lambda q, k, v: flex_c(q, k, v, **kw), q, k, v, g)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:  # (where a deterministic step's time goes: its kernels are the same two-kernel form)
        det_us, det_kernels = device_kernels(fn, q, k, v, g)
    finally:
        torch.use_deterministic_algorithms(False)
    from host_profile import loop_us
    flex_host_us = loop_us(lambda: step(lambda q, k, v: flex_c(q, k, v, **kw), q, k, v, g))
    graphs = {}  # where a replayed step's device time goes, plain and deterministic
    for det in (False, True):
        torch.use_deterministic_algorithms(det, warn_only=True)
        try:
            graphs[det] = graph_kernels(fn, q, k, v, g)
        finally:
            torch.use_deterministic_algorithms(False)
    host_us, table = profile_host(lambda: step(fn, q, k, v, g), calls=200, top=40, warmup=0)
    return (f"{variant} S={S}: FlexAttention's host {flex_host_us:.0f} us per step\n"
            f"Replayed from a CUDA graph: device kernels {graphs[False][0]:.0f} us:\n"
            f"{graphs[False][1]}\nthe same captured under deterministic algorithms: "
            f"{graphs[True][0]:.0f} us:\n{graphs[True][1]}\n"
            f"{variant} S={S}: host {host_us:.0f} us per step (loop without sync), "
            f"device kernels {dev_us:.0f} us per step:\n{kernels}\n"
            f"Under torch.use_deterministic_algorithms(True): device kernels {det_us:.0f} us:"
            f"\n{det_kernels}\n"
            f"FlexAttention (compiled), same step: device kernels {flex_us:.0f} us:\n"
            f"{flex_kernels}\n\n" + table)


def device_kernels(fn, q, k, v, g, steps: int = 20) -> tuple[float, str]:
    """(device microseconds per fwd+bwd, one line per kernel: time per step, launches
    per step, name), from the profiler over ``steps`` warm steps."""
    return _kernel_table(lambda: step(fn, q, k, v, g), steps, warmup=steps)


def graph_kernels(fn, q, k, v, g, replays: int = 20) -> tuple[float, str]:
    """``device_kernels`` of one fwd+bwd captured in a CUDA graph (as ``graph_ms``
    captures it) and replayed."""
    graph = side_capture(fn, q, k, v, g)[0]
    torch.cuda.synchronize()
    return _kernel_table(graph.replay, replays, warmup=3)


def _kernel_table(call, calls: int, warmup: int) -> tuple[float, str]:
    from host_profile import kernel_times
    times = sorted(kernel_times(call, calls, warmup=warmup), key=lambda t: -t[1])
    lines = "\n".join(f"  {us:8.1f} us  x{n}  {name[:90]}" for name, us, n in times)
    return sum(us for _, us, _ in times), lines


def first_calls(names: list[str], S: int, dtype) -> None:
    """One fwd+bwd of ours per variant at B=1, length ``S`` (plain and deterministic), as
    a test run earlier on the machine would leave them: every length measured after it
    is then a size bucket met at call time (``choosing/dispatch``), not a first build."""
    for name in names:
        kw, q, k, v, g = step_tensors(name, S, dtype, batch=1)
        for det in (False, True):
            torch.use_deterministic_algorithms(det, warn_only=True)
            try:
                step(lambda q, k, v: ne.flex_attention(q, k, v, **kw), q, k, v, g)
            finally:
                torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()


def markdown(out: dict) -> str:
    lines = [f"# fwd+bwd, {out['device']}, {out['dtype']}, B={B} H={H} D={D}", "",
             f"`{out.get('command', 'python bench/backward_gpu.py')}` (torch {out['torch']})", "",
             "ours: the form the timer chose (dQ added atomically in dK/dV's loop, or a dQ "
             "kernel of its own); ours det: under `torch.use_deterministic_algorithms(True)`, "
             "always the dQ kernel of its own.", "",
             "| variant | S | ours ms | ours det ms | flex ms | sdpa ms | cudnn ms | x flex | "
             "x flex (det) | x cudnn | bwd TFLOP/s ours / det / flex / cudnn | grad err ours | "
             "grad err det | grad err flex | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(r, k, fmt="{:.3f}"):
        return fmt.format(r[k]) if k in r else "—"
    for r in out["rows"]:
        errs = "; ".join(f"{k[6:]}: {v[:80]}" for k, v in r.items() if k.startswith("error_"))
        lines.append(f"| {r['variant']} | {r['S']} | {f(r, 'ms_ours')} | {f(r, 'ms_ours_det')} | "
                     f"{f(r, 'ms_flex')} | {f(r, 'ms_sdpa')} | {f(r, 'ms_cudnn')} | "
                     f"{f(r, 'speedup_vs_flex', '{:.2f}')} | {f(r, 'det_speedup_vs_flex', '{:.2f}')} | "
                     f"{f(r, 'ratio_vs_cudnn', '{:.2f}')} | "
                     f"{f(r, 'bwd_tflops_ours', '{:.0f}')} / {f(r, 'bwd_tflops_ours_det', '{:.0f}')} / "
                     f"{f(r, 'bwd_tflops_flex', '{:.0f}')} / "
                     f"{f(r, 'bwd_tflops_cudnn', '{:.0f}')} | {f(r, 'grad_err_ours', '{:.2e}')} | "
                     f"{f(r, 'grad_err_ours_det', '{:.2e}')} | "
                     f"{f(r, 'grad_err_flex', '{:.2e}')} | {errs} |")
    if any("graph_ms_ours" in r for r in out["rows"]):
        lines += ["", "Captured in a CUDA graph (GPU time of one fwd+bwd; `--graph`): ", "",
                  "| variant | S | ours ms | ours det ms | flex ms | cudnn ms | x flex | x cudnn "
                  "| max diff graph vs called (ours) |", "|---|---|---|---|---|---|---|---|---|"]
        for r in out["rows"]:
            lines.append(f"| {r['variant']} | {r['S']} | {f(r, 'graph_ms_ours')} | "
                         f"{f(r, 'graph_ms_ours_det')} | {f(r, 'graph_ms_flex')} | "
                         f"{f(r, 'graph_ms_cudnn')} | {f(r, 'graph_vs_flex', '{:.2f}')} | "
                         f"{f(r, 'graph_vs_cudnn', '{:.2f}')} | {f(r, 'graph_diff_ours', '{:.1e}')} |")
    lines += ["", "Gradient errors: max abs vs fp64 autograd of the plain attention, at "
              f"S = {out['check_len']} (none when it is over {CHECK_MAX}).  "
              "Goal: >= 1.3x flex, >= 0.9x cuDNN."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", default="")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--profile", action="store_true",
                    help="also write a torch.profiler table of our fwd+bwd (plain, first length)")
    ap.add_argument("--graph", action="store_true",
                    help="also time each fwd+bwd replayed from a CUDA graph")
    ap.add_argument("--first-call", type=int, default=0,
                    help="first call each variant at B=1 and this length (e.g. 64), so the "
                         "lengths measured are buckets met at call time")
    ap.add_argument("--host-profile", default="",
                    help="only profile the host per fwd+bwd of these variants at the first "
                         "length (cProfile and device time); writes backward_host_profile.txt")
    args = ap.parse_args()
    dtype = torch.bfloat16
    if args.host_profile:
        if args.first_call:
            first_calls(args.host_profile.split(","), args.first_call, dtype)
        S = int(args.lengths.split(",")[0])
        text = "\n\n".join(host_profile(S, dtype, v) for v in args.host_profile.split(","))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "backward_host_profile.txt").write_text(text)
        print(text[:6000])
        return
    lengths = (1024,) if args.quick else tuple(int(x) for x in args.lengths.split(","))
    check_len = min(lengths)  # gradients checked at the shortest length (fp64 S² fits)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device="cuda")
    names = [n for n in variants(16, slopes) if not args.variants or n in args.variants.split(",")]
    rows = []
    res = Path(args.out)
    res.mkdir(parents=True, exist_ok=True)

    def write():  # after every row: a run cut off by a time limit keeps what it measured
        out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "dtype": str(dtype), "check_len": check_len, "rows": rows,
               "command": "python bench/backward_gpu.py " + " ".join(sys.argv[1:])}
        (res / "backward.json").write_text(json.dumps(out, indent=1))
        (res / "backward.md").write_text(markdown(out) + "\n")
        return out
    if args.first_call:
        first_calls(names, args.first_call, dtype)
    for S in lengths:
        # A compiled flex_attention met at a second length can fall back to an unfused
        # path (measured: 194 ms at S=8192 after S=2048): compile afresh per length.
        torch._dynamo.reset()
        # every variant (mods, grad or not) is a recompile: the default limit of 8 sends
        # the later ones to an unfused fallback (measured: alibi at 235 ms)
        torch._dynamo.config.recompile_limit = 64
        flex_c = torch.compile(flex_attention)
        for n in names:
            rows.append(bench_one(n, S, dtype, slopes, flex_c, check_len, args.graph))
            out = write()
    if args.profile:
        (res / "backward_profile.txt").write_text(profile(lengths[0], dtype))
    from neptune_eq.dropin import flex
    src = res / "backward_kernels"
    src.mkdir(exist_ok=True)
    def chosen(kern) -> str:
        return "\n".join(["tile configs chosen per size bucket:", *kern.buckets])
    for n, st in enumerate(flex.STRUCTURES.values()):
        for (wrt, *_), (_, kern, *_) in st.backward.items():
            (src / f"structure{n}_{'_'.join(wrt)}.py.txt").write_text(
                kern.explain() + "\n\n" + chosen(kern) + "\n\n" + kern.source)
        for k, (_, kern) in enumerate(st.row_kernels.values()):  # the row dots' kernels
            (src / f"structure{n}_row_statistics{k}.py.txt").write_text(
                kern.explain() + "\n\n" + chosen(kern) + "\n\n" + kern.source)
        if st.backward_form:  # fused or two kernels, per size bucket
            (src / f"structure{n}_forms.txt").write_text("".join(
                f"lse grad {lse}, sizes up to {({k: 1 << c for k, c in b})}: "
                f"{'fused' if f else 'two kernels'} "
                f"({'timed' if t else 'as the nearest timed bucket'})\n"
                for (lse, b), (f, t) in st.backward_form.items()))
    print(markdown(out))


if __name__ == "__main__":
    main()

"""Block sparsity derived from data (issue 17) on the GPU: masks over captured tensors,
ne.flex_attention against torch's compiled flex_attention, same process.

Cases: document masks with 1, 4, 13 and 64 documents (causal inside each), jagged
sequences from offsets (a nested read ``offsets[doc[q]]``), prefix-LM with a per-sample
prefix.  Columns:

* ``ms_ours``        -- ne.flex_attention per call (summaries rebuilt every call);
* ``ms_prepass``     -- the summaries alone (``runtime.block_summary``) at the kernel's tiles;
* ``ms_flex_prebuilt`` -- torch flex_attention (compiled) with a BlockMask built once;
* ``ms_flex_percall``  -- create_block_mask + flex_attention per call (mask rebuilt);
* TFLOP/s counted on visible pairs only (4·D flops per pair), as FlexAttention reports.

    python bench/doc_mask_gpu.py                      # all cases, S 4096..32768, fp16+bf16
    python bench/doc_mask_gpu.py --S 8192 --dtype float16 --cases doc13
Writes bench/results/doc_mask.json and bench/results/doc_mask.md (rows are appended to
the JSON as they finish, so a partial run keeps what it measured).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
from neptune_eq.dropin import flex as ne_flex  # noqa: E402
from neptune_eq.runtime.block_summary import build_summaries  # noqa: E402
from neptune_eq.runtime.launcher import check_inputs  # noqa: E402
from neptune_eq.sizes import sizes_of  # noqa: E402

H, D = 16, 128
RESULTS = Path(__file__).parent / "results"


def doc_ids(S: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted document ids of ``n`` random-length documents covering S, and their offsets."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(S - 1, generator=g)[: n - 1] + 1).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([S])])
    ids = torch.repeat_interleave(torch.arange(n), offsets.diff())
    return ids.to(torch.int32).cuda(), offsets.to(torch.int32).cuda()


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
        prefix = torch.tensor([S // 4, S // 2], dtype=torch.int32, device="cuda")

        def mask(b, h, q, kv):
            return (kv < prefix[b]) | (q >= kv)
        pairs = sum(p * p + (S * (S + 1) - p * (p + 1)) / 2 for p in (S // 4, S // 2))
        return mask, 2, float(pairs)
    raise SystemExit(f"unknown case {name!r}; expected doc1/doc4/doc13/doc64/jagged/prefix_lm")


def prepass_ms(q, k, v, mask) -> float | None:
    """Time of the summaries alone, at the tiles the kernel runs with at these sizes."""
    try:
        spec = ne_flex.check(q, k, v, None, False, False)
        sizes = {"B": q.shape[0], "L": q.shape[2], "S": k.shape[2]}
        st, captured = ne_flex.trace(spec, None, mask, sizes)
        kern = st.kernel_at(sizes)
        prog = kern.input_program
        bound = check_inputs(prog, (q, k, v, *captured.values()), {}, "cuda", symbolic=True)
        la = kern._dispatch.launcher(sizes_of(prog, bound)) if kern._dispatch else kern._launcher
        if not la.ks.summaries:
            return 0.0
        return do_bench(lambda: build_summaries(la.ks.summaries, bound, la.consts),
                        return_mode="median")
    except Exception as e:  # noqa: BLE001 - a measurement, never a crash of the table
        print(f"  pre-pass not measured: {e}", file=sys.stderr)
        return None


def run_one(name: str, S: int, dtype: torch.dtype, flex) -> dict:
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
    if row["ms_prepass"] is not None:
        row["prepass_share"] = row["ms_prepass"] / row["ms_ours"]
    return row


def write(rows: list[dict]) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    (RESULTS / "doc_mask.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# Data-derived block sparsity ({meta['device']}, torch {meta['torch']}, H={H}, D={D})",
             "", "TFLOP/s on visible pairs.  ours = ne.flex_attention per call (block summaries "
             "rebuilt each call); prebuilt / per-call = torch flex_attention (compiled) with a "
             "BlockMask built once / per call.", "",
             "| case | S | dtype | density | ours TF/s | prebuilt TF/s | per-call TF/s | x prebuilt "
             "| x per-call | pre-pass % | max diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = f"{100 * r['prepass_share']:.2f}" if r.get("prepass_share") is not None else "n/a"
        lines.append(f"| {r['case']} | {r['S']} | {r['dtype']} | {r['density']:.3f} | "
                     f"{r['tflops_ours']:.0f} | {r['tflops_flex_prebuilt']:.0f} | "
                     f"{r['tflops_flex_percall']:.1f} | {r['speedup_vs_prebuilt']:.2f} | "
                     f"{r['speedup_vs_percall']:.1f} | {share} | {r['max_abs_diff_vs_flex']:.1e} |")
    (RESULTS / "doc_mask.md").write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="*", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--dtype", nargs="*", default=["float16", "bfloat16"])
    ap.add_argument("--cases", nargs="*",
                    default=["doc1", "doc4", "doc13", "doc64", "jagged", "prefix_lm"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("This benchmark needs a CUDA GPU (torch sees none).")
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for dt in args.dtype:
        for S in args.S:
            for name in args.cases:
                row = run_one(name, S, getattr(torch, dt), flex)
                rows.append(row)
                print(json.dumps(row), flush=True)
                write(rows)


if __name__ == "__main__":
    main()

"""Issue 17's decode half on the GPU: one query per sequence at the cache's end whose mask
reads document ids, ``doc[q + S - 1] == doc[kv]`` (the query sees its own document's keys),
ne.flex_attention against torch's compiled flex_attention (its decode kernel) with the
BlockMask built once and built per call, and SDPA with the mask as a boolean tensor, same
process.  Grouped heads (Hq=64 over Hkv=8, D=128: a 70B-class model's decode step).

Columns (us per call):

* ``graphed``: 20 calls replayed from one CUDA graph, the median of 5 passes with the
  three alternated in each pass (K/V in L2 at S <= 8192: each pass re-reads them);
* ``called``: ``do_bench`` median of plain calls, host included, the median of 3
  alternated passes; Flex per call builds its BlockMask in the call (for one query that
  is O(S), not issue 17's O(S^2));
* ``ours_nomask``: our decode without the mask (every key read): what the mask costs;
* ``prepass_added``: what our summary pre-pass adds to a graphed call, against the
  attention launches alone with their summaries filled beforehand.

    python bench/doc_decode_gpu.py [--S 4096 8192 32768] [--docs 1 13 64] [--dtype float16]
    python bench/doc_decode_gpu.py --batch 8    # 8 sequences, each with its own documents
    python bench/doc_decode_gpu.py --smoke     # CPU: tiny sizes, interpreter, no timing
Writes bench/results/<out>.json and .md (rows as they finish).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import neptune_eq as ne  # noqa: E402  (first: picks the Triton interpreter without a GPU)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

import doc_mask_gpu as dm  # noqa: E402

HQ, HKV, D = 64, 8, 128
RESULTS = Path(__file__).parent / "results"


def decode_mask(doc: torch.Tensor, S: int):
    """The query sees its own document's keys: ids (S,) shared by the batch, or (B, S)
    with each sequence's own documents."""
    if doc.dim() == 1:
        def mask(b, h, q, kv):
            return doc[q + S - 1] == doc[kv]
    else:
        def mask(b, h, q, kv):
            return doc[b, q + S - 1] == doc[b, kv]
    return mask


def sdpa_mask(doc: torch.Tensor, S: int) -> torch.Tensor:
    """The same mask as SDPA's boolean (B or 1, 1, 1, S)."""
    d = doc if doc.dim() == 2 else doc[None]
    return (d[:, S - 1:S] == d)[:, None, None, :]


def batch_ids(S: int, n_docs: int, batch: int, device: str = "cuda") -> torch.Tensor:
    """Sorted random documents: (S,) for one sequence, (batch, S) each its own."""
    if batch == 1:
        return dm.doc_ids(S, n_docs)[0].to(device)
    return torch.stack([dm.doc_ids(S, n_docs, seed=b)[0] for b in range(batch)]).to(device)


def run_one(S: int, n_docs: int, dtype: torch.dtype, flex, passes: int = 5, batch: int = 1) -> dict:
    dm.fresh_start()
    doc = batch_ids(S, n_docs, batch)
    mask = decode_mask(doc, S)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, HKV, S, D, device="cuda", dtype=dtype) for _ in range(2))
    t0 = time.perf_counter()
    ne.flex_attention(q, k, v, mask_mod=mask, enable_gqa=True)  # the cold build
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    nb = None if batch == 1 else batch
    bm = create_block_mask(mask, nb, None, 1, S, device="cuda")

    def sdpa():  # the boolean mask is part of the call: it changes with the documents
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(doc, S), enable_gqa=True)
    runs = {"ours": lambda: ne.flex_attention(q, k, v, mask_mod=mask, enable_gqa=True),
            "flex_prebuilt": lambda: flex(q, k, v, block_mask=bm, enable_gqa=True),
            "sdpa": sdpa,
            # what the mask costs us: the same decode with no mask (every key read)
            "ours_nomask": lambda: ne.flex_attention(q, k, v, enable_gqa=True)}
    ref = sdpa()
    errs = {key: (fn().float() - ref.float()).abs().max().item() for key, fn in runs.items()
            if key != "ours_nomask"}
    visible = int(sdpa_mask(doc, S).sum())
    row = {"S": S, "B": batch, "docs": n_docs, "dtype": str(dtype).replace("torch.", ""),
           "visible_keys": visible,
           "first_call_s": round(first, 2), "max_abs_diff_vs_sdpa": errs}
    if max(errs.values()) > 2e-2:  # a wrong kernel is reported, never timed
        row["error"] = "differs from SDPA"
        return row
    graphed = dm.alternated_graph_ms(runs, passes)
    for key, ts in graphed.items():
        row[f"us_{key}_graphed"] = 1e3 * statistics.median(ts)
    called = {key: [] for key in runs}  # alternated passes: a lone pass moved with the
    for _ in range(3):                  # host's warm-up (77.8 us vs 21 us a row later)
        for key, fn in runs.items():
            called[key].append(1e3 * dm.do_bench(fn, return_mode="median"))
    for key, ts in called.items():
        row[f"us_{key}_called"] = statistics.median(ts)
    row["us_flex_percall_called"] = 1e3 * dm.do_bench(
        lambda: flex(q, k, v, block_mask=create_block_mask(mask, nb, None, 1, S, device="cuda"),
                     enable_gqa=True), warmup=5, rep=50, return_mode="median")
    for peer in ("flex_prebuilt", "sdpa"):
        for how in ("graphed", "called"):
            row[f"x_{peer}_{how}"] = row[f"us_{peer}_{how}"] / row[f"us_ours_{how}"]
    row["x_flex_percall_called"] = row["us_flex_percall_called"] / row["us_ours_called"]
    kern, la, bound = dm.launcher_of(q, k, v, mask, enable_gqa=True)
    row["config"] = str(la.config)
    row["split_k"] = bool(getattr(getattr(la, "ks", None), "split_extent", None))
    row["chooser_timed"] = dm.chooser_timings(kern, bound)
    _, la_nomask, _ = dm.launcher_of(q, k, v, None, enable_gqa=True)
    row["config_nomask"] = str(la_nomask.config)  # (the no-mask column's own choice)
    added = dm.prepass_added(la, bound)
    if added:
        row["us_prepass_added"] = 1e3 * added["ms_prepass_added"]
        row["prepass_added_share"] = added["prepass_added_share"]
    return row


def write(rows: list[dict], out: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    (RESULTS / f"{out}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")

    def f(r, key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "n/a"
    lines = [f"# Document-mask decode ({meta['device']}, torch {meta['torch']}, Hq={HQ}, "
             f"Hkv={HKV}, D={D}, one query at the cache's end)", "",
             "x peer = peer's time / ours (above 1: ours faster).  graphed: 20 calls per CUDA "
             "graph, median of 5 alternated passes; called: do_bench median, host included.", "",
             "| S | B | docs | dtype | visible keys | ours graphed us | ours no mask graphed us "
             "| x Flex prebuilt graphed "
             "| x SDPA graphed | ours called us | x Flex prebuilt called | x Flex per call called "
             "| x SDPA called | pre-pass added us (share) | tiles |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['S']} | {r.get('B', 1)} | {r['docs']} | {r['dtype']} | "
                         f"{r['visible_keys']} | {r['error']}: {r['max_abs_diff_vs_sdpa']} ||||||||||")
            continue
        share = (f"{r['us_prepass_added']:.2f} ({100 * r['prepass_added_share']:.1f}%)"
                 if r.get("us_prepass_added") is not None else "n/a")
        lines.append(
            f"| {r['S']} | {r.get('B', 1)} | {r['docs']} | {r['dtype']} | {r['visible_keys']} | "
            f"{f(r, 'us_ours_graphed', '.2f')} | {f(r, 'us_ours_nomask_graphed', '.2f')} | "
            f"{f(r, 'x_flex_prebuilt_graphed', '.2f')} | "
            f"{f(r, 'x_sdpa_graphed', '.2f')} | {f(r, 'us_ours_called', '.2f')} | "
            f"{f(r, 'x_flex_prebuilt_called', '.2f')} | {f(r, 'x_flex_percall_called', '.2f')} | "
            f"{f(r, 'x_sdpa_called', '.2f')} | {share} | {r.get('config', 'n/a')} |")
    (RESULTS / f"{out}.md").write_text("\n".join(lines) + "\n")


def smoke() -> None:
    """CPU: the bench's own path at S=48 (documents of 1, 3 and 7; one sequence, and two
    with their own documents) through the interpreter, against eager SDPA with the
    boolean mask."""
    global HQ, HKV, D
    HQ, HKV, D = 4, 2, 16
    S = 48
    for n, batch in ((1, 1), (3, 1), (7, 1), (3, 2)):
        dev, dm.DEV = dm.DEV, "cpu"  # (doc_mask_gpu's ids land on its device)
        try:
            doc = batch_ids(S, n, batch, "cpu")
        finally:
            dm.DEV = dev
        g = torch.Generator().manual_seed(n)
        q = torch.randn(batch, HQ, 1, D, generator=g)
        k, v = (torch.randn(batch, HKV, S, D, generator=g) for _ in range(2))
        out = ne.flex_attention(q, k, v, mask_mod=decode_mask(doc, S), enable_gqa=True)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(doc, S), enable_gqa=True)
        err = (out - ref).abs().max().item()
        print(json.dumps({"docs": n, "B": batch, "S": S, "max_abs_diff_vs_sdpa": err}), flush=True)
        if not err < 1e-4:
            raise SystemExit(f"{n} documents, batch {batch}: differs from SDPA by {err}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="*", default=[4096, 8192, 32768])
    ap.add_argument("--docs", type=int, nargs="*", default=[1, 13, 64])
    ap.add_argument("--dtype", nargs="*", default=["float16"])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences, each with its own documents (ids (B, S), the mask "
                         "doc[b, q + S - 1] == doc[b, kv]); 1: ids (S,)")
    ap.add_argument("--out", default="doc_decode")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        return smoke()
    if not torch.cuda.is_available():
        raise SystemExit("This benchmark needs a CUDA GPU (torch sees none); --smoke runs a "
                         "tiny CPU check of it.")
    rows = []
    for dt in a.dtype:
        if not isinstance(getattr(torch, dt, None), torch.dtype):
            raise SystemExit(f"unknown dtype {dt!r}; expected float16 / bfloat16")
        for S in a.S:
            torch._dynamo.reset()  # each S is a new mask closure: a recompile per row
            torch._dynamo.config.recompile_limit = 64
            flex = torch.compile(flex_attention, dynamic=False)
            for n in a.docs:
                rows.append(run_one(S, n, getattr(torch, dt), flex, a.passes, a.batch))
                print(json.dumps(rows[-1]), flush=True)
                write(rows, a.out)


if __name__ == "__main__":
    main()

"""Indices read from data on the GPU (``lowering/data_indices.py``): torch's rule.

    python bench/data_index_gpu.py [--S 4096] [--out DIR]

1. ``ne.flex_attention`` with a jagged mask ``offsets[doc[q]]`` whose ids follow torch's
   rule -- padding id -1 (``offsets[-1]`` is the packed length: the row sees nothing) and
   ids counting back from the end -- against torch's own reading of the mask (fp32).
2. An id past the table, in a child process (a device assert ends its CUDA context): the
   call must fail with the pre-pass's assert, never return.
3. The pre-pass's device time in such calls (it asserts the ids now), from the profiler.
4. ``--score``: a score_mod reading ``bias[doc[q]]`` -- no mask, nothing to summarise, so
   the pre-pass is a guard that only asserts the ids (``summary_kernel``): right against
   torch with padding -1 and ids from the end; an id past the table fails in a child; and
   what the guard costs a call: 20 calls replayed from a CUDA graph against the attention
   kernel alone, PDL on and off, medians of 5 alternated passes.
5. ``--per-sample``: two samples, each with its own ids, read ``bias[doc[b, q]]`` (the
   guard reads all of the 2-D ``doc``, session 42): right against torch, and an id past
   the table in the second sample fails in a child.
6. ``--shifted``: ``bias[doc[q + 1]]`` with doc one longer than the rows (the guard reads
   ``doc[1 : 1 + L]``, L a runtime size; session 42): right against torch, a stray id at
   ``doc[0]`` (never read) is no error, one at ``doc[S // 3]`` stops the call in a child.
Writes data_index_gpu.json (``_score``, ``_per_sample``, ``_shifted``) under --out.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import neptune_eq as ne  # noqa: E402

H, D = 16, 128


def case(S: int, n_docs: int = 13, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(S - 1, generator=g)[:n_docs - 1] + 1).values
    offs = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([S])])
    ids = torch.repeat_interleave(torch.arange(n_docs), offs.diff())
    ids = torch.where(torch.rand(S, generator=g) < 0.1, ids - (n_docs + 1), ids)  # from the end
    ids[-S // 8:] = -1  # padding
    return ids.to(torch.int32).cuda(), offs.to(torch.int32).cuda()


def reference(q, k, v, visible):
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return p @ v.float()


def offset_bias(doc, offsets):
    """Item 4's score_mod: the score plus the query's document offset, read at its id."""
    def biased(score, b, h, q_idx, kv_idx):
        return score + offsets[doc[q_idx]].float() * 1e-3
    return biased


def per_sample_case(S: int):
    """Two samples' ids (13 and 4 documents), a [2, S] tensor, and a bias table of 14
    entries (ids run from -14, counted from the end)."""
    docs = torch.stack([case(S, 13, 0)[0], case(S, 4, 1)[0]])
    return docs, torch.randn(14, dtype=torch.float32)


def per_sample_bias(doc, bias):
    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[doc[b, q_idx]]
    return biased


def shifted_case(S: int):
    """Ids one longer than the rows, read at ``q + 1``, and a bias table of 14 entries."""
    doc = torch.cat([case(S, 13, 0)[0], torch.zeros(1, dtype=torch.int32, device="cuda")])
    bias = torch.randn(14, dtype=torch.float32, device="cuda")

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[doc[q_idx + 1]]
    return doc, bias, biased


def child(S: int, score: bool = False, per_sample: bool = False, shifted: bool = False) -> None:
    """Called with an id past the table: prints what happened (the parent reads it)."""
    q, k, v = (torch.randn(2 if per_sample else 1, H, S, D, device="cuda", dtype=torch.float16)
               for _ in range(3))
    if shifted:
        doc, bias, biased = shifted_case(S)
        doc[S // 3] = bias.numel()  # read (at q = S // 3 - 1): one past the table
        mods = dict(score_mod=biased)
    elif per_sample:
        doc, bias = per_sample_case(S)
        doc[1, S // 3] = bias.numel()  # the second sample's ids: one past the table
        mods = dict(score_mod=per_sample_bias(doc.cuda(), bias.cuda()))
    else:
        doc, offsets = case(S)
        doc[S // 3] = offsets.numel()  # one past the last entry

        def jagged(b, h, q_idx, kv_idx):
            return (kv_idx >= offsets[doc[q_idx]]) & (q_idx >= kv_idx)
        mods = dict(score_mod=offset_bias(doc, offsets)) if score else dict(mask_mod=jagged)
    try:
        ne.flex_attention(q, k, v, **mods)
        torch.cuda.synchronize()
        print("RETURNED")
    except Exception as e:  # noqa: BLE001 - reported
        print(f"RAISED {type(e).__name__}: {str(e)[:300]}")


def past_the_table(S: int, score: bool, per_sample: bool = False, shifted: bool = False) -> dict:
    """The call with an id past the table, in a child process: raised, with our message."""
    res = subprocess.run([sys.executable, __file__, "--child", "--S", str(S)]
                         + (["--score"] if score else [])
                         + (["--per-sample"] if per_sample else [])
                         + (["--shifted"] if shifted else []),
                         capture_output=True, text=True, timeout=300)
    row = {"past_the_table": (res.stdout.strip().splitlines() or ["(no output)"])[-1],
           "past_the_table_assert_message": "neptune_eq: an id in" in res.stderr}
    row["past_the_table_ok"] = (row["past_the_table"].startswith("RAISED")
                                and row["past_the_table_assert_message"])
    return row


def score_guard(S: int) -> dict:
    """Item 4: ``offsets[doc[q]]`` read in a score_mod, guarded by a pre-pass that only
    asserts."""
    import statistics

    import doc_mask_gpu as dm
    from prepass_pdl import twin
    doc, offsets = case(S)
    bias = offsets.float() * 1e-3
    biased = offset_bias(doc, offsets)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    got = ne.flex_attention(q, k, v, score_mod=biased)
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D) + bias[doc.long()][:, None]
    want = torch.softmax(s, -1) @ v.float()  # torch wraps the negative ids
    row = {"case": "score_mod offsets[doc[q]]", "S": S,
           "max_err_vs_torch": (got.float() - want).abs().max().item()}
    _, la, bound = dm.launcher_of(q, k, v, None, score=biased)
    pre = la._pre.pre if la._pre is not None else None
    row["guard_only_prepass"] = bool(pre and not pre.specs and pre.guards)
    row["config"] = str(la.config)
    runs = {}
    for pdl in (False, True):
        t = twin(la, pdl)
        tensors = {n: (x.clone() if n in la.program.outputs else x) for n, x in bound.items()}
        t(tensors)
        runs["pdl_on" if pdl else "pdl_off"] = (lambda t=t, x=tensors: t(x))
        if not pdl:
            runs["main_only"] = dm.main_only(t, tensors)
    torch.cuda.synchronize()
    times = dm.alternated_graph_ms(runs, 5)
    for key, ts in times.items():
        row[f"us_graphed_{key}"] = statistics.median(ts) * 1e3
    for key in ("pdl_off", "pdl_on"):
        added = row[f"us_graphed_{key}"] - row["us_graphed_main_only"]
        row[f"us_guard_added_{key}"] = added
        row[f"guard_share_{key}"] = added / row[f"us_graphed_{key}"]
    row.update(past_the_table(S, score=True))
    row["ok"] = (row["max_err_vs_torch"] < 5e-3 and row["guard_only_prepass"]
                 and row["past_the_table_ok"])
    return row


def per_sample_guard(S: int) -> dict:
    """Item 5: ``bias[doc[b, q]]``, per-sample ids guarded over the whole 2-D tensor."""
    doc, bias = per_sample_case(S)
    doc, bias = doc.cuda(), bias.cuda()
    q, k, v = (torch.randn(2, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    got = ne.flex_attention(q, k, v, score_mod=per_sample_bias(doc, bias))
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D) \
        + bias[doc.long()][:, None, :, None]
    want = torch.softmax(s, -1) @ v.float()
    row = {"case": "score_mod bias[doc[b, q]]", "S": S, "B": 2,
           "max_err_vs_torch": (got.float() - want).abs().max().item()}
    row.update(past_the_table(S, score=True, per_sample=True))
    row["ok"] = row["max_err_vs_torch"] < 5e-3 and row["past_the_table_ok"]
    return row


def shifted_guard(S: int) -> dict:
    """Item 6: ``bias[doc[q + 1]]``, guarded over ``doc[1 : 1 + L]``."""
    doc, bias, biased = shifted_case(S)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    got = ne.flex_attention(q, k, v, score_mod=biased)
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D) + bias[doc[1:].long()][:, None]
    want = torch.softmax(s, -1) @ v.float()
    row = {"case": "score_mod bias[doc[q + 1]]", "S": S,
           "max_err_vs_torch": (got.float() - want).abs().max().item()}
    doc[0] = 1000  # never read: not an error
    ne.flex_attention(q, k, v, score_mod=biased)
    torch.cuda.synchronize()
    row["unread_stray_ok"] = True
    row.update(past_the_table(S, score=True, shifted=True))
    row["ok"] = row["max_err_vs_torch"] < 5e-3 and row["past_the_table_ok"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--score", action="store_true",
                    help="the score_mod case (item 4) instead of the jagged mask")
    ap.add_argument("--per-sample", action="store_true",
                    help="per-sample ids bias[doc[b, q]] (item 5)")
    ap.add_argument("--shifted", action="store_true", help="ids read at q + 1 (item 6)")
    a = ap.parse_args()
    if a.child:
        return child(a.S, a.score, a.per_sample, a.shifted)
    S = a.S
    if a.score or a.per_sample or a.shifted:
        row = (shifted_guard(S) if a.shifted else per_sample_guard(S) if a.per_sample
               else score_guard(S))
        print(json.dumps(row), flush=True)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        name = ("data_index_gpu_shifted.json" if a.shifted else "data_index_gpu_per_sample.json"
                if a.per_sample else "data_index_gpu_score.json")
        (out / name).write_text(json.dumps(row, indent=1) + "\n")
        return
    doc, offsets = case(S)

    def jagged(b, h, q_idx, kv_idx):
        return (kv_idx >= offsets[doc[q_idx]]) & (q_idx >= kv_idx)
    row = {"S": S, "H": H, "D": D, "device": torch.cuda.get_device_name()}
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    got = ne.flex_attention(q, k, v, mask_mod=jagged)
    i, j = torch.arange(S, device="cuda")[:, None], torch.arange(S, device="cuda")[None, :]
    want = reference(q, k, v, (j >= offsets[doc.long()][i]) & (j <= i))  # torch wraps
    row["max_err_vs_torch"] = (got.float() - want).abs().max().item()
    row["padding_rows_zero"] = bool((got[:, :, -S // 8:] == 0).all())
    row["ok"] = row["max_err_vs_torch"] < 5e-3 and row["padding_rows_zero"]
    from host_profile import kernel_times
    times = kernel_times(lambda: ne.flex_attention(q, k, v, mask_mod=jagged), 20)
    from doc_mask_gpu import PREPASS_NAMES
    row["us_prepass"] = sum(us for name, us, _ in times if name.endswith(PREPASS_NAMES))
    row["us_main"] = sum(us for name, us, _ in times
                         if name.startswith("neptune_") and not name.endswith(PREPASS_NAMES))
    row.update(past_the_table(S, score=False))
    print(json.dumps(row), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_index_gpu.json").write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Probe (issue 17): a prefill data mask counting its key ids itself, with no pre-pass.

A document mask's kernel waits for the summary pre-pass (per-key-block [min, max] of the
ids) before it can bound its keys.  In a graphed call that pre-pass is one more kernel in
the stream (about 1 us in any case: a pre-pass that only checks ids, jagged offsets, adds
1.05 us) plus the wait -- 1.5 us, 3.9% of a 38 us call of 64 documents at 4096 keys.  The
decode's partials count the ids themselves (``block_skip.inline_summaries``: one row per
program); this runs ``bench/doc_mask_gpu.py`` with that form forced on prefill plans too, so
every row block counts all S key ids (O(S) a program, O(S^2 / B_i) a call) and no pre-pass
runs.  Compare its rows with a plain ``doc_mask_gpu.py`` run of the same cases.

    python bench/probe/prefill_inline_counts.py --S 4096 8192 --dtype float16 --cases doc64 doc13 --out inline_probe
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (neptune_eq first: it picks the Triton interpreter without a GPU)
from neptune_eq.lowering import block_ranges, block_skip, split_share  # noqa: E402

_decode_only = block_skip.inline_summaries


def forced(plan) -> bool:
    """``inline_summaries`` for a prefill plan too: every key-side read indexed by the key."""
    if plan.program.extents.get(plan.block_axis) == 1:
        return _decode_only(plan)
    roles, grid = block_skip._roles(plan, "@j"), set(plan.grid_axes)
    loads = [n for ps in plan.passes for a in block_skip.data_atoms(plan, ps) for n in a.walk()
             if n.op == "load" and not block_skip.row_read(plan, n)]
    return bool(loads) and all((hit := block_skip.summary_dim(n, roles, grid)) is not None
                               and hit[1] != "row" for n in loads)


block_skip.inline_summaries = forced
block_ranges.inline_summaries = forced
split_share.inline_summaries = forced

if __name__ == "__main__":
    import doc_mask_gpu
    doc_mask_gpu.main()

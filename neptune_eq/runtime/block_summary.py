"""Per-block [min, max] summaries of the captured tensors a mask reads.

A kernel whose mask reads a captured tensor with a tile-varying index (``doc[kv]``)
takes, besides the tensor itself, a summary of it along that dimension: block ``n``
holds ``[min, max]`` over elements ``n*B .. n*B + B - 1``, where ``B`` is the tile the
kernel runs with (its row block for a query index, its key block for a key index).
Reads that are not a bare tile index (``offsets[doc[q]]``) use the tensor's global
``[min, max]``.  ``lowering.block_predicate`` turns those bounds into a per-block
skip / no-mask decision.

The summaries depend on the data, so they are rebuilt on every call: one
``torch.aminmax`` per summary, O(S) work (a tensor of S ids is read once per summary).
"""
from __future__ import annotations



def summarize(x, dim: int | None, block: int):
    """``[min, max]`` of ``x`` per block of ``block`` elements along ``dim`` (a trailing
    axis of 2; the summarised dim becomes the block count), or ``[min, max, monotone]`` of
    all of ``x`` (shape (3,)) when ``dim`` is None.  Booleans are summarised as int32 0/1."""
    import torch
    if x.dtype == torch.bool:
        x = x.to(torch.int32)
    if dim is None:  # [min, max, 1 if a 1-D tensor is nondecreasing (offsets, sorted ids)]
        lo, hi = torch.aminmax(x)
        mono = bool((x[1:] >= x[:-1]).all()) if x.ndim == 1 else False
        return torch.stack([lo, hi, torch.tensor(int(mono), dtype=x.dtype, device=x.device)])
    n = x.shape[dim]
    nb = -(-n // block)
    xm = x.movedim(dim, -1)
    pad = nb * block - n
    if pad:  # repeat the last element: padding must not widen the last block's range
        xm = torch.cat([xm, xm[..., -1:].expand(*xm.shape[:-1], pad)], dim=-1)
    lo, hi = torch.aminmax(xm.reshape(*xm.shape[:-1], nb, block), dim=-1)
    return torch.stack([lo, hi], dim=-1).movedim(-2, dim).contiguous()


def build_summaries(specs, tensors: dict, consts: dict) -> dict:
    """Every summary a kernel takes, from its inputs and its block sizes."""
    return {s.name: summarize(tensors[s.tensor], s.dim, consts[s.block] if s.block else 1)
            for s in specs}

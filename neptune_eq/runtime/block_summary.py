"""Per-block [min, max] summaries of the captured tensors a mask reads, rebuilt per call.

A kernel whose mask reads a captured tensor with a tile-varying index (``doc[kv]``)
takes, besides the tensor itself, a summary of it along that dimension: block ``n``
holds ``[min, max]`` over elements ``n*B .. n*B + B - 1``, where ``B`` is the tile the
kernel runs with (its row block for a query index, its key block for a key index).
Reads that are not a bare tile index (``offsets[doc[q]]``) use the tensor's global
``[min, max, nondecreasing]``.  ``lowering.block_predicate`` turns those bounds into a
per-block skip / no-mask decision.

The summaries depend on the data, so they are rebuilt on every call, by ONE launch of
the kernel's generated pre-pass (``lowering.summary_kernel``): a few microseconds of GPU
time and no host synchronisation (the nondecreasing flag is computed on the device and
read by the main kernel, never by the host).  ``summarize`` is the same computation in
torch: the reference the pre-pass is tested against, bit for bit.
"""
from __future__ import annotations

from ..lowering.dependent_launch import PDL_FLAG
from ..lowering.summary_kernel import NUM_WARPS
from .launch import FastLaunch, dependent_options, written_outputs


def summarize(x, dim: int | None, block: int):
    """``[min, max]`` of ``x`` per block of ``block`` elements along ``dim`` (a trailing
    axis of 2; the summarised dim becomes the block count), or ``[min, max, monotone]`` of
    all of ``x`` (shape (3,)) when ``dim`` is None.  Booleans are summarised as int32 0/1.
    The torch reference of the pre-pass (it synchronises: tests only)."""
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
    """Every summary a kernel takes, by the torch reference (``summarize``)."""
    return {s.name: summarize(tensors[s.tensor], s.dim, consts[s.block] if s.block else 1)
            for s in specs}


class SummaryPrepass:
    """The per-call driver of a kernel's pre-pass: allocates the summaries and gives the
    one launch that fills them.  What depends only on the captured tensors' shapes (the
    grid, the summaries' shapes and strides, where each summary's programs start) is
    worked out once per shape."""

    def __init__(self, prepass, consts: dict, fn, options: dict | None = None,
                 pdl: bool = False, sizes: dict | None = None, first: bool = False):
        self.pre, self.fn = prepass, fn
        # the runtime sizes a guard's box reads (``Prepass.sizes``): fixed per launcher
        self.sizes = {n: (sizes or {})[n] for n in getattr(prepass, "sizes", ())}
        blocks = sorted({s.block for s in prepass.specs if s.block})
        groups = prepass.groups(consts)
        self.consts = {b: consts[b] for b in blocks}
        self.consts.update({f"G_{k}": g for k, g in enumerate(groups) if g})
        # its dependent launches (``dependent_launch``): it releases the kernel after it
        # (``pdl``) and, as the call's first launch, is itself launched dependent on the
        # kernel before it (``first``); it waits for that one first thing either way
        self.consts[PDL_FLAG] = pdl or first
        self.block_consts = consts
        self.options = dependent_options(options or {"num_warps": NUM_WARPS, "num_stages": 1},
                                         first)
        if prepass.checks:  # its device_assert of ids in range (summary_kernel): asserts on,
            # Triton's overflow checks of every integer op, which debug also turns on, off
            self.options = {**self.options, "debug": True, "sanitize_overflow": False}
        self._plans: dict[tuple, tuple] = {}

    def _plan(self, shapes: tuple, dtypes: tuple) -> tuple:
        import torch
        by_name = dict(zip((t for t, _ in self.pre.tensors), shapes))
        for (t, rank), shape in zip(self.pre.tensors, shapes):
            if len(shape) != rank:
                raise ValueError(f"Expected the captured tensor {t!r} with {rank} dims, got "
                                 f"shape {tuple(shape)}.")
            if any(n == 0 for n in shape):
                raise ValueError(f"The captured tensor {t!r} the mask reads is empty (shape "
                                 f"{tuple(shape)}); a mask cannot index an empty tensor.")
        dt = dict(zip((t for t, _ in self.pre.tensors), dtypes))
        outs, out_strides = [], []
        for s in self.pre.specs:
            dtype = torch.int32 if dt[s.tensor] == torch.bool else dt[s.tensor]
            if s.dim is None:
                shape = (3,)
            else:
                shape = list(by_name[s.tensor])
                shape[s.dim] = -(-shape[s.dim] // self.block_consts[s.block])
                shape = (*shape, 2)
            outs.append((s.name, shape, dtype))
            strides, acc = [], 1
            for n in reversed(shape):  # contiguous
                strides.append(acc)
                acc *= n
            out_strides += reversed(strides)
        counts = self.pre.programs(by_name, self.block_consts, self.sizes)
        starts, at = [], 0
        for c in counts[:-1]:
            at += c
            starts.append(at)
        grid = (at + counts[-1],)
        return outs, out_strides + starts + list(self.sizes.values()), \
            FastLaunch(self.fn, grid, self.consts, self.options)

    def plan_for(self, tensors: dict) -> tuple[list, tuple]:
        """(the captured tensors the pre-pass reads, its plan for their shapes and dtypes:
        summaries (name, shape, dtype), trailing integer arguments, the launch)."""
        xs = [tensors[t] for t, _ in self.pre.tensors]
        key = tuple((x.shape, x.dtype) for x in xs)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(tuple(x.shape for x in xs),
                                                 tuple(x.dtype for x in xs))
        return xs, plan

    def prepare(self, tensors: dict) -> tuple[dict, FastLaunch, list, list]:
        """(summaries by name, the launch, its arguments, its integer arguments)."""
        xs, (outs, tail, launch) = self.plan_for(tensors)
        # (the pre-pass writes every block's summary: no deterministic-mode fill first)
        made = dict(zip([name for name, _, _ in outs],
                        written_outputs([(shape, dtype) for _, shape, dtype in outs], xs[0].device)))
        ints = [v for x in xs for v in (*x.shape, *x.stride())] + tail
        return made, launch, xs + list(made.values()), ints

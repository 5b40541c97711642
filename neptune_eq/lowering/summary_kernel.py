"""The summary pre-pass: every per-block [min, max] summary a kernel reads, in ONE launch.

A kernel whose mask reads captured tensors (``doc[i] == doc[j]``) takes summaries of them
(``block_predicate.SummarySpec``): per block of ``B_i`` / ``B_L`` elements along one
dimension a ``[min, max]`` pair, or ``[min, max, nondecreasing]`` of the whole tensor.
They depend on the data, so they are rebuilt on every call; separate ``torch`` reductions
cost one launch each (three for a causal document mask), more than the work itself.

This module writes one ``@triton.jit`` kernel (``<name>_summaries``) that computes all of
them over a flat 1-D grid.  Programs ``[P_k, P_{k+1})`` belong to summary ``k``:

* a per-block summary gives each program ``G_k`` consecutive blocks of one "row" (one
  index of every other dimension), read as a ``[G_k, B]`` tile -- ``G_k = TILE // B``, so
  a program reads about ``TILE`` elements however small the blocks are;
* a global summary is one program that walks the flattened tensor in chunks of ``CHUNK``
  (the tensors it is used for -- offsets tables, per-sample prefixes -- are short);
* a guard summarises nothing: its programs read ids that no summary reads (``bias[doc[q]]``
  in a score_mod, with no mask to summarise; ``bias[doc[b, q]]``; ``doc[q + 1]``) ``TILE``
  entries each, over the box of entries the kernel reads (``data_indices.IdCheck``), and
  assert them in range on the device -- the one check such ids get on the GPU.

Sizes and strides are runtime arguments, so one compiled pre-pass serves every size (the
symbolic-size kernels).  The values are those of ``torch.aminmax`` (the reference,
``runtime.block_summary.summarize``): a short last block is padded with its own first
element (never widening the range), a float block holding a NaN summarises to NaN, and
booleans are summarised as int32 0/1.
"""
from __future__ import annotations

import re

from dataclasses import dataclass

from .block_predicate import SummarySpec
from .codegen import _TL_DTYPE
from .dependent_launch import PDL_FLAG, wait_then_release
from ..sizes import names_in, value

TILE = 2048    # elements one per-block program reads (G_k blocks of B)
# Elements per step of a global summary's walk, and the pre-pass's warps.  A walk is one
# program, so it is the pre-pass's critical path, and its time is the instructions each
# thread issues per step (a masked-off element costs them too).  H200, ``python
# bench/prepass_ab.py`` (same process): a walk over 8192 / 32768 document ids took
# 3.14 / 9.90 us at 4096 a step on 4 warps, 2.37 / 6.65 at 8192 on 32 warps (8 elements
# a thread); a jagged mask's pre-pass (a 14-entry walk over its offsets) 2.03 -> 2.00 us.
# Loading the next step before reducing this one measured slower (session 36).  Sorted ids
# searched at the key index need no walk now (``block_skip._count_failing`` checks their
# order); walks remain for tables read at a computed index (``offsets[doc[i]]``).
CHUNK = 8192
NUM_WARPS = 32


@dataclass(frozen=True)
class Prepass:
    """How to launch the pre-pass: ``tensors`` are the captured tensors it reads, each
    ``(name, rank)``, in parameter order; ``specs`` the summaries it writes, in parameter
    order (the ``SummarySpec`` list of the main kernel)."""
    kernel: str
    tensors: tuple
    specs: tuple
    checks: bool = False   # it asserts ids in range on the device: compile with asserts on
    guards: tuple = ()     # IdCheck: ids no summary reads, asserted in [-n, n) over their box
    sizes: tuple = ()      # runtime sizes a guard's box counts read (``n_<name>`` arguments)

    def groups(self, consts: dict) -> list[int]:
        """``G_k`` of each summary (0 for a global one) at the launch's block sizes."""
        return [0 if s.dim is None else max(1, TILE // consts[s.block]) for s in self.specs]

    def programs(self, shapes: dict, consts: dict, sizes: dict | None = None) -> list[int]:
        """Programs of each summary at the given tensor shapes and block sizes (and the
        values of the runtime sizes in ``self.sizes``)."""
        out = []
        for s, g in zip(self.specs, self.groups(consts)):
            if s.dim is None:
                out.append(1)
                continue
            shape = shapes[s.tensor]
            nb = -(-shape[s.dim] // consts[s.block])
            rows = 1
            for k, n in enumerate(shape):
                if k != s.dim:
                    rows *= n
            out.append(rows * -(-nb // g))
        for g in self.guards:
            count = 1
            for size, b in zip(shapes[g.tensor], g.box):
                count *= size if b is None else value(b[1], sizes)
            out.append(-(-count // TILE))
        return out


def prepass_source(name: str, specs: list[SummarySpec], dtype_of, rank_of,
                   ids: list | None = None) -> tuple[str, Prepass]:
    """Source text of the pre-pass kernel (to append to the kernel's module, which
    imports ``triton`` and ``tl``) and its launch description.  ``dtype_of`` / ``rank_of``:
    a captured tensor's dtype name and number of dimensions.  ``ids``: the
    ``data_indices.IdCheck`` of the kernel, entries that index a table of n entries.
    Each summary of a tensor read whole asserts -n <= entry < n, torch's rule, on the
    device -- an id past the table is an error of the call, not a read -- and ids no
    summary covers get a guard that asserts only.  ``specs`` may then be empty: the
    pre-pass is the call's check of its ids."""
    read = {s.tensor for s in specs}
    whole = {c.tensor: (c.n, c.table) for c in ids or () if c.whole and c.tensor in read}
    guards = tuple(c for c in ids or () if not (c.whole and c.tensor in read))
    if not specs and not guards:
        raise ValueError("A summary pre-pass needs at least one summary or guarded id tensor.")
    kernel = f"{name}_summaries" if specs else f"{name}_check_ids"  # (as profiles name it)
    tensors = tuple(dict.fromkeys([(s.tensor, rank_of(s.tensor)) for s in specs]
                                  + [(g.tensor, rank_of(g.tensor)) for g in guards]))
    blocks = sorted({s.block for s in specs if s.block})
    ptrs = [f"x_{t}_ptr" for t, _ in tensors] + [f"{s.name}_ptr" for s in specs]
    ints = [f"x_{t}_{w}{k}" for t, r in tensors for w in ("n", "s") for k in range(r)]
    ints += [f"{s.name}_s{k}" for s in specs for k in range(_out_rank(s, rank_of))]
    ints += [f"P_{k}" for k in range(1, len(specs) + len(guards))]
    sizes = tuple(sorted({n for g in guards for b in g.box if b is not None
                          for n in names_in(b[1])}))
    ints += [f"n_{n}" for n in sizes]
    consts = [f"{b}: tl.constexpr" for b in blocks]
    consts += [f"G_{k}: tl.constexpr" for k, s in enumerate(specs) if s.dim is not None]
    consts += [f"{PDL_FLAG}: tl.constexpr"]
    floats = any(not _is_int(dtype_of(s.tensor)) for s in specs)
    lines = ["", ""]
    if floats:  # min / max that return NaN when either side is NaN, as torch.aminmax does
        lines += ["@triton.jit", "def _nan_min(a, b):",
                  "    return tl.where(a != a, a, tl.where(b != b, b, tl.minimum(a, b)))",
                  "", "", "@triton.jit", "def _nan_max(a, b):",
                  "    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))", "", ""]
    lines += ["@triton.jit", f"def {kernel}(", *[f"    {p}," for p in ptrs + ints + consts], "):",
              "    pid = tl.program_id(0)",
              # a call's first launch: it waits for the kernel before it in the stream,
              # then lets the attention kernel launch (that waits to read the summaries)
              *wait_then_release()]
    sections = len(specs) + len(guards)
    for k in range(sections):
        if sections == 1:
            head, ind = [], "    "
        elif k == 0:
            head, ind = ["    if pid < P_1:"], "        "
        elif k < sections - 1:
            head, ind = [f"    elif pid < P_{k + 1}:"], "        "
        else:
            head, ind = ["    else:"], "        "
        if k >= len(specs):  # a guard: assert the ids, write nothing
            g = guards[k - len(specs)]
            body = _guard_body(k, g)
            what = (f"guard: every entry of {g.tensor}{_box_text(g.box)} indexes {g.table} "
                    f"inside [-{g.n}, {g.n})")
        else:
            s = specs[k]
            dt = dtype_of(s.tensor)
            body = (_block_body(k, s, rank_of(s.tensor), dt) if s.dim is not None
                    else _global_body(s, rank_of(s.tensor), dt))
            if s.tensor in whole:
                n, table = whole[s.tensor]
                ok = "((lo >= -{0}) & (hi < {0})) | (blk >= nb)" if s.dim is not None \
                    else "(lo >= -{0}) & (hi < {0})"
                body.append(f"tl.device_assert({ok.format(n)}, {_message(s.tensor, n, table)})")
            what = f"{s.name}: {_describe(s)}"
        if sections > 1:
            body = _own_names(body, k)
        lines += head + [f"{ind}# {what}"] + [ind + ln for ln in body]
    checks = bool(guards) or bool(whole)
    return "\n".join(lines) + "\n", Prepass(kernel, tensors, tuple(specs), checks, guards, sizes)


def _message(t: str, n: int, table: str) -> str:
    return f"\"neptune_eq: an id in {t} indexes {table} ({n} entries) outside [-{n}, {n})\""


def _guard_body(k: int, g) -> list[str]:
    """``TILE`` entries of the ids ``g.tensor`` per program, asserted in range: the box
    ``g.box`` flattened, the last dimension fastest (a whole dimension's size is the
    runtime ``x_<t>_n<d>``; a boxed one is read from ``start``)."""
    t, n = g.tensor, g.n
    lines = [f"p = pid{f' - P_{k}' if k else ''}",
             f"pos = p * {TILE} + tl.arange(0, {TILE})"]
    if g.box == (None,):  # a 1-D tensor read whole: the position is the address
        lines += [f"count = x_{t}_n0", f"addr = pos * x_{t}_s0"]
    elif not g.box:  # a 0-d tensor (``bias[h][which[()], q]``): its one entry
        lines += ["count = 1", "addr = pos * 0"]
    else:
        extents = [f"x_{t}_n{d}" if b is None else str(b[1]) for d, b in enumerate(g.box)]
        lines += [f"count = {' * '.join(extents)}", "rest = pos", "addr = pos * 0"]
        for d in reversed(range(len(g.box))):
            start = "" if g.box[d] is None or not g.box[d][0] else f"{g.box[d][0]} + "
            at = "rest" if d == 0 else f"rest % {extents[d]}"
            lines.append(f"addr += ({start}{at}) * x_{t}_s{d}")
            if d:
                lines.append(f"rest = rest // {extents[d]}")
    return lines + ["ok = pos < count",
                    f"v = tl.load(x_{t}_ptr + addr, mask=ok, other=0)",
                    f"tl.device_assert(((v >= -{n}) & (v < {n})) | (pos >= count), "
                    f"{_message(t, n, g.table)})"]


def _box_text(box: tuple) -> str:
    """``[1:33]`` / ``[:, 0:1]`` -- the entries a guard reads, as a slice (empty if all)."""
    if all(b is None for b in box):
        return ""
    return "[" + ", ".join(":" if b is None else f"{b[0]}:{b[0] + b[1]}" for b in box) + "]"


def _own_names(body: list[str], k: int) -> list[str]:
    """The branch's locals renamed ``name_k``: Triton types a variable assigned in several
    branches of one ``if`` as one type, and the branches differ (a block summary's ``lo``
    is a tile of G blocks, a whole-tensor summary's a scalar): measured on Triton 3.6,
    "Mismatched type for first between then block and else block"."""
    names = set()
    for line in body:
        m = re.match(r"\s*(?:for\s+)?(\w+)\s*(?:=|\+=|\s+in\b)", line)
        if m:
            names.add(m.group(1))
    if not names:
        return body
    pat = re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
    return [pat.sub(lambda m: f"{m.group(1)}_{k}", line) for line in body]


def _out_rank(s: SummarySpec, rank_of) -> int:
    return 1 if s.dim is None else rank_of(s.tensor) + 1


def _is_int(dtype: str) -> bool:
    return dtype in ("int32", "int64", "int16", "int8", "uint8", "bool")


def _describe(s: SummarySpec) -> str:
    if s.dim is None:
        return f"[min, max, nondecreasing] of all of {s.tensor}"
    return f"[min, max] of {s.tensor} per block of {s.block} along dim {s.dim}"


def _value(v: str, dtype: str) -> str:
    return f"{v}.to(tl.int32)" if dtype == "bool" else v  # bool: summarised as int32 0/1


def _reduce(fn: str, v: str, axis: int, dtype: str) -> str:
    if _is_int(dtype):
        return f"tl.{fn}({v}, axis={axis})"
    return f"tl.reduce({v}, {axis}, _nan_{fn})"


def _block_body(k: int, s: SummarySpec, rank: int, dtype: str) -> list[str]:
    """G_k blocks of one row of the tensor per program."""
    t, d, b, out = s.tensor, s.dim, s.block, s.name
    n, st = f"x_{t}_n{d}", f"x_{t}_s{d}"
    lines = [f"p = pid{f' - P_{k}' if k else ''}",
             f"nb = ({n} + {b} - 1) // {b}",
             f"ngrp = (nb + G_{k} - 1) // G_{k}",
             "grp = p % ngrp",
             "rest = p // ngrp",
             "base_in = rest * 0",
             "base_out = rest * 0"]
    for q in reversed(range(rank)):  # the row: every other index, last dim fastest
        if q == d:
            continue
        lines += [f"i{q} = rest % x_{t}_n{q}", f"rest = rest // x_{t}_n{q}",
                  f"base_in += i{q} * x_{t}_s{q}", f"base_out += i{q} * {out}_s{q}"]
    lines += [f"blk = grp * G_{k} + tl.arange(0, G_{k})",
              "has = blk < nb",
              f"pos = blk[:, None] * {b} + tl.arange(0, {b})[None, :]",
              f"ok = pos < {n}",
              # a short last block is padded with its own first element: no wider range
              f"first = tl.load(x_{t}_ptr + base_in + blk * {b} * {st}, mask=has)",
              f"v = tl.load(x_{t}_ptr + base_in + pos * {st}, mask=ok & has[:, None])",
              f"v = {_value('tl.where(ok, v, first[:, None])', dtype)}",
              f"lo = {_reduce('min', 'v', 1, dtype)}",
              f"hi = {_reduce('max', 'v', 1, dtype)}",
              f"tl.store({out}_ptr + base_out + blk * {out}_s{d}, lo, mask=has)",
              f"tl.store({out}_ptr + base_out + blk * {out}_s{d} + {out}_s{rank}, hi, mask=has)"]
    return lines


def _global_body(s: SummarySpec, rank: int, dtype: str) -> list[str]:
    """One program walks the whole tensor (flat index, last dim fastest)."""
    t, out = s.tensor, s.name
    total = " * ".join(f"x_{t}_n{q}" for q in range(rank))
    out_dt = "tl.int32" if dtype == "bool" else _TL_DTYPE[dtype]
    lines = [f"total = {total}",
             f"first = {_value(f'tl.load(x_{t}_ptr)', dtype)}",
             "lo = first",
             "hi = first",
             # bad: 1 once some x[k] > x[k+1] (or a NaN) is seen; only a 1-D tensor may be
             # flagged nondecreasing
             f"bad = pid * 0{'' if rank == 1 else ' + 1'}",
             f"for start in range(0, total, {CHUNK}):",
             f"    f = start + tl.arange(0, {CHUNK})",
             "    ok = f < total"]
    if rank == 1:  # the common case (ids, offsets): no index arithmetic
        lines += [f"    off = f * x_{t}_s0"]
    else:
        lines += ["    rem = f", "    off = f * 0"]
        for q in reversed(range(rank)):
            lines += [f"    off += (rem % x_{t}_n{q}) * x_{t}_s{q}", f"    rem = rem // x_{t}_n{q}"]
    lines += [f"    v = {_value(f'tl.where(ok, tl.load(x_{t}_ptr + off, mask=ok), first)', dtype)}"]
    if _is_int(dtype):
        lines += ["    lo = tl.minimum(lo, tl.min(v, axis=0))",
                  "    hi = tl.maximum(hi, tl.max(v, axis=0))"]
    else:
        lines += [f"    lo = _nan_min(lo, {_reduce('min', 'v', 0, dtype)})",
                  f"    hi = _nan_max(hi, {_reduce('max', 'v', 0, dtype)})"]
    if rank == 1:  # (a NaN compares false: not nondecreasing, as in torch)
        lines += ["    back = ok & (f > 0)",
                  f"    prev = {_value(f'tl.where(back, tl.load(x_{t}_ptr + (f - 1) * x_{t}_s0, mask=back), first)', dtype)}",
                  "    down = tl.where(back, tl.where(v >= prev, 0, 1), 0)",
                  "    bad = tl.maximum(bad, tl.max(down, axis=0))"]
    lines += [f"tl.store({out}_ptr, lo)",
              f"tl.store({out}_ptr + {out}_s0, hi)",
              f"tl.store({out}_ptr + 2 * {out}_s0, tl.where(bad == 0, 1, 0).to({out_dt}))"]
    return lines

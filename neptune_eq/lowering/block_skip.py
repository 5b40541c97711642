"""Data-dependent block skipping: the block predicate evaluated per key block in a kernel.

A pass whose folds are all gated by mask atoms that read captured tensors (``doc[i] ==
doc[j]``) and are not already loop bounds gets, at the top of its key loop, a scalar test
built by ``block_predicate`` over the block's index ranges and the per-block summaries
of those tensors (kernel inputs ``bs_*``, built per call by ``runtime.block_summary``):

    if may:            # else: skip -- every fold would add its identity
        if must:       # every pair visible: the body without the elementwise mask
            ...
        else:
            ...

The same test serves the split-k partials, so FlashDecoding forms skip the same way.
"""
from __future__ import annotations

from ..ir import Term, const, free_axes, rename_axis, substitute
from .block_predicate import PyOps, SummarySpec, _and, block_truth, summary_dim
from .codegen import LOOP, Emitter
from .lower import Pass, TilePlan


def data_atoms(plan: TilePlan, ps: Pass) -> list[Term]:
    """Gate atoms of a pass worth a per-block test (fold axis named ``@j``): not already
    loop bounds, reading no score or running state, and moving with the key axis.

    A row axis of extent 1 (a decode's one query) is the constant 0 in them: a row-side
    read such as ``doc[q + 8191]`` is then one element per program, read as it is,
    rather than bounded by the whole tensor's range (which tests nothing).  Packed GQA
    rows mix heads in one block and have no row-block summary, except there: every
    packed row of a one-query decode has q = 0."""
    one_row = plan.program.extents.get(plan.block_axis) == 1
    if plan.packed and not one_row:
        return []
    out = []
    for a in sorted(ps.gate_atoms - ps.bound_atoms, key=str):
        if any(n.op in ("ref", "run", "prev") or n.kind in ("reduce", "fold") for n in a.walk()):
            continue
        if "@j" in free_axes(a) and any(n.op == "load" for n in a.walk()):
            out.append(substitute(a, {plan.block_axis: const(0)}) if one_row else a)
    return out


def _roles(plan: TilePlan, loop_var: str) -> dict[str, str]:
    return {plan.block_axis: "row", loop_var: "loop"}


def inline_summaries(plan: TilePlan) -> bool:
    """Whether the kernel bounds its key blocks from the tensor itself, with no summary
    pre-pass: a decode's data mask (one query row, so the row side is one element per
    program) whose every key-side read is indexed by the key (``doc[j]``; no nested read
    needing a global summary).

    A decode program owns few keys -- a split-k chunk of a few hundred -- so reading them
    costs it one vector load, where the pre-pass was a launch of its own: 1.4-2.1 us of a
    graphed 8.5-16 us call (H200, 64/8 heads, S = 8192; session 53).  A prefill's row
    blocks would each re-read every key, O(S^2 / B_i) against the summaries' O(S)."""
    if plan.program.extents.get(plan.block_axis) != 1:
        return False
    roles, grid = _roles(plan, "@j"), set(plan.grid_axes)
    loads = [n for ps in plan.passes for a in data_atoms(plan, ps) for n in a.walk()
             if n.op == "load"]
    return bool(loads) and all((hit := summary_dim(n, roles, grid)) is not None
                               and hit[1] != "row" for n in loads)


def summary_specs(plan: TilePlan) -> list[SummarySpec]:
    """The summaries the kernel's block tests read, in parameter order (none where the
    kernel reads the data itself, ``inline_summaries``)."""
    if inline_summaries(plan):
        return []
    specs: dict[str, SummarySpec] = {}
    for ps in plan.passes:
        for atom in data_atoms(plan, ps):
            for n in atom.walk():
                if n.op != "load":
                    continue
                hit = summary_dim(n, _roles(plan, "@j"), set(plan.grid_axes))
                if hit is not None and hit[0] is None:
                    continue  # one element per program: read from the tensor itself
                if row_read(plan, n):
                    continue  # the row block's own values: read by the kernel itself
                spec = _spec(plan, n.val, hit)
                specs.setdefault(spec.name, spec)
    return list(specs.values())


def _spec(plan: TilePlan, tensor: str, hit) -> SummarySpec:
    if hit is None:
        return SummarySpec(f"bs_{tensor}_all", tensor, None, None)
    dim, role = hit
    block = f"B_{plan.block_axis}" if role == "row" else f"B_{LOOP}"
    return SummarySpec(f"bs_{tensor}_d{dim}_{role}", tensor, dim, block)


_INT_DTYPES = ("int32", "int64")


def row_read(plan: TilePlan, n: Term) -> bool:
    """A load of integers whose indices move with the row axis and the grid only
    (``doc[i]``, ``offsets[doc[i]]``, ``doc[b, i]``): its [min, max] over a row block comes
    from the kernel's own load of the block's values (``_row_values``) -- exact, where a
    summary built by the pre-pass is a launch the kernel must wait for.  Only a mask whose
    key side also needs no summary (jagged sequences: ``j >= offsets[doc[i]]``) then runs
    with no wait at all; a document mask still waits for its key blocks' summaries.
    Packed GQA rows mix heads in a block (no data atoms there, ``data_atoms``)."""
    if n.op != "load" or plan.packed:
        return False
    axes = free_axes(n)
    return (plan.block_axis in axes and axes <= {plan.block_axis, *plan.grid_axes}
            and plan.program.dtype_of(n.val) in _INT_DTYPES)


def _row_values(em: Emitter, n: Term) -> tuple[str, str]:
    """[min, max] of a ``row_read`` over the row block's rows inside the extent: the
    elementwise mask's own load of them (hoisted to the prologue, shared with the mask),
    reduced once per kernel."""
    memo = em.__dict__.setdefault("_row_values", {})
    if n not in memo:
        vec = em.expr(n).code  # (no loop axis in it: emitted in the prologue)
        ba = em.plan.block_axis
        big = 2 ** 62 if em.plan.program.dtype_of(n.val) == "int64" else 2 ** 31 - 1
        lo, hi = em.new("rv"), em.new("rv")
        em.emit(f"{lo} = tl.min(tl.where(mask_{ba}, {vec}, {big}), axis=0)", scope=0)
        em.emit(f"{hi} = tl.max(tl.where(mask_{ba}, {vec}, {-big}), axis=0)", scope=0)
        memo[n] = (lo, hi)
    return memo[n]


def _exact_rows(em: Emitter):
    """``block_predicate.Analysis``'s ``exact``: a ``row_read``'s own [min, max], else None."""
    return lambda n: _row_values(em, n) if row_read(em.plan, n) else None


class TritonOps:
    """``block_predicate``'s scalar algebra emitting Triton code; constants fold in Python."""

    def __init__(self, em: Emitter):
        self.em, self.py = em, PyOps()

    def _name(self, code: str) -> str:
        v = self.em.new("bp")
        self.em.emit(f"{v} = {code}")
        return v

    def binary(self, op, a, b):
        if not isinstance(a, str) and not isinstance(b, str):
            return self.py.binary(op, a, b)
        fmt = {"add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}",
               "min": "tl.minimum({}, {})", "max": "tl.maximum({}, {})", "lt": "{} < {}",
               "le": "{} <= {}", "eq": "{} == {}", "and": "({}) & ({})", "or": "({}) | ({})"}[op]
        return self._name(fmt.format(a, b))

    def floordiv(self, a, c):  # emitted like the elementwise mask's own ``//``
        return self._name(f"{a} // {c}")

    def mod(self, a, c):
        return self._name(f"{a} % {c}")

    def select(self, c, a, b):
        if not isinstance(c, str):
            return a if c else b
        return self._name(f"tl.where({c}, {a}, {b})")

    def not_(self, a):
        return (not a) if not isinstance(a, str) else self._name(f"{a} == 0")


def emit_block_test(em: Emitter, ps: Pass, atoms: list[Term], loop_var: str,
                    extent) -> tuple[str | bool, str | bool, frozenset]:
    """Emit the scalar test of the current key block (``l0``); (may, must, atoms the
    must-branch drops), each of may/must code or a static bool."""
    plan = em.plan
    ba = plan.block_axis
    if not any(line.strip().startswith("row_hi =") for line in em.scopes[0][0]):
        em.emit(f"row_hi = tl.minimum(row_last, {plan.row_extent} - 1)", scope=0)
    ranges = {ba: ("row_first", "row_hi"), loop_var: ("l0", em.new("bp"))}
    em.emit(f"{ranges[loop_var][1]} = tl.minimum(l0 + B_{LOOP}, {extent}) - 1")
    for a in plan.grid_axes:
        ranges[a] = (f"ax_{a}", f"ax_{a}")
    roles = _roles(plan, loop_var)
    ops = TritonOps(em)
    inline = inline_summaries(plan)

    def load(t: Term, idx: list):
        hit = summary_dim(t, roles, set(plan.grid_axes))
        if hit is not None and hit[0] is None:  # the element itself: exact
            if any(b is None for b in idx):
                return None
            off = " + ".join(f"({b[0]}) * {t.val}_s{k}" for k, b in enumerate(idx)) or "0"
            v = ops._name(f"tl.load({t.val}_ptr + {off})")
            return v, v
        spec = _spec(plan, t.val, hit)
        if hit is None:
            return _global_bounds(ops, plan, t, spec, idx)
        dim, role = hit
        at = [("pid_block" if role == "row" else f"(l0 // B_{LOOP})") if k == dim
              else (b[0] if b else "0") for k, b in enumerate(idx)]
        if any(b is None for k, b in enumerate(idx) if k != dim):
            return None
        if inline:  # the block's keys themselves, clamped into the extent (the mask reads
            # each of them; a clamped one repeats the last, leaving [min, max] as it is)
            at[dim] = f"tl.minimum(l0 + tl.arange(0, B_{LOOP}), {extent} - 1)"
            v = ops._name(f"tl.load({t.val}_ptr + "
                          + " + ".join(f"({x}) * {t.val}_s{k}" for k, x in enumerate(at)) + ")")
            return ops._name(f"tl.min({v}, axis=0)"), ops._name(f"tl.max({v}, axis=0)")
        off = " + ".join(f"({x}) * {spec.name}_s{k}" for k, x in enumerate(at))
        if role == "row":  # the row block's summary is loop-invariant: load it once
            return _hoisted(em, f"{spec.name}_ptr + {off}", f"{spec.name}_s{len(at)}")
        lo = ops._name(f"tl.load({spec.name}_ptr + {off})")
        hi = ops._name(f"tl.load({spec.name}_ptr + {off} + {spec.name}_s{len(at)})")
        return lo, hi

    may, must, drop = True, True, []
    for atom in atoms:
        a_may, a_must = block_truth(rename_axis(atom, "@j", loop_var), ops, ranges.get, load,
                                    _exact_rows(em))
        may = _and(ops, may, a_may)
        if a_must is False:
            continue
        drop.append(atom)
        must = _and(ops, must, a_must)
    if not drop:
        must = False
    return may, must, frozenset(drop)


def _hoisted(em: Emitter, addr: str, stride: str) -> tuple[str, str]:
    """[min, max] at ``addr`` loaded in the prologue, once per kernel (not per key block)."""
    memo = em.__dict__.setdefault("_row_summaries", {})
    if addr not in memo:
        lo, hi = em.new("rs"), em.new("rs")
        em.emit(f"{lo} = tl.load({addr})", scope=0)
        em.emit(f"{hi} = tl.load({addr} + {stride})", scope=0)
        memo[addr] = (lo, hi)
    return memo[addr]


def _global_bounds(ops: TritonOps, plan: TilePlan, t: Term, spec: SummarySpec, idx: list):
    """A read with a computed index (``offsets[doc[i]]``): the tensor's global [min, max];
    when a 1-D tensor is nondecreasing (the summary's flag, checked on the data) and the
    index is bounded, its values at the two ends of the index range -- tight for offsets
    of packed sequences."""
    lo = ops._name(f"tl.load({spec.name}_ptr)")
    hi = ops._name(f"tl.load({spec.name}_ptr + {spec.name}_s0)")
    if len(idx) != 1 or idx[0] is None:
        return lo, hi
    n = plan.program.shape_of(t.val)[0]
    # the ends bound the read where the table is nondecreasing and every index of the
    # range reads itself: a negative one wraps to the end (torch's rule,
    # ``data_indices``), so the range [-1, 3] reads entries 0..3 and n-1
    first, last = idx[0]
    if (isinstance(first, int) and first < 0) or (isinstance(last, int) and isinstance(n, int)
                                                  and last >= n):
        return lo, hi
    inside = [f"({first} >= 0)"] * (not isinstance(first, int))
    inside += [f"({last} < {n})"] * (not (isinstance(last, int) and isinstance(n, int)))
    mono = ops._name(" & ".join([f"(tl.load({spec.name}_ptr + 2 * {spec.name}_s0) != 0)",
                                 *inside]))
    ends = []
    for end in idx[0]:  # out-of-range indices are never read: clamp to the tensor
        at = ops._name(f"tl.minimum(tl.maximum({end}, 0), {n} - 1)")
        ends.append(ops._name(f"tl.load({t.val}_ptr + {at} * {t.val}_s0)"))
    return ops.select(mono, ends[0], lo), ops.select(mono, ends[1], hi)


# ----------------------------------------------------------------------------------
# Monotone data -> loop bounds
# ----------------------------------------------------------------------------------
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}


def _key_side(atom: Term, roles: dict, grid: set, any_rank: bool = False
              ) -> tuple[Term, str, Term] | None:
    """``atom`` as ``K cmp E``: K the key index itself or a 1-D tensor read at it, E free
    of the key axis; None if it has no such form.  ``any_rank``: K may also read a
    tensor of more dims at the key and one value per program in each other dim
    (``doc[b, j]``: a batch's own documents) -- where the kernel reads the data itself
    (``inline_summaries``); the summaries' count reads 1-D ones only."""
    if atom.op not in _FLIP:
        return None
    a, b = atom.args
    op = atom.op
    for key, other, cmp in ((a, b, op), (b, a, _FLIP[op])):
        if "@j" in free_axes(other):
            continue
        if key.op == "var" and key.val == "@j":
            return key, cmp, other
        if key.op == "load" and (len(key.args) == 1 or any_rank):
            hit = summary_dim(key, roles, grid)
            if hit is not None and hit[1] == "loop" and (hit[0] == 0 or any_rank):
                return key, cmp, other
    return None


def _key_read(em: Emitter, key: Term) -> tuple[str, str]:
    """(offset of the key's row, stride along the key) of a ``_key_side`` read: its other
    indices are one value per program, bounded exactly here."""
    dim, _ = summary_dim(key, _roles(em.plan, "@j"), set(em.plan.grid_axes))
    parts = [f"({_row_bounds(em, ix, const_ok=True)[0]}) * {key.val}_s{q}"
             for q, ix in enumerate(key.args) if q != dim]
    return " + ".join(parts) or "0", f"{key.val}_s{dim}"


def data_loop_bounds(em: Emitter, ps: Pass, k: int, split: bool = False
                     ) -> tuple[str | None, str | None]:
    """Key-loop bounds from data atoms ``K cmp E`` (emitted in the pass's scope): E is
    bounded over the row block by ``block_predicate``; K = j gives the bound directly,
    K = X[j] gives it by a count over X's key-block summary where the blocks' [min, max]
    are in order (checked per call in the same pass) -- sorted document ids make a row block's
    visible keys one contiguous range.  ``split``: a split-k partial (``_count_failing``).
    Returns (lo, hi) code, block-aligned lo."""
    plan = em.plan
    atoms = data_atoms(plan, ps)
    if not atoms:
        return None, None
    roles = _roles(plan, "@j")
    grid = set(plan.grid_axes)
    los, his = [], []
    for atom in atoms:
        form = _key_side(atom, roles, grid, inline_summaries(plan))
        if form is None:
            continue
        key, cmp, other = form
        lo_e, hi_e = _row_bounds(em, other)
        if lo_e is None:
            continue
        need_lo = lo_e if cmp in ("eq", "ge", "gt") else None   # K >= lo_e
        need_hi = hi_e if cmp in ("eq", "le", "lt") else None   # K <= hi_e
        if key.op == "var":
            if need_lo is not None:
                los.append(f"tl.maximum({need_lo}, 0)")
            if need_hi is not None:
                his.append(f"({need_hi}) + 1")
            continue
        queries = []
        if need_lo is not None:  # first key block whose max reaches lo_e
            queries.append(("max", ">=", need_lo))
        if need_hi is not None:  # one past the last key block whose min is <= hi_e
            queries.append(("min", ">", need_hi))
        blks, ordered = _count_failing(em, key, ps.extent, queries, "chunk" if split else "all")
        mono = em.new("mono")
        em.emit(f"{mono} = {ordered}")
        if need_lo is not None:
            los.append(f"tl.where({mono}, {blks.pop(0)}, 0) * B_{LOOP}")
        if need_hi is not None:
            his.append(f"tl.where({mono}, {blks.pop(0)} * B_{LOOP}, {ps.extent})")
    lo = hi = None
    if los:
        lo = f"j_dlo{k}"
        em.emit(f"{lo} = {_fold_code('tl.maximum', los)}")
        em.emit(f"{lo} = ({lo} // B_{LOOP}) * B_{LOOP}")
    if his:
        hi = f"j_dhi{k}"
        em.emit(f"{hi} = {_fold_code('tl.minimum', his)}")
    return lo, hi


def _row_bounds(em: Emitter, t: Term, const_ok: bool = False):
    """Bounds of a key-free term over the current row block (code, or Python numbers for
    a constant when ``const_ok``), or (None, None)."""
    plan = em.plan
    if not const_ok and not any(n.op == "load" for n in t.walk()) and not free_axes(t):
        return None, None
    if not any(line.strip().startswith("row_hi =") for line in em.scopes[0][0]):
        em.emit(f"row_hi = tl.minimum(row_last, {plan.row_extent} - 1)", scope=0)
    ranges = {plan.block_axis: ("row_first", "row_hi")}
    for a in plan.grid_axes:
        ranges[a] = (f"ax_{a}", f"ax_{a}")
    ops = TritonOps(em)
    from .block_predicate import Analysis

    def load(n: Term, idx: list):
        hit = summary_dim(n, {plan.block_axis: "row"}, set(plan.grid_axes))
        if hit is not None and hit[0] is None:
            if any(b is None for b in idx):
                return None
            off = " + ".join(f"({b[0]}) * {n.val}_s{q}" for q, b in enumerate(idx)) or "0"
            v = ops._name(f"tl.load({n.val}_ptr + {off})")
            return v, v
        spec = _spec(plan, n.val, hit)
        if hit is None:
            return _global_bounds(ops, plan, n, spec, idx)
        dim, _ = hit
        if any(b is None for q, b in enumerate(idx) if q != dim):
            return None
        at = ["pid_block" if q == dim else b[0] for q, b in enumerate(idx)]
        off = " + ".join(f"({x}) * {spec.name}_s{q}" for q, x in enumerate(at))
        return (ops._name(f"tl.load({spec.name}_ptr + {off})"),
                ops._name(f"tl.load({spec.name}_ptr + {off} + {spec.name}_s{len(at)})"))

    b = Analysis(ops, ranges.get, load, _exact_rows(em)).bounds(t)
    return (None, None) if b is None else b


SEARCH_CHUNK = 512  # summary entries counted per vector load (S = 65536 at B_L = 128: one)
SCAN_KEYS = 1024    # keys counted per vector load where the kernel reads the data itself
SAMPLES = 1024      # key blocks whose ends are read per vector load (``_count_sampled``)


def _count_failing(em: Emitter, key: Term, extent, queries: list,
                   scope: str = "all", mark: list | None = None) -> tuple[list[str], str]:
    """For each ``(field, cmp, target)`` (field ``min`` / ``max``): the first key block
    whose [min, max] entry satisfies ``entry cmp target``, all from ONE pass over the
    summary -- and the condition that makes those answers right: the blocks' minima and
    maxima are both nondecreasing.

    Counted, not bisected: on a nondecreasing column the failing entries are a prefix, so
    their count is the answer.  One vector load per SEARCH_CHUNK blocks replaces a chain of
    log2(nb) dependent loads (each an L2 round trip) before the key loop can start; and
    the searches of one atom (a document mask asks four: may/must x first/last) share
    the loop, one load per column, so their round trips overlap instead of queueing.

    The order is checked in the same pass (each entry against the one before it), not
    by a walk over the whole tensor in the pre-pass: that walk was one program, the
    pre-pass's critical path (2.4 / 6.7 us of a document mask's at S = 8192 / 32768 on
    an H200, against 1.1-1.2 us for the per-block summaries; session 36).  It is also the
    weaker condition the counts need -- sorted ids satisfy it, and so do ids shuffled only
    inside their blocks.  Where the kernel reads the data itself (``inline_summaries``)
    the count runs over keys instead: all of them (``scope`` "all"), a split-k partial's
    chunk ("chunk", ``_count_keys``), or the whole tensor's key-block ends ("sampled",
    ``_count_sampled``: unchecked, for sharing out work only); ``mark``: where those
    counts' first loads go (``_first_loads``)."""
    if inline_summaries(em.plan):
        if scope == "sampled":
            return _count_sampled(em, key, extent, queries, mark)
        return _count_keys(em, key, extent, queries, scope == "chunk", mark)
    spec = _spec(em.plan, key.val, (0, "loop"))  # (a 1-D read: ``_key_side``)
    nb = f"(({extent} + B_{LOOP} - 1) // B_{LOOP})"
    cnts = [em.new("bs_n") for _ in queries]
    breaks = em.new("bs_nd")
    c0, offs = em.new("bs_c"), em.new("bs_o")
    for cnt in cnts + [breaks]:
        em.emit(f"{cnt} = row_first * 0")
    em.emit(f"for {c0} in range(0, {nb}, {SEARCH_CHUNK}):  # monotone data: the visible keys are one range")
    em.emit(f"    {offs} = {c0} + tl.arange(0, {SEARCH_CHUNK})")
    vals: dict[str, str] = {}
    for field, field_off in (("min", "0"), ("max", f"{spec.name}_s1")):  # and the block before
        vals[field] = val = em.new("bs_v")
        em.emit(f"    {val} = tl.load({spec.name}_ptr + {offs} * {spec.name}_s0 + {field_off}, "
                f"mask={offs} < {nb}, other=0)")
        prev = em.new("bs_p")
        em.emit(f"    {prev} = tl.load({spec.name}_ptr + ({offs} - 1) * {spec.name}_s0 + {field_off}, "
                f"mask=({offs} >= 1) & ({offs} < {nb}), other=0)")
        em.emit(f"    {breaks} += tl.sum((({offs} >= 1) & ({offs} < {nb}) & ~({val} >= {prev}))"
                f".to(tl.int32), axis=0)")  # (a NaN compares false: a break)
    for cnt, (field, cmp, target) in zip(cnts, queries):
        em.emit(f"    {cnt} += tl.sum((({offs} < {nb}) & ~({vals[field]} {cmp} {target}))"
                f".to(tl.int32), axis=0)")
    return cnts, f"({breaks} == 0)"


def _first_loads(em: Emitter, mark: list | None, fresh: bool, lines: list[str]) -> None:
    """Emit a count's first vector loads (and the sizes they need) at ``mark``, the group's
    shared point in this scope ([scope lines, index], advanced past them), so the counts
    of one pass -- a split-k partial's sampled range, its chunk's, each atom's -- issue
    their loads back to back before any of them is summed: one memory round trip before
    the key loop instead of one per count (a ``tl.sum`` across warps is a barrier the
    next load does not move above).  ``fresh``: lines were emitted for this count since
    the mark (its read's own offsets), so the mark moves here first."""
    scope, _, indent = em.scopes[-1]
    if mark is None:
        mark = [None, 0]
    if fresh or mark[0] is not scope:
        mark[0], mark[1] = scope, len(scope)
    for line in lines:
        scope.insert(mark[1], indent + line)
        mark[1] += 1


def _count_keys(em: Emitter, key: Term, extent, queries: list, split: bool,
                mark: list | None = None) -> tuple[list[str], str]:
    """``_count_failing``'s answers from the keys themselves, over this program's keys only
    (a split-k partial's chunk; clipped to it afterwards, so nothing outside it matters).

    Where the keys are nondecreasing (checked here, key by key: stronger than the blocks'
    order, and sorted ids pass it) the keys failing a query are a prefix of the range, c
    long from its start s (a multiple of B_L): a block fails a ``max`` query when all its
    keys do -- floor((s + c) / B_L) blocks -- and a ``min`` query when its first key does
    -- ceil((s + c) / B_L).  Past the extent nothing is read: a ragged last block then
    never counts as failing a ``max`` query, which starts a may range there (one more
    masked block) or ends a must range before it (the mask kept): never a visible key
    skipped."""
    n0 = len(em.scopes[-1][0])
    base, stride = _key_read(em, key)
    x = f"{key.val}_ptr + {base}"
    start = "pid_split * CHUNK" if split else "row_first * 0"
    end = f"tl.minimum(pid_split * CHUNK + CHUNK, {extent})" if split else str(extent)
    lo, hi = em.new("ks_lo"), em.new("ks_hi")
    counted: dict[tuple, str] = {}  # may and must ask the same test, rounded two ways
    cnts = [counted.setdefault((cmp, target), em.new("ks_n")) for _, cmp, target in queries]
    breaks = em.new("ks_nd")
    c0, offs, inb = em.new("ks_c"), em.new("ks_o"), em.new("ks_in")
    val, prev = em.new("ks_v"), em.new("ks_p")

    def scan(offs, inb, val, prev):  # (the first vector's loads are emitted apart)
        return [f"{inb} = {offs} < {hi}",
                f"{val} = tl.load({x} + {offs} * {stride}, mask={inb}, other=0)",
                f"{prev} = tl.load({x} + ({offs} - 1) * {stride}, "
                f"mask={inb} & ({offs} > {lo}), other=0)"]

    def sums(op, offs, inb, val, prev):
        out = [f"{breaks} {op} tl.sum(({inb} & ({offs} > {lo}) & ~({val} >= {prev}))"
               f".to(tl.int32), axis=0)"]  # (a NaN compares false: a break)
        return out + [f"{cnt} {op} tl.sum(({inb} & ~({val} {cmp} {target})).to(tl.int32), axis=0)"
                      for (cmp, target), cnt in counted.items()]
    first = [em.new(p) for p in ("ks_o", "ks_in", "ks_v", "ks_p")]
    _first_loads(em, mark, len(em.scopes[-1][0]) != n0,
                 [f"{lo} = {start}", f"{hi} = {end}",
                  f"{first[0]} = {lo} + tl.arange(0, {SCAN_KEYS})"] + scan(*first))
    for line in sums("=", *first):
        em.emit(line)
    em.emit(f"for {c0} in range({lo} + {SCAN_KEYS}, {hi}, {SCAN_KEYS}):"
            "  # this program's keys, read here (the rest)")
    em.emit(f"    {offs} = {c0} + tl.arange(0, {SCAN_KEYS})")
    for line in scan(offs, inb, val, prev) + sums("+=", offs, inb, val, prev):
        em.emit("    " + line)
    blocks = []
    for cnt, (field, _, _) in zip(cnts, queries):
        b = em.new("ks_b")
        up = f" + B_{LOOP} - 1" if field == "min" else ""
        em.emit(f"{b} = ({lo} + {cnt}{up}) // B_{LOOP}")
        blocks.append(b)
    return blocks, f"({breaks} == 0)"


def _count_sampled(em: Emitter, key: Term, extent, queries: list,
                   mark: list | None = None) -> tuple[list[str], str]:
    """``_count_failing``'s answers over the whole tensor from its key blocks' first and
    last keys: SAMPLES blocks a vector load (S = 32768 at B_L = 32: one), where counting
    every key of a long cache would be a loop of loads before the key loop could start.

    On nondecreasing keys a block's first key is its minimum and its last its maximum,
    so the counts are the summaries' own, exact to the block.  Nothing is checked here:
    on other data the ranges may be wrong, so they only share out work, and each partial
    checks its own chunk for what they left out (``split_share``).  The flag returned is
    therefore constant."""
    n0 = len(em.scopes[-1][0])
    base, stride = _key_read(em, key)
    nb, c0 = em.new("sb_nb"), em.new("sb_c")
    counted: dict[tuple, str] = {}
    for field, cmp, target in queries:
        counted.setdefault((field, cmp, target), em.new("sb_n"))
    fields = [f for f in ("min", "max") if any(f == g for g, _, _ in counted)]

    def scan(blk, inb, vals):  # (the first vector's loads are emitted apart)
        at = {"min": f"{blk} * B_{LOOP}",
              "max": f"tl.minimum({blk} * B_{LOOP} + B_{LOOP} - 1, {extent} - 1)"}
        return [f"{inb} = {blk} < {nb}"] + [
            f"{vals[f]} = tl.load({key.val}_ptr + {base} + ({at[f]}) * {stride}, "
            f"mask={inb}, other=0)" for f in fields]

    def sums(op, inb, vals):
        return [f"{cnt} {op} tl.sum(({inb} & ~({vals[field]} {cmp} {target})).to(tl.int32), "
                f"axis=0)" for (field, cmp, target), cnt in counted.items()]
    blk1, inb1 = em.new("sb_t"), em.new("sb_in")
    vals1 = {f: em.new("sb_v") for f in fields}
    _first_loads(em, mark, len(em.scopes[-1][0]) != n0,
                 [f"{nb} = ({extent} + B_{LOOP} - 1) // B_{LOOP}",
                  f"{blk1} = tl.arange(0, {SAMPLES})"] + scan(blk1, inb1, vals1))
    for line in sums("=", inb1, vals1):
        em.emit(line)
    blk, inb = em.new("sb_t"), em.new("sb_in")
    vals = {f: em.new("sb_v") for f in fields}
    em.emit(f"for {c0} in range({SAMPLES}, {nb}, {SAMPLES}):"
            "  # the key blocks' first and last keys (the rest)")
    em.emit(f"    {blk} = {c0} + tl.arange(0, {SAMPLES})")
    for line in scan(blk, inb, vals) + sums("+=", inb, vals):
        em.emit("    " + line)
    return [counted[q] for q in map(tuple, queries)], "True"


def _fold_code(fn: str, xs: list[str]) -> str:
    out = xs[0]
    for x in xs[1:]:
        out = f"{fn}({out}, {x})"
    return out

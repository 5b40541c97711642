"""Reads at an index computed from data (``offsets[doc[q]]``): torch's indexing rule.

A mod may index a captured tensor with a value read from another -- packed sequences
read ``offsets[doc[q]]``.  An affine index (``bias[h, q_idx]``) is checked against the
tensor's extent when a structure is traced; an index computed from data holds whatever
the data holds, call by call.  Torch's rule for such an index into a dimension of n
entries: -n <= i < n, a negative one counting from the end (padding tokens often carry
document id -1, and ``offsets[-1]`` is then the packed length); anything else is an
error.  The generated code follows it:

* every load at such an index wraps it and then clamps it into [0, n) (``safe_index``):
  a valid index reads what torch reads, and no data makes a kernel read outside a tensor;
* the block tests (``block_skip``) bound such a read by the monotone table's ends only
  where the index range lies in [0, n) -- wrapped indices are not ordered;
* an index outside [-n, n) is an error of the call, never a value read off the clamp:
  on the host in the interpreter (``runtime.index_check``), and on the GPU a device
  assert in the pre-pass over the ids' entries that are read (``checked_ids``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Program, Term, reads_data
from ..sizes import SymInt


@dataclass(frozen=True)
class DataIndex:
    """Dimension ``dim`` of ``tensor`` (``extent`` entries) read at ``index``, a term
    that reads data."""
    tensor: str
    dim: int
    extent: object   # an int, or a named size of a symbolic program
    index: Term


def data_indices(program: Program) -> list[DataIndex]:
    """Every (tensor, dimension, index term) of the program read at an index from data,
    each once."""
    found: dict[tuple, DataIndex] = {}
    for d in program.defs:
        for n in d.body.walk():
            if n.op != "load":
                continue
            for k, a in enumerate(n.args):
                if reads_data(a) and (n.val, k, a) not in found:
                    found[n.val, k, a] = DataIndex(n.val, k, program.shape_of(n.val)[k], a)
    return list(found.values())


def safe_index(code: str, extent) -> str:
    """Kernel code of index ``code`` into ``extent`` entries under torch's rule: a negative
    index counts from the end; then clamped into [0, extent) so that an index torch would
    reject (reported by ``runtime.index_check``) still reads inside the tensor."""
    wrapped = f"tl.where(({code}) < 0, ({code}) + {extent}, {code})"
    return f"tl.minimum(tl.maximum({wrapped}, 0), {extent} - 1)"


@dataclass(frozen=True)
class IdCheck:
    """Entries of ``tensor`` read as an index into ``table`` (``n`` entries): each must lie
    in [-n, n).  ``box`` gives, per dimension of ``tensor``, the entries read: ``None`` for
    the whole dimension (its size known only at the call), else ``(start, count)`` --
    ``doc[q + 1]`` over 32 rows reads ``(1, 32)``, ``doc[0, q]`` ``(0, 1)`` of dimension 0;
    a count may be a runtime size (``SymInt``: a decode's ``doc[q + 4095]`` over ``L``
    rows reads ``(4095, n_L)``)."""
    tensor: str
    n: int
    table: str
    box: tuple

    @property
    def whole(self) -> bool:
        return all(b is None for b in self.box)


def checked_ids(program: Program) -> list[IdCheck]:
    """The ids the pre-pass checks on the device (``summary_kernel``): for each tensor
    read as an index into a table of a known size -- ``doc`` in ``offsets[doc[q]]`` or in
    ``bias[doc[b, q]]`` -- the box of its entries that is read, and the bound n its
    entries must meet (-n <= id < n: the smallest table they index).  A tensor read whole
    is checked in its summaries where a mask reads it per block, else in a guard that only
    asserts (a score_mod's ``bias[doc[q]]``, a chain's ``x[i, t[i]]``); a part read at a
    shifted or constant index (``doc[q + 1]``, ``doc[0, q]``) in a guard over that box.
    What the box cannot name -- an id index that is not an axis plus a constant, an axis
    twice, a table of a named size -- is left to the clamp on the GPU (and to
    ``runtime.index_check`` on CPU)."""
    bound: dict[tuple, tuple[int, str]] = {}
    for di in data_indices(program):
        x = di.index
        if x.op != "load" or not isinstance(di.extent, int) or isinstance(di.extent, bool):
            continue
        box = _box(program, x)
        if box is None:
            continue
        # (keyed by the counts' code: comparing two runtime sizes would record a guard)
        key = (x.val, tuple(b if b is None else (b[0], str(b[1])) for b in box))
        if key not in bound or di.extent < bound[key][0]:
            bound[key] = (di.extent, di.tensor, box)
    return [IdCheck(t, n, table, box) for (t, _), (n, table, box) in bound.items()]


def _box(program: Program, x: Term) -> tuple | None:
    """Per dimension of the ids ``x`` reads, ``None`` (all of it) or ``(start, count)``;
    ``None`` for the whole box when its index is not an axis plus a constant."""
    shape, box, axes = program.shape_of(x.val), [], []
    for a, size in zip(x.args, shape):
        start, axis = _axis_plus_constant(a)
        if start is None:
            return None
        if axis is None:
            box.append((start, 1))
            continue
        axes.append(axis)
        extent = program.extents.get(axis)
        if start == 0 and _same(extent, size):
            box.append(None)
        elif isinstance(extent, SymInt) or (isinstance(extent, int) and not isinstance(extent, bool)):
            box.append((start, extent))
        else:
            return None
    if len(set(axes)) != len(axes):  # doc[q, q] reads a diagonal, not the box
        return None
    return tuple(box)


def _same(a, b) -> bool:
    """Whether two extents are the same size -- runtime sizes by their code, never by a
    comparison (which would record a guard on the sizes)."""
    if isinstance(a, SymInt) or isinstance(b, SymInt):
        return isinstance(a, SymInt) and isinstance(b, SymInt) and a.code == b.code
    return a == b


def _axis_plus_constant(a: Term) -> tuple:
    """``(c, axis)`` for an index ``axis + c`` / ``c + axis`` / ``axis - c`` / ``axis``,
    ``(c, None)`` for a constant ``c``, ``(None, None)`` otherwise."""
    def const_of(t):
        return t.val if t.op == "int" and t.val >= 0 else None
    if a.op == "var":
        return 0, a.val
    if const_of(a) is not None:
        return a.val, None
    if a.op in ("add", "sub") and a.args[0].op == "var" and const_of(a.args[1]) is not None:
        c = a.args[1].val if a.op == "add" else -a.args[1].val
        return (c, a.args[0].val) if c >= 0 else (None, None)
    if a.op == "add" and a.args[1].op == "var" and const_of(a.args[0]) is not None:
        return a.args[0].val, a.args[1].val
    return None, None

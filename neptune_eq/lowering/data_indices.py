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
  assert in the pre-pass for ids read whole along their axis (``checked_ids``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Program, Term, reads_data


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


def checked_ids(program: Program) -> dict[str, tuple[int, str]]:
    """The 1-D tensors whose every entry is an index read from data -- ``doc`` in
    ``offsets[doc[q]]``, read whole along its axis -- each with the bound n its entries
    must meet (-n <= id < n: the smallest table it indexes) and that table's name.  The
    summary pre-pass asserts it on the device (``summary_kernel``): in the summaries of
    such a tensor where a mask reads it per block, else in a guard that only asserts (a
    score_mod's ``bias[doc[q]]``, a chain's ``x[i, t[i]]``).  An id read at a shifted or
    partial index, or into a table of a named size, is left to the clamp on the GPU (and
    to ``runtime.index_check`` on CPU)."""
    out: dict[str, tuple[int, str]] = {}
    for di in data_indices(program):
        x = di.index
        if (x.op != "load" or len(x.args) != 1 or x.args[0].op != "var"
                or not isinstance(di.extent, int) or isinstance(di.extent, bool)):
            continue
        if program.extents.get(x.args[0].val) != program.shape_of(x.val)[0]:
            continue
        if x.val not in out or di.extent < out[x.val][0]:
            out[x.val] = (di.extent, di.tensor)
    return out

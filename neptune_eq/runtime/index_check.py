"""The error half of torch's rule for indices read from data (``lowering.data_indices``).

A kernel wraps a negative index read from data and clamps it into the tensor, so no data
makes it read outside one; an index torch would reject (outside [-n, n)) must then be an
error of the call, not a value read off the clamp.  This module finds such indices on
the call's own tensors: it evaluates each index term read from data over its axes (the
reference interpreter, which applies the same rule to the reads inside it) and raises
with the range it found.  It runs where the data is on the host: calls in the Triton
interpreter.
"""
from __future__ import annotations

import torch

from ..interp import Interpreter, Val
from ..ir import Program, ProgramError, fmt, free_axes
from ..lowering.data_indices import DataIndex, data_indices
from ..sizes import bind, is_symbolic, sizes_of

# The most index values evaluated per read (an index over two axes -- rows and keys --
# is the product of both); past it the check is skipped and only the clamp holds.
MAX_VALUES = 1 << 24

_FOUND: dict[int, tuple[Program, list[DataIndex]]] = {}


def indices_of(program: Program) -> list[DataIndex]:
    """``data_indices(program)``, worked out once per program object."""
    got = _FOUND.get(id(program))
    if got is None or got[0] is not program:
        got = _FOUND[id(program)] = (program, data_indices(program))
    return got[1]


def check_data_indices(program: Program, tensors: dict) -> None:
    """Raise ``ProgramError`` if a read of ``program`` at an index computed from the data
    in ``tensors`` (name -> tensor) would take an index outside [-n, n)."""
    found = indices_of(program)
    if not found:
        return
    prog = bind(program, sizes_of(program, tensors)) if is_symbolic(program) else program
    needed = {n.val for di in found for n in di.index.walk() if n.op == "load"}
    reads = Program([ph for ph in prog.inputs if ph.name in needed], [], prog.extents, [])
    interp = Interpreter(reads, {name: tensors[name] for name in needed})
    for di in found:
        axes = sorted(free_axes(di.index))
        count = 1
        for a in axes:
            count *= prog.extents[a]
        if count > MAX_VALUES:
            continue
        env = {a: Val(torch.arange(prog.extents[a]), (a,)) for a in axes}
        got = interp.eval(di.index, env, {}).t
        n = prog.shape_of(di.tensor)[di.dim]
        if got.numel() and (int(got.min()) < -n or int(got.max()) >= n):
            bad = int(got.min()) if int(got.min()) < -n else int(got.max())
            raise ProgramError(
                f"Expected the index into dim {di.dim} of {di.tensor!r} ({n} entries) read "
                f"from data, {fmt(di.index)}, in [{-n}, {n}) -- torch's rule, negative ones "
                f"counting from the end -- got {bad} (values from {int(got.min())} to "
                f"{int(got.max())}); check the captured tensors the mod reads for ids past "
                f"the end of {di.tensor!r}.")

"""Symbolic sizes: one program structure, every size.

A program's sizes may be named symbols (``ne.size("S")``, or a string in a shape) instead
of ints.  Structure and sizes are kept apart as in Halide and TVM:

* the **e-graph** never sees sizes (rules are size-free), so a structure is saturated once;
* **lowering and code generation** run on a program *specialised* at representative sizes:
  every symbolic extent becomes a ``SymInt`` -- an integer expression that prints as Triton
  code over the kernel's runtime size arguments (``n_S``, ``(n_S - 1)``) and computes with
  the representative value.  Every decision taken on one (``S < 64``: pack GQA heads?
  ``rows <= 16``: decode configs?) is recorded as a **guard**, as torch.compile records
  guards on its symbolic shapes.  The generated kernel is valid for every size whose
  guards hold: that set of sizes is a **bucket**;
* at call time, the sizes are read off the tensors; a size whose bucket is known launches
  the bucket's kernel, a new bucket chooses a candidate again (cost model; no saturation).

A ``SymInt`` that must become a plain Python int (``int(n)``, ``range(n)``) records the
guard ``n == value``: correct, only narrower.  ``float(n)`` is free: costs only rank.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Callable, Iterable

from .ir import Placeholder, Program, ProgramError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Size:
    """A named symbolic size (``ne.size("S")``): usable wherever the DSL takes an extent."""
    name: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ProgramError(f"Expected a size name such as 'S' or 'seq_kv', got {self.name!r}.")

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


def size(name: str) -> Size:
    """A named symbolic size: a kernel built with it runs at any value of it.

        >>> S = ne.size("S")                                 # doctest: +SKIP
        >>> x = ne.placeholder((4, S), "float32", "x")       # doctest: +SKIP
    """
    return Size(name)


def as_extent(e) -> "int | Size":
    """An extent as the DSL accepts it: a positive int, a ``Size``, or a size name."""
    if isinstance(e, str):
        return Size(e)
    if isinstance(e, Size):
        return e
    if isinstance(e, bool) or not isinstance(e, int) or e <= 0:
        raise ProgramError(f"Expected an extent to be a positive int or a named size "
                           f"(ne.size('S') or 'S'), got {e!r}.")
    return e


def symbols(program: Program) -> list[str]:
    """The program's symbolic size names, in order of first appearance in its inputs."""
    out: dict[str, None] = {}
    for ph in program.inputs:
        for n in ph.shape:
            if isinstance(n, Size):
                out[n.name] = None
    for n in program.extents.values():
        if isinstance(n, Size):
            out[n.name] = None
    return list(out)


def is_symbolic(program: Program) -> bool:
    return bool(symbols(program))


def _map_sizes(program: Program, fn: Callable) -> Program:
    inputs = [Placeholder(ph.name, tuple(fn(n) for n in ph.shape), ph.dtype) for ph in program.inputs]
    return Program(inputs, list(program.defs), {a: fn(n) for a, n in program.extents.items()},
                   list(program.outputs), dict(program.meta))


def bind(program: Program, values: dict[str, int]) -> Program:
    """The concrete program at the given sizes (for the interpreter, the cost model and
    launchers); takes a symbolic program or one specialised by ``specialise``."""
    def concrete(n):
        if isinstance(n, Size):
            return values[n.name]
        return n.at(values) if isinstance(n, SymInt) else n
    out = _map_sizes(program, concrete)
    out.meta.pop("size_params", None)
    return out


def specialise(program: Program, values: dict[str, int], guards: "Guards") -> Program:
    """The program with every symbolic size a ``SymInt`` (computes with ``values``,
    prints as the kernel's runtime argument, records decisions in ``guards``)."""
    out = _map_sizes(program, lambda n: SymInt.symbol(n.name, values[n.name], guards)
                     if isinstance(n, Size) else n)
    out.meta["size_params"] = symbols(program)  # the kernels' runtime size arguments
    return out


def sizes_of(program: Program, tensors: dict) -> dict[str, int]:
    """Read every symbolic size off the input tensors' shapes; a size that two inputs
    disagree on is an error naming both."""
    values: dict[str, int] = {}
    seen: dict[str, str] = {}
    for ph in program.inputs:
        t = tensors[ph.name]
        if t.dim() != len(ph.shape):
            raise ProgramError(f"Expected {ph.name} with {len(ph.shape)} dims {tuple(ph.shape)}, "
                               f"got shape {tuple(t.shape)}.")
        for k, (want, got) in enumerate(zip(ph.shape, t.shape)):
            if isinstance(want, Size):
                if want.name in values and values[want.name] != got:
                    raise ProgramError(
                        f"Size {want.name} is {values[want.name]} in {seen[want.name]} but {got} in "
                        f"dim {k} of {ph.name} (shape {tuple(t.shape)}); inputs sharing a size "
                        "must agree on it.")
                if got == 0:
                    raise ProgramError(f"Expected size {want.name} (dim {k} of {ph.name}) to be "
                                       "positive, got 0.")
                values.setdefault(want.name, got)
                seen.setdefault(want.name, f"dim {k} of {ph.name}")
            elif want != got:
                raise ProgramError(f"Expected {ph.name} with shape {tuple(ph.shape)}, got "
                                   f"{tuple(t.shape)}; dim {k} must be {want} (only named sizes "
                                   "vary between calls).")
    return values


def bucket_of(values: dict[str, int]) -> tuple:
    """Sizes in one bucket share the power of two above them (1, 2, 3-4, 5-8, ...)."""
    return tuple(sorted((k, max(0, (v - 1).bit_length())) for k, v in values.items()))


def representative(values: dict[str, int]) -> dict[str, int]:
    """Where a bucket's choice is made: the top of the bucket (a power of two)."""
    return {k: 1 << max(0, (v - 1).bit_length()) for k, v in values.items()}


# ----------------------------------------------------------------------------------
# SymInt and guards
# ----------------------------------------------------------------------------------
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv,
        "%": operator.mod, "<": operator.lt, "<=": operator.le, ">": operator.gt,
        ">=": operator.ge, "==": operator.eq, "!=": operator.ne}


def _eval(e: tuple, v: dict[str, int]) -> int:
    """Evaluate an expression tree: ("sym", name) | ("const", c) | (op, a, b).  Trees,
    not lambdas, so kernels with their guards pickle into the on-disk cache."""
    tag = e[0]
    if tag == "sym":
        return v[e[1]]
    if tag == "const":
        return e[1]
    return _OPS[tag](_eval(e[1], v), _eval(e[2], v))


class Guards:
    """Decisions taken on symbolic sizes: (text, predicate tree, outcome)."""

    def __init__(self):
        self.items: list[tuple[str, tuple, bool]] = []

    def record(self, text: str, pred: tuple, outcome: bool) -> None:
        if all(t != text for t, _, _ in self.items):
            self.items.append((text, pred, outcome))

    def hold(self, values: dict[str, int]) -> bool:
        return all(bool(_eval(pred, values)) == outcome for _, pred, outcome in self.items)

    def __str__(self) -> str:
        return " and ".join(t if o else f"not ({t})" for t, _, o in self.items) or "always"


class SymInt:
    """An integer expression over symbolic sizes (see the module docstring)."""
    __slots__ = ("code", "hint", "expr", "guards")

    def __init__(self, code: str, hint: int, expr: tuple, guards: Guards):
        self.code, self.hint, self.expr, self.guards = code, hint, expr, guards

    def __getstate__(self):
        return (self.code, self.hint, self.expr, self.guards)

    def __setstate__(self, state):
        self.code, self.hint, self.expr, self.guards = state

    @staticmethod
    def symbol(name: str, hint: int, guards: Guards) -> "SymInt":
        return SymInt(f"n_{name}", hint, ("sym", name), guards)

    def at(self, values: dict[str, int]) -> int:
        return _eval(self.expr, values)

    @staticmethod
    def _parts(other):
        if isinstance(other, SymInt):
            return other.code, other.hint, other.expr
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return repr(other), other, ("const", other)
        return None

    # -- arithmetic builds expressions ------------------------------------------------
    def _op(self, other, sym: str, swap: bool = False):
        parts = self._parts(other)
        if parts is None:
            return NotImplemented
        if isinstance(parts[1], float):  # float arithmetic is cost estimation: the hint
            a, b = (other, float(self.hint)) if swap else (float(self.hint), other)
            return _OPS[sym](a, b)
        mine = (self.code, self.hint, self.expr)
        (ca, ha, ea), (cb, hb, eb) = (parts, mine) if swap else (mine, parts)
        return SymInt(f"({ca} {sym} {cb})", _OPS[sym](ha, hb), (sym, ea, eb), self.guards)

    def __add__(self, o): return self._op(o, "+")
    def __radd__(self, o): return self._op(o, "+", True)
    def __sub__(self, o): return self._op(o, "-")
    def __rsub__(self, o): return self._op(o, "-", True)
    def __mul__(self, o): return self._op(o, "*")
    def __rmul__(self, o): return self._op(o, "*", True)
    def __floordiv__(self, o): return self._op(o, "//")
    def __rfloordiv__(self, o): return self._op(o, "//", True)
    def __mod__(self, o): return self._op(o, "%")
    def __truediv__(self, o): return float(self.hint) / o   # cost estimation only
    def __rtruediv__(self, o): return o / float(self.hint)
    def __rmod__(self, o): return self._op(o, "%", True)

    def __neg__(self):
        return self._op(0, "-", True)

    # -- comparisons decide at the hint and record a guard ---------------------------
    def _cmp(self, other, sym: str) -> bool:
        parts = self._parts(other)
        if parts is None:
            return NotImplemented
        code, hint, expr = parts
        outcome = bool(_OPS[sym](self.hint, hint))
        if code != self.code:
            self.guards.record(f"{self.code} {sym} {code}", (sym, self.expr, expr), outcome)
        return outcome

    def __lt__(self, o): return self._cmp(o, "<")
    def __le__(self, o): return self._cmp(o, "<=")
    def __gt__(self, o): return self._cmp(o, ">")
    def __ge__(self, o): return self._cmp(o, ">=")
    def __eq__(self, o): return self._cmp(o, "==")  # type: ignore[override]
    def __ne__(self, o): return self._cmp(o, "!=")  # type: ignore[override]

    def __hash__(self) -> int:
        return hash(self.code)

    def __bool__(self) -> bool:
        return self != 0

    def __int__(self) -> int:
        """A plain int is needed here: true only at this exact value."""
        self.guards.record(f"{self.code} == {self.hint}", ("==", self.expr, ("const", self.hint)),
                           True)
        return self.hint

    __index__ = __int__

    def __float__(self) -> float:  # costs rank candidates; they decide nothing by themselves
        return float(self.hint)

    def __format__(self, spec: str) -> str:
        if spec:
            return format(int(self), spec)
        return self.code

    def __str__(self) -> str:
        return self.code

    def __repr__(self) -> str:  # programs print their specialised shapes symbolically
        return self.code


def value(x, values: dict[str, int]):
    """``x`` at the given sizes: a SymInt evaluated, anything else as it is."""
    return x.at(values) if isinstance(x, SymInt) else x


def names_in(x) -> set[str]:
    """The named sizes ``x`` reads: none for an int, the symbols of a SymInt's tree."""
    if not isinstance(x, SymInt):
        return set()
    out, stack = set(), [x.expr]
    while stack:
        e = stack.pop()
        if e[0] == "sym":
            out.add(e[1])
        elif e[0] != "const":
            stack.extend(e[1:])
    return out


def prod(xs: Iterable) -> "int | SymInt":
    return math.prod(xs, start=1)


# Element offsets past this overflow the kernels' int32 index arithmetic: a program id
# times a stride (``ax_z * k_s0``) is computed in 32 bits where both are (Triton makes an
# integer argument 64-bit only when it is >= 2^31 itself), and would address the wrong
# bytes -- a batched decode over a 256 x 8 x 32768 x 128 KV cache (2^33 elements) is past.
INDEX_LIMIT = 2 ** 31


def check_index_span(name: str, t) -> None:
    """Raise ``ProgramError`` where tensor ``t``'s last element lies ``INDEX_LIMIT`` or
    more elements past its first (from its shape and strides: a view counts as it is
    addressed), saying how to split the call."""
    span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n > 0)
    if span >= INDEX_LIMIT:
        raise ProgramError(
            f"Expected {name} to span fewer than 2^31 elements (the generated kernels compute "
            f"element offsets in 32-bit integers), got shape {tuple(t.shape)} with strides "
            f"{tuple(t.stride())}: its last element is {span} elements past its first. Split "
            "the call along the batch or heads so that each piece stays under 2^31.")

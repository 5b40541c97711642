"""The te-like DSL users write programs in.

    x   = ne.placeholder((N, M), "float32", "x")
    j   = ne.reduce_axis(M, "j")
    mx  = ne.compute((N,), lambda i: ne.max(x[i, j], axis=j), "mx")

Expressions are thin wrappers around ``ir.Term``; ``build_program`` collects the
definitions reachable from the outputs into an ``ir.Program``.
"""
from __future__ import annotations

import builtins
import inspect
import itertools
import math
from typing import Callable, Sequence

from .. import ir
from ..ir import ProgramError, Term
from ..sizes import Size, as_extent


class Expr:
    """An expression in the DSL; supports Python arithmetic and comparisons."""
    __slots__ = ("term",)

    def __init__(self, term: Term):
        self.term = term

    def _bin(self, op, other, swap=False):
        a, b = self.term, as_term(other)
        return Expr(Term(op, (b, a) if swap else (a, b)))

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __floordiv__(self, o): return self._bin("floordiv", o)
    def __mod__(self, o): return self._bin("mod", o)
    def __neg__(self): return Expr(Term("neg", (self.term,)))
    def __lt__(self, o): return self._bin("lt", o)
    def __le__(self, o): return self._bin("le", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __ge__(self, o): return self._bin("ge", o)
    def __eq__(self, o): return self._bin("eq", o)  # type: ignore[override]
    def __ne__(self, o): return self._bin("ne", o)  # type: ignore[override]
    __hash__ = None  # type: ignore[assignment]

    # Torch interop (FlexAttention mods written against torch): torch functions called on
    # an expression, its tensor methods, and the operators whose meaning depends on the
    # operands' dtype (& is logical on booleans, bitwise on integers) are translated by
    # neptune_eq.torch_mods, loaded on first use.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from . import torch_mods
        return torch_mods.dispatch(func, args, kwargs or {})

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        from . import torch_mods
        return torch_mods.attribute(self, name)

    def __bool__(self):
        raise ProgramError("A neptune_eq expression has no truth value while the program is "
                           "being written; use ne.where(cond, a, b) instead of if/and/or.")

    def __repr__(self):
        return f"Expr({ir.fmt(self.term)})"


def _via_torch(name: str):
    def op(*args):
        from . import torch_mods
        return torch_mods.operator(name, *args)
    op.__name__ = name
    return op


for _name in ("__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__invert__",
              "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__rfloordiv__",
              "__rmod__", "__pow__", "__rpow__", "__abs__", "__pos__"):
    setattr(Expr, _name, _via_torch(_name))
del _name


class IterVar(Expr):
    """An index variable: a compute axis or a reduce axis."""
    __slots__ = ("name", "extent", "is_reduce")

    def __init__(self, name: str, extent: int, is_reduce: bool):
        super().__init__(ir.var(name))
        self.name, self.extent, self.is_reduce = name, extent, is_reduce


def as_term(x) -> Term:
    if isinstance(x, Expr):
        return x.term
    if isinstance(x, float) and math.isinf(x):  # numerics contract: never -inf arithmetic
        return ir.const(ir.MASKED if x < 0 else -ir.MASKED)
    if isinstance(x, (bool, int, float)):
        return ir.const(x)
    if type(x).__module__.startswith("torch") or hasattr(x, "__torch_function__"):
        from . import torch_mods  # a captured torch tensor used as a value in a mod
        return torch_mods.to_term(x)
    raise ProgramError(f"Expected a neptune_eq expression or a number, got {type(x).__name__} "
                       f"({x!r}); build values with ne.placeholder/ne.compute and index them.")


def _check_extent(e, what: str) -> "int | Size":
    """A positive int, or a named symbolic size (``ne.size("S")`` or just ``"S"``)."""
    if isinstance(e, (str, Size)):
        return as_extent(e)
    if isinstance(e, bool) or not isinstance(e, int) or e <= 0:
        raise ProgramError(f"Expected {what} to be a positive int or a named size "
                           f"(ne.size('S') or 'S'), got {e!r}.")
    return e


class _Capture:
    """What one ``compute`` body touched: the tensors it read and the reduce axes it used."""

    def __init__(self):
        self.tensors: list["Tensor"] = []
        self.reduce_extents: dict[str, int] = {}


_CAPTURES: list[_Capture] = []
_CREATED = itertools.count()


class Tensor:
    """A placeholder or a computed tensor; index it to read it."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: "str | None",
                 definition: "tuple[tuple[str, ...], Term] | None",
                 capture: "_Capture | None" = None):
        self.name, self.shape, self.dtype = name, shape, dtype
        self._definition = definition  # None for placeholders
        self._order = next(_CREATED)  # placeholders keep the order they were declared in
        self._capture = capture or _Capture()
        # torch tensors the program's mods captured (ne.attention sets it on its output):
        # placeholder name -> tensor, the kernel inputs to pass after q, k, v
        self.captured: dict = {}

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, idx) -> Expr:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != self.ndim:
            raise ProgramError(f"Expected {self.ndim} indices for {self.name} with shape "
                               f"{self.shape}, got {len(idx)}; index every dimension.")
        op = "load" if self._definition is None else "ref"
        if _CAPTURES:
            _CAPTURES[-1].tensors.append(self)
        return Expr(Term(op, tuple(as_term(i) for i in idx), self.name))

    def __repr__(self):
        kind = "placeholder" if self._definition is None else "compute"
        return f"<{kind} {self.name}{list(self.shape)} {self.dtype}>"


_reduce_names: dict[str, itertools.count] = {}


def placeholder(shape: Sequence[int], dtype: str = "float32", name: str = "x") -> Tensor:
    """An input tensor of a fixed shape and dtype."""
    shape = tuple(_check_extent(s, f"every size of placeholder {name!r}") for s in shape)
    if dtype not in ir.DTYPES:
        raise ProgramError(f"Expected dtype in {ir.DTYPES} for placeholder {name!r}, got {dtype!r}.")
    _check_name(name)
    return Tensor(name, shape, dtype, None)


def reduce_axis(extent: "int | str | Size", name: str = "k") -> IterVar:
    """A reduction axis of the given extent (an int or a named size); use each one in
    exactly one reduction."""
    extent = _check_extent(extent, f"the extent of reduce axis {name!r}")
    _check_name(name)
    n = next(_reduce_names.setdefault(name, itertools.count()))
    return IterVar(name if n == 0 else f"{name}_{n}", extent, True)


def _check_name(name) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ProgramError(f"Expected a name that is a Python identifier, got {name!r}.")


def compute(shape: Sequence[int], fn: Callable[..., Expr], name: str = "t",
            dtype: str | None = None) -> Tensor:
    """``name[i, ...] = fn(i, ...)`` over ``shape``; the lambda's parameter names become
    the axis names."""
    shape = tuple(_check_extent(s, f"every size of compute {name!r}") for s in shape)
    _check_name(name)
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = [f"i{k}" for k in range(len(shape))]
    if len(params) != len(shape):
        raise ProgramError(f"compute {name!r}: shape {shape} has {len(shape)} dims but the "
                           f"function takes {len(params)} index arguments {params}.")
    if dtype is not None and dtype not in ir.DTYPES:
        raise ProgramError(f"Expected dtype in {ir.DTYPES} for compute {name!r}, got {dtype!r}.")
    axes = [IterVar(p, s, False) for p, s in zip(params, shape)]
    cap = _Capture()
    _CAPTURES.append(cap)
    try:
        body = as_term(fn(*axes))
    finally:
        _CAPTURES.pop()
    return Tensor(name, shape, dtype, (tuple(a.name for a in axes), body), cap)


def _reduce(op: str, expr, axis) -> Expr:
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    if not axes:
        raise ProgramError(f"ne.{op} needs axis=<a ne.reduce_axis>, got an empty list.")
    t = as_term(expr)
    for ax in reversed(axes):
        if not isinstance(ax, IterVar) or not ax.is_reduce:
            raise ProgramError(f"Expected axis= to be a ne.reduce_axis, got {ax!r}; create one "
                               f"with ne.reduce_axis(extent, name).")
        t = Term(op, (t,), ax.name)
        if _CAPTURES:
            _CAPTURES[-1].reduce_extents[ax.name] = ax.extent
    return Expr(t)


def sum(expr, axis) -> Expr:  # noqa: A001 - mirrors te.sum
    """Sum of ``expr`` over ``axis``."""
    return _reduce("sum", expr, axis)


def max(expr, axis) -> Expr:  # noqa: A001
    """Maximum of ``expr`` over ``axis``."""
    return _reduce("max", expr, axis)


def min(expr, axis) -> Expr:  # noqa: A001
    """Minimum of ``expr`` over ``axis``."""
    return _reduce("min", expr, axis)


def _unary(op):
    def f(x) -> Expr:
        return Expr(Term(op, (as_term(x),)))
    f.__name__ = op
    f.__doc__ = f"Elementwise {op}."
    return f


exp, exp2, log, tanh, sqrt, rsqrt, abs = (_unary(o) for o in  # noqa: A001
                                          ("exp", "exp2", "log", "tanh", "sqrt", "rsqrt", "abs"))


def maximum(a, b) -> Expr:
    """Elementwise maximum of two expressions."""
    return Expr(Term("maximum", (as_term(a), as_term(b))))


def minimum(a, b) -> Expr:
    """Elementwise minimum of two expressions."""
    return Expr(Term("minimum", (as_term(a), as_term(b))))


def where(cond, a, b) -> Expr:
    """``a`` where ``cond`` holds, else ``b``."""
    return Expr(Term("where", (as_term(cond), as_term(a), as_term(b))))


def cast(x, dtype: str) -> Expr:
    """Convert to ``dtype``."""
    if dtype not in ir.DTYPES:
        raise ProgramError(f"Expected a dtype in {ir.DTYPES}, got {dtype!r}.")
    return Expr(Term("cast", (as_term(x),), dtype))


# ----------------------------------------------------------------------------------
# Program assembly
# ----------------------------------------------------------------------------------
def build_program(outputs: "Tensor | Sequence[Tensor]") -> ir.Program:
    """Collect the definitions reachable from ``outputs`` into a validated program."""
    try:
        outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    except TypeError:  # not a tensor and not iterable (a number, None): said below
        outs = []
    if not outs or not all(isinstance(o, Tensor) for o in outs):
        raise ProgramError(f"Expected a ne.compute tensor or a list of them, got {outputs!r}.")
    for o in outs:
        if o._definition is None:
            raise ProgramError(f"Output {o.name!r} is a placeholder; outputs must be ne.compute "
                               "tensors.")
    tensors: dict[str, Tensor] = {}
    stack = list(outs)
    while stack:
        t = stack.pop()
        prev = tensors.get(t.name)
        if prev is not None:
            if prev is not t:
                raise ProgramError(f"Two different tensors are named {t.name!r}; give each a "
                                   "unique name.")
            continue
        tensors[t.name] = t
        stack.extend(t._capture.tensors)
    prog = _assemble(tensors, [o.name for o in outs])
    captured = [n for o in outs for n in o.captured]
    if captured:  # names only: a cached Kernel must not pin (or pickle) the user's tensors
        prog.meta["captured"] = captured
    return prog


def _assemble(tensors: dict[str, Tensor], outputs: list[str]) -> ir.Program:
    inputs, defs, extents = [], [], {}
    for t in sorted(tensors.values(), key=lambda t: t._order):
        if t._definition is None:
            inputs.append(ir.Placeholder(t.name, t.shape, t.dtype))
    for t in tensors.values():
        if t._definition is None:
            continue
        axes, body = t._definition
        rename = {}
        for a, s in zip(axes, t.shape):
            new = a
            k = 0
            while extents.get(new, s) != s:
                k += 1
                new = f"{a}{k}"
            extents[new] = s
            rename[a] = new
        if any(k != v for k, v in rename.items()):
            body = ir.substitute(body, {k: ir.var(v) for k, v in rename.items()})
        extents.update(t._capture.reduce_extents)
        defs.append(ir.Definition(t.name, tuple(rename[a] for a in axes), body,
                                  _infer_dtype(t, tensors)))
    prog = ir.Program(inputs, defs, extents, outputs)
    order = [n for n in _topo(prog) if n in {d.name for d in defs}]
    prog.defs = sorted(defs, key=lambda d: order.index(d.name))
    return ir.validate(prog)


def _topo(prog: ir.Program) -> list[str]:
    import networkx as nx
    g = prog.dataflow()
    if not nx.is_directed_acyclic_graph(g):
        ir.validate(prog)  # raises with the cycle
    return list(nx.lexicographical_topological_sort(g))


def _infer_dtype(t: Tensor, tensors: dict[str, Tensor]) -> str:
    """Explicit dtype wins; otherwise the widest float dtype among the inputs it reads."""
    if t.dtype is not None:
        return t.dtype
    rank = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}
    found = [tensors[n.val].dtype for n in t._definition[1].walk()
             if n.op == "load" and n.val in tensors]
    found = [d for d in found if d in rank]
    return builtins.max(found, key=lambda d: rank[d]) if found else "float32"


"""FlexAttention mods written against torch, run unchanged on DSL expressions.

``ne.attention`` calls a ``score_mod`` / ``mask_mod`` once with DSL expressions standing in
for the score and the indices.  Torch asks every argument of a torch function whether it
answers ``__torch_function__`` before running it; ``dsl.Expr`` does, and hands the call to
``dispatch`` here, which looks the torch callable up in ``TABLE`` (the one translation
table: torch callable -> builder of DSL terms).  Tensor methods on an expression
(``score.abs()``, ``q_idx.clamp(min=0)``) reach the same table through ``attribute``, and
Python operators the DSL does not define itself (``&``, ``^``, ``<<``, ...) through
``operator``.

Torch tensors a mod closes over become kernel inputs, as in FlexAttention: indexing one
with expressions reaches ``TABLE[Tensor.__getitem__]``, which ``torch_capture`` answers.

Numerics and exactness, by design:
* ``±inf`` constants become ``∓ir.MASKED`` (finite): the kernels never do -inf arithmetic.
* Ops without an IR op are expressed exactly through IR ops: relu = max(x, 0),
  sigmoid = 1/(1+exp(-x)), silu = x·sigmoid(x), gelu = x/2·(1+erf(x/√2)), tan = sin/cos,
  clamp = min(max(x, lo), hi), ``~n`` on integers = -n-1, ``a ^ b`` on booleans = a != b.
* Shifts by constants are index arithmetic: ``n << k = n·2^k`` (any n, modulo overflow)
  and ``n >> k = n // 2^k``, exact for the non-negative indices mods shift (the generated
  code's ``//`` truncates toward zero, which differs from an arithmetic shift for n < 0).
* Casts to a float dtype (``.float()``, ``.to(torch.float16)``) are the identity: every
  kernel computes in fp32 and the reference in fp64, so a narrowing cast inside a mod is
  not modelled.  Casts to integers truncate, as torch does.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from . import dsl
from ..ir import MASKED, ProgramError, Term, const
from .torch_capture import DTYPE_NAMES, View, capturing, dtype_of, getitem, scalar

__all__ = ["TABLE", "dispatch", "attribute", "operator", "capturing", "kind", "value",
           "condition", "split_masked", "is_masked_const", "supported", "to_term"]

FLOAT, INT, BOOL = "float", "int", "bool"
TRUE = Term("eq", (const(0), const(0)))   # boolean constants: the IR has no bool literal,
FALSE = Term("ne", (const(0), const(0)))  # and these evaluate and print everywhere
_KIND_OF_DTYPE = {"int32": INT, "int64": INT, "bool": BOOL}


# ----------------------------------------------------------------------------------
# Value kinds: torch decides between logical and bitwise ``&`` (and between true and
# integer results) by dtype, so the translation tracks whether a term is bool/int/float.
# ----------------------------------------------------------------------------------
def kind(t: Term) -> str:
    op = t.op
    if op in ("var", "int"):
        return INT
    if op in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"):
        return BOOL
    if op in ("load", "ref"):
        return _KIND_OF_DTYPE.get(dtype_of(t.val), FLOAT)
    if op == "cast":
        return _KIND_OF_DTYPE.get(t.val, FLOAT)
    if op in ("add", "sub", "mul", "maximum", "minimum", "floordiv", "mod", "neg", "abs",
              "bitand", "bitor", "bitxor", "where"):
        ks = {kind(a) for a in (t.args[1:] if op == "where" else t.args)}
        if FLOAT in ks or INT in ks:
            return FLOAT if FLOAT in ks else INT
        # booleans only: selecting keeps bool, arithmetic (True + True) promotes to int
        return BOOL if op in ("maximum", "minimum", "where") else INT
    return FLOAT  # flt, div, transcendental ops, reductions


# ----------------------------------------------------------------------------------
# Arguments and results
# ----------------------------------------------------------------------------------
def as_expr(x) -> dsl.Expr:
    """An argument of a torch call in a mod as an expression."""
    if isinstance(x, dsl.Expr):
        return x
    if isinstance(x, torch.Tensor):
        return scalar(x)
    if isinstance(x, View):
        raise x.incomplete()
    if isinstance(x, bool):
        return dsl.Expr(TRUE if x else FALSE)
    if isinstance(x, float) and math.isnan(x):
        raise ProgramError("Expected a number in a mod, got NaN; mask with float('-inf') instead.")
    return dsl.Expr(dsl.as_term(x))


def to_term(x) -> Term:
    """``dsl.as_term`` for what only mods produce: captured tensors and views."""
    return as_expr(x).term


def value(x, who: str) -> dsl.Expr:
    """A score_mod's result as a float expression."""
    e = as_expr(x)
    if kind(e.term) == BOOL:
        raise ProgramError(f"Expected {who} to return a score, got the boolean "
                           f"{dsl.ir.fmt(e.term)}; a mask belongs in mask_mod, or use "
                           "torch.where(cond, score, float('-inf')).")
    return e


def condition(x, who: str) -> dsl.Expr | None:
    """A mask_mod's result as a boolean expression; None when it is constantly true."""
    e = as_expr(x)
    if kind(e.term) != BOOL:
        raise ProgramError(f"Expected {who} to return a boolean (a comparison, & or |), got "
                           f"{dsl.ir.fmt(e.term)}; compare it, e.g. (...) != 0.")
    return None if e.term == TRUE else e


def is_masked_const(t: Term) -> bool:
    return t.op == "flt" and t.val <= MASKED


def split_masked(t: Term) -> tuple[Term, Term | None]:
    """``where(c, x, -inf)`` at the top of a score -> ``(x, c)``: the condition becomes part
    of the mask (a row it masks entirely returns 0, and an affine one becomes a loop
    bound).  Conditions that read the score itself stay where they are."""
    if t.op != "where":
        return t, None
    c, a, b = t.args
    if any(n.kind in ("reduce", "fold") for n in c.walk()):
        return t, None
    if is_masked_const(b):
        x, inner = split_masked(a)
        return x, _and(c, inner)
    if is_masked_const(a):
        x, inner = split_masked(b)
        return x, _and(Term("not", (c,)), inner)
    return t, None


def _and(a: Term, b: Term | None) -> Term:
    return a if b is None else Term("and", (a, b))


# ----------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------
def _E(op: str, *args) -> dsl.Expr:
    return dsl.Expr(Term(op, tuple(as_expr(a).term for a in args)))


def _unary(op: str) -> Callable:
    return lambda x, **kw: _E(op, x)


def _binary(op: str) -> Callable:
    return lambda a, b, **kw: _E(op, a, b)


def _arith(op: str) -> Callable:
    def f(a, b, *, alpha=1, out=None):
        return _E(op, a, b if alpha == 1 else _E("mul", b, alpha))
    return f


def _div(a, b, *, rounding_mode=None, out=None):
    if rounding_mode is None:
        return _E("div", a, b)
    if rounding_mode == "floor":
        return _E("floordiv", a, b)
    raise ProgramError(f"Expected rounding_mode None or 'floor' in torch.div inside a mod, got "
                       f"{rounding_mode!r}; 'trunc' differs from floor only for negative values: "
                       "use // on non-negative indices.")


def _sigmoid(x, **kw):
    return 1.0 / (1.0 + _E("exp", _E("neg", x)))


def _gelu(x, approximate="none", **kw):
    x = as_expr(x)
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + _E("tanh", inner))
    return 0.5 * x * (1.0 + _E("erf", x * (1.0 / math.sqrt(2.0))))


def _pow(a, b, **kw):
    if isinstance(b, (int, float)) and not isinstance(a, (int, float)):
        e = as_expr(a)
        if b == int(b) and 0 <= b <= 4:
            out = dsl.Expr(const(1))
            for _ in range(int(b)):
                out = out * e
            return out
        special = {0.5: lambda: _E("sqrt", e), -0.5: lambda: _E("rsqrt", e),
                   -1: lambda: 1.0 / e, -2: lambda: 1.0 / (e * e)}
        if b in special:
            return special[b]()
    if isinstance(a, (int, float)) and a > 0:  # c ** x = 2 ** (x·log2 c)
        return _E("exp2", as_expr(b) * math.log2(a))
    raise ProgramError(f"Expected x ** n with n in 0..4, ±0.5, -1, -2, or c ** x with a positive "
                       f"constant c inside a mod, got {_show(a)} ** {_show(b)}; write the power "
                       "with torch.exp/torch.log if the base is positive.")


def _clamp(x, min=None, max=None, **kw):  # noqa: A002 - torch's keyword names
    e = as_expr(x)
    if min is not None:
        e = _E("maximum", e, min)
    if max is not None:
        e = _E("minimum", e, max)
    return e


def _where(cond, a=None, b=None, **kw):
    if a is None or b is None:
        raise ProgramError("Expected torch.where(cond, x, y) in a mod, got the one-argument form "
                           "(it returns indices); pass both branches.")
    c = _truth(cond)
    if c == TRUE:
        return as_expr(a)
    if c == FALSE:
        return as_expr(b)
    return dsl.Expr(Term("where", (c, as_expr(a).term, as_expr(b).term)))


def _truth(x) -> Term:
    t = as_expr(x).term
    return t if kind(t) == BOOL else Term("ne", (t, const(0)))


def _logical(op: str) -> Callable:
    def f(a, b, **kw):
        x, y = _truth(a), _truth(b)
        return dsl.Expr(_fold_logic(op, x, y))
    return f


def _fold_logic(op: str, x: Term, y: Term) -> Term:
    """and/or with the constants and_masks/or_masks start from folded away."""
    unit, zero = (TRUE, FALSE) if op == "and" else (FALSE, TRUE)
    if x == unit or y == unit:
        return y if x == unit else x
    if x == zero or y == zero:
        return zero
    return Term(op, (x, y))


def _bitwise(logical: str, bitop: str) -> Callable:
    """``&``/``|``/``^`` as torch defines them: logical on two booleans, bitwise on integers."""
    def f(a, b, **kw):
        x, y = as_expr(a).term, as_expr(b).term
        kx, ky = kind(x), kind(y)
        if FLOAT in (kx, ky):
            raise ProgramError(f"Expected integer or boolean operands of {_SYMBOL[bitop]} in a "
                               f"mod, got {dsl.ir.fmt(x)} and {dsl.ir.fmt(y)} (a float); "
                               "bitwise ops are defined on indices and masks only.")
        if kx == ky == BOOL:
            return dsl.Expr(_fold_logic(logical, x, y) if logical != "ne" else Term("ne", (x, y)))
        return dsl.Expr(Term(bitop, (x, y)))
    return f


_SYMBOL = {"bitand": "&", "bitor": "|", "bitxor": "^"}


def _invert(x, **kw):
    t = as_expr(x).term
    k = kind(t)
    if k == BOOL:
        return dsl.Expr(FALSE if t == TRUE else TRUE if t == FALSE else Term("not", (t,)))
    if k == INT:
        return _E("sub", _E("neg", dsl.Expr(t)), 1)  # two's complement: ~n = -n - 1
    raise ProgramError(f"Expected an integer or boolean operand of ~ in a mod, got the float "
                       f"{dsl.ir.fmt(t)}; use -x or torch.logical_not.")


def _shift(left: bool, swap: bool = False) -> Callable:
    def f(a, b, **kw):
        x, n = (b, a) if swap else (a, b)
        if isinstance(n, dsl.Expr) and n.term.op == "int":
            n = n.term.val
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 63:
            raise ProgramError(f"Expected a shift by a constant 0..62 in a mod, got "
                               f"{_show(x)} {'<<' if left else '>>'} {_show(n)}; shifts are "
                               "index arithmetic here (n << k = n * 2**k, n >> k = n // 2**k).")
        if kind(as_expr(x).term) == FLOAT:
            raise ProgramError(f"Expected an integer operand of a shift, got {_show(x)}.")
        return _E("mul" if left else "floordiv", x, 2 ** n)
    return f


def _to(x, *args, **kw):
    dtype = kw.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
    return _cast(x, dtype)


def _cast(x, dtype):
    e = as_expr(x)
    k = kind(e.term)
    if dtype is None or dtype.is_floating_point:
        return e  # float casts are the identity (module docstring)
    if dtype == torch.bool:
        return e if k == BOOL else dsl.Expr(Term("ne", (e.term, const(0))))
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise ProgramError(f"Expected a cast to a float, int32, int64 or bool dtype in a mod, got "
                           f"{dtype}.")
    if k != FLOAT:
        return e
    if e.term.op == "flt":
        return dsl.Expr(const(int(e.term.val)))  # torch truncates toward zero
    return dsl.Expr(Term("cast", (e.term,), name))


def _full(fill) -> Callable:
    def f(x, *args, dtype=None, **kw):
        v = fill if fill is not None else (args[1] if len(args) > 1 else kw.get("fill_value"))
        size = args[0] if args else kw.get("size", ())
        if tuple(size) not in ((), (1,)):
            raise ProgramError(f"Expected a scalar (size ()) new tensor in a mod, got size "
                               f"{tuple(size)}; mods compute one element at a time.")
        if dtype == torch.bool:
            return dsl.Expr(TRUE if v else FALSE)
        if dtype is not None and dtype.is_floating_point:
            return dsl.Expr(const(float(v)))
        if dtype is None and isinstance(x, dsl.Expr) and kind(x.term) == FLOAT:
            return dsl.Expr(const(float(v)))
        return dsl.Expr(const(v))
    return f


def _like(fill) -> Callable:
    def f(x, *args, dtype=None, **kw):
        return _full(fill)(x, (), dtype=dtype)
    return f


def _binary_max(op: str) -> Callable:
    """torch.max(a, b) of two values; torch.max(x) / torch.max(x, dim) are reductions."""
    def f(a, b=None, *rest, **kw):
        if rest or kw or not isinstance(b, (dsl.Expr, torch.Tensor)):
            raise ProgramError(f"Expected torch.{'max' if op == 'maximum' else 'min'}(a, b) of two "
                               "values in a mod, got a reduction form; mods see one element, "
                               "so there is nothing to reduce.")
        return _E(op, a, b)
    return f


def _swap(builder: Callable) -> Callable:
    return lambda a, b, **kw: builder(b, a, **kw)


def _T(*names: str) -> tuple:
    """Tensor methods and operators by name (those this torch build has)."""
    return tuple(getattr(torch.Tensor, n) for n in names if hasattr(torch.Tensor, n))


def _fn(*objs) -> tuple:
    return tuple(o for o in objs if o is not None)


_sp = torch.special
# The translation table, as data: (torch callables, builder).  Every callable a mod may
# reach -- torch functions, torch.nn.functional, Tensor methods and operators -- is listed
# with the builder that writes it in DSL terms.
_ROWS: list[tuple[tuple, Callable]] = [
    (_fn(torch.exp) + _T("exp"), _unary("exp")),
    (_fn(torch.exp2, _sp.exp2) + _T("exp2"), _unary("exp2")),
    (_fn(torch.log) + _T("log"), _unary("log")),
    (_fn(torch.log2) + _T("log2"), lambda x, **kw: _E("log", x) * (1.0 / math.log(2.0))),
    (_fn(torch.tanh, F.tanh) + _T("tanh"), _unary("tanh")),
    (_fn(torch.sqrt) + _T("sqrt"), _unary("sqrt")),
    (_fn(torch.rsqrt) + _T("rsqrt"), _unary("rsqrt")),
    (_fn(torch.sin) + _T("sin"), _unary("sin")),
    (_fn(torch.cos) + _T("cos"), _unary("cos")),
    (_fn(torch.tan) + _T("tan"), lambda x, **kw: _E("div", _E("sin", x), _E("cos", x))),
    (_fn(torch.erf, _sp.erf) + _T("erf"), _unary("erf")),
    (_fn(torch.abs, torch.absolute) + _T("abs", "absolute", "__abs__"), _unary("abs")),
    (_fn(torch.neg, torch.negative) + _T("neg", "negative", "__neg__"), _unary("neg")),
    (_T("__pos__", "clone", "contiguous", "detach"), lambda x, *a, **kw: as_expr(x)),
    (_fn(torch.square) + _T("square"), lambda x, **kw: as_expr(x) * as_expr(x)),
    (_fn(torch.sigmoid, _sp.expit, F.sigmoid) + _T("sigmoid"), _sigmoid),
    (_fn(torch.relu, F.relu) + _T("relu"), lambda x, *a, **kw: _E("maximum", x, 0)),
    (_fn(F.silu), lambda x, *a, **kw: as_expr(x) * _sigmoid(x)),
    (_fn(F.gelu), _gelu),
    (_fn(torch.add) + _T("add", "__add__"), _arith("add")),
    (_T("__radd__"), _swap(_arith("add"))),
    (_fn(torch.sub, torch.subtract) + _T("sub", "subtract", "__sub__"), _arith("sub")),
    (_fn(torch.rsub) + _T("__rsub__"), _swap(_arith("sub"))),
    (_fn(torch.mul, torch.multiply) + _T("mul", "multiply", "__mul__"), _binary("mul")),
    (_T("__rmul__"), _swap(_binary("mul"))),
    (_fn(torch.div, torch.divide, torch.true_divide)
     + _T("div", "divide", "true_divide", "__truediv__"), _div),
    (_T("__rtruediv__", "__rdiv__"), _swap(_div)),
    (_fn(torch.floor_divide) + _T("floor_divide", "__floordiv__"), _binary("floordiv")),
    (_T("__rfloordiv__"), _swap(_binary("floordiv"))),
    (_fn(torch.remainder) + _T("remainder", "__mod__"), _binary("mod")),
    (_T("__rmod__"), _swap(_binary("mod"))),
    (_fn(torch.pow) + _T("pow", "__pow__"), _pow),
    (_T("__rpow__"), _swap(_pow)),
    (_fn(torch.maximum) + _T("maximum"), _binary("maximum")),
    (_fn(torch.minimum) + _T("minimum"), _binary("minimum")),
    (_fn(torch.max) + _T("max"), _binary_max("maximum")),
    (_fn(torch.min) + _T("min"), _binary_max("minimum")),
    (_fn(torch.clamp, torch.clip) + _T("clamp", "clip"), _clamp),
    (_fn(torch.clamp_min) + _T("clamp_min"), lambda x, m, **kw: _clamp(x, min=m)),
    (_fn(torch.clamp_max) + _T("clamp_max"), lambda x, m, **kw: _clamp(x, max=m)),
    (_fn(torch.lt, torch.less) + _T("lt", "less", "__lt__"), _binary("lt")),
    (_fn(torch.le, torch.less_equal) + _T("le", "less_equal", "__le__"), _binary("le")),
    (_fn(torch.gt, torch.greater) + _T("gt", "greater", "__gt__"), _binary("gt")),
    (_fn(torch.ge, torch.greater_equal) + _T("ge", "greater_equal", "__ge__"), _binary("ge")),
    (_fn(torch.eq) + _T("eq", "__eq__"), _binary("eq")),
    (_fn(torch.ne, torch.not_equal) + _T("ne", "not_equal", "__ne__"), _binary("ne")),
    (_fn(torch.logical_and) + _T("logical_and"), _logical("and")),
    (_fn(torch.logical_or) + _T("logical_or"), _logical("or")),
    (_fn(torch.logical_xor) + _T("logical_xor"),
     lambda a, b, **kw: dsl.Expr(Term("ne", (_truth(a), _truth(b))))),
    (_fn(torch.logical_not) + _T("logical_not"),
     lambda x, **kw: _invert(dsl.Expr(_truth(x)))),
    (_fn(torch.bitwise_and) + _T("bitwise_and", "__and__", "__rand__"), _bitwise("and", "bitand")),
    (_fn(torch.bitwise_or) + _T("bitwise_or", "__or__", "__ror__"), _bitwise("or", "bitor")),
    (_fn(torch.bitwise_xor) + _T("bitwise_xor", "__xor__", "__rxor__"), _bitwise("ne", "bitxor")),
    (_fn(torch.bitwise_not) + _T("bitwise_not", "__invert__"), _invert),
    (_fn(torch.bitwise_left_shift) + _T("bitwise_left_shift", "__lshift__"), _shift(True)),
    (_fn(torch.bitwise_right_shift) + _T("bitwise_right_shift", "__rshift__"), _shift(False)),
    (_T("__rlshift__"), _shift(True, swap=True)),
    (_T("__rrshift__"), _shift(False, swap=True)),
    (_fn(torch.where), _where),
    (_T("where"), lambda x, cond, other, **kw: _where(cond, x, other)),  # self is the "then"
    (_T("to", "type"), _to),
    (_T("float", "double", "half", "bfloat16"), lambda x, *a, **kw: as_expr(x)),
    (_T("int"), lambda x, *a, **kw: _cast(x, torch.int32)),
    (_T("long"), lambda x, *a, **kw: _cast(x, torch.int64)),
    (_T("bool"), lambda x, *a, **kw: _cast(x, torch.bool)),
    (_T("new_ones"), _full(1)),
    (_T("new_zeros"), _full(0)),
    (_T("new_full"), _full(None)),
    (_fn(torch.ones_like), _like(1)),
    (_fn(torch.zeros_like), _like(0)),
    (_T("__getitem__"), getitem),
]
TABLE: dict[Callable, Callable] = {fn: b for fns, b in _ROWS for fn in fns}
# Attributes of a scalar tensor that mods read (FlexAttention's indices are 0-d).
_PROPERTIES = {"shape": lambda e: torch.Size([]), "ndim": lambda e: 0,
               "device": lambda e: torch.device("cpu"), "is_cuda": lambda e: False,
               "dtype": lambda e: {FLOAT: torch.float32, INT: torch.int32,
                                   BOOL: torch.bool}[kind(e.term)]}
_SCALAR_METHODS = {"dim": 0, "numel": 1, "size": torch.Size([])}


def _show(x) -> str:
    return dsl.ir.fmt(x.term) if isinstance(x, dsl.Expr) else repr(x)


def _name(func) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    qual = qual.replace("_VariableFunctionsClass.", "").replace("TensorBase.", "Tensor.")
    if qual.startswith("Tensor."):
        return qual
    mod = getattr(func, "__module__", None) or "torch"
    mod = {"torch._C._nn": "torch.nn.functional", "torch._C._special": "torch.special",
           "torch._C._VariableFunctions": "torch"}.get(mod, mod)
    return f"{mod}.{qual}" if mod else qual


def supported() -> list[str]:
    """Names of the torch callables mods may use, for error messages and docs."""
    return sorted({_name(f) for f in TABLE})


def _unsupported(what: str) -> ProgramError:
    short = sorted({n.rsplit(".", 1)[-1] for n in supported()} - {""})
    short = [n for n in short if not n.startswith("_")]  # operators: listed by their names
    return ProgramError(f"Expected torch ops neptune_eq can translate inside a mod, got {what}. "
                        f"Supported: {', '.join(short)} (as torch functions, Tensor methods or "
                        "operators), plus indexing captured tensors. Try writing it with those, "
                        "or precompute it outside the mod into a captured tensor.")


def dispatch(func, args, kwargs) -> object:
    """``Expr.__torch_function__``: run the builder ``TABLE`` holds for ``func``."""
    builder = TABLE.get(func)
    if builder is None:
        raise _unsupported(_name(func))
    return builder(*args, **kwargs)


def attribute(e: dsl.Expr, name: str):
    """``expr.name`` for what the DSL does not define: tensor methods and properties."""
    if name in _PROPERTIES:
        return _PROPERTIES[name](e)
    if name in _SCALAR_METHODS:
        return lambda *a, **kw: _SCALAR_METHODS[name]
    fn = getattr(torch.Tensor, name, None)
    if fn is None:
        raise AttributeError(f"{type(e).__name__!r} object has no attribute {name!r}")
    builder = TABLE.get(fn)
    if builder is None:
        raise _unsupported(f"Tensor.{name}")
    return lambda *a, **kw: builder(e, *a, **kw)


def operator(name: str, *args):
    """A Python operator on an expression, routed through the torch table (``&``, ``^``,
    ``<<``... mean what they mean on torch tensors of the operands' kinds)."""
    return dispatch(getattr(torch.Tensor, name), args, {})

"""The e-graph's term language, declared in Python with explicit egglog names.

Rule files under ``rules/`` are written against exactly these names.  ``table.CONSTRUCTORS``
records, for every constructor, the loop-IR op it stands for and its argument kinds
(S string, I int, F float, T term, X index list); the structural rules (analyses and
substitution) are generated from that table, so a new constructor needs a method here
and one line there.
"""
from __future__ import annotations

from egglog import EGraph, Expr, Set, String, StringLike, f64Like, function, i64Like, method, relation


class Idx(Expr, egg_sort="Idx"):
    """A list of index expressions (the subscripts of a tensor access)."""

    @method(egg_fn="INil")
    @classmethod
    def nil(cls) -> Idx: ...

    @method(egg_fn="ICons")
    @classmethod
    def cons(cls, head: Term, tail: Idx) -> Idx: ...


class Term(Expr, egg_sort="Term"):
    """A loop-IR expression.  Producers are ``Acc`` (by name), never inlined."""

    @method(egg_fn="Var")
    @classmethod
    def var(cls, name: StringLike) -> Term: ...

    @method(egg_fn="Int")
    @classmethod
    def int_(cls, v: i64Like) -> Term: ...

    @method(egg_fn="Flt")
    @classmethod
    def flt(cls, v: f64Like) -> Term: ...

    @method(egg_fn="Load")
    @classmethod
    def load(cls, name: StringLike, idx: Idx) -> Term: ...

    @method(egg_fn="Acc")
    @classmethod
    def acc(cls, name: StringLike, idx: Idx) -> Term: ...

    @method(egg_fn="Run")
    @classmethod
    def run(cls, name: StringLike, idx: Idx) -> Term: ...

    @method(egg_fn="Prev")
    @classmethod
    def prev(cls, name: StringLike, idx: Idx) -> Term: ...

    @method(egg_fn="Neg")
    @classmethod
    def neg(cls, x: Term) -> Term: ...

    @method(egg_fn="Exp")
    @classmethod
    def exp(cls, x: Term) -> Term: ...

    @method(egg_fn="Exp2")
    @classmethod
    def exp2(cls, x: Term) -> Term: ...

    @method(egg_fn="Log")
    @classmethod
    def log(cls, x: Term) -> Term: ...

    @method(egg_fn="Tanh")
    @classmethod
    def tanh(cls, x: Term) -> Term: ...

    @method(egg_fn="Sqrt")
    @classmethod
    def sqrt(cls, x: Term) -> Term: ...

    @method(egg_fn="Rsqrt")
    @classmethod
    def rsqrt(cls, x: Term) -> Term: ...

    @method(egg_fn="Abs")
    @classmethod
    def abs_(cls, x: Term) -> Term: ...

    @method(egg_fn="Sin")
    @classmethod
    def sin(cls, x: Term) -> Term: ...

    @method(egg_fn="Cos")
    @classmethod
    def cos(cls, x: Term) -> Term: ...

    @method(egg_fn="Erf")
    @classmethod
    def erf(cls, x: Term) -> Term: ...

    @method(egg_fn="Not")
    @classmethod
    def not_(cls, x: Term) -> Term: ...

    @method(egg_fn="Cast")
    @classmethod
    def cast(cls, dtype: StringLike, x: Term) -> Term: ...

    @method(egg_fn="Add")
    @classmethod
    def add(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Sub")
    @classmethod
    def sub(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Mul")
    @classmethod
    def mul(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Div")
    @classmethod
    def div(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Maximum")
    @classmethod
    def maximum(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Minimum")
    @classmethod
    def minimum(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="FloorDiv")
    @classmethod
    def floordiv(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Mod")
    @classmethod
    def mod(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Lt")
    @classmethod
    def lt(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Le")
    @classmethod
    def le(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Gt")
    @classmethod
    def gt(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Ge")
    @classmethod
    def ge(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Eq")
    @classmethod
    def eq(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Ne")
    @classmethod
    def ne(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="And")
    @classmethod
    def and_(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Or")
    @classmethod
    def or_(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="BitAnd")
    @classmethod
    def bitand(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="BitOr")
    @classmethod
    def bitor(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="BitXor")
    @classmethod
    def bitxor(cls, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Where")
    @classmethod
    def where(cls, c: Term, a: Term, b: Term) -> Term: ...

    @method(egg_fn="Sum")
    @classmethod
    def sum(cls, axis: StringLike, body: Term) -> Term: ...

    @method(egg_fn="Max")
    @classmethod
    def max(cls, axis: StringLike, body: Term) -> Term: ...

    @method(egg_fn="Min")
    @classmethod
    def min(cls, axis: StringLike, body: Term) -> Term: ...

    @method(egg_fn="RollSum")
    @classmethod
    def rollsum(cls, axis: StringLike, body: Term, corr: Term) -> Term:
        """Fold ``t <- t*corr + sum_{j in block} body`` (see ir.py)."""

    @method(egg_fn="RollMax")
    @classmethod
    def rollmax(cls, axis: StringLike, body: Term, corr: Term) -> Term:
        """Fold ``t <- max(t + corr, max_{j in block} body)``."""

    @method(egg_fn="SplitK")
    @classmethod
    def splitk(cls, axis: StringLike, body: Term, corr: Term) -> Term:
        """The RollSum as parallel partial folds plus a combine re-based with ``corr``."""

    # Substitution helpers: a term with every producer read replaced by its running
    # value after (AtRun) or before (AtPrev) the current block.  Never extracted.
    @method(egg_fn="AtRun")
    @classmethod
    def at_run(cls, x: Term) -> Term: ...

    @method(egg_fn="AtPrev")
    @classmethod
    def at_prev(cls, x: Term) -> Term: ...


@function(egg_fn="AtRunI")
def at_run_idx(x: Idx) -> Idx: ...


@function(egg_fn="AtPrevI")
def at_prev_idx(x: Idx) -> Idx: ...


# Analyses.  Merged by intersection: if any member of an e-class avoids an axis (or a
# producer), the whole class does.
@function(egg_fn="free", merge=lambda old, new: old & new)
def free(t: Term) -> Set[String]:
    """Index variables a term depends on."""


@function(egg_fn="freeI", merge=lambda old, new: old & new)
def free_idx(t: Idx) -> Set[String]: ...


@function(egg_fn="uses", merge=lambda old, new: old & new)
def uses(t: Term) -> Set[String]:
    """Producers (reductions referenced by name) a term reads."""


@function(egg_fn="usesI", merge=lambda old, new: old & new)
def uses_idx(t: Idx) -> Set[String]: ...


# Separation relations used by the rolling-update rules (rules/rolling.egg):
#   Split(x, j, a, phi):    x = a * phi,  phi free of j, a free of producers
#   AddSplit(x, j, a, phi): x = a + phi,  same side conditions
WantSplit = relation("WantSplit", Term, String, egg_fn="WantSplit")
WantAdd = relation("WantAdd", Term, String, egg_fn="WantAdd")
Split = relation("Split", Term, String, Term, Term, egg_fn="Split")
AddSplit = relation("AddSplit", Term, String, Term, Term, egg_fn="AddSplit")

DECLARED = [getattr(Term, m) for m in dir(Term) if not m.startswith("_") and callable(getattr(Term, m))]


def declare(eg: EGraph) -> None:
    """Force every declaration into ``eg`` so text rules can name them."""
    for fn in DECLARED:
        eg.function_size(fn)
    for fn in (Idx.nil, Idx.cons, at_run_idx, at_prev_idx, free, free_idx, uses, uses_idx,
               WantSplit, WantAdd, Split, AddSplit):
        eg.function_size(fn)

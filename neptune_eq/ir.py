"""Loop IR: terms, named tensor definitions, the program, its printer and validator.

A program is a list of named definitions ``name[spatial axes] = body``.  Bodies are
``Term`` trees.  Producers are referenced by name (``ref``), never inlined, so the
e-graph stage can reason about a consumer as a function of its producer's value.

The same ``Term`` type carries the fused forms the rules derive:

* ``rollsum(axis; body, corr)`` -- a fold ``t <- t*corr + sum_{blk} body`` evaluated in
  blocks along ``axis`` together with the producers it reads;
* ``rollmax(axis; body, corr)`` -- a fold ``t <- max(t + corr, max_{blk} body)``;
* ``splitk(axis; body, corr)`` -- the rollsum computed as parallel partial folds over
  chunks of ``axis`` and a combine ``t = sum_p t_p * corr[prev := R_p, run := R]``;
* ``run(name)`` / ``prev(name)`` -- a producer's running value after / before the current
  block of that fold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:  # networkx loads on first use: `import neptune_eq` stays light
    import networkx as nx

# op -> (arity or None for "any", kind).  Kinds: leaf, index, unary, binary, select,
# reduce, fold.  The table is the single source of truth for the e-graph constructors,
# the interpreter and codegen.
OPS: dict[str, tuple[int | None, str]] = {
    "var": (0, "leaf"), "int": (0, "leaf"), "flt": (0, "leaf"),
    "load": (None, "access"), "ref": (None, "access"),
    "run": (None, "access"), "prev": (None, "access"),
    "neg": (1, "unary"), "exp": (1, "unary"), "exp2": (1, "unary"), "log": (1, "unary"),
    "tanh": (1, "unary"), "sqrt": (1, "unary"), "rsqrt": (1, "unary"), "abs": (1, "unary"),
    "cast": (1, "unary"), "not": (1, "unary"),
    "sin": (1, "unary"), "cos": (1, "unary"), "erf": (1, "unary"),
    "add": (2, "binary"), "sub": (2, "binary"), "mul": (2, "binary"), "div": (2, "binary"),
    "maximum": (2, "binary"), "minimum": (2, "binary"),
    "floordiv": (2, "binary"), "mod": (2, "binary"),
    "lt": (2, "binary"), "le": (2, "binary"), "gt": (2, "binary"), "ge": (2, "binary"),
    "eq": (2, "binary"), "ne": (2, "binary"), "and": (2, "binary"), "or": (2, "binary"),
    # bitwise ops on integer values (``and``/``or`` above are logical, on booleans)
    "bitand": (2, "binary"), "bitor": (2, "binary"), "bitxor": (2, "binary"),
    "where": (3, "select"),
    "sum": (1, "reduce"), "max": (1, "reduce"), "min": (1, "reduce"),
    "rollsum": (2, "fold"), "rollmax": (2, "fold"), "splitk": (2, "fold"),
}
REDUCERS = ("sum", "max", "min")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
DTYPES = FLOAT_DTYPES + ("int32", "int64", "bool")


class ProgramError(ValueError):
    """A program that cannot be compiled: the message says what was expected, what was
    given, and what to try."""


class ExtentError(ProgramError):
    """A tensor's dim read at an axis of another extent; ``tensor`` names it (a front end
    that made the tensor can say what the user wrote)."""

    def __init__(self, message: str, tensor: str):
        super().__init__(message)
        self.tensor = tensor


@dataclass(frozen=True)
class Term:
    """One node of the loop IR.  ``val`` holds the leaf value, the accessed tensor's
    name, the reduced axis, or the cast dtype."""
    op: str
    args: tuple["Term", ...] = ()
    val: object = None

    def __post_init__(self):
        if self.op not in OPS:
            raise ProgramError(f"Unknown op {self.op!r}; expected one of {sorted(OPS)}.")
        arity = OPS[self.op][0]
        if arity is not None and len(self.args) != arity:
            raise ProgramError(f"Op {self.op!r} takes {arity} operands, got {len(self.args)}.")

    # -- traversal -------------------------------------------------------------------
    def walk(self) -> Iterator["Term"]:
        """Pre-order traversal (shared subterms are visited once per occurrence)."""
        yield self
        for a in self.args:
            yield from a.walk()

    def map_args(self, fn) -> "Term":
        return Term(self.op, tuple(fn(a) for a in self.args), self.val)

    @property
    def kind(self) -> str:
        return OPS[self.op][1]

    def __str__(self) -> str:
        return fmt(self)

    def __repr__(self) -> str:
        return f"Term({fmt(self)})"


def var(name: str) -> Term:
    return Term("var", (), name)


def const(v: float | int | bool) -> Term:
    if isinstance(v, bool):
        return Term("int", (), int(v))
    return Term("int", (), v) if isinstance(v, int) else Term("flt", (), float(v))


MASKED = -1.0e30  # masked score / initial max: a large finite negative, never -inf


def positive_scale(t: Term) -> tuple[Term, float] | None:
    """(x, c) where ``t`` = x·c with a constant 1e-6 <= c <= 1e6, a scale a max or min
    commutes with (max_j(x·c) = c·max_j(x), exactly: rounding is monotone); the bounds keep
    a padding fill ``MASKED / c`` finite.  ``t`` is x·c or c·x, or a mask's select of
    one: where(p, x·c, d) = where(p, x, d/c)·c."""
    if t.op == "where" and t.args[2].op == "flt":
        inner = positive_scale(t.args[1])
        if inner is None:
            return None
        x, c = inner
        d = t.args[2].val / c
        if not abs(d) <= 1e37:  # a fill that would round to ±inf in fp32
            return None
        return Term("where", (t.args[0], x, Term("flt", (), d)), t.val), c
    if t.op != "mul":
        return None
    for x, c in (t.args, t.args[::-1]):
        if c.op == "flt" and 1e-6 <= c.val <= 1e6:
            return x, c.val
    return None


def substitute(t: Term, m: dict[str, Term]) -> Term:
    """Replace index variables by terms (``m``: name -> term)."""
    if t.op == "var" and t.val in m:
        return m[t.val]
    return t.map_args(lambda a: substitute(a, m))


def rename_axis(t: Term, old: str, new: str) -> Term:
    """Rename an index variable everywhere, including the reductions that bind it."""
    if t.op == "var" and t.val == old:
        return var(new)
    out = t.map_args(lambda a: rename_axis(a, old, new))
    if t.kind in ("reduce", "fold") and t.val == old:
        out = Term(t.op, out.args, new)
    return out


def free_axes(t: Term) -> frozenset[str]:
    """Index variables a term depends on (reductions and folds bind their axis)."""
    if t.op == "var":
        return frozenset([t.val])
    out = frozenset().union(*(free_axes(a) for a in t.args)) if t.args else frozenset()
    if t.kind in ("reduce", "fold"):
        out = out - {t.val}
    return out


def reads_data(t: Term) -> bool:
    """Whether a term reads a tensor -- as an index, its value comes from data
    (``offsets[doc[i]]``: lowering/data_indices.py)."""
    return any(n.op == "load" for n in t.walk())


def accessed(t: Term, ops=("ref", "run", "prev")) -> set[str]:
    """Names of the tensors a term reads through the given access ops."""
    return {n.val for n in t.walk() if n.op in ops}


def reachable(bodies: dict[str, Term], outputs) -> set[str]:
    """The definitions (name -> body) the outputs read, directly or through others."""
    need, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n not in need and n in bodies:
            need.add(n)
            stack.extend(accessed(bodies[n]))
    return need


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=",
          "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|",
          "floordiv": "//", "mod": "%"}


def fmt(t: Term) -> str:
    """Human-readable form, e.g. ``sum[j](exp(x[i, j] - mx[i]))``."""
    if t.op == "var":
        return str(t.val)
    if t.op in ("int", "flt"):
        return repr(t.val)
    if t.kind == "access":
        idx = ", ".join(fmt(a) for a in t.args)
        prefix = {"load": "", "ref": "", "run": "run:", "prev": "prev:"}[t.op]
        return f"{prefix}{t.val}[{idx}]"
    if t.op in _INFIX:
        return f"({fmt(t.args[0])} {_INFIX[t.op]} {fmt(t.args[1])})"
    if t.op == "neg":
        return f"-{fmt(t.args[0])}"
    if t.op == "cast":
        return f"cast<{t.val}>({fmt(t.args[0])})"
    if t.kind == "reduce":
        return f"{t.op}[{t.val}]({fmt(t.args[0])})"
    if t.kind == "fold":
        return f"{t.op}[{t.val}]({fmt(t.args[0])}; corr={fmt(t.args[1])})"
    return f"{t.op}({', '.join(fmt(a) for a in t.args)})"


@dataclass(frozen=True)
class Placeholder:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Definition:
    """``name[axes] = body``; ``axes`` are the spatial index variables, in order."""
    name: str
    axes: tuple[str, ...]
    body: Term
    dtype: str

    @property
    def is_reduction(self) -> bool:
        """True when the value needs a reduction: such a definition is a *producer* and
        is referenced by name, never inlined."""
        return any(n.kind in ("reduce", "fold") for n in self.body.walk())


@dataclass
class Program:
    """Placeholders, definitions in dependency order, the extent of every index
    variable, and which definitions are outputs."""
    inputs: list[Placeholder]
    defs: list[Definition]
    extents: dict[str, int]
    outputs: list[str]
    meta: dict = field(default_factory=dict)

    def definition(self, name: str) -> Definition:
        for d in self.defs:
            if d.name == name:
                return d
        raise KeyError(name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        for p in self.inputs:
            if p.name == name:
                return p.shape
        return tuple(self.extents[a] for a in self.definition(name).axes)

    def dtype_of(self, name: str) -> str:
        for p in self.inputs:
            if p.name == name:
                return p.dtype
        return self.definition(name).dtype

    def dataflow(self) -> "nx.DiGraph":
        """Edges producer -> consumer over placeholders and definitions."""
        import networkx as nx
        g = nx.DiGraph()
        for p in self.inputs:
            g.add_node(p.name, kind="input")
        for d in self.defs:
            g.add_node(d.name, kind="def")
            for n in d.body.walk():
                if n.kind == "access":
                    g.add_edge(n.val, d.name)
        return g

    def with_defs(self, defs: Iterable[Definition]) -> "Program":
        return Program(list(self.inputs), list(defs), dict(self.extents), list(self.outputs),
                       dict(self.meta))

    def __str__(self) -> str:
        return format_program(self)


def split_out(program: Program, pick, dtype: str | None = None) -> Program:
    """``program`` with the subterms ``pick(d)`` lists in each definition's body made
    producers of their own -- over the definition's axes they read, named after it and
    the term's op (``mean_sum``), in ``dtype`` (None: the definition's) -- and read back
    by ref; the same program when nothing is picked (no copy).  The lowering splits out
    nested reductions so the rules can fuse them (``lowering.inline``), autodiff a
    reduction a body reads twice (``frontend.autodiff``)."""
    taken = {ph.name for ph in program.inputs} | {d.name for d in program.defs}
    defs: list[Definition] = []
    changed = False
    for d in program.defs:
        table: dict[Term, Term] = {}
        for t in pick(d):
            name = fresh_name(f"{d.name}_{t.op}", taken)
            axes = tuple(a for a in d.axes if a in free_axes(t))
            defs.append(Definition(name, axes, t, dtype or d.dtype))
            table[t] = Term("ref", tuple(var(a) for a in axes), name)
        changed |= bool(table)
        defs.append(Definition(d.name, d.axes, replace_terms(d.body, table), d.dtype)
                    if table else d)
    return program.with_defs(defs) if changed else program


def replace_terms(t: Term, table: dict[Term, Term]) -> Term:
    """``t`` with every subterm found in ``table`` replaced by its entry."""
    if t in table:
        return table[t]
    return t.map_args(lambda a: replace_terms(a, table))


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base2``, ``base3``, … -- the first not in ``taken`` (which gains it)."""
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}{k}"
    taken.add(name)
    return name


def canonical_text(p: Program) -> str:
    """The program's text with reduce axes renamed in order of appearance (r0, r1, …):
    two builds of the same computation get the same text whatever the DSL named the axes."""
    lines = [f"input {ph.name}{list(ph.shape)}:{ph.dtype}" for ph in p.inputs]
    for d in p.defs:
        body, k = d.body, 0
        for n in list(d.body.walk()):
            if n.kind in ("reduce", "fold") and not n.val.startswith("@r"):
                old = n.val
                if any(m.kind in ("reduce", "fold") and m.val == old for m in body.walk()):
                    body = rename_axis(body, old, f"@r{k}")
                    k += 1
        lines.append(f"{d.name}[{','.join(d.axes)}]:{d.dtype} = {fmt(body)}")
    lines.append("outputs " + ",".join(p.outputs))
    return "\n".join(lines)


def format_program(p: Program) -> str:
    lines = []
    for ph in p.inputs:
        lines.append(f"input {ph.name}{list(ph.shape)} : {ph.dtype}")
    for d in p.defs:
        axes = ", ".join(d.axes)
        mark = "  <- output" if d.name in p.outputs else ""
        lines.append(f"{d.name}[{axes}] = {fmt(d.body)}{mark}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------
def validate(p: Program) -> Program:
    """Check a program and raise ``ProgramError`` naming the definition and the fix."""
    names = [ph.name for ph in p.inputs] + [d.name for d in p.defs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ProgramError(f"Expected unique tensor names, got {sorted(dup)} more than once; "
                           "give each placeholder/compute a distinct name.")
    if not p.outputs:
        raise ProgramError("Expected at least one output definition, got none.")
    known = set(names)
    import networkx as nx
    graph = p.dataflow()
    missing = [n for n in graph.nodes if n not in known]
    if missing:
        raise ProgramError(f"Definitions read unknown tensors {sorted(missing)}; "
                           "declare them with ne.placeholder or ne.compute.")
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise ProgramError(f"Expected acyclic definitions, got the cycle {cycle}; a tensor "
                           "cannot depend on itself.")
    seen_reduce: dict[str, tuple[str, Term]] = {}
    for d in p.defs:
        _validate_definition(p, d, seen_reduce)
    return p


def _validate_definition(p: Program, d: Definition, seen_reduce: dict[str, tuple[str, Term]]) -> None:
    bound = set(d.axes)
    for a in d.axes:
        if a not in p.extents:
            raise ProgramError(f"{d.name}: axis {a!r} has no extent.")

    def check(t: Term, scope: set[str]) -> None:
        if t.op == "var" and t.val not in scope:
            raise ProgramError(
                f"{d.name}: index variable {t.val!r} is not bound here (bound: {sorted(scope)}); "
                f"reduce over it with ne.sum/ne.max(..., axis={t.val}) or use a compute axis.")
        if t.kind in ("reduce", "fold"):
            ax = t.val
            if ax in scope:
                raise ProgramError(f"{d.name}: axis {ax!r} is reduced inside a scope that already "
                                   "binds it; use a fresh ne.reduce_axis.")
            owner = seen_reduce.setdefault(ax, (d.name, t))
            if owner[1] != t:
                raise ProgramError(
                    f"{d.name}: reduce axis {ax!r} is already used by another reduction (in "
                    f"{owner[0]}); create one ne.reduce_axis per reduction.")
            for a in t.args:
                check(a, scope | {ax})
            return
        if t.kind == "access":
            shape = p.shape_of(t.val)
            if len(t.args) != len(shape):
                raise ProgramError(
                    f"{d.name}: {t.val} has {len(shape)} dims {shape}, indexed with "
                    f"{len(t.args)} indices; index it as {t.val}[{', '.join('_' * 1 for _ in shape)}].")
            for k, (ix, ext) in enumerate(zip(t.args, shape)):
                n = p.extents.get(ix.val) if ix.op == "var" else None
                # An input may be read in a prefix of a dimension along a spatial axis (a
                # captured (4, S) table indexed by a batch axis of 1); a reduction must cover
                # the dimension, and a producer is read over its own axes.
                prefix_ok = (t.op == "load" and ix.val in d.axes and isinstance(n, int)
                             and isinstance(ext, int) and n < ext)
                if n is not None and n != ext and not prefix_ok:
                    raise ExtentError(
                        f"{d.name}: dim {k} of {t.val} has extent {ext} but is indexed by "
                        f"{ix.val!r} of extent {p.extents[ix.val]}; use an axis of extent {ext} "
                        "or a computed index.", t.val)
        for a in t.args:
            check(a, scope)

    check(d.body, bound)

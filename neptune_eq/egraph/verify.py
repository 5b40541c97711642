"""Soundness checks: of rule files, and of every fold the rules derive.

* ``check_fold`` proves Neptune's conditions for one fold: Eq. 3
  ``h(g(r, c), r, r') = g(r', c)`` with sympy (falling back to random points), and Eq. 4
  ``h(x ⊕ y) = h(x) ⊕ h(y)``, which for ``h(t) = t·corr`` (sum) or ``t + corr`` (max)
  holds exactly when ``corr`` is free of the loop axis.
* ``check_rule_file`` checks every rule of a file: symbolically with sympy when both
  sides are plain algebra, otherwise on random inputs through the reference interpreter
  (side conditions such as "c does not depend on j" shape the random instances).  Rules
  that only add separation facts (``Split``…) are checked at every firing instead, through
  ``check_fold`` of the fold they produce.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import sympy
import torch

from .table import CONSTRUCTORS
from ..interp import evaluate
from ..ir import Definition, Placeholder, Program, Term, const, free_axes, var

_SYM_UNARY = {"exp": sympy.exp, "exp2": lambda x: 2 ** x, "log": sympy.log, "sqrt": sympy.sqrt,
              "rsqrt": lambda x: 1 / sympy.sqrt(x), "tanh": sympy.tanh, "abs": sympy.Abs,
              "neg": lambda x: -x, "sin": sympy.sin, "cos": sympy.cos, "erf": sympy.erf}


_SYM_BINARY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
               "div": lambda a, b: a / b, "maximum": sympy.Max, "minimum": sympy.Min,
               "lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge,
               "eq": sympy.Eq, "ne": sympy.Ne, "and": sympy.And, "or": sympy.Or}
_SYM_LOGIC = ("eq", "ne", "and", "or")  # (sympy takes booleans there as they are)
_CONDITIONS = ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not")


def _number(t: Term, subst: dict, positive: bool) -> sympy.Basic:
    """An operand of arithmetic in sympy.  A condition there is the 0 or 1 torch makes of
    it (``score * (kv_idx <= q_idx)``): an opaque symbol where it reads no running value
    (as index arithmetic is; a Piecewise there sent simplify into an expansion that
    filled memory), else no algebraic form."""
    if t.op not in _CONDITIONS:
        return to_sympy(t, subst, positive)
    if _reads_running(t):
        raise NotAlgebraic(f"{t.op} used as a number")
    return _opaque(t)


# Integer index arithmetic (masks: batchify, dilated windows, NATTEN, Morton codes) has no
# useful sympy form: such a subterm, and a where's condition, that reads no running value
# is an opaque symbol, like an access.  Sound for proofs (equal text, equal symbol; an
# identity that holds for every value of the symbol holds for its value), and it keeps
# sympy from expanding a large mask (a Morton decode is thousands of nodes as a tree).
_OPAQUE_INDEX_OPS = ("floordiv", "mod", "bitand", "bitor", "bitxor")


def _reads_running(t: Term) -> bool:
    return any(n.op in ("run", "prev") for n in t.walk())


def _opaque(t: Term) -> sympy.Symbol:
    """A symbol standing for ``t``; named by a digest so distinct terms never collide."""
    return sympy.Symbol("opaque_" + hashlib.sha256(str(t).encode()).hexdigest()[:16], real=True)


def _opaque_condition(t: Term) -> sympy.Basic:
    """A condition as ``symbol > 7/4``: free to be true or false in a proof, and the random
    points of check_fold (uniform in [0.5, 3]) take both branches."""
    return sympy.Gt(_opaque(t), sympy.Rational(7, 4))


class NotAlgebraic(Exception):
    pass


@lru_cache(maxsize=1024, typed=True)
def _exact(value) -> sympy.Expr:
    """A constant as sympy's simplest exact form (``1.4426950408889634`` -> ``1/log(2)``,
    so exp2(x·log2 e) = exp(x) is provable).  Kept per value: the search behind it
    (mpmath's ``identify``) took 0.26 of an attention build's 2.0 s under cProfile, for
    the same few constants (log2 e, the softmax scale) in every build."""
    return sympy.nsimplify(value)


def to_sympy(t: Term, subst: dict[str, sympy.Symbol] | None = None, positive=False) -> sympy.Expr:
    """Algebraic terms -> sympy.  Accesses and inner reductions become opaque symbols
    (``subst`` can rename producer reads, e.g. run:mx -> mx_new)."""
    subst = subst or {}
    if t.op in ("int", "flt"):
        return _exact(t.val)
    if t.kind == "access" or t.kind in ("reduce", "fold") or t.op == "var":
        key = f"{t.op}:{t.val}" if t.op in ("run", "prev") else str(t)
        if key in subst:
            return subst[key]
        name = re.sub(r"\W+", "_", str(t)).strip("_") or "v"
        return sympy.Symbol(name, real=True, positive=positive or None)
    if t.op in _SYM_UNARY:
        return _SYM_UNARY[t.op](_number(t.args[0], subst, positive))
    if t.op in _SYM_BINARY:
        if t.op in _SYM_LOGIC:
            return _SYM_BINARY[t.op](*(to_sympy(a, subst, positive) for a in t.args))
        return _SYM_BINARY[t.op](*(_number(a, subst, positive) for a in t.args))
    if t.op in _OPAQUE_INDEX_OPS and not _reads_running(t):
        return _opaque(t)
    if t.op == "where":
        c = (to_sympy(t.args[0], subst, positive) if _reads_running(t.args[0])
             else _opaque_condition(t.args[0]))
        a, b = (to_sympy(x, subst, positive) for x in t.args[1:])
        return sympy.Piecewise((a, c), (b, True))
    if t.op == "not":
        return sympy.Not(to_sympy(t.args[0], subst, positive))
    raise NotAlgebraic(t.op)


@dataclass
class FoldCheck:
    fold: str
    eq3: bool
    eq4: bool
    method: str
    detail: str = ""
    bounded: bool = True  # its exponentials cannot overflow mid-loop (``_bounded_exps``)

    @property
    def ok(self) -> bool:
        return self.eq3 and self.eq4 and self.bounded


def check_fold(t: Term, max_producers: frozenset[str] | None = None) -> FoldCheck:
    """Eq. 3 and Eq. 4 for a rollsum/rollmax/splitk term, and -- given the producers that
    are maxima (``max_producers``; None skips it) -- that its exponentials stay bounded
    in floating point (``_bounded_exps``)."""
    body, corr = t.args
    if max_producers is not None:
        why = _unbounded_exp(body, corr, max_producers)
        if why:
            return FoldCheck(str(t), True, True, "floating point", why, bounded=False)
    eq4 = t.val not in free_axes(corr) and not any(n.kind == "fold" for n in corr.walk())
    producers = {n.val for n in body.walk() if n.op == "run"} | {n.val for n in corr.walk()
                                                                  if n.op in ("run", "prev")}
    old = {f"run:{r}": sympy.Symbol(f"{r}_old", real=True) for r in producers}
    new = {f"run:{r}": sympy.Symbol(f"{r}_new", real=True) for r in producers}
    hsub = {**{f"prev:{r}": old[f"run:{r}"] for r in producers}, **new}
    try:
        g_old, g_new = to_sympy(body, old), to_sympy(body, new)
        h = to_sympy(corr, hsub)
    except NotAlgebraic as e:
        return FoldCheck(str(t), False, eq4, "unsupported", f"op {e} has no sympy form")
    lhs = h * g_old if t.op in ("rollsum", "splitk") else h + g_old
    diff = sympy.piecewise_fold(sympy.expand_log(lhs - g_new, force=True))
    if _expands_to_zero(diff):
        return FoldCheck(str(t), True, eq4, "sympy")
    diff = sympy.simplify(diff)
    if diff == 0:
        return FoldCheck(str(t), True, eq4, "sympy")
    # Not proved symbolically: random points (positive, where sqrt/log need it).
    syms = sorted(diff.free_symbols, key=str)
    rng = random.Random(0)
    for _ in range(20):
        point = {s: rng.uniform(0.5, 3.0) for s in syms}
        val = complex(diff.subs(point).evalf())
        scale = 1 + abs(complex(g_new.subs(point).evalf()))
        if abs(val) > 1e-9 * scale:
            return FoldCheck(str(t), False, eq4, "random", f"counter-example {point}: "
                             f"h·g(r,c) − g(r',c) = {val.real:.3g}")
    return FoldCheck(str(t), True, eq4, "random (20 points)")


def _expands_to_zero(e: sympy.Expr) -> bool:
    """``e`` is 0 by expansion and power rules that hold for every value (no ``force``),
    branch by branch for a ``Piecewise``: every fold of the shipped rules is proved so
    in 2-10 ms, where ``simplify`` took 9-33 ms each (and a first call imports sympy's
    units, ~0.3 s) on the CPU machine.  False means "not shown", and ``simplify`` tries."""
    branches = [a for a, _ in e.args] if isinstance(e, sympy.Piecewise) else [e]
    return all(sympy.expand(sympy.powsimp(sympy.expand(b))) == 0 for b in branches)


def _unbounded_exp(body: Term, corr: Term, max_producers: frozenset[str]) -> str:
    """Why a fold's exponentials may overflow mid-loop ("" if they cannot).

    The rolling identity is exact in real arithmetic for any producer, but a fold
    evaluates exp(a - R) at every *running* value of R.  For a running maximum entering
    with a negative sign (FlashAttention's exp(s - m), exp(m_prev - m)) the exponent only
    shrinks as the loop goes.  A running sum does not: its partial values wander
    (Σ x over scores of magnitude 30 passes -100 on its way to 28), exp(x - R) overflows
    fp32 where exp(x - Σx) is finite, and the fold returns inf·0 = NaN (found by
    tests/test_fuzz.py).  Such folds are banned; the two-pass program is kept."""
    for n in [*body.walk(), *corr.walk()]:
        if n.op not in ("exp", "exp2"):
            continue
        running = {m.val for m in n.args[0].walk() if m.op in ("run", "prev")}
        not_max = sorted(running - max_producers)
        if not_max:
            return f"exp reads the running value of {not_max[0]}, which is not a maximum"
        syms = {r: sympy.Symbol(f"{r}_run", real=True) for r in running}
        try:
            expo = to_sympy(n.args[0], {**{f"run:{r}": s for r, s in syms.items()},
                                        **{f"prev:{r}": s for r, s in syms.items()}})
        except NotAlgebraic as e:  # (not shown bounded: refused, as unbounded)
            return f"exp's exponent has no algebraic form ({e})"
        for r, s in syms.items():
            slope = sympy.diff(expo, s)
            if not (slope.is_number and slope <= 0):
                return f"exp grows with the running maximum {r} (slope {slope})"
    return ""


# ----------------------------------------------------------------------------------
# Rule files
# ----------------------------------------------------------------------------------
def _parse_sexpr(text: str):
    tokens = re.findall(r'\(|\)|"[^"]*"|[^\s()]+', text)
    pos = 0

    def read():
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "(":
            out = []
            while tokens[pos] != ")":
                out.append(read())
            pos += 1
            return out
        return tok
    out = []
    while pos < len(tokens):
        out.append(read())
    return out


@dataclass
class RuleCheck:
    name: str
    where: str
    status: str      # "proved", "tested", "per-firing", "unchecked", "UNSOUND"
    method: str
    detail: str = ""


class _Instantiator:
    """Builds IR terms for a rule's pattern with random leaves for its variables."""
    EXT = {"i": 3, "j": 5}

    def __init__(self, free_of_j: set[str], no_producer: set[str]):
        self.free_of_j, self.no_producer = free_of_j, no_producer
        self.leaves: dict[str, Term] = {}
        self.consts: dict[str, float] = {}
        self.folds = False

    def number(self, pat) -> float:
        """A float literal, a float pattern variable (a random constant), or f64 math."""
        if isinstance(pat, list):
            a, b = (self.number(x) for x in pat[1:3])
            return {"*": a * b, "+": a + b, "-": a - b, "/": a / b}[pat[0]]
        try:
            return float(pat)
        except ValueError:
            return self.consts.setdefault(pat, round(random.Random(pat).uniform(0.5, 2.0), 3))

    def leaf(self, v: str) -> Term:
        if v not in self.leaves:
            axes = ("i",) if v in self.free_of_j else ("i", "j")
            self.leaves[v] = Term("load", tuple(var(a) for a in axes), f"p_{v}")
        return self.leaves[v]

    def build(self, pat) -> Term:
        if isinstance(pat, str):
            if pat[0].isdigit() or pat[0] == "-":
                return const(float(pat))
            return self.leaf(pat)
        head, args = pat[0], pat[1:]
        if head not in CONSTRUCTORS:
            raise NotAlgebraic(head)
        op, kinds = CONSTRUCTORS[head]
        if op in ("flt", "int"):
            return const(self.number(args[0]) if op == "flt" else int(args[0]))
        if kinds.startswith("S") and kinds != "S":
            axis = "j"
            if op in ("rollsum", "rollmax", "splitk"):
                # Folds only arise from the rolling rules, so a fold pattern's variables
                # are bound to a valid fold (softmax's denominator: Eq. 3 holds).
                self.folds = True
                body, corr = _valid_fold()
                for v, t in zip(args[1:], (body, corr)):
                    if isinstance(v, str) and v not in self.leaves:
                        self.leaves[v] = t
            rest = [self.build(a) for a in args[1:]]
            return Term(op, tuple(rest), axis)
        if op in ("load", "ref", "run", "prev", "var", "cast"):
            raise NotAlgebraic(head)
        return Term(op, tuple(self.build(a) for a in args))


def _valid_fold() -> tuple[Term, Term]:
    """Body and correction of a valid fold: Σ_j exp(x_j − m) with h = exp(m − m')."""
    run, prev = Term("run", (var("i"),), "m"), Term("prev", (var("i"),), "m")
    body = Term("exp", (Term("sub", (Term("load", (var("i"), var("j")), "p_x"), run)),))
    corr = Term("exp", (Term("sub", (prev, run)),))
    return body, corr


# Random inputs for rule checks: positive values first (where log/sqrt are defined), then
# signed and large-magnitude ones, so a rule that only holds for x > 0 (e.g. √(a·a) = a)
# is refuted rather than passed.
INPUT_RANGES = ((0.5, 3.0), (-3.0, 3.0), (-40.0, 40.0))


def _program(inst: _Instantiator, terms: dict[str, Term],
             lo_hi: tuple[float, float] = INPUT_RANGES[0]) -> tuple[Program, dict]:
    extents = dict(_Instantiator.EXT)
    inputs, data = [], {}
    leaves = {v: t for v, t in inst.leaves.items() if t.op == "load"}
    if inst.folds:
        leaves["x"] = Term("load", (var("i"), var("j")), "p_x")
    for v, t in leaves.items():
        shape = tuple(extents[a.val] for a in t.args)
        inputs.append(Placeholder(t.val, shape, "float64"))
        lo, hi = lo_hi
        data[t.val] = torch.rand(shape, dtype=torch.float64) * (hi - lo) + lo
    defs = []
    if inst.folds:
        defs.append(Definition("m", ("i",), Term("max", (Term("load", (var("i"), var("k")), "p_x"),), "k"),
                               "float64"))
        extents["k"] = extents["j"]
    for name, t in terms.items():
        axes = tuple(a for a in ("i", "j") if a in free_axes(t))
        defs.append(Definition(name, axes, t, "float64"))
    return Program(inputs, defs, extents, list(terms)), data


def _conditions(body: list) -> tuple[set[str], set[str], bool]:
    """Side conditions in a rule's query: which variables are free of j / read no
    producer; and whether the query holds anything else (relations)."""
    alias, free_of, no_prod, other = {}, set(), set(), False
    for atom in body:
        if atom[0] == "=" and isinstance(atom[2], list) and atom[2][0] in ("free", "uses"):
            if isinstance(atom[1], str):
                alias[atom[1]] = (atom[2][0], atom[2][1])
            elif atom[2][0] == "uses":
                no_prod.add(atom[2][1])
        elif atom[0] == "=" and isinstance(atom[1], list) and atom[1][0] == "uses":
            no_prod.add(atom[1][1])
        elif atom[0] == "set-not-contains" and atom[1] in alias:
            free_of.add(alias[atom[1]][1])
        elif atom[0] == "=" and isinstance(atom[2], list) and atom[2][0] in CONSTRUCTORS:
            continue
        else:
            other = True
    return free_of, no_prod, other


def check_rule_file(path: str | Path, trials: int = 3) -> list[RuleCheck]:
    """Check every rule in a rule file (see the module docstring)."""
    from .rulefiles import parse_rule_file
    _, infos = parse_rule_file(path)
    out = []
    for info in infos:
        form = _parse_sexpr(info.source)[0]
        kind = form[0]
        try:
            if kind in ("rewrite", "birewrite"):
                lhs_p, rhs_p, query = form[1], form[2], []
            else:
                query, actions = form[1], form[2]
                unions = [a for a in actions if a[0] == "union"]
                pattern = [a for a in query if a[0] == "=" and isinstance(a[2], list)
                           and a[2][0] in CONSTRUCTORS]
                if not unions or not pattern:
                    out.append(RuleCheck(info.name, info.where, "per-firing", "relation",
                                         "adds facts only; checked through Eq. 3/4 of every fold it leads to"))
                    continue
                binding = {a[1]: a[2] for a in pattern}
                lhs_p, rhs_p = binding.get(unions[0][1], unions[0][1]), unions[0][2]
            free_of, no_prod, other = _conditions(query)
            if other:
                if isinstance(rhs_p, list) and rhs_p[0] in FOLD_CONSTRUCTORS:
                    out.append(RuleCheck(info.name, info.where, "per-firing", "relation",
                                         "derives a fold; Eq. 3/4 checked at every firing"))
                else:
                    out.append(RuleCheck(info.name, info.where, "unchecked", "relation",
                                         "its query uses relations and it unions a non-fold term: "
                                         "neither provable here nor checked per firing"))
                continue
            out.append(_check_pair(info, lhs_p, rhs_p, free_of, no_prod, trials))
        except (NotAlgebraic, IndexError, KeyError) as e:
            out.append(RuleCheck(info.name, info.where, "unchecked", "unsupported",
                                 f"cannot instantiate its pattern ({e}): neither proved nor refuted"))
    return out


# Unions whose right side is one of these are checked where they fire: every derived fold
# must pass Eq. 3 and Eq. 4 (check_fold) or it is never extracted.
FOLD_CONSTRUCTORS = ("RollSum", "RollMax", "SplitK")


def _check_pair(info, lhs_p, rhs_p, free_of, no_prod, trials) -> RuleCheck:
    inst = _Instantiator(free_of, no_prod)
    lhs, rhs = inst.build(lhs_p), inst.build(rhs_p)
    algebraic = not any(n.kind in ("reduce", "fold") for t in (lhs, rhs) for n in t.walk())
    if algebraic:
        try:
            if sympy.simplify(to_sympy(lhs) - to_sympy(rhs)) == 0:
                return RuleCheck(info.name, info.where, "proved", "sympy")
        except NotAlgebraic:
            pass
    extra = free_axes(rhs) - free_axes(lhs)
    if extra:
        return RuleCheck(info.name, info.where, "UNSOUND", "scoping",
                         f"counter-example: with the pattern variables depending on {sorted(extra)}, "
                         f"the right side {rhs} depends on {sorted(extra)} which the left side "
                         f"{lhs} binds (a side condition is missing)")
    prog, _ = _program(inst, {"lhs": lhs, "rhs": rhs})
    for lo_hi in INPUT_RANGES:
        for seed in range(trials):
            torch.manual_seed(seed)
            _, data = _program(inst, {"lhs": lhs, "rhs": rhs}, lo_hi)
            res = evaluate(prog, data, block=2)
            a, b = _common(prog, res["lhs"], res["rhs"])
            bad = refinement_mismatch(a, b)
            if bad is not None:
                return RuleCheck(info.name, info.where, "UNSOUND", "random inputs",
                                 f"counter-example: lhs {lhs} = {a.flatten()[bad].item():.6g} but rhs "
                                 f"{rhs} = {b.flatten()[bad].item():.6g} (inputs uniform in "
                                 f"[{lo_hi[0]:g}, {lo_hi[1]:g}], seed {seed})")
    return RuleCheck(info.name, info.where, "tested",
                     f"interpreter, {trials * len(INPUT_RANGES)} random inputs (positive, signed, large)")


def refinement_mismatch(ref: torch.Tensor, got: torch.Tensor, rtol: float = 1e-9) -> int | None:
    """Flat index of the first element where ``got`` does not refine ``ref``, else None.

    A rewrite may turn an undefined value (NaN: √ of a negative, 0/0) into a defined one —
    that is a refinement, as in every optimising compiler — but it may never change a
    defined value, or make one undefined.  Tolerance is relative to the largest defined
    magnitude (sums of terms of mixed sign lose digits to cancellation, not to the rule)."""
    ref, got = ref.flatten(), got.flatten()
    defined = ~torch.isnan(ref)
    if not bool(defined.any()):
        return None
    scale = 1.0 + float(ref[defined & torch.isfinite(ref)].abs().max()) if bool(
        (defined & torch.isfinite(ref)).any()) else 1.0
    same_inf = torch.isinf(ref) & (ref == got)
    wrong = defined & ~same_inf & ~((ref - got).abs() <= rtol * scale)
    idx = torch.nonzero(wrong)
    return int(idx[0]) if len(idx) else None


def _common(prog: Program, a: torch.Tensor, b: torch.Tensor):
    """Broadcast two definition values (axes a subset of (i, j)) to (i, j)."""
    def full(name, t):
        axes = prog.definition(name).axes
        shape = [prog.extents[x] if x in axes else 1 for x in ("i", "j")]
        return t.reshape(shape).expand(prog.extents["i"], prog.extents["j"])
    return full("lhs", a), full("rhs", b)

"""Reverse-mode differentiation of a plain program: the backward is another program.

``backward_program(p, wrt)`` returns a plain ``ir.Program`` that computes the gradients
of ``p``'s outputs with respect to the inputs ``wrt``, given the outputs' cotangents.  It
is written in the same IR as any user program, so the whole pipeline (saturation, rules,
lowering, the interpreter oracle) applies to it unchanged.

How the adjoint of one definition ``X[a…] = body`` is built (index-level reverse mode):

* the body is differentiated symbolically top-down with a cotangent term ``c`` that lives
  in the definition's scope (its axes plus every reduce axis bound on the path);
  ``sum[r](f)`` passes ``c`` into ``f`` (the reduction becomes a broadcast: ``r`` is now a
  free axis of the contribution), ``max[r](f)`` passes ``c·[f = max]/#ties`` (torch's
  ``amax`` rule: equal maxima share the gradient evenly);
* each read ``Y[idx…]`` met on the way contributes ``c·∂`` to ``gY[t…]``: an index that is
  a plain scope variable is renamed to the target axis; any other index (``h // group``
  for GQA, ``j − i`` into a relative-position table) becomes an indicator
  ``where(idx = t, ·, 0)``; every scope variable left over is summed over -- a broadcast
  turns into a reduction over the missing indices (``d_slope[h] = Σ_{b,i,j} dS·(j − i)``);
* ``where(cond, a, b)`` sends ``c`` to the chosen side only, so masked scores (and the
  large finite ``MASKED`` constant) receive exactly zero, never NaN.

Forward values the backward reads are either *saved* (they become placeholders of the
backward program: the output O and row statistics such as the max and the
denominator) or recomputed (the score matrix S).  ``constant=`` names definitions whose
gradient is known to vanish, e.g. the softmax max ``m``: ``exp(s − m)/Σ exp(s − m)`` does
not depend on ``m``, so its adjoint is exactly zero and dropping it removes a reduction
the rules could not prove away.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .. import ir
from ..ir import Definition, Placeholder, Program, ProgramError, Term, const, var

GRAD_PREFIX = "d_"


@dataclass
class Backward:
    """A backward program and how to feed it.

    ``program`` takes, in order: the forward inputs it reads, the ``saved`` forward
    definitions (placeholders named as in the forward), and one cotangent per forward
    output (``d_<output>``); its outputs are ``d_<input>`` for each name in ``wrt``."""
    program: Program
    wrt: tuple[str, ...]
    saved: tuple[str, ...]
    cotangents: tuple[str, ...]

    def grad_name(self, name: str) -> str:
        return GRAD_PREFIX + name


def default_saved(p: Program) -> tuple[str, ...]:
    """What the forward keeps for the backward: its outputs, and row statistics -- the
    definitions whose body is a reduction and that have fewer axes than the largest
    definition (the max and the denominator of a softmax, not the score matrix)."""
    widest = max(len(d.axes) for d in p.defs)
    keep = [d.name for d in p.defs
            if d.name in p.outputs or (d.body.kind == "reduce" and len(d.axes) < widest)]
    return tuple(keep)


def backward_program(p: Program, wrt, *, saved=None, constant=()) -> Backward:
    """The plain backward program of ``p`` with respect to the inputs ``wrt``.

    ``saved``: forward definitions the backward reads as inputs (default
    ``default_saved(p)``); the others it reads are recomputed.  ``constant``: forward
    definitions treated as constants (their gradient is dropped; only sound where the
    outputs do not depend on them, such as a softmax's stabilising max)."""
    wrt = (wrt,) if isinstance(wrt, str) else tuple(wrt)
    inputs = {ph.name: ph for ph in p.inputs}
    defs = {d.name: d for d in p.defs}
    if not wrt:
        raise ProgramError("Expected at least one input to differentiate with respect to, got "
                           f"none; pass wrt=[...] from {sorted(inputs)}.")
    for n in wrt:
        if n not in inputs:
            raise ProgramError(f"Expected wrt to name inputs of the program {sorted(inputs)}, got "
                               f"{n!r}; gradients are taken with respect to placeholders.")
        if inputs[n].dtype not in ir.FLOAT_DTYPES:
            raise ProgramError(f"Input {n!r} has dtype {inputs[n].dtype}; only float inputs have "
                               "gradients.")
    saved = default_saved(p) if saved is None else tuple(saved)
    for n in (*saved, *constant):
        if n not in defs:
            raise ProgramError(f"Expected saved/constant to name definitions of the program "
                               f"{sorted(defs)}, got {n!r}.")
    for d in p.defs:
        for t in d.body.walk():
            if t.kind == "fold" or t.op in ("run", "prev"):
                raise ProgramError(f"{d.name}: differentiate the plain program, not a fused one "
                                   f"(found {t.op}); pass kern.input_program.")
    return _Builder(_repeated_reductions_named(p), wrt, saved, frozenset(constant)).build()


def _repeated_reductions_named(p: Program) -> Program:
    """``p`` with each reduction a definition's body reads twice or more (the raw score
    of ``s = r·sigmoid(r)``, ``r = Σ_d q·k``) made a definition of its own, read by ref.
    The product rule sends a cotangent to each occurrence with the other factor copied
    in; copied as a term, each copy of ``r`` gets its own reduce axis (a new sum per
    term), the rules never see them as one score tile, and the lowering built [rows,
    keys, head dim] products that no GPU config compiled.  A ref is one value: the
    backward recomputes it once per tile, as it does ``s``.  Only a reduction over all of
    the definition's own axes is named (a tile of the same shape), and only one of float
    reads (named as a float32 definition, an integer count would change type)."""
    def repeated(d: Definition) -> list[Term]:
        seen: dict[Term, int] = {}
        for t in d.body.walk():
            if t.kind == "reduce":
                seen[t] = seen.get(t, 0) + 1
        return [t for t, n in seen.items() if n > 1 and t is not d.body
                and ir.free_axes(t) == frozenset(d.axes) and _float_only(p, t)]
    return ir.split_out(p, repeated, "float32")


def _float_only(p: Program, t: Term) -> bool:
    """Whether ``t`` reads float tensors, and only them."""
    reads = {n.val for n in t.walk() if n.op in ("load", "ref")}
    return all(p.dtype_of(n) in ir.FLOAT_DTYPES for n in reads) and bool(reads)


# ----------------------------------------------------------------------------------
class _Builder:
    def __init__(self, p: Program, wrt, saved, constant):
        self.p, self.wrt, self.saved, self.constant = p, wrt, saved, constant
        self.extents = dict(p.extents)
        self.contrib: dict[str, list[Term]] = {}   # target -> contribution bodies
        self.target_axes: dict[str, tuple[str, ...]] = {}
        self.fresh = itertools.count()
        self.used_names = set(p.extents)
        self.partials: list[Definition] = []   # row-wise partial gradients of inputs

    # -- which definitions carry a gradient ----------------------------------------------
    def _active(self) -> set[str]:
        """Definitions that depend on a wrt input and that an output depends on."""
        import networkx as nx
        g = self.p.dataflow()
        g.remove_nodes_from(self.constant)
        down = set(self.wrt).union(*(nx.descendants(g, w) for w in self.wrt))
        outs = [o for o in self.p.outputs if o in g]
        up = set(outs).union(*(nx.ancestors(g, o) for o in outs))
        return {n for n in down & up} - self.constant

    def build(self) -> Backward:
        active = self._active()
        missing = [w for w in self.wrt if w not in active]
        if missing:
            raise ProgramError(f"No output depends on {missing} (through definitions not marked "
                               "constant); their gradient is zero -- drop them from wrt.")
        cotangents = tuple(GRAD_PREFIX + o for o in self.p.outputs)
        adjoint_defs: list[Definition] = []
        for d in reversed(self.p.defs):
            if d.name not in active:
                continue
            made = self._adjoint_of_definition(d)
            if not made:
                continue
            adjoint_defs += made
            self._differentiate_body(d, made[-1])
        grads = []
        for w in self.wrt:
            ph = next(x for x in self.p.inputs if x.name == w)
            axes = self._axes_for_input(w)
            body = self._sum_contributions(w)
            grads.append(Definition(GRAD_PREFIX + w, axes, body, ph.dtype))
        return self._assemble(adjoint_defs, grads, cotangents)

    def _adjoint_of_definition(self, d: Definition) -> list[Definition]:
        """``g_X[axes]``: the output's cotangent plus what its consumers sent back (the
        last definition returned).  When several contributions meet and some reduce, each
        reducing one becomes a definition of its own (``g_X_1``, …): a producer is one
        reduction, so the pipeline can give each its own loop."""
        parts = list(self.contrib.get(d.name, []))
        if d.name in self.p.outputs:
            parts.insert(0, Term("load", tuple(var(a) for a in d.axes), GRAD_PREFIX + d.name))
        if not parts:
            return []
        self.target_axes[d.name] = d.axes
        dtype = d.dtype if d.dtype in ir.FLOAT_DTYPES else "float32"
        out: list[Definition] = []
        if len(parts) > 1:
            for k, t in enumerate(parts):
                if any(n.kind == "reduce" for n in t.walk()):
                    name = f"g_{d.name}_{len(out) + 1}"
                    out.append(Definition(name, d.axes, t, dtype))
                    parts[k] = Term("ref", tuple(var(a) for a in d.axes), name)
        body = parts[0]
        for t in parts[1:]:
            body = Term("add", (body, t))
        return out + [Definition("g_" + d.name, d.axes, body, dtype)]

    def _axes_for_input(self, name: str) -> tuple[str, ...]:
        return self.target_axes[name] if name in self.target_axes else self._new_axes(name)

    def _new_axes(self, name: str) -> tuple[str, ...]:
        """Axes of an input's gradient, named after the spatial axes the forward reads the
        input along (``d_x[i, c]`` for ``y[i, c] = … x[i, c] …``): the lowering matches
        a producer's reads by axis name, so the backward must speak the forward's names."""
        shape = next(ph.shape for ph in self.p.inputs if ph.name == name)
        # Gradients of inputs of one shape but maybe the last dim (dK and dV, Ev may differ
        # from E) share their axis names where the extents agree: each name known from one
        # input's reads serves all, so the lowering sees folds that keep the
        # same rows and runs them in one loop over the recomputed P (FlashAttention-2's
        # fused dK/dV) rather than one kernel each.
        group = {name} | {ph.name for ph in self.p.inputs if ph.name in self.wrt
                          and len(ph.shape) == len(shape) and ph.shape[:-1] == shape[:-1]}
        seen: list[list[str]] = [[] for _ in shape]
        for d in self.p.defs:
            for t in d.body.walk():
                if t.op == "load" and t.val in group:
                    for k, ix in enumerate(t.args):
                        if ix.op == "var" and ix.val in d.axes and ix.val not in seen[k]:
                            seen[k].append(ix.val)
        axes: list[str] = []
        for k, n in enumerate(shape):
            pick = next((a for a in seen[k] if a not in axes and self.extents[a] == n), None)
            if pick is None:
                pick = f"{name}{k}"
                while pick in self.used_names:
                    pick = f"{name}{k}_{next(self.fresh)}"
                self.used_names.add(pick)
                self.extents[pick] = n
            axes.append(pick)
        self.target_axes[name] = tuple(axes)
        return tuple(axes)

    def _sum_contributions(self, name: str) -> Term:
        parts = self.contrib.get(name, [])
        body = parts[0]
        for t in parts[1:]:
            body = Term("add", (body, t))
        return body

    # -- symbolic differentiation of one body ---------------------------------------------
    def _differentiate_body(self, d: Definition, g: Definition) -> None:
        seed = Term("ref", tuple(var(a) for a in d.axes), g.name)
        self.primal = self._primal_values(d)
        self._push(d.body, seed, tuple(d.axes), d)

    def _primal_values(self, d: Definition) -> dict[Term, Term]:
        """Subterms of ``d``'s body whose value the forward saved: a derivative that needs
        them reads the saved tensor instead of recomputing it.  For attention this turns
        ∂O/∂l = −O/l into a read of the saved output, so the softmax-gradient term
        ``Σ_j P_ij·dP_ij`` becomes ``Σ_e dO_ie·O_ie`` (one row-wise dot, FlashAttention-2's
        D_i) instead of recomputing P·V per row.  In ``where(c, X, 0)`` the branch ``X``
        equals the saved value wherever ``c`` holds, and everywhere else its cotangent
        ``where(c, g, 0)`` is zero, so reading the (finite) saved value there is exact."""
        if d.name not in self.saved:
            return {}
        saved = Term("ref", tuple(var(a) for a in d.axes), d.name)
        out = {d.body: saved}
        if d.body.op == "where" and d.body.args[2] == const(0.0):
            out[d.body.args[1]] = saved
        return out

    def _push(self, t: Term, c: Term, scope: tuple[str, ...], d: Definition) -> None:
        """Send cotangent ``c`` (a term over ``scope``) into term ``t``."""
        op, a = t.op, t.args
        if op in ("var", "int", "flt") or op in ir.COMPARISONS or op in (
                "floordiv", "mod", "bitand", "bitor", "bitxor"):
            return  # integer / boolean values carry no gradient
        if op in ("load", "ref"):
            self._accumulate(t, c, scope, d)
            return
        if op == "add":
            self._push(a[0], c, scope, d)
            self._push(a[1], c, scope, d)
        elif op == "sub":
            self._push(a[0], c, scope, d)
            self._push(a[1], _neg(c), scope, d)
        elif op == "mul":
            self._push(a[0], _mul(c, a[1]), scope, d)
            self._push(a[1], _mul(c, a[0]), scope, d)
        elif op == "div":
            cb = Term("div", (c, a[1]))
            self._push(a[0], cb, scope, d)
            # d(a/b)/db = −(c/b)·(a/b): never forms b², which underflows in fp32 and would
            # turn 0·a/b² into NaN on a fully masked row (b clamped to 1e-30).
            self._push(a[1], _neg(_mul(cb, self.primal.get(t, t))), scope, d)
        elif op == "neg":
            self._push(a[0], _neg(c), scope, d)
        elif op in _UNARY_DERIVATIVE:
            self._push(a[0], _mul(c, _UNARY_DERIVATIVE[op](self.primal.get(t, t), a[0])), scope, d)
        elif op in ("maximum", "minimum"):
            pick = "gt" if op == "maximum" else "lt"
            # torch's rule: the larger (smaller) operand gets c, a tie splits it evenly
            first = Term("where", (Term(pick, a), c, Term("where", (
                Term("eq", a), _mul(c, const(0.5)), const(0.0)))))
            second = Term("where", (Term(pick, (a[1], a[0])), c, Term("where", (
                Term("eq", a), _mul(c, const(0.5)), const(0.0)))))
            self._push(a[0], first, scope, d)
            self._push(a[1], second, scope, d)
        elif op == "where":
            self._push(a[1], Term("where", (a[0], c, const(0.0))), scope, d)
            self._push(a[2], Term("where", (a[0], const(0.0), c)), scope, d)
        elif op == "cast":
            if t.val in ir.FLOAT_DTYPES:
                self._push(a[0], c, scope, d)
        elif op == "sum":
            # c was built outside the reduction: give its own reductions fresh axes so
            # none of them binds t's axis, which is a free variable from here on
            self._push(a[0], self._rebind(c), scope + (t.val,), d)
        elif op in ("max", "min"):
            share = self._extremum_share(t, d)
            self._push(a[0], _mul(self._rebind(c), share), scope + (t.val,), d)
        else:
            raise ProgramError(f"{d.name}: cannot differentiate op {op!r}; expected a plain "
                               f"program of {sorted(_DIFFERENTIABLE)}.")

    def _extremum_share(self, t: Term, d: Definition) -> Term:
        """``[f = M] / #{r : f = M}`` for ``M = max_r f`` (or min): each tie gets an equal
        share, as torch.amax/amin.  ``M`` is the saved definition when the reduction is
        the whole body, else recomputed."""
        f, r = t.args[0], t.val
        if t is d.body:
            m = Term("ref", tuple(var(a) for a in d.axes), d.name)
        else:
            m = self._rebind(t)
        hit = Term("where", (Term("eq", (f, m)), const(1.0), const(0.0)))
        r2 = self._fresh_axis(r)
        count = Term("sum", (self._rebind(ir.substitute(hit, {r: var(r2)})),), r2)
        return Term("div", (hit, count))

    def _rebind(self, t: Term) -> Term:
        """A copy of ``t`` with every reduce axis it binds renamed to a fresh one (each
        reduce axis belongs to exactly one reduction)."""
        for ax in dict.fromkeys(n.val for n in t.walk() if n.kind == "reduce"):
            t = ir.rename_axis(t, ax, self._fresh_axis(ax))
        return t

    def _fresh_axis(self, like: str) -> str:
        base = like.split("_b")[0] or like
        name = f"{base}_b{next(self.fresh)}"
        while name in self.used_names:
            name = f"{base}_b{next(self.fresh)}"
        self.used_names.add(name)
        self.extents[name] = self.extents[like]
        return name

    # -- one read's contribution to its tensor's adjoint -----------------------------------
    def _accumulate(self, read: Term, c: Term, scope: tuple[str, ...], d: Definition) -> None:
        name = read.val
        if read.op == "load" and name not in self.wrt:
            return
        if read.op == "ref" and (name in self.constant or name not in self._active_cache()):
            return
        targets = self._axes_for_input(name) if read.op == "load" else self.target_axes.get(
            name) or self.p.definition(name).axes
        # Every scope variable gets a fresh name first: the contribution is a new term in a
        # new definition, whose reduce axes must be its own.
        ren = {v: self._fresh_axis(v) for v in scope}
        body = _rebind_all(c, ren, self)
        idx = [_rebind_all(i, ren, self) for i in read.args]
        bind: dict[str, Term] = {}
        conds: list[Term] = []
        for ix, tgt in zip(idx, targets):
            # A read at a loop variable binds it to the target axis -- only where the two
            # have one extent: a 64-entry table read at 37 queries (``t[q_idx]`` where the
            # table was not cut to L, as when it is read at q and kv of other lengths)
            # takes the ``where(q == m)`` form below, as a computed index does.
            if (ix.op == "var" and ix.val in ren.values() and ix.val not in bind
                    and self.extents[ix.val] == self.extents[tgt]):
                bind[ix.val] = var(tgt)
            else:
                conds.append(Term("eq", (ix, var(tgt))))
        body = ir.substitute(body, bind)
        if conds:
            cond = conds[0]
            for x in conds[1:]:
                cond = Term("and", (cond, x))
            body = Term("where", (ir.substitute(cond, bind), body, const(0.0)))
        left = [s for s in scope if ren[s] not in bind]
        rows = [s for s in left if s in d.axes][:-1]
        if read.op == "load" and len(left) >= 3 and rows and not set(rows) & set(targets):
            # An input read along fewer axes than the definition (a captured per-head
            # slope): its gradient reduces over batch, queries and keys at once.  Keep the
            # forward's rows: a partial ``p[t…, rows…] = Σ_key …`` is one row-wise
            # reduction like dQ's, and the gradient sums the partials over the rows.
            inner = body
            for v in reversed([ren[s] for s in left if s not in rows]):
                inner = Term("sum", (inner,), v)
            inner = ir.substitute(inner, {ren[s]: var(s) for s in rows})
            pname = f"p_{name}_{len(self.partials) + 1}"
            paxes = tuple(targets) + tuple(rows)
            self.partials.append(Definition(pname, paxes, inner, "float32"))
            body = Term("ref", tuple(var(a) for a in targets) + tuple(var(ren[s]) for s in rows),
                        pname)
            left = rows
        for v in reversed([ren[s] for s in left]):
            body = Term("sum", (body,), v)
        self.contrib.setdefault(name, []).append(body)

    def _active_cache(self) -> set[str]:
        if not hasattr(self, "_active_set"):
            self._active_set = self._active()
        return self._active_set

    # -- the program ----------------------------------------------------------------------
    def _assemble(self, adjoint_defs, grads, cotangents) -> Backward:
        adjoint_defs = adjoint_defs + self.partials
        body_defs = adjoint_defs + grads
        reads = {n.val for d in body_defs for n in d.body.walk() if n.op in ("ref", "load")}
        # forward definitions the backward reads: saved ones become inputs, the rest are
        # recomputed (with everything they read in turn)
        needed: set[str] = set()
        stack = [n for n in reads if n in {d.name for d in self.p.defs}]
        while stack:
            n = stack.pop()
            if n in needed:
                continue
            needed.add(n)
            if n not in self.saved:
                stack += [m.val for m in self.p.definition(n).body.walk() if m.op == "ref"]
        saved = tuple(n for n in self.saved if n in needed)
        recomputed = [d for d in self.p.defs if d.name in needed and d.name not in saved]
        loads = reads | {m.val for d in recomputed for m in d.body.walk() if m.op == "load"}
        inputs = [ph for ph in self.p.inputs if ph.name in loads]
        inputs += [Placeholder(n, self.p.shape_of(n), self.p.dtype_of(n)) for n in saved]
        cots = [Placeholder(GRAD_PREFIX + o, self.p.shape_of(o), _float(self.p.dtype_of(o)))
                for o in self.p.outputs]
        inputs += [ph for ph in cots if ph.name in loads]
        defs = [_load_saved(d, saved) for d in recomputed + adjoint_defs + grads]
        prog = Program(inputs, defs, self.extents, [g.name for g in grads],
                       # the forward and what it saved: translation validation draws
                       # the saved inputs from the forward (independent random values of
                       # a max and a sum would exercise inputs that never occur)
                       {"backward_of": list(self.p.outputs), "wrt": list(self.wrt),
                        "forward": self.p, "saved": list(saved)})
        _order_defs(prog)
        ir.validate(prog)
        return Backward(prog, self.wrt, saved, tuple(ph.name for ph in cots if ph.name in loads))


def _rebind_all(t: Term, ren: dict[str, str], b: _Builder) -> Term:
    """Rename the scope variables and give every reduction inside ``t`` a fresh axis."""
    return b._rebind(ir.substitute(t, {k: var(v) for k, v in ren.items()}))


def _load_saved(d: Definition, saved) -> Definition:
    """Saved forward values are placeholders of the backward: read them with ``load``."""
    def swap(t: Term) -> Term:
        t = t.map_args(swap)
        return Term("load", t.args, t.val) if t.op == "ref" and t.val in saved else t
    return Definition(d.name, d.axes, swap(d.body), d.dtype)


def _order_defs(prog: Program) -> None:
    import networkx as nx
    g = prog.dataflow()
    order = list(nx.lexicographical_topological_sort(g))
    prog.defs.sort(key=lambda d: order.index(d.name))


def _float(dtype: str) -> str:
    return dtype if dtype in ir.FLOAT_DTYPES else "float32"


def _neg(c: Term) -> Term:
    return Term("neg", (c,))


def _mul(a: Term, b: Term) -> Term:
    return Term("mul", (a, b))


_UNARY_DERIVATIVE = {
    "exp": lambda t, x: t,
    "exp2": lambda t, x: _mul(t, const(math.log(2.0))),
    "log": lambda t, x: Term("div", (const(1.0), x)),
    "tanh": lambda t, x: Term("sub", (const(1.0), _mul(t, t))),
    "sqrt": lambda t, x: Term("div", (const(0.5), t)),
    "rsqrt": lambda t, x: _mul(const(-0.5), Term("div", (t, x))),
    # torch: d|x|/dx = sign(x), 0 at 0
    "abs": lambda t, x: Term("where", (Term("gt", (x, const(0.0))), const(1.0), Term(
        "where", (Term("lt", (x, const(0.0))), const(-1.0), const(0.0))))),
    "sin": lambda t, x: Term("cos", (x,)),
    "cos": lambda t, x: _neg(Term("sin", (x,))),
    "erf": lambda t, x: _mul(const(2.0 / math.sqrt(math.pi)), Term("exp", (_neg(_mul(x, x)),))),
}
_DIFFERENTIABLE = set(_UNARY_DERIVATIVE) | {"add", "sub", "mul", "div", "neg", "maximum",
                                            "minimum", "where", "cast", "sum", "max", "min",
                                            "load", "ref"}

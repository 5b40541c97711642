"""Forms of a backward program that use what the caller knows about its inputs.

``frontend.autodiff`` writes the plain adjoint of a program; these rewrite it where the
caller knows more than the program says: a saved input or cotangent that is a constant
(attention's denominator is 1 once the row shift is the lse; the lse's cotangent is 0
when the loss does not use it), a definition another kernel returns anyway (Σ_e dO·O,
computed by dQ's kernel, read by dK/dV's), a definition to return as an extra output.
Each returns a new ``Backward``; the gradients stay those of the plain program (tested
against autograd in ``tests/test_autodiff.py``).
"""
from __future__ import annotations

import math

from .. import ir
from ..ir import Definition, Placeholder, Program, ProgramError, Term, const
from .autodiff import Backward

_FOLD = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
         "maximum": max, "minimum": min, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
         "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b,
         "ne": lambda a, b: a != b, "div": lambda a, b: a / b if b else math.nan}  # x/0: kept


def with_constant_input(bw: Backward, name: str, value: float, why: str = "") -> Backward:
    """``bw`` where the saved input or cotangent ``name`` is known to equal ``value``
    everywhere it is read; the placeholder is dropped and the arithmetic it fed is folded
    away (with definitions that fold to a constant, and those no output reads any more).

    Attention's backward reads the row denominator ``l`` through ``o = acc / max(l, ε)``
    and ``where(l > 0, …)``.  Fed ``m := lse`` the denominator is 1 on every row that sees
    a key (see ``dropin.flex_backward``): knowing it turns ``dO / max(l, ε)`` back into
    ``dO`` -- an fp16 load the P·dO and dO·Vᵀ products take straight to the tensor cores,
    where a computed fp32 tile would force an fp32 product.

    A cotangent set to 0 (an output the loss does not use, such as the lse) also absorbs
    what it multiplies: autograd's convention -- a zero cotangent contributes nothing, the
    term is not evaluated -- so the kernel loads and adds nothing for it.

    ``why`` (each form takes one): the reason the caller knows it, shown by the kernel's
    ``explain()`` before the rules' derivation."""
    if name not in bw.saved and name not in bw.cotangents:
        raise ProgramError(f"Expected a saved input {list(bw.saved)} or a cotangent "
                           f"{list(bw.cotangents)} of the backward, got {name!r}.")
    p = bw.program
    c = const(float(value))
    absorb = name in bw.cotangents and value == 0
    known: dict[str, Term] = {}  # definitions that folded to a constant

    def fold(t: Term) -> Term:
        if t.op == "load" and t.val == name:
            return c
        if t.op == "ref" and t.val in known:
            return known[t.val]
        return _fold_constants(t.map_args(fold), absorb)

    defs = []
    for d in p.defs:
        body = fold(d.body)
        if body.op in ("int", "flt") and d.name not in p.outputs:
            known[d.name] = body
        else:
            defs.append(Definition(d.name, d.axes, body, d.dtype))
    need = ir.reachable({d.name: d.body for d in defs}, p.outputs)
    defs = [d for d in defs if d.name in need]
    reads = {n.val for d in defs for n in d.body.walk() if n.op == "load"}
    inputs = [ph for ph in p.inputs if ph.name != name and (ph.name in reads or ph.name in
                                                            bw.cotangents)]
    prog = Program(inputs, defs, dict(p.extents), list(p.outputs),
                   note_prepared(dict(p.meta, saved=[s for s in p.meta.get("saved", []) if s != name],
                               constant_inputs={**p.meta.get("constant_inputs", {}), name: value}),
                          f"{name} := {value:g} everywhere, folded away", why))
    ir.validate(prog)
    return Backward(prog, bw.wrt, tuple(s for s in bw.saved if s != name),
                    tuple(n for n in bw.cotangents if any(ph.name == n for ph in inputs)))


def _fold_constants(t: Term, absorb_zero: bool) -> Term:
    """One node of ``with_constant_input``'s folding, its arguments already folded."""
    a = t.args

    def lit(x, v=None):
        return x.op in ("int", "flt") and (v is None or x.val == v)
    if a and all(lit(x) for x in a) and t.op in _FOLD:
        v = _FOLD[t.op](*(x.val for x in a))
        if isinstance(v, bool) or math.isfinite(v):
            return const(v)
    if t.op == "where" and lit(a[0]):
        return a[1] if a[0].val else a[2]
    if t.op in ("mul", "div") and lit(a[1], 1):
        return a[0]
    if t.op == "mul" and lit(a[0], 1):
        return a[1]
    if t.op in ("add", "sub") and lit(a[1], 0):
        return a[0]
    if t.op == "add" and lit(a[0], 0):
        return a[1]
    if absorb_zero:
        if (t.op == "mul" and (lit(a[0], 0) or lit(a[1], 0))) or (
                t.op == "div" and lit(a[0], 0)) or (
                t.op in ("neg", "cast", "sum") and lit(a[0], 0)) or (
                t.op == "where" and lit(a[1], 0) and lit(a[2], 0)):
            return const(0.0)
        if t.op == "sub" and lit(a[0], 0):
            return Term("neg", (a[1],))
    return t


def with_outputs(bw: Backward, names: list[str], why: str = "") -> Backward:
    """``bw`` that also returns its definitions ``names`` (after its gradients)."""
    p = bw.program
    for n in names:
        p.definition(n)  # a clear error for a name that is not a definition
    prog = Program(list(p.inputs), list(p.defs), dict(p.extents),
                   list(p.outputs) + [n for n in names if n not in p.outputs],
                   note_prepared(dict(p.meta), f"{', '.join(names)} also returned", why))
    ir.validate(prog)
    return Backward(prog, bw.wrt, bw.saved, bw.cotangents)


def with_definition_as_input(bw: Backward, name: str, why: str = "") -> Backward:
    """``bw`` reading its definition ``name`` as an input computed elsewhere -- by the
    kernel of another gradient that computes it anyway, as dQ's kernel computes the row
    dot ``Σ_e dO·O`` before its loop: the dK/dV kernel then reads one number per query
    row instead of recomputing it from an O tile in every key block's program."""
    p = bw.program
    d = p.definition(name)
    if name in p.outputs:
        raise ProgramError(f"Expected an intermediate definition, got the output {name!r}.")

    def swap(t: Term) -> Term:
        t = t.map_args(swap)
        return Term("load", t.args, name) if t.op == "ref" and t.val == name else t
    defs = [Definition(x.name, x.axes, swap(x.body), x.dtype) for x in p.defs if x.name != name]
    reads = {n.val for x in defs for n in x.body.walk() if n.op == "load"}
    inputs = [ph for ph in p.inputs if ph.name in reads]
    inputs.append(Placeholder(name, p.shape_of(name), d.dtype))
    prog = Program(inputs, defs, dict(p.extents), list(p.outputs),
                   note_prepared(dict(p.meta, precomputed=[*p.meta.get("precomputed", []), name],
                               saved=[s for s in p.meta.get("saved", []) if s in reads]),
                          f"{name} read as an input", why))
    ir.validate(prog)
    return Backward(prog, bw.wrt, tuple(s for s in bw.saved if s in reads),
                    tuple(n for n in bw.cotangents if any(ph.name == n for ph in inputs)))


def with_fp32_output(bw: Backward, name: str, why: str = "") -> Backward:
    """``bw`` whose output ``name`` is stored in float32 (the caller casts it): an output
    accumulated by atomic adds across programs (``lowering.scatter``) adds in fp32."""
    p = bw.program
    if name not in p.outputs:
        raise ProgramError(f"Expected an output of the backward {p.outputs}, got {name!r}.")
    defs = [Definition(d.name, d.axes, d.body, "float32") if d.name == name else d
            for d in p.defs]
    prog = Program(list(p.inputs), defs, dict(p.extents), list(p.outputs),
                   note_prepared(dict(p.meta), f"{name} accumulated in float32", why))
    ir.validate(prog)
    return Backward(prog, bw.wrt, bw.saved, bw.cotangents)


def with_guarded_reads(bw: Backward, name: str, guard: str, below: float, value: float,
                       why: str = "") -> Backward:
    """``bw`` where every read ``name[idx]`` becomes ``where(guard[idx] <= below, value,
    name[idx])``: a per-row fix-up the caller would otherwise make with torch ops before
    each call (a compare and a masked copy: launches, and host time) done in the kernels'
    row loads instead.  ``guard`` is read at the same index, so both must be indexed
    alike (attention's per-row saved values and cotangents)."""
    p = bw.program
    shapes = {ph.name: ph.shape for ph in p.inputs}
    if name not in shapes or guard not in shapes or shapes[name] != shapes[guard]:
        raise ProgramError(f"Expected two inputs of one shape to guard, got {name!r} and "
                           f"{guard!r}; the inputs are {shapes}.")

    def swap(t: Term) -> Term:
        t = t.map_args(swap)
        if t.op == "load" and t.val == name:
            g = Term("load", t.args, guard)
            return Term("where", (Term("le", (g, const(below))), const(value), t))
        return t
    defs = [Definition(d.name, d.axes, swap(d.body), d.dtype) for d in p.defs]
    prog = Program(list(p.inputs), defs, dict(p.extents), list(p.outputs),
                   note_prepared(dict(p.meta), f"{name} read as {value:g} where {guard} <= "
                                 f"{below:g}", why))
    ir.validate(prog)
    return Backward(prog, bw.wrt, bw.saved, bw.cotangents)


def only_outputs(bw: Backward, names: list[str], why: str = "") -> Backward:
    """``bw`` computing only its definitions ``names`` (and what they read): the row
    statistics a fused gradient kernel reads, as a kernel of their own."""
    p = bw.program
    for n in names:
        p.definition(n)
    need = ir.reachable({d.name: d.body for d in p.defs}, list(names))
    defs = [d for d in p.defs if d.name in need]
    reads = {n.val for d in defs for n in d.body.walk() if n.op == "load"}
    inputs = [ph for ph in p.inputs if ph.name in reads]
    # (only the axes these definitions use: a size no input has would be unreadable)
    used = {a for d in defs for a in d.axes} | {n.val for d in defs for n in d.body.walk()
                                                if n.op == "var" or n.kind in ("reduce", "fold")}
    prog = Program(inputs, defs, {a: n for a, n in p.extents.items() if a in used}, list(names),
                   # row statistics hold for any saved values: their inputs are not
                   # recomputed by the forward (which reads sizes these do not have)
                   note_prepared({k: v for k, v in p.meta.items() if k not in (
                       "forward", "saved")}, f"only {', '.join(names)}", why))
    ir.validate(prog)
    return Backward(prog, bw.wrt, tuple(s for s in bw.saved if s in reads),
                    tuple(n for n in bw.cotangents if n in reads))


def note_prepared(meta: dict, step: str, why: str) -> dict:
    """``meta`` with ``step`` (and its reason) appended to ``meta["prepared"]``: the forms
    applied before saturation, which ``Kernel.explain`` lists above the derivation."""
    return dict(meta, prepared=[*meta.get("prepared", []), f"{step}: {why}" if why else step])


def with_spread_output(bw: Backward, name: str, part: str, row: str, copies: int,
                       why: str = "") -> Backward:
    """``bw`` whose output ``name[a…] = Σ_s part[…]``, over ``part[b…] = Σ_j where(c, X,
    0)``, gains a trailing axis of ``copies`` entries: ``part``'s terms of row ``i`` (its
    axis ``row``) go to copy ``i mod copies`` (``where(c & (i mod n = r), X, 0)``), so
    the output is the old one split into ``copies`` parts whose sum (the caller's) is the
    old one.  Terms added into few entries by atomic adds collide; spread over copies by
    row they collide ``copies`` times less."""
    p = bw.program
    d, q = p.definition(name), p.definition(part)
    inner = q.body.args[0] if q.body.op == "sum" else None
    if inner is None or inner.op != "where" or row not in q.axes or name not in p.outputs:
        raise ProgramError(f"Expected {name} = Σ {part}[…] over {part} = Σ_j where(c, X, 0) "
                           f"with a row axis {row!r}, got {name} = {d.body}.")
    rep = ir.fresh_name("copy", set(p.extents))
    pick = Term("eq", (Term("mod", (ir.var(row), const(copies))), ir.var(rep)))
    body = Term("sum", (Term("where", (Term("and", (inner.args[0], pick)), inner.args[1],
                                        inner.args[2])),), q.body.val)
    refs = [t for t in d.body.walk() if t.op == "ref" and t.val == part]
    table = {t: Term("ref", t.args + (ir.var(rep),), part) for t in refs}
    defs = [Definition(part, q.axes + (rep,), body, q.dtype) if x.name == part else
            Definition(name, d.axes + (rep,), ir.replace_terms(d.body, table), x.dtype)
            if x.name == name else x for x in p.defs]
    prog = Program(list(p.inputs), defs, dict(p.extents, **{rep: copies}), list(p.outputs),
                   note_prepared(dict(p.meta), f"{name} spread over {copies} copies by row",
                                 why))
    ir.validate(prog)
    return Backward(prog, bw.wrt, bw.saved, bw.cotangents)

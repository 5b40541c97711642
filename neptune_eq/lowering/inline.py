"""Definitions between reductions: every reduction a definition of its own (issue 15).

Users write statistics *derived* from reductions as one definition:
``mean[i] = Σ_k x[i, k] / K``, ``den[i] = Σ_j exp(x[i, j] − m[i]) + c[i]``,
``lse[i] = m[i] + log Σ_j exp(...)``.  Such a definition is neither a producer (its
top is not a reduction, so no fold can hold it) nor pointwise (it contains a reduction,
so the e-graph encoder cannot inline it).  The lowering could only refuse it.

Here each loop-level reduction inside such a definition becomes a definition of its own
(``mean_sum[i] = Σ_k x[i, k]``), and the definition itself becomes pointwise over the
new producers (``mean[i] = mean_sum[i] / K``).  The e-graph encoder then inlines the
pointwise rest into its consumers, as Neptune's ``InlineMapReturnReduce`` does before
fusing, so the rolling/split-k rules see ``Σ_k (x[i, k] − mean_sum[i] / K)²`` -- a
consumer of a named producer -- and fuse it like any other.  The row-wise arithmetic is
recomputed per element, where it costs a few flops on values already in registers.

Outputs that nobody reads keep their nested reductions: the lowering computes those
folds itself and applies the rest in the epilogue.

``isolate_reductions`` runs before saturation (``api``).  The rules may still hand back a
producer whose best term is arithmetic over folds (``Σ x² − mean·Σ x`` for a variance):
``inline_derived`` runs in the lowering and splits such a definition the same way, then
substitutes its pointwise rest into its readers, so each row's value is recomputed from
fold states that are final by then.
"""
from __future__ import annotations

from ..ir import Definition, Program, ProgramError, Term, split_out, substitute


def loop_level(t: Term):
    """The outermost reduce/fold nodes of ``t``."""
    if t.kind in ("reduce", "fold"):
        yield t
        return
    for a in t.args:
        yield from loop_level(a)


def isolate_reductions(program: Program) -> Program:
    """``program`` with every reduction nested in a read definition split out into a
    producer of its own; the same program when there is none (no copy)."""
    read = {n.val for d in program.defs for n in d.body.walk() if n.op == "ref"}

    def nested(d: Definition) -> list[Term]:
        if d.body.kind in ("reduce", "fold") or (d.name not in read and d.name in program.outputs):
            return []
        return list(dict.fromkeys(loop_level(d.body)))
    return split_out(program, nested)


def inline_derived(program: Program) -> Program:
    """``program`` where no definition read by others is arithmetic over reductions or
    pointwise: its reductions are producers of their own and the rest is substituted
    into every read (a non-output one is then dropped).  The same program when there is
    nothing to do."""
    program = isolate_reductions(program)
    pointwise = {d.name: d for d in program.defs if not d.is_reduction}
    read = {n.val for d in program.defs for n in d.body.walk() if n.op in ("ref", "run", "prev")
            and n.val in pointwise}
    if not read:
        return program
    for d in program.defs:
        for n in d.body.walk():
            if n.op in ("run", "prev") and n.val in pointwise:
                raise ProgramError(f"{d.name} reads the running value of {n.val}, which is not a "
                                   "fold; expected running values of reductions only.")

    def expand(t: Term) -> Term:
        if t.op == "ref" and t.val in pointwise:
            src = pointwise[t.val]
            return expand(substitute(src.body, dict(zip(src.axes, (expand(a) for a in t.args)))))
        return t.map_args(expand)

    defs = [Definition(d.name, d.axes, expand(d.body), d.dtype) for d in program.defs
            if not (d.name in pointwise and d.name not in program.outputs)]
    return program.with_defs(defs)

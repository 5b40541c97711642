"""Structural rules generated from the constructor table: the ``free``/``uses`` analyses
and producer substitution (``AtRun``/``AtPrev``).

They are mechanical (one rule per constructor), so they are derived from
``table.CONSTRUCTORS`` rather than written by hand: a new constructor gets its analysis
and substitution rules automatically.  The mathematics lives in ``rules/*.egg``.
"""
from __future__ import annotations

from .table import CONSTRUCTORS

ANALYSIS = "analysis"
SUBST = "subst"
_BINDS_AXIS = {"Sum", "Max", "Min", "RollSum", "RollMax", "SplitK"}
_ACCESS = {"Load", "Acc", "Run", "Prev"}


def _args(kinds: str) -> list[str]:
    return [f"a{k}" for k in range(len(kinds))]


def analysis_rules() -> str:
    out = [f"(ruleset {ANALYSIS})",
           f'(rule ((= e (INil))) ((set (freeI e) (set-empty)) (set (usesI e) (set-empty))) '
           f':ruleset {ANALYSIS} :name "free-INil")',
           f'(rule ((= e (ICons h t)) (= fh (free h)) (= ft (freeI t)) (= uh (uses h)) (= ut (usesI t))) '
           f'((set (freeI e) (set-union fh ft)) (set (usesI e) (set-union uh ut))) '
           f':ruleset {ANALYSIS} :name "free-ICons")']
    for name, (_, kinds) in CONSTRUCTORS.items():
        args = _args(kinds)
        pat = f"(= e ({name} {' '.join(args)}))"
        if name == "Var":
            out.append(f"(rule ({pat}) ((set (free e) (set-of a0)) (set (uses e) (set-empty))) "
                       f':ruleset {ANALYSIS} :name "free-{name}")')
            continue
        conds, frees, usess = [pat], [], []
        for a, k in zip(args, kinds):
            if k == "T":
                conds.append(f"(= f{a} (free {a})) (= u{a} (uses {a}))")
            elif k == "X":
                conds.append(f"(= f{a} (freeI {a})) (= u{a} (usesI {a}))")
            else:
                continue
            frees.append(f"f{a}")
            usess.append(f"u{a}")
        f = _union(frees)
        u = _union(usess)
        if name in _BINDS_AXIS:
            f = f"(set-remove {f} a0)"
        if name in _ACCESS and name != "Load":
            u = f"(set-insert {u} a0)"
        out.append(f"(rule ({' '.join(conds)}) ((set (free e) {f}) (set (uses e) {u})) "
                   f':ruleset {ANALYSIS} :name "free-{name}")')
    return "\n".join(out)


def _union(xs: list[str]) -> str:
    if not xs:
        return "(set-empty)"
    acc = xs[0]
    for x in xs[1:]:
        acc = f"(set-union {acc} {x})"
    return acc


def substitution_rules() -> str:
    """AtRun(x): x with producer reads Acc(n, i) replaced by Run(n, i); AtPrev likewise."""
    out = [f"(ruleset {SUBST})"]
    for helper, idx_helper, target in (("AtRun", "AtRunI", "Run"), ("AtPrev", "AtPrevI", "Prev")):
        out.append(f'(rewrite ({idx_helper} (INil)) (INil) :ruleset {SUBST} :name "{helper}-INil")')
        out.append(f"(rewrite ({idx_helper} (ICons h t)) (ICons ({helper} h) ({idx_helper} t)) "
                   f':ruleset {SUBST} :name "{helper}-ICons")')
        for name, (_, kinds) in CONSTRUCTORS.items():
            args = _args(kinds)
            new = []
            for a, k in zip(args, kinds):
                new.append(f"({helper} {a})" if k == "T" else f"({idx_helper} {a})" if k == "X" else a)
            ctor = target if name == "Acc" else name
            out.append(f"(rewrite ({helper} ({name} {' '.join(args)})) ({ctor} {' '.join(new)}) "
                       f':ruleset {SUBST} :name "{helper}-{name}")')
    return "\n".join(out)

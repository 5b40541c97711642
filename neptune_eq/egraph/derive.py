"""Derivations: how the input program became the chosen one, as readable steps.

egglog 13 has no proofs, so the derivation is built from snapshots: after every
saturation iteration the best program (under the final cost model) is extracted; each
change of a definition between snapshots is one step, shown as the smallest subterm that
changed (before → after) and attributed to the rules that matched in that iteration and
mention the constructors involved, with their ``file:line`` and identity.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .table import EGG_NAME
from ..ir import Term, fmt


@dataclass
class Step:
    iteration: int
    definition: str
    before: Term
    after: Term
    rules: list = field(default_factory=list)   # RuleInfo (or names for structural rules)

    def __str__(self) -> str:
        names = ", ".join(f"{r.name} [{r.where}]" if hasattr(r, "where") else str(r)
                          for r in self.rules) or "(saturation)"
        lines = [f"iteration {self.iteration}: {self.definition}: {names}",
                 f"    {fmt(self.before)}",
                 f"  → {fmt(self.after)}"]
        for r in self.rules:
            if getattr(r, "comment", ""):
                lines.append(f"    · {r.name}: {r.comment}")
        return "\n".join(lines)


def smallest_change(a: Term, b: Term) -> tuple[Term, Term] | None:
    """The smallest pair of subterms where ``a`` and ``b`` differ."""
    if a == b:
        return None
    if a.op == b.op and a.val == b.val and len(a.args) == len(b.args):
        inner = [d for d in (smallest_change(x, y) for x, y in zip(a.args, b.args)) if d]
        if len(inner) == 1:
            return inner[0]
    return a, b


def _ctors(t: Term) -> set[str]:
    return {EGG_NAME[n.op] for n in t.walk()}


def _rule_ctors(source: str) -> set[str]:
    return set(re.findall(r"\(([A-Z][A-Za-z0-9]*)", source))


def derivation(snapshots: list[tuple[int, dict[str, Term]]], trace) -> list[Step]:
    steps: list[Step] = []
    by_iter = {it.iteration: it.matches for it in trace.iterations}
    for (_, prev), (it, cur) in zip(snapshots, snapshots[1:]):
        for name, after in cur.items():
            before = prev.get(name)
            if before is None or before == after:
                continue
            a, b = smallest_change(before, after)
            involved = _ctors(a) | _ctors(b)
            rules = []
            for r, n in sorted(by_iter.get(it, {}).items(), key=lambda kv: -kv[1]):
                info = trace.rules.get(r)
                if not n or info is None or "union" not in info.source and "rewrite" not in info.source:
                    continue
                lhs_ctors = _rule_ctors(info.source)
                if lhs_ctors & involved:
                    rules.append(info)
            steps.append(Step(it, name, a, b, rules[:6]))
    return steps

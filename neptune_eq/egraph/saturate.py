"""Program -> e-graph, saturation under a schedule with limits, and the rewrite trace.

Each outer iteration first saturates the structural rules (analyses, substitution), then
runs the stage's rules once, all matched on the same e-graph.  Growth is bounded from
Python: the e-graph is pushed before an iteration and popped if the iteration pushes the
row count past the budget (egglog has no node limit).  A rule that matches too often is
banned for a while by an exponential back-off scheduler (egg's ``BackoffScheduler``), so
one explosive rule (a user's commutativity, say) cannot starve the others.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..ir import Program, ProgramError, Term, free_axes, substitute
from .rulefiles import (RuleFileError, RuleInfo, new_egraph, parse_rule_file, rule_ruleset,
                        shipped_rule_files)
from .structural import ANALYSIS, SUBST
from .table import EGG_NAME, CONSTRUCTORS


# ----------------------------------------------------------------------------------
# Program -> egglog terms
# ----------------------------------------------------------------------------------
def _fmt_float(v: float) -> str:
    if not math.isfinite(v):
        raise ProgramError(f"Constant {v} is not finite; use a large finite value (e.g. -1e30) "
                           "for masked scores.")
    s = repr(float(v))
    if "e" in s and "." not in s.split("e")[0]:
        a, b = s.split("e")
        s = f"{a}.0e{b}"
    return s


class ProgramEncoder:
    """Turns definitions into egglog s-expressions.

    A read ``R[idx]`` of a producer (a definition that needs a reduction) stays a
    by-name ``Acc`` when ``idx`` is free of the enclosing reduction axes -- that is the
    "g with a hole" the rolling rules need.  Pointwise definitions, and producers read at
    an index that moves with an enclosing reduction (a score tile ``s[i, j]``), are
    inlined: their value is recomputed per element, as a fused kernel would."""

    def __init__(self, program: Program):
        self.p = program
        self.reductions = {d.name for d in program.defs if d.is_reduction}

    def inline_refs(self, t: Term, bound: frozenset[str] = frozenset()) -> Term:
        if t.op == "ref":
            idx = tuple(self.inline_refs(a, bound) for a in t.args)
            d = self.p.definition(t.val)
            moves = set().union(*(free_axes(a) for a in idx)) & bound if idx else set()
            if d.name not in self.reductions or moves:
                return self.inline_refs(substitute(d.body, dict(zip(d.axes, idx))), bound)
            return Term("ref", idx, t.val)
        if t.kind in ("reduce", "fold"):
            return t.map_args(lambda a: self.inline_refs(a, bound | {t.val}))
        return t.map_args(lambda a: self.inline_refs(a, bound))

    def sexpr(self, t: Term) -> str:
        name = EGG_NAME[t.op]
        kinds = CONSTRUCTORS[name][1]
        parts = []
        if t.op == "var":
            parts.append(json.dumps(t.val))
        elif t.op == "int":
            parts.append(str(int(t.val)))
        elif t.op == "flt":
            parts.append(_fmt_float(t.val))
        elif t.kind == "access":
            idx = "(INil)"
            for a in reversed(t.args):
                idx = f"(ICons {self.sexpr(a)} {idx})"
            parts += [json.dumps(t.val), idx]
        else:
            if kinds.startswith("S"):
                parts.append(json.dumps(t.val))
            parts += [self.sexpr(a) for a in t.args]
        return f"({name} {' '.join(parts)})"

    def encode(self) -> dict[str, str]:
        return {d.name: self.sexpr(self.inline_refs(d.body)) for d in self.p.defs}


def root_var(def_name: str) -> str:
    return f"$def_{def_name}"


# ----------------------------------------------------------------------------------
# Trace
# ----------------------------------------------------------------------------------
@dataclass
class IterationRecord:
    iteration: int
    stage: str
    matches: dict[str, int]
    rows: int
    seconds: float
    banned: dict[str, int] = field(default_factory=dict)  # rule -> banned until iteration


@dataclass
class Trace:
    """What saturation did: per iteration and ruleset, the rules that matched, the
    e-graph size and the time; why it stopped; and where each rule comes from."""
    iterations: list[IterationRecord] = field(default_factory=list)
    stop_reason: str = "not run"
    rules: dict[str, RuleInfo] = field(default_factory=dict)
    fold_checks: list = field(default_factory=list)   # verify.FoldCheck per derived fold
    stage_reasons: list = field(default_factory=list)  # "stage: why it stopped"
    snapshots: list = field(default_factory=list)     # (iteration, {def: best term})
    rule_checks: list = field(default_factory=list)   # one line per user rule file checked
    validation: object = None  # translation_validation.ValidationReport of the chosen kernel

    def fired(self) -> dict[str, int]:
        """Total matches per rule over the whole run (rules that matched at least once)."""
        tot: dict[str, int] = {}
        for it in self.iterations:
            for r, n in it.matches.items():
                if n:
                    tot[r] = tot.get(r, 0) + n
        return tot

    def __str__(self) -> str:
        lines = [f"saturation: {len(self.iterations)} iteration(s), stop reason: {self.stop_reason}"
                 + (f" ({'; '.join(self.stage_reasons)})" if self.stage_reasons else "")]
        for it in self.iterations:
            fired = {r: n for r, n in it.matches.items() if n}
            body = ", ".join(f"{r}×{n}" for r, n in sorted(fired.items())) or "(nothing new)"
            lines.append(f"  iter {it.iteration:>2} [{it.stage}] rows={it.rows:<6} "
                         f"{it.seconds * 1e3:7.1f} ms  {body}")
            for r, until in sorted(it.banned.items()):
                lines.append(f"           back-off: {r} matched too often, banned until "
                             f"iteration {until}")
        for line in self.rule_checks:
            lines.append(f"user rules checked at load: {line}")
        if self.validation is not None:
            lines.append(str(self.validation))
        if self.fold_checks:
            ok = sum(c.ok for c in self.fold_checks)
            lines.append(f"fold checks (Eq. 3 and Eq. 4 of every derived fold): {ok}/"
                         f"{len(self.fold_checks)} hold")
            for c in self.fold_checks:
                if not c.ok:
                    lines.append(f"  REJECTED {c.fold}: {c.detail}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------
# The e-graph stage
# ----------------------------------------------------------------------------------
@dataclass
class Limits:
    """Hard bounds on saturation as a whole (iterations over all stages), and the
    back-off: a rule matching more than ``match_limit`` times in one iteration is left
    out for ``ban_length`` iterations; both double with every ban of that rule.
    ``match_limit=None`` turns back-off off."""
    iterations: int = 48
    rows: int = 50_000
    seconds: float = 60.0
    match_limit: int | None = 1000
    ban_length: int = 4

    def __post_init__(self):
        for name in ("iterations", "rows", "ban_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Expected Limits.{name} to be a positive int, got {v!r}.")
        if not isinstance(self.seconds, (int, float)) or self.seconds <= 0:
            raise ValueError(f"Expected Limits.seconds to be a positive number, got "
                             f"{self.seconds!r}.")
        if self.match_limit is not None and (not isinstance(self.match_limit, int)
                                             or self.match_limit < 1):
            raise ValueError(f"Expected Limits.match_limit to be a positive int or None (no "
                             f"back-off), got {self.match_limit!r}.")


class BackOff:
    """Exponential rule back-off (as in egg): rule r's threshold is
    ``match_limit · 2^bans(r)``; past it, r is banned for ``ban_length · 2^bans(r)``
    iterations and that iteration is redone without r."""

    def __init__(self, match_limit: int | None, ban_length: int):
        self.match_limit, self.ban_length = match_limit, ban_length
        self.times_banned: dict[str, int] = {}
        self.banned_until: dict[str, int] = {}

    def is_banned(self, rule: str, it: int) -> bool:
        return self.banned_until.get(rule, 0) >= it

    def over_limit(self, matches: dict[str, int]) -> list[str]:
        if self.match_limit is None:
            return []
        return sorted(r for r, n in matches.items()
                      if n > self.match_limit << self.times_banned.get(r, 0))

    def ban(self, rules: list[str], it: int) -> dict[str, int]:
        out = {}
        for r in rules:
            k = self.times_banned.get(r, 0)
            self.banned_until[r] = out[r] = it + (self.ban_length << k) - 1
            self.times_banned[r] = k + 1
        return out

    def lift(self, rules: list[str], it: int) -> list[str]:
        """Fast-forward: once nothing else changes, banned rules run again (a stage is
        only saturated with every rule taking part)."""
        lifted = [r for r in rules if self.is_banned(r, it)]
        for r in lifted:
            del self.banned_until[r]
        return lifted


@dataclass(frozen=True)
class Stage:
    """One step of the schedule: these rulesets (rule files), at most this many
    iterations."""
    name: str
    rulesets: tuple[str, ...]
    iterations: int


# Families in order: normalise, derive and simplify folds, privatize them, then
# everything (user files included) to a fixpoint.
DEFAULT_SCHEDULE = [
    Stage("algebra", ("algebra", "backward"), 6),
    Stage("rolling", ("algebra", "rolling"), 24),
    Stage("split-k", ("splitk",), 2),
    Stage("layout", ("layout", "algebra"), 6),
    Stage("all", ("*",), 12),
]


def _resolve(schedule: list[Stage], loaded: list[str]) -> list[Stage]:
    """Drop rulesets that are not loaded; ``*`` means every loaded ruleset."""
    out = []
    for st in schedule:
        rs = tuple(loaded) if "*" in st.rulesets else tuple(r for r in st.rulesets if r in loaded)
        if rs:
            out.append(Stage(st.name, rs, st.iterations))
    return out


class EGraphStage:
    """Holds one e-graph for one program."""

    def __init__(self, program: Program, rule_files: list[Path | str] | None = None,
                 extra_rule_files: list[Path | str] = ()):
        self.program = program
        self.eg = new_egraph()
        self.low = self.eg._egraph
        self.trace = Trace()
        self.rulesets: list[str] = []                  # rule files, in load order
        self.rules_of: dict[str, list[str]] = {}       # rule file -> its rule names
        self._combined: dict[tuple[str, ...], str] = {}
        files = shipped_rule_files() if rule_files is None else [Path(f) for f in rule_files]
        for f in list(files) + [Path(f) for f in extra_rule_files]:
            self.load_rules(f)
        self.roots: dict[str, str] = {}
        for name, sx in ProgramEncoder(program).encode().items():
            self._run(f"(let {root_var(name)} {sx})", "<program>")
            self.roots[name] = root_var(name)

    def _run(self, text: str, filename: str):
        return self.low.run_program(*self.low.parse_program(text, filename=filename))

    def load_rules(self, path: Path | str) -> list[RuleInfo]:
        """Add a rule file; raises RuleFileError (and changes nothing) if it is bad."""
        cmds, infos = parse_rule_file(path, set(self.trace.rules))
        rs = infos[0].ruleset if infos else None
        if rs is None:
            return []
        if rs in self.rulesets:
            raise RuleFileError(f"{path}: a rule file named {rs!r} is already loaded; rename it.")
        self._run("\n".join(f"(ruleset {i.egg_ruleset})" for i in infos), "<ruleset>")
        self.low.run_program(*cmds)
        self.rulesets.append(rs)
        self.rules_of[rs] = [i.name for i in infos]
        for i in infos:
            self.trace.rules[i.name] = i
        return infos

    def rows(self) -> int:
        return sum(n for _, n in self.eg.all_function_sizes())

    def saturate(self, limits: Limits = Limits(), on_iteration=None,
                 schedule: "list[Stage] | None" = None) -> Trace:
        """Run the staged schedule (default: ``DEFAULT_SCHEDULE``; rulesets not named in
        it, e.g. user files, join the last stage).  Every stage runs until it saturates or
        spends its iteration budget; a row or time limit stops everything.
        ``on_iteration(stage, iteration)`` is called after every kept iteration."""
        t0 = time.perf_counter()
        stages = _resolve(schedule or DEFAULT_SCHEDULE, self.rulesets)
        backoff = BackOff(limits.match_limit, limits.ban_length)
        reasons, it, reason = [], 0, "saturated"
        for stage in stages:
            rules = [r for rs in stage.rulesets for r in self.rules_of[rs]]
            reason = "iteration limit"
            for _ in range(stage.iterations):
                if time.perf_counter() - t0 > limits.seconds:
                    reason = "time limit"
                    break
                if it >= limits.iterations:
                    break
                it += 1
                before = self.rows()
                t1 = time.perf_counter()
                # Rulesets are made before the push: a pop would take them away.
                active = self._active_ruleset(rules, backoff, it)
                self.eg.push()
                matches, changed = self._iterate(active)
                banned = backoff.ban(backoff.over_limit(matches), it)
                if banned:  # redo the iteration without the rules that matched too often
                    self.eg.pop()
                    active = self._active_ruleset(rules, backoff, it)
                    self.eg.push()
                    matches, changed = self._iterate(active)
                rows = self.rows()
                record = IterationRecord(it, stage.name, matches, rows, 0.0, banned)
                if rows > limits.rows:
                    self.eg.pop()  # back to the last state within budget
                    reason = "row limit"
                    record.stage += " (rolled back)"
                    record.seconds = time.perf_counter() - t1
                    self.trace.iterations.append(record)
                    break
                # egglog has no "drop snapshot": the copy stays on its stack until the stage
                # is discarded (bounded by iterations x rows).
                record.seconds = time.perf_counter() - t1
                self.trace.iterations.append(record)
                if on_iteration is not None:
                    on_iteration(self, it)
                if rows == before and not changed and not banned:
                    if backoff.lift(rules, it):
                        continue
                    reason = "saturated"
                    break
            reasons.append(f"{stage.name}: {reason}")
            if reason in ("row limit", "time limit") or it >= limits.iterations:
                if reason == "saturated":
                    reason = "iteration limit"
                break
        self.trace.stage_reasons = reasons
        if reason in ("row limit", "time limit"):
            self.trace.stop_reason = reason
        elif all(r.endswith("saturated") for r in reasons) and len(reasons) == len(stages):
            self.trace.stop_reason = "saturated"
        else:
            self.trace.stop_reason = "iteration limit"
        return self.trace

    def _active_ruleset(self, rules: list[str], backoff: BackOff, it: int) -> str | None:
        """One egglog ruleset holding the rules not banned at iteration ``it``, so they
        all match on the same e-graph (created once per distinct set: bans change it
        rarely).  None if every rule is banned."""
        rules = [r for r in rules if not backoff.is_banned(r, it)]
        if not rules:
            return None
        key = tuple(rules)
        if key not in self._combined:
            name = f"active-{len(self._combined)}"
            owner = {r: rs for rs, names in self.rules_of.items() for r in names}
            parts = " ".join(rule_ruleset(owner[r], r) for r in rules)
            self._run(f"(unstable-combined-ruleset {name} {parts})", "<schedule>")
            self._combined[key] = name
        return self._combined[key]

    def _iterate(self, ruleset: str | None) -> tuple[dict[str, int], bool]:
        """One iteration: structural rules to fixpoint, the ruleset once (its rules all
        matched on the same e-graph), structural again.  Returns matches per rule and
        whether the rules changed the e-graph."""
        self._run(f"(run-schedule (saturate (run {ANALYSIS}) (run {SUBST})))", "<schedule>")
        matches: dict[str, int] = {}
        changed = False
        if ruleset is not None:
            for report in self._run(f"(run-schedule (run {ruleset}))", "<schedule>"):
                changed |= bool(report.report.updated)
                for r, n in report.report.num_matches_per_rule.items():
                    matches[r] = matches.get(r, 0) + n
        self._run(f"(run-schedule (saturate (run {ANALYSIS}) (run {SUBST})))", "<schedule>")
        return matches, changed

    def serialize(self) -> dict:
        """The whole e-graph as egraph-serialize JSON (nodes, classes, let-bound roots)."""
        return json.loads(self.low.serialize([]).to_json())

    def dot(self) -> str:
        return self.low.serialize([]).to_dot()

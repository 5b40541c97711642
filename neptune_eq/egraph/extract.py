"""Extraction: rank the e-graph's programs with a cost model and decode the winner.

Works on the e-graph's serialized form (egraph-serialize JSON), so it needs no egglog:
classes, their member nodes, and the ``free``/``uses`` analyses the rules computed.

The first cost model counts work weighted by iteration domain (the product of the
extents an e-class depends on), with transcendental ops dearer than arithmetic, and
charges a *pass over memory* for every reduction whose body reads a producer by name
(that producer must be complete first, so the data is read again).  A fused fold
(``RollSum``) reads running values instead and pays no pass.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .table import CONSTRUCTORS
from ..ir import Definition, Program, Term, accessed, reachable

INF = math.inf

# Per-element weights (arithmetic = 1).  SFU ops cost more; memory reads more still.
# exp costs a multiply by log2(e) on top of the SFU's ex2, so exp2 is cheaper.
OP_WEIGHT = {"exp": 4.5, "exp2": 3.0, "log": 4.0, "tanh": 6.0, "sqrt": 4.0, "rsqrt": 4.0,
             "sin": 4.0, "cos": 4.0, "erf": 8.0,
             "div": 2.0, "load": 8.0, "ref": 1.0, "run": 1.0, "prev": 1.0,
             "sum": 1.0, "max": 1.0, "min": 1.0, "rollsum": 1.5,
             "rollmax": 1.5, "splitk": 2.0}
LEAF = {"var", "int", "flt"}
PASS_WEIGHT = 64.0  # re-reading the loop's data once more (per element of the loop domain)


@dataclass
class Node:
    op: str            # egglog constructor name
    children: tuple    # child e-class ids


@dataclass
class EGraphView:
    """A read-only view of a serialized e-graph."""
    classes: dict[str, list[Node]]
    literal: dict[str, object]          # primitive class -> python value
    free: dict[str, frozenset]
    uses: dict[str, frozenset]
    roots: dict[str, str]               # let-bound name -> class
    n_nodes: int = 0

    @classmethod
    def from_json(cls, data: dict | str) -> "EGraphView":
        data = json.loads(data) if isinstance(data, str) else data
        nodes = data["nodes"]
        cls_of = {nid: n["eclass"] for nid, n in nodes.items()}
        classes: dict[str, list[Node]] = {}
        literal: dict[str, object] = {}
        sets: dict[str, frozenset] = {}
        analyses: dict[str, dict[str, str]] = {"free": {}, "uses": {}}
        for nid, n in nodes.items():
            op, kids = n["op"], [cls_of[c] for c in n["children"]]
            if n["eclass"].startswith(("String-", "i64-", "f64-")):
                literal[n["eclass"]] = _literal(n["eclass"], op)
            elif op == "set-of":
                sets[n["eclass"]] = kids  # resolved below
            elif op in analyses:
                analyses[op][kids[0]] = n["eclass"]
            elif op in CONSTRUCTORS or op in ("AtRun", "AtPrev", "INil", "ICons"):
                classes.setdefault(n["eclass"], []).append(Node(op, tuple(kids)))
        def as_set(c):
            return frozenset(literal[k] for k in sets.get(c, ()))
        free = {t: as_set(s) for t, s in analyses["free"].items()}
        uses = {t: as_set(s) for t, s in analyses["uses"].items()}
        roots = {v["let"].lstrip("$"): k for k, v in data.get("class_data", {}).items() if "let" in v}
        return cls(classes, literal, free, uses, roots, len(nodes))


def _literal(eclass: str, op: str):
    if eclass.startswith("String-"):
        return json.loads(op)
    if eclass.startswith("i64-"):
        return int(op)
    return float(op)


class CostModel:
    """Work weighted by iteration domain, plus one pass penalty per unfused reduction.

    ``allow_split_k`` prices split-k folds; while False they stay in the e-graph (and in
    the candidate listing) but are never extracted."""

    def __init__(self, program: Program, allow_split_k: bool = False,
                 forbid: frozenset[str] = frozenset()):
        self.extents = program.extents
        self.allow_split_k = allow_split_k
        self.forbid = forbid  # constructors this model never extracts
        self.banned: set[tuple[str, str, tuple]] = set()  # fold nodes that failed Eq. 3/4

    def domain(self, view: EGraphView, cls: str) -> float:
        return float(math.prod(self.extents.get(a, 1) for a in view.free.get(cls, ())))

    def node_cost(self, view: EGraphView, cls: str, node: Node) -> float:
        if node.op in ("AtRun", "AtPrev") or (node.op == "SplitK" and not self.allow_split_k):
            return INF
        if (cls, node.op, node.children) in self.banned or node.op in self.forbid:
            return INF
        if node.op in ("INil", "ICons"):
            return 0.0
        op = CONSTRUCTORS[node.op][0]
        if op in LEAF:
            return 0.0
        cost = OP_WEIGHT.get(op, 1.0) * self.domain(view, cls)
        if op in ("sum", "max", "min"):
            body = node.children[-1]
            if view.uses.get(body):
                cost += PASS_WEIGHT * self.domain(view, body)
        return cost


@dataclass
class Extraction:
    """The cheapest term of every e-class under a cost model."""
    view: EGraphView
    model: CostModel
    best: dict[str, tuple[float, Node]] = field(default_factory=dict)

    @classmethod
    def run(cls, view: EGraphView, model: CostModel) -> "Extraction":
        ex = cls(view, model)
        changed = True
        while changed:
            changed = False
            for c, nodes in view.classes.items():
                for n in nodes:
                    cost = model.node_cost(view, c, n)
                    if cost == INF:
                        continue
                    for k in n.children:
                        if k in view.literal:
                            continue
                        kb = ex.best.get(k)
                        if kb is None:
                            cost = INF
                            break
                        cost += kb[0]
                    if cost < ex.best.get(c, (INF, None))[0]:
                        ex.best[c] = (cost, n)
                        changed = True
        return ex

    def cost(self, cls: str) -> float:
        return self.best.get(cls, (INF, None))[0]

    def term(self, cls: str, memo: dict | None = None) -> Term:
        """Decode the cheapest term of ``cls`` back to the loop IR."""
        memo = {} if memo is None else memo
        if cls in memo:
            return memo[cls]
        if cls not in self.best:
            raise ValueError(f"e-class {cls} has no finite-cost term")
        node = self.best[cls][1]
        op, kinds = CONSTRUCTORS[node.op]
        lits = [self.view.literal[k] for k, kind in zip(node.children, kinds) if kind in "SIF"]
        subs = [k for k, kind in zip(node.children, kinds) if kind == "T"]
        idx = [k for k, kind in zip(node.children, kinds) if kind == "X"]
        if op in LEAF:
            out = Term(op, (), lits[0])
        elif idx:
            out = Term(op, tuple(self._idx(idx[0], memo)), lits[0])
        else:
            out = Term(op, tuple(self.term(k, memo) for k in subs), lits[0] if lits else None)
        memo[cls] = out
        return out

    def term_rooted_at_reduction(self, cls: str, memo: dict) -> Term:
        """The cheapest term of ``cls`` whose top node is a reduction or fold.

        A definition read through ``run:``/``prev:`` must be one: those reads name the
        running value of its top reduction.  Its class may hold a cheaper non-reduction
        form (``Σ_j a·c = (Σ_j a)·c`` puts a ``mul`` on top), which alone is equal in
        total but has no running value."""
        best = None
        for n in self.view.classes.get(cls, ()):
            if n.op not in REDUCTION_OPS:
                continue
            own = self.model.node_cost(self.view, cls, n)
            kids = [k for k in n.children if k not in self.view.literal]
            if own == INF or any(k not in self.best for k in kids):
                continue
            cost = own + sum(self.best[k][0] for k in kids)
            if best is None or cost < best[0]:
                best = (cost, n)
        if best is None:
            raise ValueError(f"e-class {cls} is read through run/prev but holds no "
                             "finite-cost reduction")
        saved = self.best[cls]
        self.best[cls] = best  # decode this one class at the reduction node
        try:
            return self.term(cls, {k: v for k, v in memo.items() if k != cls})
        finally:
            self.best[cls] = saved

    def _idx(self, cls: str, memo) -> list[Term]:
        out = []
        while True:
            node = self.best[cls][1]
            if node.op == "INil":
                return out
            out.append(self.term(node.children[0], memo))
            cls = node.children[1]


@dataclass
class Candidate:
    """One extracted program with its predicted cost."""
    program: Program
    cost: float
    description: str


FOLD_OPS = ("RollSum", "RollMax", "SplitK")
# Constructors whose term is a reduction (or a fold of one): what run:/prev: may read.
REDUCTION_OPS = ("Sum", "Max", "Min") + FOLD_OPS


def check_folds(view: EGraphView, model: CostModel,
                max_producers: frozenset[str] | None = None) -> list:
    """Check Eq. 3 and Eq. 4 for every fold e-node the rules created (each at its
    cheapest body and correction), and that its exponentials stay bounded given which
    producers are maxima; failing nodes are banned from extraction."""
    from .verify import check_fold
    ex = Extraction.run(view, model)
    results, seen = [], {}
    for c, nodes in view.classes.items():
        for n in nodes:
            if n.op not in FOLD_OPS or any(k not in ex.best for k in n.children[1:]):
                continue
            t = Term(CONSTRUCTORS[n.op][0], (ex.term(n.children[1]), ex.term(n.children[2])),
                     view.literal[n.children[0]])
            key = (t.op if t.op == "rollmax" else "sum", t.args, t.val)
            if key not in seen:
                seen[key] = check_fold(t, max_producers)
                results.append(seen[key])
            if not seen[key].ok:
                model.banned.add((c, n.op, n.children))
    return results


def extract_program(view: EGraphView, program: Program, model: CostModel | None = None) -> Candidate:
    """Cheapest program: every output, and every producer it reads, at its best term."""
    model = model or CostModel(program)
    ex = Extraction.run(view, model)
    memo: dict = {}
    bodies = {d.name: ex.term(view.roots[f"def_{d.name}"], memo) for d in program.defs}
    needed = reachable(bodies, program.outputs)
    for name in _running_targets(bodies, needed):
        if bodies[name].kind not in ("reduce", "fold"):
            bodies[name] = ex.term_rooted_at_reduction(view.roots[f"def_{name}"], memo)
    defs = [Definition(d.name, d.axes, bodies[d.name], d.dtype) for d in program.defs
            if d.name in needed]
    cost = sum(ex.cost(view.roots[f"def_{d.name}"]) for d in defs)
    return Candidate(program.with_defs(defs), cost, _describe(defs))


def alternatives(view: EGraphView, program: Program, model: CostModel,
                 chosen: Candidate) -> list[Candidate]:
    """The best program of each kind the e-graph holds: ``chosen`` (the model's choice),
    plain (no folds) and split-k; duplicates removed."""
    out: list[Candidate] = [chosen]
    variants = [CostModel(program, forbid=frozenset(FOLD_OPS)),
                CostModel(program, allow_split_k=True, forbid=frozenset({"RollSum", "RollMax"}))]
    for m in variants:  # same weights as ``model`` (named sizes: its representative extents)
        m.banned, m.extents = model.banned, model.extents
    for m in variants:
        try:
            c = extract_program(view, program, m)
        except ValueError:
            continue
        if all(str(c.program) != str(o.program) for o in out):
            out.append(c)
    return out


# ----------------------------------------------------------------------------------
# k-best extraction
# ----------------------------------------------------------------------------------
@dataclass
class KBest:
    """The ``k`` cheapest distinct terms of every e-class (tree cost).

    An entry is (cost, node, ranks): the node with child ``i`` at rank ``ranks[i]`` of its
    class.  Since a node and its children's terms determine the term, and every class's
    list holds distinct terms, entries with distinct (node, ranks) are distinct terms --
    deduplication is exact.  Candidates per node: all children at their best, and each
    child in turn at each of its ranks (a node's k best usually differ in one child)."""
    view: EGraphView
    k: int
    lists: dict[str, list] = field(default_factory=dict)

    @classmethod
    def run(cls, view: EGraphView, model: CostModel, k: int, rounds: int = 40) -> "KBest":
        kb = cls(view, k)
        for _ in range(rounds):
            changed = False
            for c, nodes in view.classes.items():
                cands: dict = {}
                for n in nodes:
                    base = model.node_cost(view, c, n)
                    kids = [ch for ch in n.children if ch not in view.literal]
                    if base == INF or any(ch not in kb.lists for ch in kids):
                        continue
                    combos = [(0,) * len(kids)]
                    for i, ch in enumerate(kids):
                        combos += [tuple(r if j == i else 0 for j in range(len(kids)))
                                   for r in range(1, len(kb.lists[ch]))]
                    for rk in combos:
                        cost = base + sum(kb.lists[ch][r][0] for ch, r in zip(kids, rk))
                        key = (n.op, n.children, rk)
                        if cost < cands.get(key, (INF,))[0]:
                            cands[key] = (cost, n, rk)
                entries = sorted(cands.values(), key=lambda e: e[0])[:k]
                if entries and entries != kb.lists.get(c):
                    kb.lists[c] = entries
                    changed = True
            if not changed:
                break
        return kb

    def term(self, cls: str, rank: int = 0) -> Term:
        _, node, ranks = self.lists[cls][rank]
        op, kinds = CONSTRUCTORS[node.op]
        lits = [self.view.literal[k] for k, kind in zip(node.children, kinds) if kind in "SIF"]
        kids = dict(zip([c for c in node.children if c not in self.view.literal], ranks))
        subs = [k for k, kind in zip(node.children, kinds) if kind == "T"]
        idx = [k for k, kind in zip(node.children, kinds) if kind == "X"]
        if op in LEAF:
            return Term(op, (), lits[0])
        if idx:
            return Term(op, tuple(self._idx(idx[0], kids[idx[0]])), lits[0])
        return Term(op, tuple(self.term(k, kids[k]) for k in subs), lits[0] if lits else None)

    def _idx(self, cls: str, rank: int) -> list[Term]:
        _, node, ranks = self.lists[cls][rank]
        if node.op == "INil":
            return []
        head, tail = node.children
        return [self.term(head, ranks[0])] + self._idx(tail, ranks[1])


def top_programs(view: EGraphView, program: Program, model: CostModel, k: int = 8,
                 beam: int = 64) -> list[Candidate]:
    """The ``k`` cheapest distinct programs: each definition at one of its k best terms,
    combined by a beam over definitions; definitions no output needs are dropped."""
    kb = KBest.run(view, model, k)
    beams: list[tuple[float, dict]] = [(0.0, {})]
    for d in program.defs:
        cls = view.roots[f"def_{d.name}"]
        opts = kb.lists.get(cls, [])
        if not opts:
            raise ValueError(f"definition {d.name} has no finite-cost term")
        beams = sorted(((c + e[0], {**ch, d.name: r}) for c, ch in beams
                        for r, e in enumerate(opts)), key=lambda b: b[0])[:beam]
    out: dict[str, Candidate] = {}
    for _, choice in beams:
        bodies = {n: kb.term(view.roots[f"def_{n}"], r) for n, r in choice.items()}
        needed = reachable(bodies, program.outputs)
        if any(bodies[n].kind not in ("reduce", "fold")
               for n in _running_targets(bodies, needed)):
            continue  # run:/prev: of a non-reduction form has no meaning (see above)
        defs = [Definition(d.name, d.axes, bodies[d.name], d.dtype) for d in program.defs
                if d.name in needed]
        cost = sum(kb.lists[view.roots[f"def_{d.name}"]][choice[d.name]][0] for d in defs)
        cand = Candidate(program.with_defs(defs), cost, _describe(defs))
        key = str(cand.program)
        if key not in out or out[key].cost > cost:
            out[key] = cand
    return sorted(out.values(), key=lambda c: c.cost)[:k]


def _running_targets(bodies: dict[str, Term], names) -> set[str]:
    """Definitions some body in ``names`` reads through ``run:`` or ``prev:``."""
    return {t for n in names for t in accessed(bodies[n], ("run", "prev"))}


def _describe(defs) -> str:
    ops = [n.op for d in defs for n in d.body.walk() if n.kind == "fold"]
    if not ops:
        return "plain: one pass per dependent reduction"
    if "splitk" in ops:
        return f"split-k: {ops.count('splitk')} fold(s) as parallel partials + combine"
    return f"rolling: {len(ops)} fused fold(s)"

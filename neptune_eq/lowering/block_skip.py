"""Data-dependent block skipping: the block predicate evaluated per key block in a kernel.

A pass whose folds are all gated by mask atoms that read captured tensors (``doc[i] ==
doc[j]``) and are not already loop bounds gets, at the top of its key loop, a scalar test
built by ``block_predicate`` over the block's index ranges and the per-block summaries
of those tensors (kernel inputs ``bs_*``, built per call by ``runtime.block_summary``):

    if may:            # else: skip -- every fold would add its identity
        if must:       # every pair visible: the body without the elementwise mask
            ...
        else:
            ...

The same test serves the split-k partials, so FlashDecoding forms skip the same way.
"""
from __future__ import annotations

from ..ir import Term, free_axes, rename_axis
from .block_predicate import PyOps, SummarySpec, _and, block_truth, summary_dim
from .codegen import LOOP, Emitter
from .lower import Pass, TilePlan


def data_atoms(plan: TilePlan, ps: Pass) -> list[Term]:
    """Gate atoms of a pass worth a per-block test (fold axis named ``@j``): not already
    loop bounds, reading no score or running state, and moving with the key axis."""
    if plan.packed:  # packed GQA rows mix heads in one block: no row-block summary
        return []
    out = []
    for a in sorted(ps.gate_atoms - ps.bound_atoms, key=str):
        if any(n.op in ("ref", "run", "prev") or n.kind in ("reduce", "fold") for n in a.walk()):
            continue
        if "@j" in free_axes(a) and any(n.op == "load" for n in a.walk()):
            out.append(a)
    return out


def _roles(plan: TilePlan, loop_var: str) -> dict[str, str]:
    return {plan.block_axis: "row", loop_var: "loop"}


def summary_specs(plan: TilePlan) -> list[SummarySpec]:
    """The summaries the kernel's block tests read, in parameter order."""
    specs: dict[str, SummarySpec] = {}
    for ps in plan.passes:
        for atom in data_atoms(plan, ps):
            for n in atom.walk():
                if n.op != "load":
                    continue
                hit = summary_dim(n, _roles(plan, "@j"), set(plan.grid_axes))
                if hit is not None and hit[0] is None:
                    continue  # one element per program: read from the tensor itself
                spec = _spec(plan, n.val, hit)
                specs.setdefault(spec.name, spec)
    return list(specs.values())


def _spec(plan: TilePlan, tensor: str, hit) -> SummarySpec:
    if hit is None:
        return SummarySpec(f"bs_{tensor}_all", tensor, None, None)
    dim, role = hit
    block = f"B_{plan.block_axis}" if role == "row" else f"B_{LOOP}"
    return SummarySpec(f"bs_{tensor}_d{dim}_{role}", tensor, dim, block)


class TritonOps:
    """``block_predicate``'s scalar algebra emitting Triton code; constants fold in Python."""

    def __init__(self, em: Emitter):
        self.em, self.py = em, PyOps()

    def _name(self, code: str) -> str:
        v = self.em.new("bp")
        self.em.emit(f"{v} = {code}")
        return v

    def binary(self, op, a, b):
        if not isinstance(a, str) and not isinstance(b, str):
            return self.py.binary(op, a, b)
        fmt = {"add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}",
               "min": "tl.minimum({}, {})", "max": "tl.maximum({}, {})", "lt": "{} < {}",
               "le": "{} <= {}", "eq": "{} == {}", "and": "({}) & ({})", "or": "({}) | ({})"}[op]
        return self._name(fmt.format(a, b))

    def floordiv(self, a, c):  # emitted like the elementwise mask's own ``//``
        return self._name(f"{a} // {c}")

    def mod(self, a, c):
        return self._name(f"{a} % {c}")

    def select(self, c, a, b):
        if not isinstance(c, str):
            return a if c else b
        return self._name(f"tl.where({c}, {a}, {b})")

    def not_(self, a):
        return (not a) if not isinstance(a, str) else self._name(f"{a} == 0")


def emit_block_test(em: Emitter, ps: Pass, atoms: list[Term], loop_var: str,
                    extent) -> tuple[str | bool, str | bool, frozenset]:
    """Emit the scalar test of the current key block (``l0``); (may, must, atoms the
    must-branch drops), each of may/must code or a static bool."""
    plan = em.plan
    ba = plan.block_axis
    if not any(line.strip().startswith("row_hi =") for line in em.scopes[0][0]):
        em.emit(f"row_hi = tl.minimum(row_last, {plan.row_extent} - 1)", scope=0)
    ranges = {ba: ("row_first", "row_hi"), loop_var: ("l0", em.new("bp"))}
    em.emit(f"{ranges[loop_var][1]} = tl.minimum(l0 + B_{LOOP}, {extent}) - 1")
    for a in plan.grid_axes:
        ranges[a] = (f"ax_{a}", f"ax_{a}")
    roles = _roles(plan, loop_var)
    ops = TritonOps(em)

    def load(t: Term, idx: list):
        hit = summary_dim(t, roles, set(plan.grid_axes))
        if hit is not None and hit[0] is None:  # the element itself: exact
            if any(b is None for b in idx):
                return None
            off = " + ".join(f"({b[0]}) * {t.val}_s{k}" for k, b in enumerate(idx)) or "0"
            v = ops._name(f"tl.load({t.val}_ptr + {off})")
            return v, v
        spec = _spec(plan, t.val, hit)
        if hit is None:
            return _global_bounds(ops, plan, t, spec, idx)
        dim, role = hit
        at = [("pid_block" if role == "row" else f"(l0 // B_{LOOP})") if k == dim
              else (b[0] if b else "0") for k, b in enumerate(idx)]
        if any(b is None for k, b in enumerate(idx) if k != dim):
            return None
        off = " + ".join(f"({x}) * {spec.name}_s{k}" for k, x in enumerate(at))
        lo = ops._name(f"tl.load({spec.name}_ptr + {off})")
        hi = ops._name(f"tl.load({spec.name}_ptr + {off} + {spec.name}_s{len(at)})")
        return lo, hi

    may, must, drop = True, True, []
    for atom in atoms:
        a_may, a_must = block_truth(rename_axis(atom, "@j", loop_var), ops, ranges.get, load)
        may = _and(ops, may, a_may)
        if a_must is False:
            continue
        drop.append(atom)
        must = _and(ops, must, a_must)
    if not drop:
        must = False
    return may, must, frozenset(drop)


def _global_bounds(ops: TritonOps, plan: TilePlan, t: Term, spec: SummarySpec, idx: list):
    """A read with a computed index (``offsets[doc[i]]``): the tensor's global [min, max];
    when a 1-D tensor is nondecreasing (the summary's flag, checked on the data) and the
    index is bounded, its values at the two ends of the index range -- tight for offsets
    of packed sequences."""
    lo = ops._name(f"tl.load({spec.name}_ptr)")
    hi = ops._name(f"tl.load({spec.name}_ptr + {spec.name}_s0)")
    if len(idx) != 1 or idx[0] is None:
        return lo, hi
    n = plan.program.shape_of(t.val)[0]
    mono = ops._name(f"tl.load({spec.name}_ptr + 2 * {spec.name}_s0) != 0")
    ends = []
    for end in idx[0]:  # out-of-range indices are never read: clamp to the tensor
        at = ops._name(f"tl.minimum(tl.maximum({end}, 0), {n} - 1)")
        ends.append(ops._name(f"tl.load({t.val}_ptr + {at} * {t.val}_s0)"))
    return ops.select(mono, ends[0], lo), ops.select(mono, ends[1], hi)

"""``ne.superoptimize``: the whole pipeline, and the ``Kernel`` it returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from . import dsl
from .codegen import KernelSource, generate
from .egraph.saturate import EGraphStage, Limits, Trace
from .derive import Step, derivation
from .extract import Candidate, CostModel, EGraphView, alternatives, check_folds, extract_program
from .ir import Program
from .lower import TilePlan, plan as make_plan
from .runtime import (Launcher, TileConfig, candidate_configs, check_inputs, resolve_target,
                      time_configs)


@dataclass
class Kernel:
    """A superoptimized program: call it on torch tensors.

    ``source`` is the Triton source, ``program`` the chosen (fused) loop program,
    ``trace`` what saturation did, ``candidates`` what was considered."""
    input_program: Program
    program: Program
    plan: TilePlan
    kernel_source: KernelSource
    trace: Trace
    candidates: list[dict]
    target: str
    config: TileConfig
    timings: list = field(default_factory=list)
    _egraph_json: dict = field(default_factory=dict, repr=False)
    _egraph_dot: str = field(default="", repr=False)
    _launcher: Launcher | None = field(default=None, repr=False)

    @property
    def source(self) -> str:
        return self.kernel_source.source

    @property
    def launches(self) -> list[str]:
        return [self.kernel_source.name]

    def egraph_json(self) -> dict:
        """The saturated e-graph in egraph-serialize JSON (nodes, e-classes, roots)."""
        return self._egraph_json

    def egraph_dot(self) -> str:
        """The saturated e-graph as Graphviz DOT (render with ``dot -Tsvg``)."""
        return self._egraph_dot

    @property
    def derivation(self) -> list[Step]:
        """Steps from the input program to the chosen one (rule, file:line, before → after)."""
        return derivation(self.trace.snapshots, self.trace)

    def explain(self) -> str:
        """How the chosen program was derived from the input, step by step."""
        fired = self.trace.fired()
        lines = ["input program:", _indent(str(self.input_program)), "",
                 "derivation (smallest changed subterm per step):"]
        lines += [_indent(str(s)) for s in self.derivation] or ["  (no change)"]
        lines += ["", "chosen program:", _indent(str(self.program)), "",
                  f"plan ({self.plan.n_passes} pass(es) over memory):", _indent(self.plan.describe()),
                  "", "candidates:"]
        for c in self.candidates:
            cost = ("not lowered yet (split-k kernels: issue 4)" if c["predicted_cost"] == float("inf")
                    else f"predicted cost {c['predicted_cost']:.4g}")
            lines.append(f"  #{c['rank']} {c['description']}: {cost}"
                         f"{'  <- chosen' if c['chosen'] else ''}")
        lines += ["", "rules that fired (total matches):"]
        for name, n in sorted(fired.items(), key=lambda kv: -kv[1]):
            info = self.trace.rules.get(name)
            where = f"  [{info.where}]  {info.comment}" if info else "  [structural]"
            lines.append(f"  {name:<24} ×{n:<4}{where}")
        return "\n".join(lines)

    def __call__(self, *args, **kwargs):
        import torch
        bound = check_inputs(self.program, args, kwargs, self.target)
        dev = "cuda" if self.target == "cuda" else "cpu"
        outs = {}
        for name in self.program.outputs:
            shape = self.program.shape_of(name)
            dt = getattr(torch, self.program.dtype_of(name))
            outs[name] = torch.empty(shape, dtype=dt, device=dev)
        if self._launcher is None:
            self._launcher = Launcher(self.program, self.kernel_source, self.target, self.config)
        self._launcher({**bound, **outs})
        res = [outs[n] for n in self.program.outputs]
        return res[0] if len(res) == 1 else tuple(res)


def _indent(s: str) -> str:
    return "\n".join("  " + line for line in s.splitlines())


def superoptimize(outputs, *, rules: Sequence[str | Path] | None = None,
                  extra_rules: Sequence[str | Path] = (), target: str = "auto",
                  limits: Limits | None = None, example_inputs: dict | None = None) -> Kernel:
    """Superoptimize the program that computes ``outputs`` (a ne.compute tensor or a list).

    ``rules`` replaces the shipped rule files, ``extra_rules`` adds user rule files.
    On a GPU the chosen program's tile configs are timed on random inputs (or
    ``example_inputs``) and the fastest is kept."""
    program = outputs if isinstance(outputs, Program) else dsl.build_program(outputs)
    target = resolve_target(target)
    from . import rules as rule_registry
    stage = EGraphStage(program, rules, list(rule_registry.loaded()) + list(extra_rules))
    model = CostModel(program)

    def snapshot(st: EGraphStage, it: int):
        cand = extract_program(EGraphView.from_json(st.serialize()), program, model)
        st.trace.snapshots.append((it, {d.name: d.body for d in cand.program.defs}))

    snapshot(stage, 0)
    trace = stage.saturate(limits or Limits(), on_iteration=snapshot)
    egraph_json = stage.serialize()
    view = EGraphView.from_json(egraph_json)
    trace.fold_checks = check_folds(view, model)
    chosen: Candidate = extract_program(view, program, model)
    tile_plan = make_plan(chosen.program)
    ks = generate(tile_plan, bf16_dot_in_fp32=(target == "interpreter"))
    candidates = []
    for alt in alternatives(view, program, model, chosen):
        is_chosen = str(alt.program) == str(chosen.program)
        candidates.append({"rank": 0, "description": alt.description, "program": alt.program,
                           "predicted_cost": alt.cost if is_chosen or "split-k" not in alt.description
                           else float("inf"), "chosen": is_chosen})
    candidates.sort(key=lambda c: c["predicted_cost"])
    for k, c in enumerate(candidates, 1):
        c["rank"] = k
    configs = candidate_configs(ks, target)
    timings = []
    config = configs[0]
    if target == "cuda" and len(configs) > 1:
        tensors = _random_inputs(program, example_inputs)
        timings = time_configs(chosen.program, ks, target, tensors, configs)
        ok = [(c, ms) for c, ms, _ in timings if ms is not None]
        if ok:
            config = min(ok, key=lambda cm: cm[1])[0]
    return Kernel(program, chosen.program, tile_plan, ks, trace, candidates, target, config,
                  timings, egraph_json, stage.dot())


def _random_inputs(program: Program, given: dict | None) -> dict:
    import torch
    out = dict(given or {})
    for ph in program.inputs:
        if ph.name not in out:
            dt = getattr(torch, ph.dtype)
            out[ph.name] = (torch.randn(ph.shape, device="cuda").to(dt) if dt.is_floating_point
                            else torch.zeros(ph.shape, dtype=dt, device="cuda"))
    for name in program.outputs:
        out[name] = torch.empty(program.shape_of(name), dtype=getattr(torch, program.dtype_of(name)),
                                device="cuda")
    return out

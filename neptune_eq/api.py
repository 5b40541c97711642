"""``ne.superoptimize``: the whole pipeline, and the ``Kernel`` it returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pickle
import sys

from .frontend import dsl
from .choosing.cache import load as cache_load, make_key, store as cache_store
from .choosing.choose import CandidateRow, spearman
from .choosing.costmodel import device_for
from .egraph.derive import Step, derivation
from .egraph.saturate import EGraphStage, Limits, Trace
from .egraph.extract import CostModel, EGraphView, alternatives, check_folds, extract_program, top_programs
from .ir import Program
from .lowering.codegen import FP32_DOT
from .lowering.inline import isolate_reductions
from .lowering.kernelgen import KernelSource, generate
from .lowering.lower import TilePlan, plan as make_plan
from .lowering import saturated_index
from .runtime.bound_call import BoundCall
from .runtime.launch import written_outputs
from .runtime.timing import strided_rows, timing_tensors
from .runtime.gluon_launch import GluonBoundCall, make_launcher
from .runtime.launcher import Launcher, check_inputs, resolve_target
from .runtime.tile_configs import TileConfig, candidate_configs
from .choosing.dispatch import SizeDispatch, choose_bucket
from .sizes import Guards, bind, sizes_of, specialise, symbols
from .choosing.translation_validation import validate_translation


_LAZY_FIELDS = ("trace", "candidates", "_egraph_json", "_egraph_dot")


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
    candidates: list[CandidateRow]
    target: str
    config: TileConfig
    timings: list = field(default_factory=list)
    _egraph_json: dict = field(default_factory=dict, repr=False)
    _egraph_dot: str = field(default="", repr=False)
    device: str = ""
    cache_status: str = "disabled"   # hit / miss / corrupt entry rebuilt
    build_seconds: float = 0.0
    # Where a cold build spent its time (seconds per stage, in pipeline order): the first
    # call of a new structure has a budget, and this is what tells which stage to cut.
    build_stages: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)   # named sizes the first bucket was chosen at
    _dispatch: SizeDispatch | None = field(default=None, repr=False)  # symbolic sizes only
    _launcher: Launcher | None = field(default=None, repr=False)
    # input signature (shape, strides, dtype, device of each) -> BoundCall: a call at a
    # signature met before binds only the data (runtime.bound_call; None: not replayable)
    _bound: dict = field(default_factory=dict, repr=False)

    def __getstate__(self):  # the compiled launcher is process-local: never cached
        state = dict(self.__dict__)
        state["_launcher"] = None
        state["_bound"] = {}
        # What only explaining reads -- the saturation trace, the e-graph, the candidates'
        # table -- kept pickled apart and unpickled on first use (``__getattr__``): they
        # were 6 of a warm cache hit's 13 ms (CPU, causal attention; issue 16: <= 10 ms).
        lazy = dict(state.pop("_lazy", None) or {})
        for name in _LAZY_FIELDS:
            if name in state:
                lazy[name] = pickle.dumps(state.pop(name), protocol=pickle.HIGHEST_PROTOCOL)
        state["_lazy"] = lazy
        return state

    def __getattr__(self, name):
        """A field kept pickled by ``__getstate__``, unpickled when first read."""
        lazy = self.__dict__.get("_lazy")
        if lazy is None or name not in lazy:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = pickle.loads(lazy.pop(name))
        setattr(self, name, value)
        return value

    def replay_for(self, args) -> Callable | None:
        """The replay kept for a positional call on ``args`` (``runtime.bound_call``:
        ``replay(list(args))`` launches and returns the outputs as a list), or None where
        no call at their signature has been made or the form is not replayed.  What a
        caller that made such a call keeps to skip ``__call__``'s look-up next time."""
        sig = _signature(tuple(args))
        return self._bound.get(sig) if sig is not None else None

    @property
    def ranking_spearman(self) -> float | None:
        """Spearman correlation of predicted vs measured time over the timed candidates."""
        return spearman(self.candidates)

    def candidate_table(self) -> str:
        lines = ["rank  predicted   measured   candidate"]
        lines += [c.line() for c in self.candidates]
        rho = self.ranking_spearman
        if rho is not None:
            lines.append(f"cost model vs measurement: Spearman {rho:+.2f} over "
                         f"{sum(c.measured_ms is not None for c in self.candidates)} timed candidates")
        return "\n".join(lines)

    @property
    def source(self) -> str:
        return self.kernel_source.source

    @property
    def launches(self) -> list[str]:
        """The Triton kernels one call runs, in order."""
        return self.kernel_source.launched(self.config is not None and self.config.fused)

    def egraph_json(self) -> dict:
        """The saturated e-graph in egraph-serialize JSON (nodes, e-classes, roots)."""
        return self._egraph_json

    def egraph_svg(self) -> str:
        """The saturated e-graph as SVG (layered by depth from the roots; no Graphviz needed)."""
        from .egraph.svg import egraph_svg
        return egraph_svg(EGraphView.from_json(self._egraph_json))

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
        lines = ["input program:", _indent(str(self.input_program)), ""]
        prepared = self.input_program.meta.get("prepared")
        if prepared:  # forms of a backward program applied before saturation (backward_forms)
            lines += ["prepared before saturation (what the caller knows):",
                      *[f"  - {p}" for p in prepared], ""]
        lines += ["derivation (smallest changed subterm per step):"]
        lines += [_indent(str(s)) for s in self.derivation] or ["  (no change)"]
        lines += ["", "chosen program:", _indent(str(self.program)), "",
                  f"plan ({self.plan.n_passes} pass(es) over memory):", _indent(self.plan.describe()),
                  "", f"candidates (cost model: {self.device or 'default device'}):",
                  _indent(self.candidate_table())]
        if self.chosen_row and self.chosen_row.estimate:
            lines.append("  chosen: " + self.chosen_row.estimate.describe())
        if self.build_stages:
            lines += ["", "build time: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.build_stages.items())]
        lines += ["", "rules that fired (total matches):"]
        for name, n in sorted(fired.items(), key=lambda kv: -kv[1]):
            info = self.trace.rules.get(name)
            where = f"  [{info.where}]  {info.comment}" if info else "  [structural]"
            lines.append(f"  {name:<24} ×{n:<4}{where}")
        return "\n".join(lines)

    @property
    def chosen_row(self) -> CandidateRow | None:
        return next((c for c in self.candidates if c.chosen), None)

    @property
    def saturations(self) -> int:
        """How many times this structure was saturated: once, whatever the sizes called."""
        return 1

    @property
    def buckets(self) -> list[str]:
        """The size buckets chosen so far (named sizes only): where each choice was made,
        the guards that bound it, and the candidate chosen."""
        if self._dispatch is None:
            return []
        return [f"{c.sizes}: {c.row.description}; {c.row.structure}; tiles {c.config} "
                f"({'timed' if c.row.measured_ms is not None else 'untimed'}); "
                f"valid where {c.guards}"
                for cs in self._dispatch.buckets.values() for c in cs]

    def bucket_ms(self, sizes: dict[str, int], tensors: dict) -> float | None:
        """GPU milliseconds of a call at the named ``sizes`` under its bucket's config --
        the bucket's timing, or for a bucket chosen untimed one timing of that config on
        ``tensors`` (``SizeDispatch.measured_ms``); None for a kernel of fixed sizes, off
        the GPU, or while a CUDA graph is captured."""
        if self._dispatch is None:
            return None
        return self._dispatch.measured_ms({s: sizes[s] for s in self._dispatch.symbols}, tensors)

    def __call__(self, *args, **kwargs):
        import torch
        if torch.compiler.is_compiling():
            # Inside torch.compile: a graph break, the kernel runs eagerly between the
            # compiled pieces (Dynamo cannot trace the launcher; ne.flex_attention is a
            # custom op instead, compiled whole).
            return torch.compiler.disable(self.__call__)(*args, **kwargs)
        # A signature met before: only the data is bound (runtime.bound_call).  Looked up
        # before the rows check below: every signature kept was taken after it (on the GPU
        # a kept one has contiguous rows), so a hit skips it -- a few us of a replay's ~20.
        sig = _signature(args) if not kwargs else None
        replay = self._bound.get(sig) if sig is not None else None
        if not replay and self.target == "cuda":
            rows = _rows_contiguous(args)
            if rows is not args:  # copied: the copies' signature may have been met
                args, sig = rows, _signature(rows) if not kwargs else None
                replay = self._bound.get(sig) if sig is not None else None
            kwargs = {k: v.contiguous() if strided_rows(v) else v for k, v in kwargs.items()}
        if replay:
            res = replay(list(args))
            return res[0] if len(res) == 1 else tuple(res)
        bound, launcher = (self._bind_symbolic(args, kwargs) if self._dispatch is not None
                           else self._bind_static(args, kwargs))
        launcher(bound)
        if sig is not None and len(args) == len(self.input_program.inputs):
            if len(self._bound) >= 256:  # a growing KV cache: keep it bounded
                self._bound.clear()
            try:
                replay = GluonBoundCall if getattr(launcher, "gluon", False) else BoundCall
                self._bound[sig] = replay(launcher, [ph.name for ph in self.input_program.inputs],
                                          bound, self.program.outputs)
            except ValueError:  # a form the replay does not cover: the general call each time
                self._bound[sig] = None
        res = [bound[n] for n in self.program.outputs]
        return res[0] if len(res) == 1 else tuple(res)

    def _bind_static(self, args: tuple, kwargs: dict) -> tuple[dict, Launcher]:
        """Inputs and freshly allocated outputs by name, checked, and the launcher."""
        import torch
        if self._launcher is None:
            self._launcher = make_launcher(self.program, self.kernel_source, self.target, self.config)
        bound = check_inputs(self.program, args, kwargs, self.target)
        dev = "cuda" if self.target == "cuda" else "cpu"
        outs = self.program.outputs
        bound.update(zip(outs, written_outputs(
            [(self.program.shape_of(n), getattr(torch, self.program.dtype_of(n))) for n in outs],
            dev)))
        return bound, self._launcher

    def _bind_symbolic(self, args: tuple, kwargs: dict) -> tuple[dict, Launcher]:
        """Any size: read the named sizes off the inputs; the size's launcher (its
        bucket's kernel; a new bucket is chosen once, without saturating)."""
        import torch
        prog = self.input_program
        bound = check_inputs(prog, args, kwargs, self.target, symbolic=True)
        values = sizes_of(prog, bound)
        launcher = self._dispatch.launcher(values, bound)
        dev = "cuda" if self.target == "cuda" else "cpu"
        specs = [([values[n.name] if hasattr(n, "name") else n for n in prog.shape_of(name)],
                  getattr(torch, prog.dtype_of(name))) for name in prog.outputs]
        bound.update(zip(prog.outputs, written_outputs(specs, dev)))
        return bound, launcher


def _rows_contiguous(args: tuple) -> tuple:
    """The arguments with each tensor's last dimension contiguous (stride 1), copied where
    it is not -- FlashAttention's and cuDNN's input rule.  On Triton 3.6 (H100) a query
    with row stride 1 and column stride 20 (a transposed copy viewed back) made the
    generated kernels fault or return wrong values at some tile configs (64x64 tiles, 3
    stages; bench/gpu_validate.py, session 11), where contiguous rows were right at every
    config.  One copy of such an input is the price of never running that form."""
    if not any(strided_rows(t) for t in args):
        return args
    return tuple(t.contiguous() if strided_rows(t) else t for t in args)


def _signature(args: tuple) -> tuple | None:
    """What a replay depends on besides the data: each tensor's shape, strides, dtype and
    device (None if an argument is not a tensor: the general call explains)."""
    import torch
    sig = []
    for t in args:
        if not isinstance(t, torch.Tensor):
            return None
        sig.append((t.shape, t.stride(), t.dtype, t.device))
    return tuple(sig)


def _indent(s: str) -> str:
    return "\n".join("  " + line for line in s.splitlines())


def superoptimize(outputs, *, rules: Sequence[str | Path] | None = None,
                  extra_rules: Sequence[str | Path] = (), target: str = "auto",
                  limits: Limits | None = None, example_inputs: dict | None = None,
                  top_k: int = 3, cache: bool = True, progress: bool = False,
                  device: str | None = None, allow_unchecked_rules: bool = False,
                  sizes: dict[str, int] | None = None,
                  float32_matmul_precision: str | None = None) -> Kernel:
    """Superoptimize the program that computes ``outputs`` (a ne.compute tensor or a list).

    ``rules`` replaces the shipped rule files, ``extra_rules`` adds user rule files; every
    user rule is checked for soundness first (``UnsoundRuleError`` for a refuted rule, and
    for one that can be neither proved nor refuted unless ``allow_unchecked_rules=True``).
    The e-graph's cheapest distinct programs are lowered and ranked by the GPU cost model
    (``device``: 'H100' / 'H200', default the GPU present, else H200); on a GPU the best
    ``top_k`` are timed over tile configs on random inputs (or ``example_inputs``) and the
    fastest is kept.  Before it is returned, the chosen program and its kernel are compared
    with the input program on random inputs (translation validation; a mismatch raises
    ``TranslationValidationError``).  A program with named sizes (``ne.size("S")``) is
    saturated once and the kernel runs at any size: the choice among candidates is made
    per size bucket when a call first meets it (``sizes=`` gives the first bucket's sizes,
    default the example inputs' or 1024).  Contractions of two float32 operands follow
    ``float32_matmul_precision`` as torch's matmuls do ("highest": exact fp32; "high" or
    "medium": TF32 tensor cores), default ``torch.get_float32_matmul_precision()`` at this
    call; the kernel keeps it.  The winner is cached on disk
    (``$NEPTUNE_EQ_CACHE``) unless ``cache=False``; a warm call returns without saturating.

        >>> import neptune_eq as ne
        >>> x = ne.placeholder((4, 10), "float32", "x")
        >>> j = ne.reduce_axis(10, "j")
        >>> mx = ne.compute((4,), lambda i: ne.max(x[i, j], axis=j), "mx")
        >>> kern = ne.superoptimize(mx, target="interpreter", cache=False)
        >>> kern.launches
        ['neptune_mx']
    """
    import time
    t0 = time.perf_counter()
    program = outputs if isinstance(outputs, Program) else dsl.build_program(outputs)
    target = resolve_target(target)
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"Expected top_k to be a positive int (candidates timed on the GPU), "
                         f"got {top_k!r}.")
    if limits is not None and not isinstance(limits, Limits):
        raise TypeError(f"Expected limits to be ne.Limits(...), got {type(limits).__name__}; "
                        "e.g. ne.Limits(rows=20_000, match_limit=500).")
    from . import rules as rule_registry
    from .egraph.rulefiles import shipped_rule_files
    rule_files = ([Path(f) for f in rules] if rules is not None else shipped_rule_files()) \
        + [Path(f) for f in list(rule_registry.loaded()) + list(extra_rules)]
    rule_report = rule_registry.vet(rule_files, allow_unchecked=allow_unchecked_rules)
    gpu_name = device or _gpu_name(target)
    fp32_dot = fp32_dot_of(float32_matmul_precision)
    key = make_key(program, rule_files, target, gpu_name,
                   {"top_k": top_k, "limits": repr(limits or Limits()), "fp32_dot": fp32_dot})
    status = "disabled"
    if cache:
        hit, status = cache_load(key)
        if hit is not None:  # the key holds a hash of this package's source: a changed
            # code generator is a new key, so an entry is what today's code would emit
            hit.cache_status, hit.build_seconds = "hit", time.perf_counter() - t0
            _store_new_buckets(hit, key)
            return hit
    kern = _build(program, rules, extra_rules, target, limits, example_inputs, top_k,
                  progress, gpu_name, sizes, fp32_dot)
    kern.trace.rule_checks = rule_report
    kern.cache_status, kern.build_seconds = status, time.perf_counter() - t0
    if cache:
        cache_store(key, kern)
        _store_new_buckets(kern, key)
    return kern


def _store_new_buckets(kern: "Kernel", key: str) -> None:
    """The cache holds structure -> candidates *and* bucket -> winner: a bucket chosen at
    call time is written back, so another process at that size neither lowers nor times."""
    if kern._dispatch is not None:
        kern._dispatch.on_new_bucket = lambda: cache_store(key, kern)


def _gpu_name(target: str) -> str:
    if target == "cuda":
        import torch
        return torch.cuda.get_device_name()
    return "none (interpreter)"


def fp32_dot_of(precision: str | None) -> str:
    """tl.dot's input_precision for fp32 operands (``codegen.FP32_DOT``) under torch's
    float32 matmul ``precision`` (None: torch's current setting)."""
    if precision is None:
        import torch
        precision = torch.get_float32_matmul_precision()
    if precision not in FP32_DOT:
        raise ValueError(f"Expected float32_matmul_precision to be one of {sorted(FP32_DOT)} "
                         f"(as torch.set_float32_matmul_precision takes) or None, got "
                         f"{precision!r}.")
    return FP32_DOT[precision]


def _build(program, rules, extra_rules, target, limits, example_inputs, top_k, progress,
           gpu_name, sizes, fp32_dot) -> Kernel:
    from . import rules as rule_registry
    clock = _StageClock()
    user_program = program
    # Reductions nested in a definition others read become producers of their own, so
    # the rules fuse them and the lowering sees only folds and pointwise code.
    program = isolate_reductions(program)
    syms = symbols(program)
    values = _first_sizes(program, syms, sizes, example_inputs)
    concrete = bind(program, values) if syms else program   # what the cost model weighs
    stage = EGraphStage(program, rules, list(rule_registry.loaded()) + list(extra_rules))
    model = CostModel(concrete)

    def snapshot(st: EGraphStage, it: int):
        cand = extract_program(EGraphView.from_json(st.serialize()), program, model)
        st.trace.snapshots.append((it, {d.name: d.body for d in cand.program.defs}))
        if progress:
            print(f"\r[neptune_eq] saturating: iteration {it}", end="", file=sys.stderr, flush=True)

    snapshot(stage, 0)
    trace = stage.saturate(limits or Limits(), on_iteration=snapshot)
    if progress:
        print(file=sys.stderr)
    clock.lap("saturate")
    egraph_json = stage.serialize()
    view = EGraphView.from_json(egraph_json)
    trace.fold_checks = check_folds(view, model, frozenset(
        d.name for d in program.defs if d.body.op == "max"))
    best_term = extract_program(view, program, model)
    split_model = CostModel(concrete, allow_split_k=True)
    split_model.banned = model.banned
    pool = alternatives(view, program, model, best_term) + top_programs(view, program, split_model)
    clock.lap("extract")
    dev = device_for(gpu_name)
    tensors = timing_tensors(concrete, example_inputs) if target == "cuda" else None
    first = choose_bucket(pool, values, target, dev, tensors, top_k, progress, fp32_dot=fp32_dot)
    chosen = first.row
    clock.lap("lower, compile and time")
    # (a far index's check runs past its distance: the smallest tiles keep that size low)
    far = saturated_index.far_distance(user_program) is not None
    trace.validation = validate_translation(
        user_program, first.program, lambda: _blame(trace, chosen),
        lambda small, named, data: _run_small_kernel(small, named, data, target, fp32_dot, far),
        values, fp32_dot, target)
    kern = Kernel(user_program, first.program, chosen.plan, chosen.kernel, trace, first.rows, target,
                  chosen.config, chosen.timings, egraph_json, stage.dot(), device=gpu_name)
    clock.lap("validate")
    kern.build_stages = clock.stages
    if syms:
        kern.sizes = dict(values)
        kern._dispatch = SizeDispatch(pool, syms, target, dev, fp32_dot=fp32_dot)
        kern._dispatch.add(first)
    return kern


class _StageClock:
    """Seconds per build stage, lap by lap."""

    def __init__(self):
        import time
        self._now = time.perf_counter
        self._last = self._now()
        self.stages: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = self._now()
        self.stages[name] = now - self._last
        self._last = now


def _first_sizes(program: Program, syms: list[str], sizes: dict | None,
                 example_inputs: dict | None) -> dict[str, int]:
    """Where the first bucket is chosen: ``sizes=``, else the example inputs' shapes, else
    1024 per named size."""
    if not syms:
        return {}
    if sizes is not None:
        unknown = set(sizes) - set(syms)
        missing = [s for s in syms if s not in sizes]
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if unknown or missing or bad:
            raise ValueError(f"Expected sizes= to give a positive int for each named size "
                             f"{syms}, got {sizes!r}; e.g. sizes={{{', '.join(repr(s) + ': 1024' for s in syms)}}}.")
        return dict(sizes)
    if example_inputs and all(ph.name in example_inputs for ph in program.inputs):
        return sizes_of(program, example_inputs)
    return {s: 1024 for s in syms}


def _blame(trace: Trace, chosen: CandidateRow) -> str:
    """The rules on the derivation path of the chosen candidate, for an error message."""
    rules = {r.name: r.where for step in derivation(trace.snapshots, trace) for r in step.rules
             if hasattr(r, "where")}
    if not rules:  # no visible step: every rewrite rule that fired is a suspect
        rules = {n: trace.rules[n].where for n in trace.fired() if n in trace.rules}
    listed = ", ".join(f"{n} [{w}]" for n, w in rules.items()) or "none (a structural rule)"
    return f"Chosen candidate: {chosen.description}. Rules on its derivation path: {listed}."


def _run_small_kernel(program: Program, values: dict[str, int], data: dict, target: str,
                      fp32_dot: str, small_blocks: bool = False) -> dict:
    """The chosen candidate's kernel generated for ``program`` (small sizes; its named
    sizes, at ``values``, stay runtime arguments as in the real kernel), run once --
    at the first tile config, or with ``small_blocks`` at the plain config of the
    smallest tiles (a far index is checked at sizes past its distance plus three of
    them: ``translation_validation.FAR_MARGIN``)."""
    import torch
    spec = specialise(program, values, Guards())
    kernel = generate(make_plan(spec), bf16_dot_in_fp32=(target == "interpreter"), fp32_dot=fp32_dot)
    conc = kernel.concrete(values)
    program = bind(spec, values)
    configs = candidate_configs(conc, target)
    config = configs[0]
    if small_blocks:
        plain = [c for c in configs if not (c.gluon_ws or c.warp_specialize or c.tma)]
        config = min(plain or configs, key=lambda c: max(c.blocks.values(), default=0))
    launcher = Launcher(program, conc, target, config.at(values),
                        tuple(values[s] for s in kernel.size_params))
    dev = "cuda" if target == "cuda" else "cpu"
    bound = {k: v.to(dev) for k, v in data.items()}
    for name in program.outputs:
        bound[name] = torch.empty(program.shape_of(name), device=dev,
                                  dtype=getattr(torch, program.dtype_of(name)))
    launcher(bound)
    return {name: bound[name] for name in program.outputs}

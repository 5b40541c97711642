"""``neptune_eq::flex_attention``, a torch.library op, and ``ne.flex_attention`` under
``torch.compile``.

The op takes q, k, v, the tensors the mods captured and the name of a traced structure
(``flex.STRUCTURES``); its fake implementation gives the output shapes, so
``torch.compile(fullgraph=True)`` records one opaque call and never looks inside.  Its
autograd formula is one call of ``neptune_eq::flex_attention_backward``, an op of the same
kind, so AOT autograd traces the backward without running a kernel on fake tensors.

What makes the *call site* compile without a graph break is ``compiled_structure``.
Tracing the mods (DSL expressions standing in for scores) cannot run under Dynamo, so
``compile_plan`` is marked ``torch._dynamo.assume_constant_result``: Dynamo runs it once,
in plain Python, on the real mod objects, and keeps its result -- the structure key, plus
*where* in the mods' environment each captured tensor and each value the structure may
depend on lives (``_Walk``: closure cells, globals the code names, defaults,
``functools.partial`` arguments, ``self`` attributes of bound methods) -- as a constant.
The compiled code then reads those places again with ordinary Python (``_fetch``), which
Dynamo traces: captured tensors become graph inputs (a new tensor in the same place is
used, not the one seen at compile time), and comparing every scalar with the value the
key was made from installs a guard, so a changed closure (softcap 20 -> 30, even through a
cell Dynamo would otherwise not watch) recompiles and re-keys instead of running a stale
kernel.  Dynamo's own guard on a function covers only its code object.

Mods may be module-level functions and lambdas, closures made outside the compiled region
(``__init__``), bound methods (``self.score_mod`` reading ``self.bias``),
``functools.partial`` and ``and_masks``/``or_masks`` (also called inside ``forward``),
and functions defined inside ``forward`` whose closure holds only constants.  A function
defined inside the compiled region that closes over a traced value (``self``, a tensor,
a local computed there) cannot be handed over by Dynamo: with ``fullgraph=True`` that is
an ``Unsupported`` error naming it ("nested function with non-constructible closure"),
without it a graph break around the call, which then runs eagerly.  Define such a mod
outside, or as a method.

Under compile the call's lengths are symbolic, so a captured dim read at q_idx / kv_idx
takes the size name unconditionally (``flex._name_captured_sizes``): a table longer than
S is refused at run time by name (eager calls build a concrete-size structure for it).
"""
from __future__ import annotations

import functools
import types

import torch
from torch import Tensor

from . import flex
from ..frontend.torch_capture import made_from_data
from ..ir import ProgramError


@torch.library.custom_op("neptune_eq::flex_attention", mutates_args=())
def flex_attention_op(q: Tensor, k: Tensor, v: Tensor, captured: list[Tensor], structure: str,
                      max_scores: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse, max_scores) of the traced ``structure``; max_scores is empty unless asked."""
    return flex.run(structure, q, k, v, list(captured), max_scores)


@flex_attention_op.register_fake
def _(q, k, v, captured, structure, max_scores):
    b, hq, lq, _e = q.shape
    ev = v.shape[-1]
    out = q.new_empty((b, hq, lq, ev))
    lse = q.new_empty((b, hq, lq), dtype=torch.float32)
    mx = q.new_empty((b, hq, lq) if max_scores else (0,), dtype=torch.float32)
    return out, lse, mx


@torch.library.custom_op("neptune_eq::flex_attention_backward", mutates_args=())
def flex_attention_backward_op(q: Tensor, k: Tensor, v: Tensor, captured: list[Tensor],
                               out: Tensor, lse: Tensor, d_out: Tensor | None,
                               d_lse: Tensor | None, d_max: Tensor | None, structure: str,
                               needs: list[bool]) -> list[Tensor]:
    """Gradients of the op (dq, dk, dv, then one per captured tensor); an empty tensor
    where ``needs`` is False.  An op of its own so that ``torch.compile`` records the
    backward as one opaque call: its kernels are built and run at run time, never on the
    fake tensors AOT autograd traces with."""
    from . import flex_backward
    flex_backward.check_no_max_grad(d_max)
    grads = flex_backward.run_backward(structure, q, k, v, list(captured), out, lse, d_out,
                                       d_lse, needs)
    return [g if g is not None else q.new_empty((0,)) for g in grads]


@flex_attention_backward_op.register_fake
def _(q, k, v, captured, out, lse, d_out, d_lse, d_max, structure, needs):
    return [torch.empty_like(t) if need else q.new_empty((0,))
            for t, need in zip([q, k, v, *captured], needs)]


def _op_backward(ctx, d_out, d_lse, d_max):
    """The op's autograd formula: one call of the backward op."""
    from . import flex_backward
    (q, k, v, out, lse, *captured), needs = flex_backward.saved(ctx)
    grads = flex_attention_backward_op(q, k, v, captured, out, lse, d_out, d_lse, d_max,
                                       ctx.structure, needs)
    grads = [g if need else None for g, need in zip(grads, needs)]
    return grads[0], grads[1], grads[2], list(grads[3:]), None, None


def _register_autograd() -> None:
    """Gradients for q, k, v and captured float tensors (``flex_backward``)."""
    from . import flex_backward
    flex_attention_op.register_autograd(_op_backward, setup_context=flex_backward.setup_context)


_register_autograd()


class EagerFlexAttention(torch.autograd.Function):
    """Eager calls that need gradients: the op's autograd formula (``flex_backward``)
    without the custom op's dispatch layers -- argument flattening, redispatch and the
    autograd wrapper cost about 0.3 ms of host time a call, which a short training step
    (S = 2048: 0.6 ms of GPU time) cannot hide.  ``torch.compile`` keeps using the op."""

    @staticmethod
    def forward(ctx, q, k, v, structure: str, max_scores: bool, want_lse: bool, *captured):
        from . import flex_backward
        # the lse is finished (-inf on rows with no visible key) only if it is returned;
        # the backward's row shift reads either form
        out, lse, mx = flex.run(structure, q, k, v, list(captured), max_scores, want_lse)
        flex_backward.setup_context(ctx, (q, k, v, captured, structure, max_scores),
                                    (out, lse, mx))
        return out, lse, mx

    @staticmethod
    def backward(ctx, d_out, d_lse, d_mx):
        from . import flex_backward
        dq, dk, dv, d_captured, _, _ = flex_backward.backward(ctx, d_out, d_lse, d_mx)
        if torch.is_grad_enabled():  # create_graph=True: a gradient of these must say why not
            reach = [t for t in ctx.saved_tensors if t.requires_grad]
            dq, dk, dv, *d_captured = (None if g is None else _NoDoubleBackward.apply(g, *reach)
                                       for g in (dq, dk, dv, *d_captured))
        return (dq, dk, dv, None, None, None, *d_captured)


class _NoDoubleBackward(torch.autograd.Function):
    """A gradient returned under ``create_graph=True``, tied to the inputs it depends on:
    differentiating it again raises a clear error (the derived backward kernels have no
    backward of their own, as FlexAttention's have none) instead of torch's "element 0
    of tensors does not require grad"."""

    @staticmethod
    def forward(ctx, g, *inputs):
        return g.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise ProgramError("Expected a first-order gradient of ne.flex_attention, got a "
                           "gradient of its gradient (double backward), which it does not "
                           "have (as FlexAttention); differentiate a torch reference "
                           "attention for second-order terms.")


# ----------------------------------------------------------------------------------
# Under torch.compile
# ----------------------------------------------------------------------------------
def compiled_structure(score_mod, mask_mod, spec: "flex.Spec") -> tuple[str, list]:
    """The structure key, the captured tensors and the dims the structure names in them
    (``flex.fit_captured``), in a form Dynamo traces."""
    key, guards, shapes, captured, named_dims = compile_plan(
        *_split(score_mod), *_split(mask_mod), spec.dtype, spec.hq, spec.hkv, spec.e, spec.ev,
        spec.scale, spec.target, spec.max_scores, spec.same_len, spec.fp32_precision)
    roots = (score_mod, mask_mod)
    for root, path, expected in guards:
        if _fetch(roots[root], path) != expected:  # Dynamo guards on it; eager never fails
            raise ProgramError(f"Expected {_show(path)} to be {expected!r} as when compiled.")
    for root, path, shape in shapes:  # shapes of tensors a mod may read shape facts from
        got = _fetch(roots[root], path).shape
        if len(got) != len(shape) or any(n is not None and g != n for g, n in zip(got, shape)):
            raise ProgramError(f"Expected {_show(path)} of shape {shape} as when compiled.")
    tensors = [_fetch(roots[c[1]], c[2]) if c[0] == "path" else c[1] for c in captured]
    return key, tensors, named_dims


def _split(mod) -> tuple:
    """A bound method as (function, self): Dynamo hands functions and objects to
    ``compile_plan`` as Python objects, but not bound methods (``self.score_mod`` of an
    nn.Module).  ``compile_plan`` binds them again."""
    if isinstance(mod, types.MethodType):
        return mod.__func__, mod.__self__
    if isinstance(mod, types.FunctionType):
        # A function created inside the compiled region whose closure holds traced values
        # (a tensor, ``self``) cannot be handed over: Dynamo's repr() of it reports that
        # as a graph break (and fullgraph=True as an error naming it), whereas passing it
        # on would end the compile with an internal ClosureConversionError.
        repr(mod)
    return mod, None


@torch._dynamo.assume_constant_result
def compile_plan(score_fn, score_self, mask_fn, mask_self, dtype, hq, hkv, e, ev, scale, target,
                 max_scores, same_len, fp32_precision):
    """Trace the mods (plain Python, once per compile): the structure key; (root, path,
    value) of every scalar in the mods' environment; (root, path, shape) of every tensor
    there; and per captured tensor ("path", root, path), or ("const", tensor) for one the
    mod creates itself (``torch.tensor([...])[h]``: a constant of the mod's code)."""
    score_mod, mask_mod = (fn if obj is None else types.MethodType(fn, obj)
                           for fn, obj in ((score_fn, score_self), (mask_fn, mask_self)))
    spec = flex.Spec(dtype, hq, hkv, e, ev, scale, target, max_scores, same_len, fp32_precision)
    st, captured = flex.trace(spec, score_mod, mask_mod)
    walks = [_Walk(m) for m in (score_mod, mask_mod)]
    guards = tuple((r, p, x) for r, w in enumerate(walks) for p, x in w.scalars)
    # A captured dim the structure names (doc ids of length S) stays free: guarding it
    # would recompile the graph per length.  Every other dim is guarded exactly.
    named = {id(t): tuple(n if isinstance(n, int) else None for n in st.shapes[name])
             for name, t in captured.items()}
    shapes = tuple((r, p, named.get(id(t), tuple(t.shape)))
                   for r, w in enumerate(walks) for p, t in w.tensors)
    for r, w in enumerate(walks):
        if w.opaque:
            p, x = w.opaque[0]
            raise ProgramError(
                f"Expected the mods of ne.flex_attention under torch.compile to read only "
                f"numbers, strings, torch tensors, functions, tuples/lists/dicts and plain "
                f"objects of those, got {type(x).__name__} at {_show(p)} (of the "
                f"{('score_mod', 'mask_mod')[r]}); its value cannot be guarded, so a change "
                "could reuse a stale kernel. Convert it to a tensor or a number, or call "
                "ne.flex_attention outside torch.compile.")
    made = [n for n, t in captured.items() if made_from_data(t)]
    if made:  # baked into the compiled graph, it would keep the compile's values
        raise ProgramError(
            f"Expected the mods of ne.flex_attention under torch.compile to index tensors "
            f"they close over, got {made[0]!r} (shape {tuple(captured[made[0]].shape)}), "
            "which a mod computes from one of them while traced (e.g. (doc > 0)[q_idx]): "
            "compiled, it would keep the values of the first call. Compute it outside the "
            "mod (flag = doc > 0, then flag[q_idx]) or index first ((doc[q_idx] > 0)).")
    where = {id(t): (r, p) for r, w in enumerate(walks) for p, t in w.tensors}
    plan = tuple(("path",) + where[id(t)] if id(t) in where else ("const", t)
                 for t in captured.values())
    return st.key, guards, shapes, plan, st.named_dims


def _fetch(obj, path: tuple):
    """Follow ``path`` from a mod (plain attribute and item reads, so Dynamo traces them
    and guards what it reads)."""
    for step, arg in path:
        if step == "cell":
            obj = obj.__closure__[arg].cell_contents
        elif step == "global":
            obj = obj.__globals__[arg]
        elif step == "default":
            obj = obj.__defaults__[arg]
        elif step == "kwdefault":
            obj = obj.__kwdefaults__[arg]
        elif step == "self":
            obj = obj.__self__
        elif step == "method":
            obj = obj.__func__
        elif step == "pfunc":
            obj = obj.func
        elif step == "parg":
            obj = obj.args[arg]
        elif step == "pkw":
            obj = obj.keywords[arg]
        elif step == "attr":
            obj = getattr(obj, arg)
        else:  # "item"
            obj = obj[arg]
    return obj


def _show(path: tuple) -> str:
    out = "mod"
    for step, arg in path:
        out += {"cell": f".<closure {arg}>", "global": f".<global {arg}>",
                "default": f".<default {arg}>", "kwdefault": f".<default {arg}>",
                "self": ".__self__", "method": ".__func__", "pfunc": ".func",
                "parg": f".args[{arg}]", "pkw": f".keywords[{arg!r}]", "attr": f".{arg}",
                "item": f"[{arg!r}]"}[step]
    return out


_SCALARS = (bool, int, float, str, complex, type(None), torch.dtype, torch.device)
_LIBRARIES = ("torch", "math", "builtins", "operator", "functools", "numpy", "typing",
              "collections", "itertools", "triton")
_MAX_ITEMS = 64  # a container this large is not configuration a structure depends on


class _Walk:
    """Everything a mod can read besides its arguments, with the path to each leaf:
    ``scalars`` and ``tensors`` (path, value); ``opaque`` what cannot be guarded.

    Attributes of objects (``self.slopes``, ``cfg.softcap``) are followed when the code
    that may read them names them (``co_names``): an over-approximation of the reads,
    so nothing the structure depends on is missed."""

    def __init__(self, root, depth: int = 6, codes: bool = False):
        self.scalars: list[tuple[tuple, object]] = []
        # (path, code object) of every function reached, when ``codes``: the eager
        # fingerprint must notice a nested function swapped for another.
        self.codes: list[tuple[tuple, types.CodeType]] | None = [] if codes else None
        self.tensors: list[tuple[tuple, Tensor]] = []
        self.opaque: list[tuple[tuple, object]] = []
        self._seen: set[int] = set()
        if root is not None:
            self._visit(root, (), frozenset(), depth)

    def _visit(self, x, path: tuple, names: frozenset, depth: int) -> None:
        if isinstance(x, Tensor):
            self.tensors.append((path, x))
            return
        if isinstance(x, _SCALARS):
            if not (isinstance(x, float) and x != x):  # NaN != NaN would never guard
                self.scalars.append((path, x))
            return
        if id(x) in self._seen or _is_library(x):
            return
        if depth == 0:
            self.opaque.append((path, x))
            return
        self._seen.add(id(x))
        d = depth - 1
        if isinstance(x, types.FunctionType):
            self._function(x, path, d)
        elif isinstance(x, types.MethodType):
            self._visit(x.__func__, path + (("method", None),), names, d)
            self._visit(x.__self__, path + (("self", None),), _names(x.__func__.__code__), d)
        elif isinstance(x, functools.partial):
            self._visit(x.func, path + (("pfunc", None),), names, d)
            for i, a in enumerate(x.args):
                self._visit(a, path + (("parg", i),), names, d)
            for k, a in x.keywords.items():
                self._visit(a, path + (("pkw", k),), names, d)
        elif isinstance(x, (tuple, list)) and len(x) <= _MAX_ITEMS:
            for i, a in enumerate(x):
                self._visit(a, path + (("item", i),), names, d)
        elif isinstance(x, dict) and len(x) <= _MAX_ITEMS and all(
                isinstance(k, (str, int)) for k in x):
            for k, a in x.items():
                self._visit(a, path + (("item", k),), names, d)
        elif isinstance(x, (types.ModuleType, type)) or hasattr(x, "__dict__"):
            if path == () and isinstance(getattr(type(x), "__call__", None), types.FunctionType):
                # a callable object as the mod: what its __call__ reads
                self._visit(x.__call__, (("attr", "__call__"),), names, d)
            for n in sorted(names):
                try:
                    a = getattr(x, n)
                except Exception:  # noqa: BLE001 - a name the code uses for something else
                    continue
                self._visit(a, path + (("attr", n),), names, d)
        else:
            self.opaque.append((path, x))

    def _function(self, fn: types.FunctionType, path: tuple, d: int) -> None:
        code = fn.__code__
        if self.codes is not None:
            self.codes.append((path, code))
        names = _names(code)
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell: nothing to read yet
                continue
            self._visit(content, path + (("cell", i),), names, d)
        if _library_module(fn):  # torch's and_masks / or_masks: only their closures are data
            return
        for n in sorted(names):
            if n in fn.__globals__:
                self._visit(fn.__globals__[n], path + (("global", n),), names, d)
        for i, a in enumerate(fn.__defaults__ or ()):
            self._visit(a, path + (("default", i),), names, d)
        for k, a in (fn.__kwdefaults__ or {}).items():
            self._visit(a, path + (("kwdefault", k),), names, d)


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> frozenset:
    """Global and attribute names a code object (and the functions defined in it) uses.
    Remembered per code object (immutable): every eager call walks its mods' code."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return frozenset(out)


def _is_library(x) -> bool:
    """Code from torch, the standard library, numpy: not configuration of a mod."""
    if isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return True
    if isinstance(x, (functools.partial, types.MethodType)):
        return False  # containers of a function and its arguments: visited
    if isinstance(x, types.FunctionType) and x.__closure__:
        return False  # a library function's closure holds user data (and_masks): visit it
    return _library_module(x)


def _library_module(x) -> bool:
    mod = x.__name__ if isinstance(x, types.ModuleType) else getattr(x, "__module__", None)
    return isinstance(mod, str) and mod.split(".")[0] in _LIBRARIES

"""``ne.flex_attention``: a drop-in for ``torch.nn.attention.flex_attention.flex_attention``.

A call (1) checks its arguments as FlexAttention does, (2) traces the mods into the plain
attention program (``ne.attention`` with *named* batch and sequence sizes ``B``, ``L``,
``S``; heads, head dims, dtype and scale concrete), whose canonical text names the
program's **structure**, (3) finds the structure in a process-level table -- saturated
once per structure; a new size only dispatches (``sizes.py``) -- and (4) runs the kernel
through the torch.library op ``neptune_eq::flex_attention`` (``torch_op.py``), the one
opaque op ``torch.compile`` sees.

The key is the program text itself (``ir.canonical_text``), not the mod objects: it holds
every constant a mod closed over (a softcap of 20 and one of 30 are two keys, so a
changed closure never reuses a stale kernel) and the shapes of the tensors it captured,
while the captured tensors' *values* are kernel inputs (a new ALiBi slope tensor of the
same shape reuses the kernel).  Tracing costs about a millisecond per eager call; under
``torch.compile`` it runs once, at compile time (``torch_op.compile_plan``).

Every kernel also writes the log-sum-exp (one float per row, next to the row's ``Ev``
outputs): ``return_lse`` then needs no second structure, and the lse is always the one of
the very scores the output was computed from.
"""
from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, field

import torch

from ..frontend import dsl
from ..ir import MASKED, ExtentError, ProgramError, canonical_text
from ..sizes import as_extent, check_index_span, symbols

SIZES = ("B", "L", "S")   # batch, query length, key length: named, so any value runs


def call_sizes(q, k) -> dict:
    """B, L and S of a call with query ``q`` (B, Hq, L, E) and key ``k`` (B, Hkv, S, E)."""
    return {SIZES[0]: q.shape[0], SIZES[1]: q.shape[2], SIZES[2]: k.shape[2]}


_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class Structure:
    """One traced structure: its key, program text, and (once built) its kernel."""
    key: str
    text: str
    target: str
    max_scores: bool
    outputs: list | None               # DSL outputs; dropped once the kernel exists
    symbols: list = field(default_factory=list)   # its named sizes (S may stand for L too)
    shapes: dict = field(default_factory=dict)    # input name -> shape (ints, Size names)
    kernel: object = None
    program: object = None             # the plain forward program (its backward derives from it)
    backward: dict = field(default_factory=dict)  # input name -> backward Kernel (flex_backward)
    row_kernels: dict = field(default_factory=dict)  # program -> row-dot kernel (flex_backward)
    # (input names, shared, lse grad?) -> kernels summed for one gradient (pieces_of)
    backward_pieces: dict = field(default_factory=dict)
    # (lse grad?, size bucket) -> (fused?, timed there?) (flex_backward.fused_is_faster)
    backward_form: dict = field(default_factory=dict)
    # (captured position, dim, size name) of each captured dim named by a size (fit_captured)
    named_dims: tuple = ()
    fp32_precision: str = "highest"   # torch's float32 matmul precision it is built for
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def kernel_at(self, sizes: dict[str, int], example: dict | None = None):
        """The superoptimized kernel; built on first use, with its first size bucket
        chosen at ``sizes`` (the sizes of the call that needed it) and its tile configs
        timed on ``example`` (that call's tensors by input name)."""
        if self.kernel is None:
            with self.lock:  # two threads meeting a new structure saturate it once
                if self.kernel is None:
                    from ..api import superoptimize
                    self.kernel = superoptimize(self.outputs, target=self.target, sizes={
                        n: sizes[n] for n in self.symbols} if self.symbols else None,
                        example_inputs=example, float32_matmul_precision=self.fp32_precision)
                    self.outputs = None
        return self.kernel


STRUCTURES: dict[str, Structure] = {}   # structure key -> Structure (process lifetime)
_TABLE_LOCK = threading.Lock()


@dataclass(frozen=True)
class Spec:
    """What the structure depends on besides the mods (all plain constants, so that
    ``torch.compile`` can hand it to a constant-folded function)."""
    dtype: str
    hq: int
    hkv: int
    e: int
    ev: int
    scale: float
    target: str
    max_scores: bool
    same_len: bool     # L == S: a table read at q_idx and kv_idx may take one named size
    # torch's float32 matmul precision for float32 inputs ("highest" otherwise): their
    # kernels' fp32 products follow it (``api.superoptimize``), so it is part of the key
    fp32_precision: str = "highest"


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None, *,
                   return_aux=None, mask_mod=None):
    """``torch.nn.attention.flex_attention.flex_attention``, superoptimized.

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev); returns (B, Hq, L, Ev)
    in query's dtype.  ``score_mod(score, b, h, q_idx, kv_idx)`` and the mask --
    ``block_mask`` from ``create_block_mask`` (its ``mask_mod`` is used: the masks become
    loop bounds here, so its block tables are not needed) or ``mask_mod=`` directly --
    are FlexAttention's; tensors they index are kernel inputs.  ``scale`` defaults to
    1/sqrt(E); ``enable_gqa`` lets Hq be a multiple of Hkv.  ``return_lse=True`` returns
    ``(out, lse)``, lse (B, Hq, L) float32, natural log, -inf on a row with no visible key
    (whose output is 0); ``return_aux=AuxRequest(lse=..., max_scores=...)`` returns
    ``(out, AuxOutput)``.  ``kernel_options`` tune torch's own kernels and are ignored:
    tile sizes here are chosen per size bucket by the cost model.

    The first call of a structure superoptimizes it (seconds); later calls at any B, L, S
    reuse it.  Inputs on CUDA run the generated Triton kernel, CPU inputs the Triton
    interpreter.  Works inside ``torch.compile(fullgraph=True)`` (see ``torch_op``)."""
    from . import eager_env, torch_op
    compiling = torch.compiler.is_compiling()
    if compiling:
        # Heads and head dims shape the tiles: keep them out of dynamic shapes (as
        # torch's own flex_attention does under compile), before check() reads them.
        for x in (query, key, value):
            if isinstance(x, torch.Tensor) and x.dim() == 4:
                torch._dynamo.mark_static(x, 1)
                torch._dynamo.mark_static(x, 3)
    mask_mod = _mask_of(block_mask, mask_mod)
    want_lse, want_max = _aux_request(return_lse, return_aux)
    spec = (check(query, key, value, scale, enable_gqa, want_max) if compiling
            else _checked(query, key, value, scale, enable_gqa, want_max))
    if min(query.shape[0], query.shape[2], key.shape[2]) == 0:
        # (torch ops only, so torch.compile traces it too: Dynamo specialises sizes 0 and 1)
        return _result(*_empty_attention(query, key, value, spec), want_lse, want_max,
                       return_aux)
    if compiling:
        skey, captured, named_dims = torch_op.compiled_structure(score_mod, mask_mod, spec)
        captured = fit_captured(named_dims, query, key, captured, compiling=True)
        out, lse, mx = torch_op.flex_attention_op(query, key, value, captured, skey, want_max)
        return _result(out, lse, mx, want_lse, want_max, return_aux)
    skey, captured = eager_env.eager_structure(
        score_mod, mask_mod, spec, call_sizes(query, key))
    captured = fit_captured(STRUCTURES[skey].named_dims, query, key, captured)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value, *captured)):
        out, lse, mx = torch_op.EagerFlexAttention.apply(query, key, value, skey, want_max,
                                                         want_lse, *captured)
    else:  # eager, no autograd: the op's dispatch layers would only add host time
        out, lse, mx = run(skey, query, key, value, captured, want_max, want_lse)
    return _result(out, lse, mx, want_lse, want_max, return_aux)


def _result(out, lse, mx, want_lse: bool, want_max: bool, return_aux):
    """What the call returns: out, (out, lse) or (out, AuxOutput)."""
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput
        return out, AuxOutput(lse=lse if want_lse else None, max_scores=mx if want_max else None)
    return (out, lse) if want_lse else out


def _empty_attention(q, k, v, spec: "Spec") -> tuple:
    """(out, lse, max_scores) when the batch, the queries or the keys are empty, as torch's
    eager flex_attention returns for an empty batch or query; with no keys every row sees
    none, so its output is 0 and its lse and max -inf, as a fully masked row's.  Torch ops
    on the empty shapes, so autograd gives zero gradients of the right shapes.  No mod is
    traced: it would be traced at a size of 0."""
    g = spec.hq // spec.hkv
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * spec.scale   # (B, Hq, L, S): one of them is 0
    out = s @ v                                   # zeros, or empty
    lse = torch.logsumexp(s.float(), -1)          # -inf over no keys
    return out, lse, torch.full_like(lse, float("-inf"))


# ----------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------
def _mask_of(block_mask, mask_mod):
    """The mask_mod to trace: ``mask_mod=``, or the one ``block_mask`` was made from."""
    if block_mask is None:
        return mask_mod
    if mask_mod is not None:
        raise ValueError("Expected a mask as block_mask= or as mask_mod=, got both; pass "
                         "block_mask=create_block_mask(my_mask, ...) or mask_mod=my_mask.")
    from torch.nn.attention import flex_attention as fa
    if not isinstance(block_mask, fa.BlockMask):
        raise ValueError(f"Expected block_mask to be a BlockMask from create_block_mask, got "
                         f"{type(block_mask).__name__}; to pass a function use mask_mod=.")
    mod = block_mask.mask_mod
    if mod is getattr(fa, "_sliced_mask_mod_error", None):
        raise ValueError("Expected a BlockMask with its mask_mod, got a sliced BlockMask "
                         "(torch replaces its mask_mod); create the mask for the slice you need.")
    if mod is None or mod is fa.noop_mask:
        # No mask_mod: the block tables are the mask (BlockMask.from_kv_blocks).  Only
        # tables listing every block mean "no mask"; sparse ones cannot be translated.
        n = block_mask.kv_num_blocks
        if block_mask.full_kv_num_blocks is not None:
            n = n + block_mask.full_kv_num_blocks
        dense = (n == block_mask.kv_indices.shape[-1]).all()
        if torch.compiler.is_compiling():
            torch._assert_async(dense, "neptune_eq.flex_attention: a BlockMask without a "
                                "mask_mod must list every block (its tables cannot be translated)")
        elif not bool(dense):
            raise ProgramError("Expected a BlockMask made from a mask_mod (create_block_mask), got "
                               "block tables without one (BlockMask.from_kv_blocks); neptune_eq "
                               "turns the mask_mod into loop bounds and cannot read sparse tables. "
                               "Pass the mask as mask_mod= instead.")
        return None
    return mod


def _aux_request(return_lse, return_aux) -> tuple[bool, bool]:
    if return_aux is None:
        return bool(return_lse), False
    if return_lse:
        raise ValueError("Expected return_lse or return_aux, got both; use "
                         "return_aux=AuxRequest(lse=True).")
    return bool(return_aux.lse), bool(return_aux.max_scores)


def check(q, k, v, scale, enable_gqa, want_max) -> Spec:
    """FlexAttention's argument checks, as ValueError / ProgramError saying what to do."""
    names = ("query", "key", "value")
    for n, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Expected {n} to be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(f"Expected {n} of rank 4 (B, H, seq, head_dim), got shape "
                             f"{tuple(t.shape)}; add the missing dims with .unsqueeze/.view.")
        check_index_span(n, t)  # (before a first call times any kernel on it)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"Expected query, key and value of one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}; convert them with .to(query.dtype).")
    if q.dtype not in _DTYPES:
        raise ProgramError(f"Expected float16, bfloat16 or float32 inputs, got {q.dtype}; "
                           "convert them with .to(torch.float32).")
    if not (q.device == k.device == v.device):
        raise ValueError(f"Expected query, key and value on one device, got {q.device}, "
                         f"{k.device}, {v.device}; move them with .to(query.device).")
    if q.device.type not in ("cuda", "cpu"):
        raise ProgramError(f"Expected CUDA tensors (generated Triton kernels) or CPU tensors "
                           f"(the Triton interpreter), got {q.device}.")
    b, hq, lq, e = q.shape
    bk, hkv, s, ek = k.shape
    bv, hv, sv, ev = v.shape
    if bk != b or bv != b:
        raise ValueError(f"Expected query, key and value with one batch size, got {b}, {bk}, "
                         f"{bv}; expand the smaller ones with .expand(B, ...).")
    if hv != hkv or sv != s:
        raise ValueError(f"Expected key and value with the same heads and length, got key "
                         f"{tuple(k.shape)} and value {tuple(v.shape)}.")
    if ek != e:
        raise ValueError(f"Expected query and key with the same head dim E, got {e} and {ek}.")
    if 0 in (hq, hkv, e, ev):  # (an empty batch or sequence is an empty result, not this)
        raise ValueError(f"Expected at least one head and head dims of at least 1, got query "
                         f"{tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}.")
    if not enable_gqa and hq != hkv:
        raise ValueError(f"Expected query and key/value with the same number of heads, got "
                         f"Hq={hq} and Hkv={hkv}; set enable_gqa=True for GQA.")
    if hq % hkv:
        raise ValueError(f"Expected the query heads to be a multiple of the key/value heads "
                         f"for GQA, got Hq={hq} and Hkv={hkv}.")
    if scale is None:
        scale = 1.0 / math.sqrt(_concrete(e))
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"Expected scale to be a number or None, got {scale!r}.")
    # A branch, not bool(): under torch.compile it guards on L == S (a constant for the
    # structure lookup) instead of leaving a symbolic bool.
    same_len = True if lq == s else False  # noqa: SIM210
    hq, hkv, e, ev = (_concrete(n) for n in (hq, hkv, e, ev))
    return Spec(_DTYPES[q.dtype], hq, hkv, e, ev, float(scale),
                "cuda" if q.device.type == "cuda" else "interpreter", bool(want_max), same_len,
                _fp32_precision() if q.dtype == torch.float32 else "highest")


@torch._dynamo.assume_constant_result
def _fp32_precision() -> str:
    """``torch.get_float32_matmul_precision()``, which Dynamo cannot trace but guards on
    (a change recompiles), so under torch.compile it is a constant of the graph."""
    return torch.get_float32_matmul_precision()


_SPECS: dict[tuple, Spec] = {}  # eager argument signature -> its Spec (checks passed)


def _checked(q, k, v, scale, enable_gqa, want_max) -> Spec:
    """``check`` of an eager call, remembered per argument signature (types, shapes,
    dtypes, devices and the options): checks that passed for a signature pass again, and
    are ~7 us of a call that is host-bound at short lengths."""
    try:
        key = (type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, type(scale), scale, enable_gqa, want_max,
               torch.get_float32_matmul_precision())
        spec = _SPECS.get(key)
    except (AttributeError, TypeError):  # not tensors, an unhashable option: check() says
        return check(q, k, v, scale, enable_gqa, want_max)
    if spec is None:
        spec = check(q, k, v, scale, enable_gqa, want_max)
        if len(_SPECS) >= 1024:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec


def _concrete(n) -> int:
    """A head count or head dim as a plain int.  Under ``torch.compile(dynamic=True)`` it
    arrives symbolic even after mark_static; range() needs a real int, so Dynamo
    specialises it (a guard, as mark_static would) and the structure lookup gets a
    constant.  Eagerly it is the int itself."""
    return len(range(n))


# ----------------------------------------------------------------------------------
# Structure: trace, key, table
# ----------------------------------------------------------------------------------
def trace(spec: Spec, score_mod, mask_mod, sizes: dict[str, int] | None = None
          ) -> tuple[Structure, dict[str, torch.Tensor]]:
    """Trace the mods at ``spec``; the table's Structure for it (registered if new) and
    the tensors the mods captured (placeholder name -> tensor, in kernel order).
    ``sizes``: this call's B, L, S (None under torch.compile, where they are symbolic)."""
    from ..rules import loaded
    outputs, captured, both = _trace_once(spec, score_mod, mask_mod, SIZES, sizes)
    if both and spec.same_len:
        # A captured dim read at q_idx and at kv_idx (document ids in self-attention):
        # with L == S it is one named size, so the query length is named S too.
        outputs, captured, _ = _trace_once(spec, score_mod, mask_mod,
                                           (SIZES[0], SIZES[2], SIZES[2]), sizes)
    try:
        prog = dsl.build_program(outputs)
    except ProgramError as e:
        if sizes is None:
            raise _does_not_fit(e, sizes, captured)
        # A captured table that fits this call but not every size: a structure at this
        # call's concrete sizes (one per size).
        outputs, captured, _ = _trace_once(spec, score_mod, mask_mod,
                                           tuple(sizes[n] for n in SIZES), sizes)
        try:
            prog = dsl.build_program(outputs)
        except ProgramError as e:
            raise _does_not_fit(e, sizes, captured)
    prog.meta.pop("captured", None)
    # Rule files loaded by the user change what saturation finds: part of the key.
    text = "\n".join([canonical_text(prog), f"target {spec.target}",
                      f"float32 matmul precision {spec.fp32_precision}",
                      *(f"rules {p}" for p in loaded())])
    skey = "flex_" + hashlib.sha256(text.encode()).hexdigest()[:24]
    st = STRUCTURES.get(skey)
    if st is None:
        with _TABLE_LOCK:
            st = STRUCTURES.setdefault(skey, Structure(skey, text, spec.target, spec.max_scores,
                                                       outputs, symbols(prog),
                                                       {p.name: p.shape for p in prog.inputs},
                                                       program=prog,
                                                       named_dims=_named_dims(prog),
                                                       fp32_precision=spec.fp32_precision))
    return st, captured


def _does_not_fit(e: ProgramError, sizes: dict[str, int] | None, captured: dict
                  ) -> ProgramError:
    """The program's complaint about a captured tensor's shape (``ExtentError``), said
    for a flex user; any other complaint as it is."""
    if not (isinstance(e, ExtentError) and e.tensor in captured):
        return e
    at = (f" (B={sizes[SIZES[0]]}, L={sizes[SIZES[1]]}, S={sizes[SIZES[2]]})" if sizes
          else "")
    said = ProgramError(
        f"Expected the tensors the mods capture to fit this call{at}: a dim read at kv_idx "
        f"needs at least S entries, one at q_idx at least L, one at b at least B; got: {e} "
        "A tensor shorter than that reads out of range (torch raises IndexError). One read "
        "at both q_idx and kv_idx with L != S: capture its query part as a tensor of its "
        "own (doc_q = doc[:L]; doc_q[q_idx] == doc[kv_idx]).")
    said.__cause__ = e
    return said


def _trace_once(spec: Spec, score_mod, mask_mod, extents: tuple, sizes) -> tuple:
    """``ne.attention`` with batch, query and key lengths ``extents`` (names or ints)."""
    from ..frontend.attention import attention
    b, lq, s = extents
    out = attention(b, spec.hq, lq, s, spec.e, spec.dtype,
                    kv_heads=spec.hkv, scale=spec.scale, score_mod=score_mod,
                    mask_mod=mask_mod, dv=spec.ev)
    captured, out.captured = out.captured, {}   # the table must not pin the user's tensors
    outputs = [out] + _row_stats(out, spec.max_scores)
    return outputs, captured, _name_captured_sizes(outputs, captured, sizes)


def _row_stats(out: dsl.Tensor, max_scores: bool) -> list[dsl.Tensor]:
    """lse (and the row max) from the attention program's own ``mx`` and ``den``: a row
    with no visible key has den = 0 and gets MASKED, which ``finish`` turns into -inf
    (the kernels never compute with infinities)."""
    mx, den = _find(out, "mx"), _find(out, "den")
    shape = mx.shape
    lse = dsl.compute(shape, lambda z, y, i: dsl.where(
        den[z, y, i] > 0.0, mx[z, y, i] + dsl.log(dsl.maximum(den[z, y, i], 1e-30)), MASKED),
        "lse", dtype="float32")
    if not max_scores:
        return [lse]
    mxo = dsl.compute(shape, lambda z, y, i: dsl.where(den[z, y, i] > 0.0, mx[z, y, i], MASKED),
                      "max_scores", dtype="float32")
    return [lse, mxo]


def _name_captured_sizes(outputs: list, captured: dict, sizes: dict[str, int] | None) -> bool:
    """A captured dim read only at a sequence or batch index (``doc_ids[kv_idx]``,
    ``bias[h, q_idx]``) gets that index's size name, so the structure -- and its one
    saturation -- serves every length; the kernel then reads the size off that tensor
    too: a longer one is cut to it (``fit_captured``), a shorter one is refused by name.
    With ``sizes`` known (eager calls) a dim shorter than this call's size stays concrete
    (the read is out of range: the program says where).  True if a dim is read at both L
    and S."""
    both = False
    if not captured:
        return both
    extents: dict[str, object] = {}
    tensors = _all_tensors(outputs)
    for t in tensors:
        if t._definition is not None:
            for ax, n in zip(t._definition[0], t.shape):
                extents.setdefault(ax, set()).add(n)
            for ax, n in t._capture.reduce_extents.items():
                extents.setdefault(ax, set()).add(n)
    axis_size = {ax: next(iter(ns)).name for ax, ns in extents.items()
                 if len(ns) == 1 and getattr(next(iter(ns)), "name", None) in SIZES}
    reads: dict[str, list[tuple]] = {}
    for t in tensors:
        if t._definition is not None:
            for n in t._definition[1].walk():
                if n.op == "load" and n.val in captured:
                    reads.setdefault(n.val, []).append(n.args)
    by_name = {t.name: t for t in tensors}
    for name, idx_lists in reads.items():
        ph = by_name[name]
        shape = list(ph.shape)
        for k, dim in enumerate(shape):
            named = {axis_size.get(ix[k].val) if ix[k].op == "var" else None for ix in idx_lists}
            if named == {SIZES[1], SIZES[2]} and (sizes is None or sizes[SIZES[2]] <= dim):
                both = True
            if len(named) == 1 and None not in named:
                size = named.pop()
                if sizes is None or sizes[size] <= dim:
                    shape[k] = as_extent(size)
        ph.shape = tuple(shape)
    return both


def _named_dims(prog) -> tuple:
    """(captured position, dim, size name) of each captured dim the program names
    (its inputs after q, k, v are the captured tensors, in kernel order)."""
    return tuple((i, d, ext.name) for i, ph in enumerate(prog.inputs[3:])
                 for d, ext in enumerate(ph.shape) if not isinstance(ext, int))


def fit_captured(named_dims: tuple, q, k, captured: list, compiling: bool = False) -> list:
    """The captured tensors cut to the sizes the structure names in them.  A dim is named
    only when every read indexes it at that size's own index (``tab[kv_idx]``), so no
    read reaches past the size: a table longer than S -- traced where it was exactly S,
    or a 64-entry bias at 32 keys -- reads the same as its first S entries, as in torch.
    A shorter one stays, and the kernel refuses it by name.  Under torch.compile the cut
    is always taken (a slice, which clamps): comparing sizes there would guard on them."""
    if not named_dims:
        return captured
    sizes = call_sizes(q, k)
    out = list(captured)
    for i, d, name in named_dims:
        x, n = out[i], sizes[name]
        if compiling or x.shape[d] > n:
            out[i] = x[(slice(None),) * d + (slice(0, n),)]
    return out


def _all_tensors(outputs: list) -> list[dsl.Tensor]:
    out, stack, seen = [], list(outputs), set()
    while stack:
        t = stack.pop()
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
            stack.extend(t._capture.tensors)
    return out


def _find(out: dsl.Tensor, name: str) -> dsl.Tensor:
    """The tensor called ``name`` among those ``out`` is computed from."""
    stack, seen = [out], set()
    while stack:
        t = stack.pop()
        if t.name == name:
            return t
        if id(t) not in seen:
            seen.add(id(t))
            stack.extend(t._capture.tensors)
    raise ProgramError(f"Expected ne.attention to compute {name!r}; it no longer does "
                       "(neptune_eq.flex needs its row max 'mx' and row sum 'den').")


def run(skey: str, q, k, v, captured: list, want_max: bool, want_lse: bool = True):
    """The kernel of structure ``skey`` on q, k, v and the captured tensors:
    (out, lse, max_scores or an empty tensor).  ``want_lse=False``: the lse is not
    returned, so its masked rows are left as the kernel wrote them (two torch ops fewer,
    each a launch on a GPU)."""
    st = STRUCTURES.get(skey)
    if st is None:
        raise ProgramError(f"Expected a structure traced in this process, got key {skey!r} "
                           "(a graph from another process?); call ne.flex_attention, which "
                           "traces the mods, rather than the op directly.")
    sizes = call_sizes(q, k)
    kern = st.kernel
    if kern is None:  # the first call: its own data are what the tile configs are timed on
        kern = st.kernel_at(sizes, dict(zip([ph.name for ph in st.program.inputs],
                                            [q, k, v, *captured])))
    res = kern(q, k, v, *captured)
    out, lse = res[0], res[1]
    if want_lse:
        finish(lse)
    mx = finish(res[2]) if want_max else lse.new_empty((0,))
    return out, lse, mx


def finish(stat: torch.Tensor) -> torch.Tensor:
    """MASKED (a row with no visible key) -> -inf, as FlexAttention reports it.  A real
    lse is at least the row's largest score, never near -1e30."""
    return stat.masked_fill_(stat <= MASKED * 0.5, float("-inf"))

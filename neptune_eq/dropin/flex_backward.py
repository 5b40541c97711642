"""Gradients of ``ne.flex_attention``: the autograd formula of the
``neptune_eq::flex_attention`` op, running kernels derived from the plain program.

For each input that needs a gradient (q, k, v, and every float tensor the mods captured)
``frontend.autodiff`` writes the plain backward program of the structure's forward
program (outputs O and lse) and ``ne.superoptimize`` fuses and lowers it -- once per
structure and input, at any B, L, S (the sizes stay named).  Every gradient row is owned
by one program instance, except dQ in the fused group: it is summed over key blocks by
atomic adds inside dK/dV's loop (``torch.use_deterministic_algorithms(True)`` gives the
atomic-free form: dQ by a kernel of its own).  On the GPU the timer chooses between the
two forms (``fused_is_faster``); in the interpreter the fused one runs (it does two fewer
products per block pair, the only thing the interpreter can tell).

What the forward saved is only (O, lse).  The backward programs read a row max ``m`` and
denominator ``l`` instead: the row max is a constant of the program (softmax does not
depend on it), so any per-row shift gives the same gradients, and with the shift
``m := lse = m + log l`` the denominator becomes ``l = Σ exp(s − lse) = 1``:
``exp(s − m)/l = exp(s − (m + log l))``, P recomputed from the log-sum-exp alone.  The
denominator is then the constant 1 and is folded into the program
(``backward_forms.with_constant_input``): ``dO/max(l, ε)`` is ``dO`` again, an fp16 operand of the
tensor-core products.  A row with no visible key has lse = −inf: it gets the shift
``UNSEEN_ROW_SHIFT``, under which every ``exp(s − m)`` of the row underflows to exactly 0, so
its gradients are zero (never NaN).
"""
from __future__ import annotations

import math

import torch

from . import backward_plan, flex
from ..frontend.autodiff import backward_program
from ..frontend.backward_forms import (note_prepared, only_outputs, with_constant_input,
                                       with_spread_output,
                                       with_definition_as_input, with_fp32_output,
                                       with_guarded_reads)
from ..errors import DeviceFaultError
from ..ir import MASKED, ProgramError
from ..sizes import bucket_of

SAVED = ("mx", "den", "o")
# A table of fewer entries than SPREAD_TO (T5's 32 buckets a head) has its gradient's
# atomic adds spread over up to MAX_COPIES copies by query row (``_at_computed_index``).
SPREAD_TO, MAX_COPIES = 8192, 64
UNSEEN_ROW_SHIFT = -MASKED  # s − m <= −1e30 on a row with no visible key: P = 0


def backward_kernel(st: "flex.Structure", wrt: tuple[str, ...], sizes: dict[str, int],
                    shared: bool = False, lse_grad: bool = True, example: dict | None = None,
                    piece: int = 0):
    """The superoptimized backward kernel of structure ``st`` for the inputs ``wrt`` (one
    kernel computes all of them: ``("k", "v")`` share the recomputed P in one loop).

    ``shared``: dQ's and dK/dV's kernels both run, and the row statistics both read
    (``row_statistics``: Σ_e dO·O) are computed once -- by a row kernel dQ's group runs
    first (as the fused group does), read by both as inputs.  ``lse_grad=False``: the
    loss does not use the lse (the usual case), its cotangent is 0 and is folded away --
    no input, no term.
    ``example``: the call's tensors by input name, which a first build times its tile
    configs on.  Returns (backward, kernel, rows, expanded, stats, pre): ``pre`` is the
    (backward, kernel) that computes the row statistics first, for the fused group and
    dQ's.  ``piece``: which of a gradient's kernels (``pieces_of``).""" 
    key = (wrt, shared, lse_grad) + ((piece,) if piece else ()) + (
        ("deterministic",) if _atomics_barred(wrt) else ())
    if key not in st.backward:
        with st.lock:
            if key not in st.backward:
                st.backward[key] = _build_backward(st, wrt, sizes, shared, lse_grad, example,
                                                   piece)
    return st.backward[key]


def pieces_of(st, wrt: tuple[str, ...], shared: bool, lse_grad: bool) -> int:
    """How many kernels compute ``wrt``'s gradient (``_partial_pieces``), known once its
    first is built: 1, or one per row-wise partial of a captured tensor read along two
    row roles (``t[q_idx]`` and ``t[kv_idx]``)."""
    return st.backward_pieces.get((wrt, shared, lse_grad), 1)


def _build_backward(st, wrt, sizes, shared, lse_grad, example=None, piece: int = 0):
    program, expanded = _grouped_reads_expanded(st.program, wrt)
    bw = backward_program(program, list(wrt), saved=SAVED, constant=("mx",))
    bw = _grouped_inputs_shared(bw, st.program, expanded)
    if "den" in bw.saved:  # (a gradient that never reads the denominator keeps none)
        bw = with_constant_input(bw, "den", 1.0, "fed the row shift m := lse, "
                                 "exp(s − m)/l = exp(s − (m + log l)) makes every row's l = 1")
    if not lse_grad and "d_lse" in bw.cotangents:
        bw = with_constant_input(bw, "d_lse", 0.0, "the loss does not read the lse")
    # the returned kernel then fixes up a row with no visible key (lse -inf, or the
    # forward kernel's ~-1e30 when it was not returned) in its row loads, not torch ops
    # before each call: its shift makes every exp(s − m) 0, its lse cotangent is dropped
    # (first the shift, so the cotangent's guard reads the lse as saved)
    reads = {ph.name for ph in bw.program.inputs}
    if "mx" in reads:
        bw = with_guarded_reads(bw, "mx", "mx", MASKED * 0.5, UNSEEN_ROW_SHIFT,
                                "a row with no visible key: every exp(s − m) underflows to 0")
    if {"mx", "d_lse"} <= reads:
        bw = with_guarded_reads(bw, "d_lse", "mx", MASKED * 0.5, 0.0,
                                "a row with no visible key has no lse to differentiate")
    fused = fused_group(wrt)
    first_row_kernel = fused or wrt == ("q",)  # (dK/dV's reads those of dQ's group)
    stats = row_statistics(bw) if shared or first_row_kernel else []
    pre = None
    # the row dots first, by a row-reduction kernel of their own, before the fused kernel
    # or dQ's: each then reads them, and dQ's kernel is one pass of sums over key blocks
    # -- the shape the warp-specialised sums skeleton lowers (``lowering.gluon_sums``);
    # returned by dQ's kernel as a pass before its loop, they kept it on the tl forms
    if stats and first_row_kernel:
        pre = _row_statistics_kernel(st, bw, stats, wrt, sizes, lse_grad, example)
    for name in stats:
        bw = with_definition_as_input(bw, name, "computed once by a row kernel, not from an "
                                      "O tile in every key block's program" if pre else
                                      "computed once by the row kernel dQ's backward runs "
                                      "first, not from an O tile in every key block's program")
    if fused:
        bw = with_fp32_output(bw, "d_q", "summed over key blocks by atomic adds in the "
                              "dK/dV loop (FlashAttention-2): no second kernel recomputing P, dP")
    pieces = _at_computed_index(bw, wrt) or _partial_pieces(bw, wrt)
    st.backward_pieces[(wrt, shared, lse_grad)] = len(pieces)
    bw, rows = pieces[piece]
    kern = _superoptimize(st, bw, wrt, sizes, example)
    return bw, kern, rows, expanded, stats, pre


def _row_statistics_kernel(st, bw, stats, wrt, sizes, lse_grad, example):
    """(backward, kernel) of the row statistics alone, built once per structure and shared
    by the fused group and dQ's kernel (so the timer's comparison of the two forms counts
    the one kernel, timed once; the key is the program, so only the same one is shared)."""
    first = only_outputs(bw, stats, "the row dots Σ_e dO·O (the softmax-gradient term "
                         "Σ_j P·dP), read by every key block of the gradient kernels")
    key = str(first.program)
    if key not in st.row_kernels:
        st.row_kernels[key] = (first, _superoptimize(st, first, wrt, sizes, example))
    return st.row_kernels[key]


def _superoptimize(st, bw, wrt, sizes, example):
    from ..api import superoptimize
    from ..sizes import symbols
    named = symbols(bw.program)  # (the row-statistics kernel has no key length S)
    try:
        return superoptimize(bw.program, target=st.target, sizes={
            n: sizes[n] for n in named} if named else None, example_inputs=example,
            float32_matmul_precision=st.fp32_precision)
    except DeviceFaultError:
        raise  # (it says what happened; the process cannot go on)
    except Exception as e:  # noqa: BLE001 - named here, not deep in triton
        hint = ("report it with the mods that raised it" if set(wrt) <= {"q", "k", "v"}
                else "detach that captured tensor to train q, k and v meanwhile")
        raise ProgramError(
            f"ne.flex_attention: the backward kernel for the gradient of {', '.join(wrt)} "
            f"could not be built ({type(e).__name__}: {str(e)[:300]}); {hint}.") from e


def fused_is_faster(st, names, needs, sizes, lse_grad: bool, env: dict) -> bool:
    """On the GPU both forms are built once per structure and the timer decides, per size
    bucket: the fused one (row statistics, then one kernel adding dQ atomically) against
    the two kernels (dQ's loop over keys, dK/dV's over queries), each kernel's time at
    this bucket (``Kernel.bucket_ms``: its config as timed on the first call's tensors,
    or on a call at a new bucket long enough to be tuned; a bucket chosen untimed times
    its carried config once), plus what each form's outputs cost outside
    its kernels (``outside_ms``: the fused form's fp32 dQ is zeroed before the launch and
    converted to q's dtype after -- 21 us of a 215 us step for window(256) at S=2048 on an
    H200, session 14).  A bucket with no time (inside a graph capture, off the GPU) takes
    the form of the nearest bucket that has one.  Measured: neither form wins everywhere --
    fused was 9-14% faster for softcap and document masks at S=8192 (H200, session 12),
    the two kernels 12% faster for plain attention at S=8192 once both have Gluon forms
    (H100, session 21); for a document mask and a window(256) the `tl` fused kernel took
    0.175 / 0.147 ms at S=2048 against 0.234 / 0.186 for the two kernels, the reverse of
    8192 (H100, session 22, bench/gluon_backward_validate.py): a first call at one size
    must not fix the form for another."""
    key = (lse_grad, bucket_of(sizes))
    if key not in st.backward_form:
        def ms(groups) -> float:
            total = 0.0
            for group, built in group_kernels(st, groups, sizes, lse_grad, env):
                pre = built[-1]
                for kern, bw in [(built[1], built[0])] + ([(pre[1], pre[0])] if pre else []):
                    kern_ms = kern.bucket_ms(sizes, {ph.name: env[ph.name] for ph in
                                                     bw.program.inputs if ph.name in env})
                    if kern_ms is None:
                        return float("nan")  # no time at this bucket: no basis
                    total += kern_ms
                total += outside_ms(built[0], built[1], group, env)
            return total
        fused = ms(gradient_groups(names, needs))
        split = ms(gradient_groups(names, needs, deterministic=True))
        if fused == fused and split == split:
            st.backward_form[key] = (not split < fused, True)
        else:  # (no time: inside a graph capture) the form timed at the nearest size, else fused
            timed = [k for k, (_, was_timed) in st.backward_form.items()
                     if k[0] == lse_grad and was_timed]
            near = min(timed, key=lambda k: _bucket_distance(k[1], key[1]), default=None)
            st.backward_form[key] = (st.backward_form[near][0] if near else True, False)
    return st.backward_form[key][0]


def _bucket_distance(a: tuple, b: tuple) -> int:
    """How far apart two size buckets (``sizes.bucket_of``: (name, power-of-two class)
    pairs) are: the sum of their classes' differences."""
    return sum(abs(x - y) for (_, x), (_, y) in zip(a, b))


def outside_work(bw, kern, group: tuple[str, ...], env: dict) -> list[tuple]:
    """What a gradient kernel's outputs cost outside it, as (shape, zeroed, converted to
    this dtype or None): an output added into atomically (``scattered``) is zeroed before
    the launch, and an fp32 output is converted to its input's dtype after
    (``run_backward``'s ``.to``)."""
    scattered = getattr(kern.chosen_row.kernel, "scattered", ())
    work = []
    for name, oname in zip(group, bw.program.outputs):
        t = env[name]
        to = t.dtype if (bw.program.dtype_of(oname) == "float32"
                         and t.dtype != torch.float32) else None
        if oname in scattered or to is not None:
            work.append((tuple(t.shape), oname in scattered, to))
    return work


def outside_ms(bw, kern, group: tuple[str, ...], env: dict) -> float:
    """GPU milliseconds of ``outside_work``, timed as the kernels are (``device_ms``)."""
    from ..runtime.timing import device_ms
    work = outside_work(bw, kern, group, env)
    if not work:
        return 0.0

    def call(_):
        for shape, zeroed, to in work:
            g = torch.empty(shape, dtype=torch.float32, device="cuda")
            if zeroed:
                g.zero_()
            if to is not None:
                g.to(to)
    return device_ms(call, [[]])


def group_kernels(st, groups, sizes, lse_grad: bool, env: dict):
    """(group, ``backward_kernel``'s tuple) for each group in turn, built as it is reached
    (a dK/dV kernel built after dQ's ran is timed on the row statistics its row kernel
    computed).  Where a dQ and a dK/dV kernel both run they share the row statistics."""
    shared = ("q",) in groups and any(g[0] in ("k", "v") for g in groups)
    for g in groups:
        sh = shared and g[0] in ("q", "k", "v")
        yield g, backward_kernel(st, g, sizes, sh, lse_grad, env)
        for piece in range(1, pieces_of(st, g, sh, lse_grad)):  # (summed by the caller)
            yield g, backward_kernel(st, g, sizes, sh, lse_grad, env, piece)


def fused_group(wrt: tuple[str, ...]) -> bool:
    """Whether ``wrt`` is the one-kernel group: dK/dV's loop over query blocks with dQ
    added atomically (``lowering.scatter``), listed (k, v, q) so dK sets the rows."""
    return len(wrt) > 1 and wrt[-1] == "q"


def row_statistics(bw) -> list[str]:
    """Definitions of a backward that are one number per query row and read neither q, k
    nor v -- reductions over the head dim of cotangents and saved values, such as
    ``Σ_e dO·O`` (the adjoint of the softmax denominator).  Every gradient kernel of
    attention reads them; computed per key block they would cost an O tile per block."""
    p = bw.program
    rows = p.shape_of("mx") if any(ph.name == "mx" for ph in p.inputs) else None
    out = []
    for d in p.defs:
        if d.name in p.outputs or d.body.kind != "reduce" or p.shape_of(d.name) != rows:
            continue
        if not {n.val for n in d.body.walk() if n.op in ("load", "ref")} & {"q", "k", "v"}:
            out.append(d.name)
    return out


def _grouped_reads_expanded(program, wrt: tuple[str, ...]):
    """(program, {name: G}): the program where each input in ``wrt`` read only at head
    ``y // G`` (GQA's K and V) is read at ``y``, as if from a copy with the query heads'
    count -- the form autodiff differentiates (``_grouped_inputs_shared`` then points the
    reads back at the original tensor; no copy is made).

    The adjoint of a read at ``y // G`` sums over the G query heads of a group; written
    as is, that is ``Σ_y where(y // G = t, …)``, a loop over every head for each KV head.
    Read at ``y``, dK and dV are per-query-head tiles like MHA's (one kernel over key
    blocks, no atomics), and the sum over each group's G heads is a torch ``sum`` of a
    ``[B, Hkv, G, S, D]`` view after the kernel."""
    from ..ir import Placeholder, Program, Term, var
    groups: dict[str, int] = {}
    for d in program.defs:
        for t in d.body.walk():
            if t.op == "load" and t.val in wrt and len(t.args) > 1:
                h = t.args[1]
                if h.op == "floordiv" and h.args[0].op == "var" and h.args[1].op == "int":
                    groups.setdefault(t.val, set()).add((h.args[0].val, int(h.args[1].val)))
                else:
                    groups.setdefault(t.val, set()).add(None)
    groups = {n: next(iter(g))[1] for n, g in groups.items()
              if len(g) == 1 and None not in g and next(iter(g))[1] > 1}
    if not groups:
        return program, {}

    def swap(t: Term) -> Term:
        t = t.map_args(swap)
        if t.op == "load" and t.val in groups:
            return Term("load", (t.args[0], var(t.args[1].args[0].val), *t.args[2:]), t.val)
        return t
    heads = next(ph.shape[1] for ph in program.inputs if ph.name == "q")  # (a captured
    # input may have one dim: ALiBi's slopes)
    inputs = [Placeholder(ph.name, (ph.shape[0], heads, *ph.shape[2:]), ph.dtype)
              if ph.name in groups else ph for ph in program.inputs]
    defs = [type(d)(d.name, d.axes, swap(d.body), d.dtype) for d in program.defs]
    return Program(inputs, defs, dict(program.extents), list(program.outputs),
                   dict(program.meta)), groups


def _grouped_inputs_shared(bw, forward, groups: dict[str, int]):
    """``bw`` (derived from ``_grouped_reads_expanded``'s program) reading each grouped
    input from the original ``[B, Hkv, …]`` tensor at head ``y // G`` again.  Only the
    gradients need the per-query-head layout; the reads do not, so no copy of K and V
    is made per backward call, and the G heads of a group read one K/V tile (an L2 hit
    for all but the first) as the forward does."""
    from ..ir import Program, Term, const, validate
    if not groups:
        return bw
    p = bw.program

    def shared(t: Term) -> Term:
        t = t.map_args(shared)
        if t.op == "load" and t.val in groups:
            head = Term("floordiv", (t.args[1], const(groups[t.val])))
            return Term("load", (t.args[0], head, *t.args[2:]), t.val)
        return t
    original = {ph.name: ph for ph in forward.inputs}
    inputs = [original[ph.name] if ph.name in groups else ph for ph in p.inputs]
    defs = [type(d)(d.name, d.axes, shared(d.body), d.dtype) for d in p.defs]
    # (the forward that computes the saved values from these inputs: the original one)
    meta = dict(p.meta, forward=forward) if "forward" in p.meta else dict(p.meta)
    meta = note_prepared(meta, ", ".join(f"{n} read at head y // {g}" for n, g in groups.items()),
                         "GQA -- differentiated per query head, summed over each group after "
                         "the kernel; the reads need no copy")
    prog = validate(Program(inputs, defs, dict(p.extents), list(p.outputs), meta))
    return type(bw)(prog, bw.wrt, bw.saved, bw.cotangents)


def gradient_groups(names: list[str], needs: list[bool],
                    deterministic: bool = False) -> list[tuple[str, ...]]:
    """Which gradients one kernel computes together: dK and dV with dQ added atomically
    (FlashAttention-2: P, dP recomputed once per block pair); with ``deterministic``
    (no float atomics) dK and dV in one loop over query blocks and dQ in a loop over key
    blocks of its own.  Each captured tensor on its own."""
    want = [n for n, need in zip(names, needs) if need]
    kv = tuple(n for n in ("k", "v") if n in want)
    q = tuple(n for n in want if n == "q")
    main = [kv + q] if kv and q and not deterministic else [g for g in [q, kv] if g]
    return main + [(n,) for n in want if n not in ("q", "k", "v")]


def _partial_pieces(bw, wrt: tuple[str, ...]) -> list:
    """[(backward, rows)] of ``_partial_only``: one entry, or, where a captured tensor's
    gradient adds partials of different row roles -- ``t[q_idx]`` summed over the keys
    per query and ``t[kv_idx]`` over the queries per key -- one per partial.  One kernel
    holding both tiled neither (its tile spanned queries and keys whole); each alone is
    the row-wise reduction ``_partial_only`` computes -- or, read at an index moving with
    the keys, the added output ``_at_computed_index`` makes -- and their sum is a torch
    add."""
    grad = bw.program.definition("d_" + wrt[0]) if len(wrt) == 1 else None
    terms = _added(grad.body) if grad is not None else []
    if len(terms) < 2:
        return [_partial_only(bw, wrt)]
    pieces, roles = [], set()
    for term in terms:
        prog = bw.program.with_defs(
            d.__class__(d.name, d.axes, term, d.dtype) if d is grad else d
            for d in bw.program.defs)
        one = type(bw)(prog, bw.wrt, bw.saved, bw.cotangents)
        scattered = _at_computed_index(one, wrt)  # (``t[kv_idx]`` beside ``t[q_idx]``, L ≠ S)
        if scattered:
            pieces += scattered
            roles.add(("added at its index", len(pieces)))
            continue
        piece = _partial_only(one, wrt)
        if not piece[1]:  # a term that is not a row-wise partial: keep them in one kernel
            return [_partial_only(bw, wrt)]
        pieces.append(piece)
        roles.add(_loop_role(piece[0].program))
    # partials looping over the same axis of what they read (``where(q == m)`` forms, a
    # table not cut to one length) share one kernel's loop: kept together
    return pieces if len(roles) > 1 else [_partial_only(bw, wrt)]


def _atomics_barred(wrt: tuple[str, ...]) -> bool:
    """A captured tensor's gradient under ``torch.use_deterministic_algorithms``: no
    atomic adds (``_at_computed_index``), so its kernel differs."""
    return not set(wrt) <= {"q", "k", "v"} and torch.are_deterministic_algorithms_enabled()


def _at_computed_index(bw, wrt: tuple[str, ...]) -> list:
    """[(backward, rows)] where the gradient of a table read at a computed index (a
    relative-position table ``rel[q_idx - kv_idx + n]``, T5's buckets) is the whole
    kernel's output: each score's gradient added into the table where its index points,
    one pass over the score tiles (``lowering.index_scatter``), in float32.  Tiled as a
    row-wise partial, every table entry recomputed all the scores.  A table of fewer
    than ``SPREAD_TO`` entries gets a trailing axis of copies (``rows`` = 1: summed after
    the kernel), unless its index reads queries and keys only through their difference
    (each tile then adds once per diagonal, ``IndexScattered.diagonal``).  [] where it
    is not that form, or where deterministic algorithms bar atomic adds."""
    from ..lowering import index_scatter
    if len(wrt) != 1 or _atomics_barred(wrt):
        return []
    name = "d_" + wrt[0]
    wide = with_fp32_output(bw, name, "added into by atomic adds, one per score, at the "
                            "index the mod computes")
    found = index_scatter.find(wide.program)
    if [sc.name for sc, _ in found] != [name]:
        return []
    ((sc, part),) = found
    shape = wide.program.shape_of(name)
    entries = math.prod(shape) if all(isinstance(n, int) for n in shape) else None
    if entries is None or part is None or entries >= SPREAD_TO:  # (None: a named size)
        return [(wide, 0)]
    if sc.diagonal() is not None:  # a tile's adds: one per diagonal, few
        return [(wide, 0)]
    copies = min(MAX_COPIES, 1 << (-(-SPREAD_TO // entries) - 1).bit_length())
    spread = with_spread_output(wide, name, part, sc.state_axes[-1], copies, (
        f"{entries} entries take every score's add: spread by query row over copies, "
        "summed after the kernel, the adds collide that many times less"))
    return [(spread, 1)]


def _loop_role(prog) -> frozenset:
    """Where the one output's reduction variable indexes what it reads: {(name, dim)}."""
    part = prog.definition(prog.outputs[0])
    if part.body.op != "sum":
        return frozenset()
    v = part.body.val
    return frozenset((t.val, k) for t in part.body.walk() if t.op in ("ref", "load")
                     for k, a in enumerate(t.args) if a.op == "var" and a.val == v)


def _added(t) -> list:
    """The terms of a sum ``a + b + …``."""
    return _added(t.args[0]) + _added(t.args[1]) if t.op == "add" else [t]


def _partial_only(bw, wrt: tuple[str, ...]):
    """A captured tensor's gradient is ``d_X[t…] = Σ_rows p[t…, rows…]`` over a row-wise
    partial ``p`` (autodiff keeps the forward's rows).  The kernel computes the partial --
    one reduction over the keys per (batch, head, query) row, as dQ -- and the sum over
    the rows, B·L values per element, is a torch sum: a kernel reducing over batch,
    queries and keys at once does not tile yet.  Returns (backward, how many trailing
    row dims to sum; 0 when the gradient is computed whole)."""
    from ..ir import Program
    if len(wrt) != 1:
        return bw, 0
    wrt = wrt[0]
    prog = bw.program
    grad = prog.definition("d_" + wrt)
    body, summed = grad.body, []
    while body.op == "sum":
        summed.append(body.val)
        body = body.args[0]
    if not summed or body.op != "ref" or not body.val.startswith(f"p_{wrt}_"):
        return bw, 0
    idx = [a.val if a.op == "var" else None for a in body.args]
    if idx != list(grad.axes) + summed[:len(idx) - len(grad.axes)] or \
            len(idx) != len(grad.axes) + len(summed):
        return bw, 0
    part = prog.definition(body.val)
    defs = [d for d in prog.defs if d.name != grad.name]
    program = Program(list(prog.inputs), defs, dict(prog.extents), [part.name], dict(prog.meta))
    return type(bw)(program, bw.wrt, bw.saved, bw.cotangents), len(summed)


def run_backward(skey: str, q, k, v, captured: list, out, lse, d_out, d_lse, needs: list[bool]):
    """Gradients (dq, dk, dv, [d captured...]); None where ``needs`` is False.  A key met
    before runs its recorded kernels' replays (``backward_plan``)."""
    st = flex.STRUCTURES.get(skey)
    if st is None or st.program is None:
        raise ProgramError(f"Expected a structure traced in this process, got key {skey!r}; "
                           "call ne.flex_attention, which traces the mods.")
    names, tensors, sizes, env = backward_env(st, q, k, v, captured, out, lse, d_out, d_lse)
    key = backward_plan.plan_key(skey, needs, [*tensors, out, lse, d_out], d_lse)
    plan = backward_plan.get(key)
    if plan is not None:
        return plan.run(env, names, tensors)
    for name, t, need in zip(names, tensors, needs):
        if need and not t.is_floating_point():
            raise ProgramError(f"Expected a float tensor to differentiate, got {name} of dtype "
                               f"{t.dtype}; only float captured tensors have gradients.")
    got, rec = {}, backward_plan.Recorder()
    groups = chosen_groups(st, names, needs, sizes, d_lse is not None, env)
    for group, built in group_kernels(st, groups, sizes, d_lse is not None, env):
        bw, kern, rows, expanded, stats, pre = built
        if pre is not None:  # the fused kernel's row statistics, by their own kernel
            first, row_kern = pre
            inputs = [ph.name for ph in first.program.inputs]
            args = [env[n] for n in inputs]
            res = row_kern(*args)
            env.update(zip(stats, res if isinstance(res, tuple) else (res,)))
            rec.row_statistics(row_kern, inputs, args, stats)
        inputs = [ph.name for ph in bw.program.inputs]
        args = [env[n] for n in inputs]
        res = kern(*args)  # positional: replayed
        res = res if isinstance(res, tuple) else (res,)
        rec.gradients(kern, inputs, args, group, rows, expanded)
        for name, g in zip(group, res):
            backward_plan.add_gradient(got, name, backward_plan.finish_gradient(
                g, rows, expanded.get(name)))
    backward_plan.keep(key, rec)
    return [backward_plan.as_input_dtype(got.get(n), t) for n, t in zip(names, tensors)]


def chosen_groups(st, names, needs, sizes, lse_grad: bool, env: dict) -> list[tuple[str, ...]]:
    """The gradient groups this call runs: the fused one unless deterministic algorithms
    are on or, on the GPU, the timer found the two-kernel form faster."""
    groups = gradient_groups(names, needs, torch.are_deterministic_algorithms_enabled())
    if st.target == "cuda" and any(fused_group(g) for g in groups) and \
            not fused_is_faster(st, names, needs, sizes, lse_grad, env):
        groups = gradient_groups(names, needs, deterministic=True)
    return groups


def backward_env(st, q, k, v, captured: list, out, lse, d_out, d_lse):
    """(input names, their tensors, the named sizes, every backward kernel's inputs by
    name): the forward's inputs, and what it saved made into the backward's reads."""
    names = [ph.name for ph in st.program.inputs]
    tensors = [q, k, v, *captured]
    sizes = flex.call_sizes(q, k)
    env = dict(zip(names, tensors))
    # (a row with no visible key is shifted in the kernels' loads: ``with_guarded_reads``)
    env["mx"] = lse.float().contiguous()
    env["o"] = out.contiguous()
    env["d_o"] = (torch.zeros_like(out) if d_out is None else d_out.to(out.dtype)).contiguous()
    if d_lse is not None:  # (None: the loss does not use the lse, see backward_kernel)
        env["d_lse"] = d_lse.float().contiguous()
    return names, tensors, sizes, env


def setup_context(ctx, inputs, output):
    q, k, v, captured, structure, _max_scores = inputs
    out, lse, _mx = output
    ctx.structure = structure
    # an output the loss does not use gets None, not a zero tensor: the lse's gradient
    # is then folded out of the backward kernels (no allocation, no load, no term)
    ctx.set_materialize_grads(False)
    # per captured tensor (a list input has one needs_input_grad flag): float tensors that
    # require grad get one; integer tables (document ids) never do
    ctx.captured_needs = [c.requires_grad and c.is_floating_point() for c in captured]
    ctx.save_for_backward(q, k, v, out, lse, *captured)


def check_no_max_grad(d_max) -> None:
    if d_max is not None and d_max.numel() and bool((d_max != 0).any()):
        raise ProgramError("max_scores of ne.flex_attention has no gradient (as in "
                           "FlexAttention); detach it before using it in a loss.")


def saved(ctx) -> tuple[list, list[bool]]:
    """(q, k, v, out, lse, *captured) as ``setup_context`` saved them, and which inputs
    need a gradient (q, k, v, then each captured tensor)."""
    return list(ctx.saved_tensors), list(ctx.needs_input_grad[:3]) + list(ctx.captured_needs)


def backward(ctx, d_out, d_lse, d_max):
    """Eager autograd formula (``torch_op.EagerFlexAttention``): the kernels run here."""
    check_no_max_grad(d_max)
    (q, k, v, out, lse, *captured), needs = saved(ctx)
    grads = run_backward(ctx.structure, q, k, v, captured, out, lse, d_out, d_lse, needs)
    return grads[0], grads[1], grads[2], list(grads[3:]), None, None

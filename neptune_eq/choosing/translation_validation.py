"""Translation validation: the chosen program, and its kernel, against the input program.

Rules are checked when they are loaded and every derived fold is checked (Eq. 3/4), but a
rule the checker could not decide, a bug in extraction, lowering or code generation could
still produce a wrong kernel.  So before ``superoptimize`` returns, the chosen program is
evaluated by the reference interpreter next to the input program on random inputs, and
the chosen candidate's kernel is run on the same inputs.  A mismatch is an error naming
the rules on the derivation path, never a returned kernel.

Sizes: the rewrite rules never look at sizes, so the comparison holds at *any* sizes of the
same structure.  The programs are shrunk (every size above ``SMALL`` maps, in order, to
SMALL+1, SMALL+3, …: equal sizes stay equal, order is kept, odd sizes exercise the edge
masks) so the check costs milliseconds, not the full problem.  Inputs: a normal draw,
large magnitudes (scores of ±1e4: a missing max-shift overflows), and integer tensors with
few distinct values (document ids: rows with no visible key appear).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import ir
from ..errors import TranslationValidationError
from ..interp import evaluate
from ..ir import Placeholder, Program, ProgramError, validate as validate_program
from ..sizes import Size
from ..egraph.verify import refinement_mismatch
from ..lowering import saturated_index

SMALL = 16
# A table index that stops moving past |i − j| >= D (``lowering.saturated_index``: T5's
# buckets) gets key loops of its own past D, which sizes of 17 never reach: such a
# program's two axes are checked once more at sizes past D + this -- a row block and two
# key blocks of the checked config's (the interpreter's are 16; on a GPU the check takes
# the config of the smallest tiles, 64, ``api._run_small_kernel``).  With a margin of
# 3 x 128, T5's first call on an H200 took 218 s against 71 without far loops (what of
# it was this check was not measured apart); the margin of 3 x 64 was not run there.
FAR_MARGIN = {"interpreter": 3 * 16, "cuda": 3 * 64}
FAR_OTHERS = 3  # ... and its other named sizes at most this (``_past``)
# label, scale of float inputs, integer inputs drawn from [0, high)
CASES = (("normal", 1.0, 2), ("large-magnitude", 40.0, 2), ("few-ids", 1.0, 3))
# The kernel runs on two of them: large magnitudes catch most forward faults (an unshifted
# exp, a lost max), but they make a softmax one-hot, so its gradient through the scores --
# dQ, dK, a captured bias's -- is ~0 there and any kernel passes; the normal inputs check
# those (a backward reading a table at queries and keys was wrong and passed on ~0 values).
KERNEL_CASES = ("normal", "large-magnitude")
KERNEL_TOL = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 6e-2, "float64": 1e-6}
# A kernel may stray from fp64 this many times as far as the fp32 evaluation of the same
# program does (its sums run in another order); a lowering fault is off by O(1)
FP32_SLACK = 4.0


def output_tolerance(program: Program, name: str, fp32_dot: str = "ieee") -> float:
    """Relative tolerance of output ``name``: its dtype's, or, if looser, that of a narrow
    float input multiplied with a *computed* operand in a contraction it reads.  The
    kernel feeds such a product to the tensor cores in the input's dtype, so the computed
    side (P, dS) is rounded to it: a float32 gradient summed by fp32 atomics from
    ``Σ_j dS·K`` with bf16 K is as exact as a bf16 output of the same product, not more.
    A product of two loads (Q·Kᵀ) rounds nothing and loosens nothing -- unless fp32
    products run in TF32 (``fp32_dot``, torch's float32 matmul precision "high"): its
    10-bit mantissa is fp16's, so any contraction is held to fp16's tolerance then."""
    need = ir.reachable({d.name: d.body for d in program.defs}, [name])
    dtypes = {program.dtype_of(name)}
    narrow = {ph.name: ph.dtype for ph in program.inputs if ph.dtype in ("float16", "bfloat16")}
    for d in program.defs:
        if d.name not in need:
            continue
        for n in d.body.walk():
            if n.kind != "reduce" or n.args[0].op != "mul":
                continue
            if fp32_dot != "ieee":
                dtypes.add("float16")
            a, b = n.args[0].args
            for x, y in ((a, b), (b, a)):
                if x.op == "load" and x.val in narrow and y.op != "load":
                    dtypes.add(narrow[x.val])
    return max(KERNEL_TOL.get(dt, 1e-3) for dt in dtypes)


@dataclass
class ValidationReport:
    """What translation validation compared, and how long it took (shown in the trace)."""
    sizes: dict[int, int] = field(default_factory=dict)      # original size -> checked size
    cases: list[str] = field(default_factory=list)
    program_error: float = 0.0        # max |chosen − input| / max|input| over the cases
    kernel: str = "not run"
    seconds: float = 0.0
    far_sizes: dict = field(default_factory=dict)  # the kernel once more past a far index

    def __str__(self) -> str:
        shrunk = _moved(self.sizes)
        return (f"translation validation: chosen program = input program on {len(self.cases)} "
                f"random input(s) ({', '.join(self.cases)}) at "
                f"{'sizes ' + shrunk if shrunk else 'the given sizes'} "
                f"(max rel. diff {self.program_error:.1e}); kernel: {self.kernel}"
                + (f" (once more at sizes {_moved(self.far_sizes)}, where its far key loops "
                   "run)" if self.far_sizes else "") + f"; {self.seconds * 1e3:.0f} ms")


def _moved(sizes: dict) -> str:
    return ", ".join(f"{a}->{b}" for a, b in sorted(sizes.items(), key=str) if a != b)


def size_map(program: Program, small: int = SMALL) -> dict:
    """Every size in the program (an int, or a named ``Size``) -> its checked size:
    monotone and injective on the ints, named sizes after them."""
    sizes = set(program.extents.values()) | {n for ph in program.inputs for n in ph.shape}
    grid = _grid_only(program)
    big = sorted(s for s in sizes if isinstance(s, int) and s > small)
    big += sorted((s for s in sizes if isinstance(s, Size) and s not in grid), key=lambda s: s.name)
    out = {s: s for s in sizes if isinstance(s, int) and s <= small}
    out.update({s: small + 2 * k + 1 for k, s in enumerate(big)})
    # A named size that only ever spans grid axes (a batch) is never blocked, looped or
    # masked by a tile: a small value distinct from every other checks it as well as 17
    # would, without multiplying the interpreter's work by 17.
    # (Past the small values, the next free large odd value keeps the map injective.)
    used = set(out.values())
    free = iter([v for v in range(2, small + 1) if v not in used]
                + list(range(small + 2 * len(big) + 1, small + 2 * len(big) + 2 * len(grid) + 2, 2)))
    out.update({s: next(free) for s in sorted(grid, key=lambda s: s.name)})
    return out


def _past(sizes: dict, keys: list, least: int) -> dict:
    """``sizes`` with the checked values of ``keys`` moved up to at least ``least`` --
    where they were shrunk at all (a call already at most SMALL keeps its sizes).  An
    int key moves with every int at least as large (their order and equalities stay);
    a named key takes a fresh odd value; a named size it would meet moves past it.  The
    other named sizes (a batch) drop to ``FAR_OTHERS``: the check is of the key loops,
    and a backward's batch of 21 made it 7x the work."""
    low = min(sizes[k] for k in keys)
    if low <= SMALL or low >= least:
        return sizes
    out = dict(sizes)
    ints = [k for k in keys if isinstance(k, int)]
    if ints:
        first, shift = min(ints), least - min(sizes[k] for k in ints)
        for s in sizes:
            if isinstance(s, int) and s >= first and shift > 0:
                out[s] = sizes[s] + shift
    for s in sizes:
        if isinstance(s, Size) and s not in keys:
            out[s] = min(out[s], FAR_OTHERS)
    fresh = max(max(out.values()) + 1, least) | 1  # odd, above every value and least
    for s in sorted((s for s in sizes if isinstance(s, Size)), key=lambda s: s.name):
        clash = any(out[s] == v for t, v in out.items() if t != s)
        if (s in keys and out[s] < least) or clash:
            out[s], fresh = fresh, fresh + 2
    return out


def _grid_only(program: Program) -> set:
    """Named sizes whose axes are always an outer output axis: never a definition's last
    (blocked) axis, never reduced."""
    out_axes = [d.axes for d in program.defs]
    outer = {a for axes in out_axes for a in axes[:-1]}
    inner = {axes[-1] for axes in out_axes if axes}
    reduced = set(program.extents) - {a for axes in out_axes for a in axes}
    by_size: dict = {}
    for a, n in program.extents.items():
        if isinstance(n, Size):
            by_size.setdefault(n, set()).add(a)
    return {n for n, axes in by_size.items()
            if axes <= outer and not axes & (inner | reduced)}


def shrink(program: Program, sizes: dict) -> Program:
    """The same program with every size (int or ``Size``) replaced through ``sizes``."""
    inputs = [Placeholder(ph.name, tuple(sizes[n] for n in ph.shape), ph.dtype)
              for ph in program.inputs]
    return Program(inputs, list(program.defs), {a: sizes[n] for a, n in program.extents.items()},
                   list(program.outputs), dict(program.meta))


def random_inputs(program: Program, seed: int, scale: float, int_high: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for ph in program.inputs:
        dt = getattr(torch, ph.dtype)
        if dt.is_floating_point:
            out[ph.name] = (torch.randn(ph.shape, generator=g, dtype=torch.float64) * scale).to(dt)
        elif dt is torch.bool:
            out[ph.name] = torch.rand(ph.shape, generator=g) < 0.5
        else:
            out[ph.name] = torch.randint(0, int_high, ph.shape, generator=g, dtype=dt)
    return out


def consistent_inputs(program: Program, sizes: dict, seed: int, scale: float,
                      int_high: int, tf32: bool = False) -> dict:
    """Random inputs; for a backward program (``meta['forward']``, ``meta['saved']``) the
    inputs that are saved forward values are computed by the forward program from the
    other inputs, as they are at run time.  ``tf32``: float32 inputs are drawn on TF32's
    grid (``tf32_rounded``)."""
    data = random_inputs(program, seed, scale, int_high)
    if tf32:
        data = {n: tf32_rounded(x) if program.dtype_of(n) == "float32" else x
                for n, x in data.items()}
    forward, saved = program.meta.get("forward"), program.meta.get("saved") or []
    if forward is None or not saved:
        return data
    small = shrink(forward, sizes)
    extra = random_inputs(small, seed + 1000, scale, int_high)
    values = evaluate(small, {ph.name: data.get(ph.name, extra[ph.name]) for ph in small.inputs})
    for name in saved:
        data[name] = values[name].to(data[name].dtype)
    return data


def tf32_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to TF32 (fp32 with a 10-bit mantissa; to nearest, ties away), in its
    own dtype.  A kernel built for TF32 rounds the fp32 operands of its contractions so:
    on inputs already on that grid only its computed operands round (P in P·V, at most
    2^-11 relative, never amplified), while rounding q and k at scale 40 moves a score by
    units and its softmax weight by e^units -- a property of the format the caller chose,
    not of the translation, so the kernel is checked on inputs TF32 holds exactly."""
    bits = x.float().view(torch.int32)
    rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded.to(x.dtype), x)


def _check_reads(program: Program, sizes: dict) -> None:
    """Evaluate ``program`` with its sizes mapped through ``sizes``: a read out of bounds
    raises (``ProgramError``, or torch's ``IndexError`` / ``RuntimeError``)."""
    small = shrink(program, sizes)
    validate_program(small)
    evaluate(small, consistent_inputs(small, sizes, 0, 1.0, 2))


def _runs_at(program: Program, sizes: dict) -> bool:
    """Whether ``program`` reads in bounds with its sizes mapped through ``sizes``."""
    try:
        _check_reads(program, sizes)
    except (ProgramError, IndexError, RuntimeError):
        return False
    return True


# The most loop iterations (a definition's axes and reductions) a check at the call's
# named sizes may take in the fp64 interpreter: a decode of 32 heads over 4096 keys at
# D=128 is 2^24; past this the check would take minutes and gigabytes.
MAX_REAL_WORK = 1 << 25


def _work(program: Program) -> int:
    """The largest loop nest of ``program``: the product of one definition's extents."""
    most = 1
    for d in program.defs:
        axes = set(d.axes) | {n.val for n in d.body.walk() if n.kind == "reduce"}
        most = max(most, math.prod(int(program.extents[a]) for a in axes))
    return most


def _one_size_as_called(program: Program, sizes: dict) -> dict | None:
    """``sizes`` with one int size kept as called -- the largest that lets ``program``
    read in bounds with the rest still shrunk (the ints above it moved just above it, so
    the map stays monotone) -- or None.
    A decode's ``doc[q + 8191]`` needs the key length as called, not its 64 heads and
    head dim of 128: checked with those at the call's sizes too, its cold build took
    230 s on an H200 (session 52)."""
    ints = sorted(n for n in sizes if isinstance(n, int))
    for keep in sorted((n for n in ints if sizes[n] != n), reverse=True):
        trial = {**sizes, keep: keep}
        # the ints above it follow just above it, in order (T5's 32-entry table kept, its
        # head dim of 64 checked at 33, not as called: in session 61 the check of T5's
        # backward at head dim 64 and ~500 keys did not fit in 24 GiB of host memory)
        above = [n for n in ints if n > keep]
        trial.update({n: keep + 2 * k + 1 for k, n in enumerate(above)})
        mapped = [trial[n] for n in ints]
        if any(a >= b for a, b in zip(mapped, mapped[1:])):
            continue  # the order of the sizes would change: not the same structure
        if _runs_at(program, trial):
            return trial
    return None


def _sizes_it_runs_at(program: Program, sizes: dict, values: dict) -> dict:
    """The checked sizes of a program whose reads stay in bounds only at sizes near the
    call's: one int kept, the rest small (``_one_size_as_called``); else its ints kept,
    named sizes still small; else every size as called (``values`` gives the named ones)
    -- for a program with named sizes only up to ``MAX_REAL_WORK``.  A program out of
    bounds as called raises its own error."""
    one = _one_size_as_called(program, sizes)
    if one is not None:
        return one
    kept = {n: n if isinstance(n, int) else v for n, v in sizes.items()}
    if kept != sizes and _runs_at(program, kept):
        return kept
    named = [n for n in sizes if isinstance(n, Size)]
    if any(n.name not in values for n in named):
        raise ProgramError(
            "Expected the program to read in bounds at small values of its named sizes; it "
            f"does not ({', '.join(n.name for n in named)}), and their values at the call "
            "are not known here: pass sizes= to ne.superoptimize.")
    real = {n: values[n.name] if isinstance(n, Size) else n for n in sizes}
    work = _work(shrink(program, real)) if named else 0
    if work > MAX_REAL_WORK:
        raise ProgramError(
            f"Expected the program to read in bounds at smaller sizes than the call's, to "
            f"check the kernel against the reference interpreter; an index is in bounds only "
            f"at the call's sizes (a captured tensor read at a constant shift, such as "
            f"doc[q_idx + 4095]), and a check there takes {work:.2e} loop iterations, past "
            f"{MAX_REAL_WORK:.2e}. Write the shift as data (doc[q_idx + offset[0]], offset a "
            f"captured tensor) or relative to the sizes, so that the check can shrink them.")
    _check_reads(program, real)  # out of bounds as called too: the program's own error
    return real


def validate_translation(input_program: Program, chosen: Program, blame: Callable[[], str],
                         run_kernel: Callable[[Program, dict, dict], dict] | None,
                         values: dict | None = None, fp32_dot: str = "ieee",
                         target: str = "interpreter") -> ValidationReport:
    """Compare ``chosen`` with ``input_program`` (and the kernel ``run_kernel(program,
    sizes, inputs)`` builds for the chosen program with its ints shrunk, at the checked
    values of its named sizes) on random inputs; raise ``TranslationValidationError``
    with ``blame()`` (the rules on the derivation path) on a mismatch.  ``values``: the
    named sizes at the call, for a program that reads in bounds only near them.
    ``fp32_dot``: the kernel's precision of fp32 contractions (``output_tolerance``);
    ``target``: where the kernel runs (the blocks its far loops need, ``FAR_MARGIN``)."""
    t0 = time.perf_counter()
    sizes = size_map(input_program)
    if not _runs_at(input_program, sizes):
        # An index that only stays in bounds at the real sizes (x[i + 5] of a size S + 5
        # tensor; a decode's doc[q + 4095] into 4096 ids): check at bigger ones instead.
        sizes = _sizes_it_runs_at(input_program, sizes, values or {})
    small_in, small_out = shrink(input_program, sizes), shrink(chosen, sizes)
    report = ValidationReport(sizes=sizes)
    kernel_error = None
    for seed, (label, scale, high) in enumerate(CASES):
        data = consistent_inputs(small_in, sizes, seed, scale, high, tf32=fp32_dot != "ieee")
        ref = evaluate(small_in, data)
        got = evaluate(small_out, data)
        for name in input_program.outputs:
            r, c = ref[name], got[name]
            bad = refinement_mismatch(r, c, rtol=1e-7)
            if bad is not None:
                raise TranslationValidationError(
                    f"The chosen program disagrees with the input program on {name} ({label} "
                    f"inputs, seed {seed}, sizes {sizes}): input gives "
                    f"{r.flatten()[bad].item():.6g}, chosen gives {c.flatten()[bad].item():.6g}. "
                    f"{blame()} Remove or fix the suspect rule (`neptune-eq rules check FILE`).")
            finite = torch.isfinite(r)
            if bool(finite.any()):
                denom = 1.0 + float(r[finite].abs().max())
                report.program_error = max(report.program_error,
                                           float((r[finite] - c[finite]).abs().max()) / denom)
        report.cases.append(label)
        if run_kernel is not None and label in KERNEL_CASES:
            kernel_prog, named = _kernel_sizes(chosen, sizes)
            kernel_error = max(kernel_error or 0.0, _check_kernel(
                kernel_prog, named, small_out, data, ref, run_kernel, label,
                seed, blame, fp32_dot))
    far = saturated_index.far_distance(input_program)
    if run_kernel is not None and far is not None:
        # its far key loops run only past D: once more there, on the normal inputs
        wide = _past(sizes, [input_program.extents[a] for a in far[1]],
                     far[0] + FAR_MARGIN.get(target, FAR_MARGIN["cuda"]))
        if wide != sizes and _runs_at(input_program, wide):
            wide_in = shrink(input_program, wide)
            data = consistent_inputs(wide_in, wide, 0, 1.0, 2, tf32=fp32_dot != "ieee")
            kernel_prog, named = _kernel_sizes(chosen, wide)
            kernel_error = max(kernel_error or 0.0, _check_kernel(
                kernel_prog, named, shrink(chosen, wide), data,
                evaluate(wide_in, data), run_kernel, f"normal, past the far distance {far[0]}",
                0, blame, fp32_dot))
            report.far_sizes = wide
    if kernel_error is not None:
        report.kernel = (f"the chosen candidate's kernel, run at the checked sizes on the "
                         f"{' and '.join(KERNEL_CASES)} inputs, agrees with the fp64 reference "
                         f"(max rel. err {kernel_error:.1e})")
    report.seconds = time.perf_counter() - t0
    return report


def _kernel_sizes(chosen: Program, sizes: dict) -> tuple[Program, dict]:
    """The program the kernel is generated for at checked ``sizes`` (its ints shrunk, its
    named sizes kept named, as in the real kernel) and those named sizes' values."""
    ints_only = {k: (k if isinstance(k, Size) else v) for k, v in sizes.items()}
    return shrink(chosen, ints_only), {k.name: v for k, v in sizes.items() if isinstance(k, Size)}


def _nudged(data: dict, seed: int) -> dict:
    """``data`` with each float tensor times (1 + 2^-24·N(0, 1)), seeded: what an fp32
    rounding of it might have been."""
    g = torch.Generator().manual_seed(seed)
    return {k: v * (1 + 2.0 ** -24 * torch.randn(v.shape, generator=g, dtype=v.dtype))
            if v.is_floating_point() else v for k, v in data.items()}


def range_edge(r: torch.Tensor, c: torch.Tensor, dtype: str, tol: float):
    """(elements at the edge of ``dtype``'s range, those of them the kernel got wrong).

    A value past the output dtype's range (an fp16 gradient of the large-magnitude inputs:
    -130166) has one right answer in that dtype, the infinity it rounds to.  A value
    within ``tol`` of the largest finite one (65504 in fp16) may round either way after
    an fp32 accumulation that is right to ``tol``: 65525.5 stored as 65504, -65518.8 as
    -inf are both right (each measured in a kernel on an H100)."""
    dt = getattr(torch, dtype)
    top = torch.finfo(dt).max if dt.is_floating_point else math.inf
    edge = r.abs() >= top * (1 - tol)
    same_inf = c == torch.sign(r) * math.inf
    close = torch.isfinite(c) & ((r - c).abs() <= tol * r.abs())
    right = same_inf | close
    return edge, edge & ~right


def _check_kernel(kernel_program: Program, named: dict, program: Program, data: dict, ref: dict,
                  run_kernel, label: str, seed: int, blame, fp32_dot: str) -> float:
    got = run_kernel(kernel_program, named, data)
    # A program that overflows fp32 as written (exp(x) with no max subtracted) may give
    # inf/NaN in a kernel that accumulates in fp32: only elements the fp32 evaluation of
    # the same program keeps finite are held to the fp64 reference.
    ref32 = evaluate(program, data, dtype=torch.float32)
    # One evaluation's error is one sample of the rounding noise, and an output that
    # cancels to ~0 (a table's per-query partial, Σ_j dS = 0 exactly) can land near 0 by
    # luck -- 0.35 off fp64 where the kernel, summing in another order, was 1.69 off and
    # right.  Before refusing, two more fp32 evaluations on the inputs nudged by an fp32
    # rounding (relative 2^-24, seeded) are made, once, and the slack is taken from the
    # worst of the three (a kernel within the first's slack is within theirs).
    samples = [ref32]
    worst = 0.0
    for name in program.outputs:
        r, c = ref[name], got[name].double().cpu()
        tol = output_tolerance(program, name, fp32_dot)
        held = torch.isfinite(ref32[name]) & torch.isfinite(r)
        edge, wrong = range_edge(r, c, program.dtype_of(name), tol)
        if bool((held & wrong).any()):
            k = int(torch.nonzero((held & wrong).flatten())[0])
            rounded = r.flatten()[k].to(getattr(torch, program.dtype_of(name))).item()
            raise TranslationValidationError(
                f"The generated kernel disagrees with the fp64 reference on {name} ({label} "
                f"inputs, seed {seed}): reference {r.flatten()[k].item():.6g} rounds to "
                f"{rounded:g} in {program.dtype_of(name)}, kernel "
                f"{c.flatten()[k].item():.6g}. This is a lowering or code-generation fault, "
                f"or: {blame()}")
        held &= ~edge
        if not bool(held.any()):
            continue
        r, c = torch.where(held, r, 0.0), torch.where(held, c, 0.0)
        denom = max(1.0, float(r.abs().max()))
        # The program as written, evaluated in fp32, may itself stray this far from fp64
        # (a softmax gradient at scores of ~1e4: 8.5e-4 of its largest value, a score_mod
        # doubling them): a kernel accumulating in fp32 in another order is allowed
        # FP32_SLACK times that where it is looser than the dtype's tolerance.
        def slack(evaluations) -> float:
            noise = 0.0
            for e in evaluations:
                e = e[name].double().cpu()
                noise = max(noise, float((torch.where(held & torch.isfinite(e), e, r)
                                          - r).abs().max()))
            return max(tol, FP32_SLACK * noise / denom)
        held_to = slack(samples)
        bad = ~torch.isfinite(c) | ((r - c).abs() > held_to * denom)
        if bool(bad.any()) and len(samples) == 1:
            samples += [evaluate(program, _nudged(data, seed), dtype=torch.float32)
                        for seed in (1, 2)]
            held_to = slack(samples)
            bad = ~torch.isfinite(c) | ((r - c).abs() > held_to * denom)
        if bool(bad.any()):
            k = int(torch.nonzero(bad.flatten())[0])
            raise TranslationValidationError(
                f"The generated kernel disagrees with the fp64 reference on {name} ({label} "
                f"inputs, seed {seed}): reference {r.flatten()[k].item():.6g}, kernel "
                f"{c.flatten()[k].item():.6g} (tolerance {held_to:g} x {denom:.3g}). This is a "
                f"lowering or code-generation fault, or: {blame()}")
        worst = max(worst, float((r - c).abs().max()) / denom)
    return worst

"""Reference interpreter: evaluates any program (plain or fused) on torch CPU.

It is the correctness oracle for every later stage.  Values are dense tensors whose
dimensions are named by index variables; operations broadcast by name.  Fused folds
(``rollsum``) are evaluated *as folds*, block by block, with producers' running values
(``run``/``prev``) recomputed over the processed prefix -- so a wrong correction factor
gives a wrong answer here, exactly as it would in a kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .ir import Program, ProgramError, Term, fmt, reads_data

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
                 "bool": torch.bool}


@dataclass
class Val:
    """A tensor with one named index variable per dimension."""
    t: torch.Tensor
    axes: tuple[str, ...]

    def expand_to(self, axes: tuple[str, ...]) -> torch.Tensor:
        src = self.t
        perm = [self.axes.index(a) for a in axes if a in self.axes]
        src = src.permute(*perm) if perm else src
        present = [a for a in axes if a in self.axes]
        shape, k = [], 0
        for a in axes:
            if a in self.axes:
                shape.append(src.shape[k])
                k += 1
            else:
                shape.append(1)
        return src.reshape(shape) if present or not axes else src.reshape([1] * len(axes))


def _align(*vals: Val) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    axes: list[str] = []
    for v in vals:
        for a in v.axes:
            if a not in axes:
                axes.append(a)
    tup = tuple(axes)
    return tup, [v.expand_to(tup) for v in vals]


_UNARY = {"neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
          "tanh": torch.tanh, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "abs": torch.abs,
          "not": torch.logical_not, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf}
_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
           "maximum": torch.maximum, "minimum": torch.minimum,
           "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
           "mod": torch.remainder, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
           "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
           "and": torch.logical_and, "or": torch.logical_or,
           "bitand": torch.bitwise_and, "bitor": torch.bitwise_or, "bitxor": torch.bitwise_xor}
FOLD_BLOCKS = 256  # blocks a fold is evaluated in, at most (``Interpreter._fold``)
_IDENTITY = {"sum": 0.0, "rollsum": 0.0, "splitk": 0.0, "max": -math.inf, "rollmax": -math.inf,
             "min": math.inf}


class Interpreter:
    """Evaluate ``program`` on ``inputs`` (name -> tensor).

    ``dtype`` is the float type all arithmetic runs in (float64 for an oracle);
    ``block`` is the block length folds are evaluated with, ``parts`` the number of
    split-k partials."""

    def __init__(self, program: Program, inputs: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float64, block: int = 4, parts: int = 3):
        self.p, self.dtype, self.block = program, dtype, max(1, int(block))
        self.parts = max(1, int(parts))
        self.inputs = {}
        for ph in program.inputs:
            if ph.name not in inputs:
                raise ProgramError(f"Missing input {ph.name!r}; expected tensors for "
                                   f"{[q.name for q in program.inputs]}.")
            t = torch.as_tensor(inputs[ph.name]).cpu()
            if tuple(t.shape) != ph.shape:
                raise ProgramError(f"Expected {ph.name} with shape {ph.shape}, got "
                                   f"{tuple(t.shape)}.")
            self.inputs[ph.name] = t.to(dtype) if t.is_floating_point() else t
        self.values: dict[str, Val] = {}
        self._prefix_cache: dict[tuple[str, int, int], Val] = {}
        self._prefixes_from: set[tuple[str, int]] = set()  # (name, start) cached at every end

    # -- public ------------------------------------------------------------------------
    def run(self) -> dict[str, torch.Tensor]:
        return {d.name: self._ref_value(d.name).contiguous() for d in self.p.defs}

    # -- definitions ---------------------------------------------------------------------
    def _full_value(self, name: str) -> Val:
        d = self.p.definition(name)
        return self.eval(d.body, {a: self._arange(a) for a in d.axes}, {})

    def _arange(self, axis: str, limit: int | None = None) -> Val:
        n = self.p.extents[axis] if limit is None else limit
        return Val(torch.arange(n), (axis,))

    def prefix_value(self, name: str, lo: int, hi: int) -> Val:
        """Value of producer ``name`` with its top-level reduction restricted to the
        positions ``[lo, hi)`` of its axis: its running value inside a fold (or a split-k
        partial) that started at ``lo`` and has processed up to ``hi``."""
        key = (name, lo, hi)
        if key not in self._prefix_cache:
            d = self.p.definition(name)
            if d.body.kind not in ("reduce", "fold"):
                raise ProgramError(f"run/prev of {name!r}: expected a definition whose body is "
                                   f"a reduction, got {d.body.op}.")
            env = {a: self._arange(a) for a in d.axes}
            if (name, lo) not in self._prefixes_from:
                # A fold reads its producers' running values at every block end from the
                # same start: each computed alone costs the prefix's length, so a fold over
                # S keys cost O(S^2 / block) -- minutes for a decode checked at S = 8192.
                # All of them in one pass from ``lo`` is O(S).
                self._prefixes_from.add((name, lo))
                self._all_prefixes(name, d.body, env, lo)
            if key not in self._prefix_cache:  # (an end off the block grid: a chunk's end)
                self._prefix_cache[key] = self.eval(d.body, env, {d.body.val: (lo, hi)})
        return self._prefix_cache[key]

    def _all_prefixes(self, name: str, body: Term, env: dict, lo: int) -> None:
        """Cache the running value of ``name`` (its top-level reduction ``body``) from
        ``lo`` at every end a fold reads: each position for a reduction (a cumulative
        sum / max / min of the body, evaluated once), each block end for a fold (the
        fold's own accumulator as it passes that end: the same blocks, the same
        arithmetic as a fold stopped there)."""
        ax, n = body.val, self.p.extents[body.val]
        if n <= lo:
            return
        if body.op in ("rollsum", "rollmax"):
            record: dict[int, Val] = {}
            self._fold(body, env, {ax: (lo, n)}, lo, n, record)
            for end, acc in record.items():
                self._prefix_cache[(name, lo, end)] = acc
            return
        if body.kind != "reduce":
            return
        part = self.eval(body.args[0], {**env, ax: Val(torch.arange(lo, n), (ax,))},
                         {ax: (lo, n)})
        if ax not in part.axes:  # constant along the axis: each prefix is cheap alone
            return
        dim = part.axes.index(ax)
        rest = part.axes[:dim] + part.axes[dim + 1:]
        t = part.t if part.t.is_floating_point() else part.t.to(self.dtype)
        cum = {"sum": lambda: torch.cumsum(t, dim), "max": lambda: torch.cummax(t, dim).values,
               "min": lambda: torch.cummin(t, dim).values}[body.op]()
        for k in range(n - lo):
            self._prefix_cache[(name, lo, lo + k + 1)] = Val(cum.select(dim, k), rest)

    # -- terms ---------------------------------------------------------------------------
    def eval(self, t: Term, env: dict[str, Val], limits: dict[str, tuple[int, int]],
             step: tuple[tuple[int, int], tuple[int, int]] | None = None) -> Val:
        """``limits`` restricts reduction axes to a range (running values); ``step`` holds
        the ranges that ``prev`` and ``run`` reads see in the enclosing fold."""
        op = t.op
        if op == "var":
            if t.val not in env:
                raise ProgramError(f"Unbound index variable {t.val!r}.")
            return env[t.val]
        if op == "int":
            return Val(torch.tensor(t.val), ())
        if op == "flt":
            return Val(torch.tensor(t.val, dtype=self.dtype), ())
        if op in ("load", "ref"):
            src = self.inputs[t.val] if op == "load" else self._ref_value(t.val)
            return self._gather(src, t.args, env, limits, step)
        if op in ("run", "prev"):
            if step is None:
                raise ProgramError(f"{op}:{t.val} used outside a fold.")
            lo, hi = step[1] if op == "run" else step[0]
            pv = self._dense(t.val, self.prefix_value(t.val, lo, hi))
            return self._gather(pv, t.args, env, limits, step)
        if op in _UNARY:
            v = self.eval(t.args[0], env, limits, step)
            return Val(_UNARY[op](v.t), v.axes)
        if op == "cast":
            v = self.eval(t.args[0], env, limits, step)
            want = _TORCH_DTYPES[t.val]
            return Val(v.t.to(self.dtype if want.is_floating_point else want), v.axes)
        if op in _BINARY:
            axes, (a, b) = _align(self.eval(t.args[0], env, limits, step),
                                  self.eval(t.args[1], env, limits, step))
            return Val(_BINARY[op](a, b), axes)
        if op == "where":
            axes, (c, a, b) = _align(*(self.eval(x, env, limits, step) for x in t.args))
            return Val(torch.where(c.bool(), a, b), axes)
        if t.kind == "reduce":
            return self._reduce(t, env, limits, step)
        if op in ("rollsum", "rollmax"):
            lo, hi = limits.get(t.val, (0, self.p.extents[t.val]))
            return self._fold(t, env, limits, lo, hi)
        if op == "splitk":
            return self._split(t, env, limits)
        raise ProgramError(f"The interpreter cannot evaluate op {op!r}.")

    def _ref_value(self, name: str) -> torch.Tensor:
        """The full value of a definition (computed once)."""
        if name not in self.values:
            self.values[name] = self._full_value(name)
        return self._dense(name, self.values[name])

    def _dense(self, name: str, v: Val) -> torch.Tensor:
        """A value of definition ``name`` as a tensor over its axes, in their order."""
        d = self.p.definition(name)
        return v.expand_to(d.axes).expand(*[self.p.extents[a] for a in d.axes])

    def _gather(self, src: torch.Tensor, idx: tuple[Term, ...], env, limits, step) -> Val:
        ivals = [self.eval(i, env, limits, step) for i in idx]
        axes, its = _align(*ivals) if ivals else ((), [])
        its = [i.long() for i in its]
        for k, (term, i) in enumerate(zip(idx, its)):
            n = src.shape[k]
            # an index read from data: torch's rule, -n <= i < n, a negative one counting
            # from the end (lowering/data_indices.py); an affine index must lie in [0, n)
            if reads_data(term):
                if i.numel() and (int(i.min()) < -n or int(i.max()) >= n):
                    raise ProgramError(
                        f"Expected the index {k} of a read of shape {tuple(src.shape)}, "
                        f"computed from data ({fmt(term)}), in [{-n}, {n}) (torch's rule: "
                        f"negative indices count from the end), got values from "
                        f"{int(i.min())} to {int(i.max())}; check the tensor it reads for "
                        "ids past the table.")
                its[k] = i = torch.where(i < 0, i + n, i)
            if i.numel() and (int(i.min()) < 0 or int(i.max()) >= n):
                raise ProgramError(f"Index {k} of a read of shape {tuple(src.shape)} goes out of "
                                   f"range [{int(i.min())}, {int(i.max())}]; clamp it or mask "
                                   "the read with ne.where.")
        out = src[tuple(its)] if its else src
        return Val(out, axes)

    def _reduce(self, t: Term, env, limits, step) -> Val:
        ax = t.val
        lo, hi = limits.get(ax, (0, self.p.extents[ax]))
        n = hi - lo
        rng = Val(torch.arange(lo, max(hi, lo + 1)), (ax,))
        if n <= 0:
            body_axes = self.eval(t.args[0], {**env, ax: rng}, limits, step).axes
            rest = tuple(a for a in body_axes if a != ax)
            shape = [env[a].t.numel() if a in env else self.p.extents[a] for a in rest]
            return Val(torch.full(shape, _IDENTITY[t.op], dtype=self.dtype), rest)
        body = self.eval(t.args[0], {**env, ax: rng}, limits, step)
        if ax not in body.axes:  # constant along the axis
            return Val(body.t * n, body.axes) if t.op == "sum" else body
        dim = body.axes.index(ax)
        rest = body.axes[:dim] + body.axes[dim + 1:]
        f = {"sum": lambda x: x.sum(dim), "max": lambda x: x.amax(dim),
             "min": lambda x: x.amin(dim)}[t.op]
        return Val(f(body.t.to(self.dtype) if not body.t.is_floating_point() else body.t), rest)

    def _fold(self, t: Term, env, limits, lo: int, hi: int, record: dict | None = None) -> Val:
        """rollsum: ``t <- t*corr + sum_blk body``; rollmax: ``t <- max(t + corr, max_blk body)``;
        run/prev see the producers' values over ``[lo, end)`` / ``[lo, previous end)``.
        ``record``: end -> the accumulator after the block ending there."""
        ax = t.val
        body, corr = t.args
        acc: Val | None = None
        prev_end = lo
        # at most FOLD_BLOCKS blocks over the axis: a check that cannot shrink its sizes
        # (a decode's doc[q + 8191]) otherwise evaluates 2048 blocks per fold
        size = max(self.block, -(-int(self.p.extents[ax]) // FOLD_BLOCKS))
        while prev_end < hi:
            end = min(hi, prev_end + size)
            blk = Val(torch.arange(prev_end, end), (ax,))
            step = ((lo, prev_end), (lo, end))
            part = self.eval(body, {**env, ax: blk}, limits, step)
            if ax in part.axes:
                dim = part.axes.index(ax)
                red = part.t.sum(dim) if t.op == "rollsum" else part.t.amax(dim)
                part = Val(red, part.axes[:dim] + part.axes[dim + 1:])
            elif t.op == "rollsum":
                part = Val(part.t * (end - prev_end), part.axes)
            if acc is None:
                acc = part
            else:
                c = self.eval(corr, env, limits, step)
                axes, (a, cc, p_) = _align(acc, c, part)
                acc = Val(a * cc + p_ if t.op == "rollsum" else torch.maximum(a + cc, p_), axes)
            if record is not None:
                record[end] = acc
            prev_end = end
        if acc is None:
            return Val(torch.tensor(_IDENTITY[t.op], dtype=self.dtype), ())
        return acc

    def _split(self, t: Term, env, limits) -> Val:
        """Split-k: partial folds over ``parts`` chunks, each with its own running
        producers, combined as ``sum_p t_p * corr[prev := R over chunk p, run := R]``."""
        ax = t.val
        lo, hi = limits.get(ax, (0, self.p.extents[ax]))
        size = max(1, -(-(hi - lo) // self.parts))
        fold = Term("rollsum", t.args, ax)
        total: Val | None = None
        for a in range(lo, hi, size):
            b = min(hi, a + size)
            part = self._fold(fold, env, {**limits, ax: (a, b)}, a, b)
            c = self.eval(t.args[1], env, limits, ((a, b), (lo, hi)))
            axes, (pp, cc) = _align(part, c)
            term = Val(pp * cc, axes)
            if total is None:
                total = term
            else:
                axes, (x, y) = _align(total, term)
                total = Val(x + y, axes)
        return total if total is not None else Val(torch.tensor(0.0, dtype=self.dtype), ())


def evaluate(program: Program, inputs: dict[str, torch.Tensor], dtype=torch.float64,
             block: int = 4, parts: int = 3) -> dict[str, torch.Tensor]:
    """Evaluate every definition; returns name -> tensor in each definition's axis order."""
    return Interpreter(program, inputs, dtype, block, parts).run()

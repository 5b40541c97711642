"""Differentiable kernels: the forward and the derived backward, both superoptimized.

``ne.differentiable(out, wrt=[...])`` returns a callable whose result carries gradients:
the forward kernel also emits what the backward reads (row statistics such as the max and
the denominator), and the backward runs one superoptimized kernel per input gradient.
Each backward kernel comes from ``frontend.autodiff.backward_program`` -- a plain program
the rules fuse like any other -- so ``fn.backward_kernels[name].explain()`` shows how it
was derived.

One kernel per gradient is the grouping by row structure: dQ's rows are queries (a loop
over key blocks), dK's and dV's rows are keys (a loop over query blocks).  None of these
kernels uses atomics: every gradient element is written by the one program that owns its
row, so the backward is deterministic (``deterministic=True`` is what exists).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..api import Kernel, superoptimize
from ..frontend import dsl
from ..frontend.autodiff import Backward, backward_program, default_saved
from ..ir import Program, ProgramError


@dataclass
class DifferentiableKernel:
    """Call it like the forward ``Kernel`` (positional in the program's input order, or by
    name); the outputs support ``.backward()``."""
    program: Program
    wrt: tuple[str, ...]
    forward_kernel: Kernel
    backward_kernels: dict[str, Kernel]
    backwards: dict[str, Backward]
    saved: tuple[str, ...]
    _input_names: list[str] = field(default_factory=list)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # a graph break: run eagerly, as Kernel does
            return torch.compiler.disable(self.__call__)(*args, **kwargs)
        names = self._input_names
        if len(args) > len(names):
            raise TypeError(f"Expected at most {len(names)} inputs {names}, got {len(args)}.")
        bound = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names or k in bound:
                raise TypeError(f"Unexpected or repeated input {k!r}; the inputs are {names}.")
            bound[k] = v
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"Missing inputs {missing}; the inputs are {names}.")
        outs = _KernelFunction.apply(self, *[bound[n] for n in names])
        return outs[0] if len(self.program.outputs) == 1 else outs

    def explain(self) -> str:
        parts = ["forward:", self.forward_kernel.explain()]
        for name, kern in self.backward_kernels.items():
            parts += ["", f"backward (d_{name}):", kern.explain()]
        return "\n".join(parts)


def differentiable(outputs, wrt, *, constant=(), saved=None, target: str = "auto",
                   deterministic: bool = True, **superoptimize_kwargs) -> DifferentiableKernel:
    """Superoptimize ``outputs`` and its backward with respect to the inputs ``wrt``.

    ``constant`` names definitions the outputs do not depend on (a softmax's stabilising
    max): their gradient is dropped.  ``saved`` overrides which forward definitions the
    forward kernel keeps for the backward (default: outputs and row statistics).  The other
    keyword arguments go to ``ne.superoptimize`` for every kernel."""
    if not deterministic:
        raise ProgramError("Expected deterministic=True: the derived backward kernels use no "
                           "atomics (one program owns each gradient row), so only the "
                           "deterministic form exists.")
    program = outputs if isinstance(outputs, Program) else dsl.build_program(outputs)
    wrt = (wrt,) if isinstance(wrt, str) else tuple(wrt)
    saved = default_saved(program) if saved is None else tuple(saved)
    backwards = {w: backward_program(program, [w], saved=saved, constant=constant) for w in wrt}
    kept = [n for n in saved if any(n in b.saved for b in backwards.values())]
    extra = [n for n in kept if n not in program.outputs]
    fwd_program = Program(list(program.inputs), list(program.defs), dict(program.extents),
                          list(program.outputs) + extra, dict(program.meta))
    fwd = superoptimize(fwd_program, target=target, **superoptimize_kwargs)
    bwd = {w: superoptimize(b.program, target=target, **superoptimize_kwargs)
           for w, b in backwards.items()}
    return DifferentiableKernel(program, wrt, fwd, bwd, backwards, tuple(kept),
                                [ph.name for ph in program.inputs])


class _KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dk: DifferentiableKernel, *inputs):
        res = dk.forward_kernel(*inputs)
        res = res if isinstance(res, tuple) else (res,)
        values = dict(zip(dk.forward_kernel.program.outputs, res))
        ctx.dk = dk
        ctx.names = dk._input_names
        ctx.save_for_backward(*inputs, *[values[n] for n in dk.saved])
        return tuple(values[n] for n in dk.program.outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        dk: DifferentiableKernel = ctx.dk
        tensors = ctx.saved_tensors
        n_in = len(ctx.names)
        env = dict(zip(ctx.names, tensors[:n_in]))
        env.update(zip(dk.saved, tensors[n_in:]))
        for name, g in zip(dk.program.outputs, grad_outputs):
            dtype = getattr(torch, dk.program.dtype_of(name))
            env["d_" + name] = (torch.zeros(dk.program.shape_of(name), dtype=dtype,
                                            device=tensors[0].device)
                                if g is None else g.to(dtype).contiguous())
        grads = {}
        for w, kern in dk.backward_kernels.items():
            prog = dk.backwards[w].program
            grads[w] = kern(**{ph.name: env[ph.name] for ph in prog.inputs})
        return (None, *[grads.get(n) if ctx.needs_input_grad[1 + k] else None
                        for k, n in enumerate(ctx.names)])

"""Launching compiled Triton kernels with little host overhead.

``kernel[grid](...)`` re-binds and re-specialises all ~30 arguments on every call
(tens of µs in Python), which is longer than a short decode kernel runs on the GPU.
``FastLaunch`` keeps the ``CompiledKernel`` that Triton chose for a call and launches it
directly while every fact Triton specialises on stays the same (``launch_key``: each
pointer's 16-byte alignment and the exact value of every integer argument, at least as
fine as Triton's own specialisation on alignment, ``== 1``, ``% 16`` and i32/i64), so a
hit always reuses the kernel Triton itself would have picked.

The direct call relies on Triton internals (``CompiledKernel.run``'s argument order),
so the first call under every key is *checked*: the fast launch must reproduce the
normal launch bit for bit (``Launcher.__call__`` compares the outputs), else the fast
path is switched off for good and ``reason`` says why.
"""
from __future__ import annotations


def _hook_source():
    """Where Triton keeps its launch hooks (profilers set them at any time, so they are
    read on every launch -- from an object found once, not by an import per call)."""
    try:
        from triton import knobs
        return knobs.runtime, "launch_enter_hook", "launch_exit_hook"
    except (ImportError, AttributeError):  # pragma: no cover - older Triton
        from triton.compiler import CompiledKernel
        return CompiledKernel, "launch_enter_hook", "launch_exit_hook"


def current_stream(device: int):
    from triton.runtime import driver
    return driver.active.get_current_stream(device)


def launch_key(tensors: list, ints: list) -> tuple:
    """What Triton specialises a launch on, or finer: the device, each pointer's 16-byte
    alignment and every integer argument's value (scratch buffers are ours and always
    aligned; chunk sizes are fixed per launcher)."""
    import torch
    return (torch.cuda.current_device(), tuple(t.data_ptr() & 15 == 0 for t in tensors),
            tuple(ints))


def _triton_int_specialisation():
    """Triton's own specialisation of an integer argument (``== 1`` becomes a constexpr,
    ``% 16`` a divisibility hint, the range i32/i64), or None on a Triton without it."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # pragma: no cover - Triton before 3.5
        return None
    native_specialize_impl(BaseBackend, 37, False, True, True)  # fails here, not per launch
    return lambda v: native_specialize_impl(BaseBackend, v, False, True, True)


def class_launch_key(tensors: list, ints: list, spec) -> tuple:
    """``launch_key`` for kernels that take sizes at run time: integers by the class
    Triton specialises them into (``spec``), not by value, so one checked launch serves
    every size of that class -- a KV cache growing by one key per step does not re-check."""
    import torch
    return (torch.cuda.current_device(), tuple(t.data_ptr() & 15 == 0 for t in tensors),
            tuple(spec(i) for i in ints))


class FastLaunch:
    """One JIT function, one grid and fixed constexprs; launches by key."""

    def __init__(self, fn, grid: tuple, consts: dict, options: dict):
        self.fn, self.grid, self.consts, self.options = fn, tuple(grid) + (1,) * (3 - len(grid)), \
            consts, options
        names = list(getattr(fn, "arg_names", None) or consts)  # interpreter: unused
        self.const_values = [consts[n] for n in names[len(names) - len(consts):]]
        self._hooks = _hook_source()

    def slow(self, args: list):
        """Triton's own launch; returns the compiled kernel it picked."""
        return self.fn[self.grid](*args, **self.consts, **self.options)

    def fast(self, ck, args: list, stream) -> None:
        src, enter_name, exit_name = self._hooks
        enter, exit_ = getattr(src, enter_name), getattr(src, exit_name)
        meta = ck.launch_metadata(self.grid, stream, *args, *self.const_values)
        ck.run(*self.grid, stream, ck.function, ck.packed_metadata, meta, enter, exit_,
               *args, *self.const_values)

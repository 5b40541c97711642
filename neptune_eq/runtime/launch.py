"""Launching compiled Triton kernels with little host overhead.

``kernel[grid](...)`` re-binds and re-specialises all ~30 arguments on every call
(tens of µs in Python), which is longer than a short decode kernel runs on the GPU.
``FastLaunch`` keeps the ``CompiledKernel`` that Triton chose for a call and launches it
directly while every fact Triton specialises on stays the same (``launch_key``: each
pointer's 16-byte alignment and the exact value of every integer argument, at least as
fine as Triton's own specialisation on alignment, ``== 1``, ``% 16`` and i32/i64), so a
hit always reuses the kernel Triton itself would have picked.

The direct call relies on Triton internals (``CompiledKernel.run``'s argument order, and
on Triton 3.6 the compiled launcher's under it, ``raw_launcher``),
so the first call under every key is *checked*: the fast launch must reproduce the
normal launch bit for bit (``Launcher.__call__`` compares the outputs), else the fast
path is switched off for good and ``reason`` says why.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache


def _hook_source():
    """Where Triton keeps its launch hooks (profilers set them at any time, so they are
    read on every launch -- from an object found once, not by an import per call)."""
    try:
        from triton import knobs
        return knobs.runtime, "launch_enter_hook", "launch_exit_hook"
    except (ImportError, AttributeError):  # pragma: no cover - older Triton
        from triton.compiler import CompiledKernel
        return CompiledKernel, "launch_enter_hook", "launch_exit_hook"


def _set(hook):
    """``hook`` if it would call anything: Triton 3.6 on keeps its launch hooks in an
    always-present ``HookChain`` (a list of calls, empty unless a profiler added one);
    before, a hook was a callable or None."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


def launch_hooks(hooks: tuple) -> tuple:
    """(enter, exit) hooks to hand a launch, from ``_hook_source()``'s triple: both None
    when neither would call anything, so the launch makes no metadata for them and the
    launcher calls nothing (as with no hook set; a profiler started later adds its hook
    to the chain, read here on every launch)."""
    src, enter_name, exit_name = hooks
    enter, exit_ = getattr(src, enter_name), getattr(src, exit_name)
    if _set(enter) is None and _set(exit_) is None:
        return None, None
    return enter, exit_


def dependent_launch(target: str) -> bool:
    """Whether a kernel that reads what the kernel before it wrote (the pre-pass's
    summaries) may be launched dependent on it (programmatic dependent launch,
    ``lowering/dependent_launch.py``): on a GPU of compute capability 9.0 or newer, unless
    ``NEPTUNE_EQ_PDL=0``; never in the interpreter."""
    return (target == "cuda" and os.environ.get("NEPTUNE_EQ_PDL", "1") != "0"
            and _hopper_or_newer())


@lru_cache(maxsize=1)
def _hopper_or_newer() -> bool:
    """A GPU of compute capability 9.0 or newer, and a Triton with both halves of PDL: the
    ``launch_pdl`` launch option and ``tl.extra.cuda.gdc_wait`` (3.6 has them; a later
    release that moved either turns the dependent launch off, not the kernel)."""
    import dataclasses

    import torch
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    return (hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
            and any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions)))


def first_launch_dependent(ks, dependent: bool) -> bool:
    """Whether the first of a call's launches of ``ks`` may be launched dependent on the
    kernel before it in the stream: where the GPU can (``dependent``, ``dependent_launch``),
    where that kernel waits for it first thing (``KernelSource.waits_first``,
    ``lowering.dependent_launch.wait_then_release``), and unless ``NEPTUNE_EQ_PDL_FIRST=0``."""
    return (dependent and getattr(ks, "waits_first", False)
            and os.environ.get("NEPTUNE_EQ_PDL_FIRST", "1") != "0")


def dependent_options(options: dict, on: bool) -> dict:
    """``options`` with ``launch_pdl`` where the launch is dependent (``on``): only for a
    kernel that waits before its first read of what the kernel before wrote."""
    return {**options, "launch_pdl": True} if on else options


def current_stream(device: int):
    from triton.runtime import driver
    return driver.active.get_current_stream(device)


class HostQueries:
    """The three facts a replayed call asks the host for on every call -- the current
    device, its current stream (as Triton's launcher takes it) and whether a CUDA graph
    capture is running -- as the functions under the public wrappers, found once.
    ``torch.cuda.current_device()`` and ``is_current_stream_capturing()`` each add a
    Python frame and a lazy-init check, and Triton's ``driver.active`` a property, to a
    C call: the three public calls took 4.9 of a GQA decode call's 50 us on one H200
    host, 1.9 of 25 on another (session 51, ``bench/probe/host_sections.py``).  A replay
    exists only after a GPU call, so CUDA is initialised when these run.  Where a torch
    or Triton lacks one, the public call."""

    def __init__(self):
        import torch
        from triton.runtime import driver
        self.device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        self.capturing = (getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
                          or torch.cuda.is_current_stream_capturing)
        self.stream = getattr(driver.active, "get_current_stream", None) or current_stream
        self._hooks = _hook_source()

    def hooks_set(self) -> bool:
        """Whether a profiler has set a launch hook (read per call: it may at any time)."""
        return launch_hooks(self._hooks) != (None, None)


@lru_cache(maxsize=1)
def host_queries() -> HostQueries:
    """The process's ``HostQueries``, made at the first replay that asks: not once per
    replay, as a growing KV cache makes a new signature, and so a new replay, per step."""
    return HostQueries()


def written_outputs(specs: list, device) -> list:
    """Tensors of ``specs`` ((shape, torch dtype) pairs) for a launch that writes every
    element of them (a kernel's outputs, and split-k's fold states and the pre-pass's summaries, which
their kernels write before they read; those a kernel adds into are zeroed by the caller).

    Under ``torch.use_deterministic_algorithms(True)`` torch fills every new tensor with
    NaN (``torch.utils.deterministic.fill_uninitialized_memory``), so that a read of
    uninitialised memory is reproducible.  Nothing reads these before the kernel writes
    them, so there the fill is only time: a launch of its own per output, 4 launches and
    83 us of a window(256) fwd+bwd's 831 us at S=8192 (H200, session 30,
    ``bench/backward_gpu.py --host-profile``).  Then the storage is taken as it comes."""
    import torch
    if not (torch.are_deterministic_algorithms_enabled()
            and torch.utils.deterministic.fill_uninitialized_memory):
        return [torch.empty(shape, dtype=dt, device=device) for shape, dt in specs]
    outs = []
    for shape, dt in specs:
        store = torch.UntypedStorage(math.prod(shape) * dt.itemsize, device=device)
        outs.append(torch.empty(0, dtype=dt, device=device).set_(store, 0, tuple(shape)))
    return outs


class OutputMaker:
    """Fresh outputs of fixed ``specs`` ((shape, torch dtype) pairs) per call, for a replay
    (``BoundCall``, ``GluonBoundCall``): ``torch.empty_like`` of a one-element prototype
    expanded to each shape (not dense, so the copy is contiguous) skips the parsing of
    shape, dtype and device that ``torch.empty`` does per call -- a decode call's output
    7.1 -> 4.9 us on the H200's host against ``written_outputs`` (session 50,
    ``bench/probe/host_split.py``).  Under deterministic algorithms it defers to
    ``written_outputs`` (no NaN fill of what the kernel writes anyway)."""

    def __init__(self, specs: list, device):
        import torch
        self.specs, self.device = list(specs), device
        ones = written_outputs([((1,) * len(shape), dt) for shape, dt in self.specs], device)
        self._protos = [one.expand(shape) for one, (shape, _) in zip(ones, self.specs)]
        self._contiguous = torch.contiguous_format

    def __call__(self) -> list:
        import torch
        if torch.are_deterministic_algorithms_enabled() \
                and torch.utils.deterministic.fill_uninitialized_memory:
            return written_outputs(self.specs, self.device)
        return [torch.empty_like(p, memory_format=self._contiguous) for p in self._protos]


def launch_key(tensors: list, ints: list) -> tuple:
    """What Triton specialises a launch on, or finer: the device, each pointer's 16-byte
    alignment and every integer argument's value (scratch buffers are ours and always
    aligned; chunk sizes are fixed per launcher)."""
    import torch
    return (torch.cuda.current_device(), tuple([t.data_ptr() & 15 == 0 for t in tensors]),
            tuple(ints))


_I32 = 2 ** 31


def int_classes(ints: list) -> tuple:
    """Each integer's class under Triton's specialisation, computed here in Python: 1
    (``== 1``, a constexpr), then by range (i32 / i64 / u64) and ``% 16``.  The classes
    are at least as fine as Triton's (``native_specialize_impl``; tests/test_kernels.py
    checks it), at a third of the host time of calling it once per integer."""
    return tuple([(1 if v == 1 else 2 if not v & 15 else 3) if -_I32 <= v < _I32
                  else 4 + 2 * (v >= 2 ** 63) + (not v & 15) for v in ints])


def _triton_int_specialisation():
    """``int_classes`` when this Triton specialises integers the way it mirrors (``== 1``
    a constexpr, ``% 16`` a divisibility hint, the range i32/i64: Triton 3.5 on), else
    None."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # pragma: no cover - Triton before 3.5
        return None
    native_specialize_impl(BaseBackend, 37, False, True, True)  # fails here, not per launch
    return int_classes


def class_launch_key(tensors: list, ints: list, spec) -> tuple:
    """``launch_key`` for kernels that take sizes at run time: integers by the class
    Triton specialises them into (``spec``, over the whole list), not by value, so one
    checked launch serves every size of that class -- a KV cache growing by one key per
    step does not re-check."""
    import torch
    return (torch.cuda.current_device(), tuple([t.data_ptr() & 15 == 0 for t in tensors]),
            spec(ints))


def positional(fn) -> int:
    """How many positional parameters ``fn`` names (-1 if it is not Python code)."""
    code = getattr(fn, "__code__", None)
    return code.co_argcount if code is not None else -1


def launcher_36(ck):
    """``ck.run`` if it is Triton 3.6's ``CudaLauncher`` as the direct launches below rely
    on it: its call layout (grid, stream and function, then the rest: ``positional`` 6
    with ``self``; later Triton takes the metadata and hooks first), no global or profile
    scratch to allocate, and its cooperative-grid and PDL flags; else None."""
    run = getattr(ck, "run", None)
    if run is None or positional(type(run).__call__) != 6 \
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1) \
            or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl"):
        return None
    return run


def raw_launcher(ck):
    """The compiled launcher under ``ck.run``, where calling it directly is what 3.6's
    ``CudaLauncher.__call__`` would do (``launcher_36``) and it is not Python (no
    descriptor wrapper to run: ``tma_launch`` takes those).  Else None, and ``ck.run`` is
    called as before.  It saves the call's frame, its two scratch closures and an
    argument copy: per warm call of GQA decode at S=512 (two launches) 31.2 -> 29.0 us of
    host time, of alibi decode at 2048 36.3 -> 33.0 (H200 host, alternated in one
    process, session 31, ``bench/diagnose.py launchab``)."""
    raw = getattr(launcher_36(ck), "launch", None)
    if raw is None or hasattr(raw, "__code__") or not callable(raw):
        return None
    return raw


def raw_head(ck, grid: tuple, stream, meta=None, enter=None, exit_=None) -> tuple:
    """What a raw launcher of ``ck`` takes before the kernel's arguments, as 3.6's
    ``CudaLauncher.__call__`` passes it: grid, stream, function, its cooperative-grid and
    PDL flags, no global or profile scratch (``launcher_36`` checked there is none), the
    metadata and hooks.  The one place that layout is written (``call_raw`` and
    ``FastLaunch.prepared`` use it)."""
    run = ck.run
    return (*grid, stream, ck.function, run.launch_cooperative_grid, run.launch_pdl, None,
            None, ck.packed_metadata, meta, enter, exit_)


def call_raw(raw, ck, grid: tuple, stream, args: list, meta=None, enter=None, exit_=None):
    """Call a raw launcher of ``ck`` with ``args`` after ``raw_head``."""
    raw(*raw_head(ck, grid, stream, meta, enter, exit_), *args)


RAW = os.environ.get("NEPTUNE_EQ_RAW_LAUNCH", "1") != "0"


class FastLaunch:
    """One JIT function, one grid and fixed constexprs; launches by key."""

    def __init__(self, fn, grid: tuple, consts: dict, options: dict):
        self.fn, self.grid, self.consts, self.options = fn, tuple(grid) + (1,) * (3 - len(grid)), \
            consts, options
        names = list(getattr(fn, "arg_names", None) or consts)  # interpreter: unused
        self.const_values = [consts[n] for n in names[len(names) - len(consts):]]
        self._hooks = _hook_source()
        self._raw: dict = {}  # id(compiled kernel) -> (it, raw_launcher(it) or None)

    def slow(self, args: list):
        """Triton's own launch; returns the compiled kernel it picked."""
        return self.fn[self.grid](*args, **self.consts, **self.options)

    def _raw_of(self, ck):
        raw = self._raw.get(id(ck))
        if raw is None:
            raw = self._raw[id(ck)] = (ck, raw_launcher(ck) if RAW else None)
        return raw[1]

    def prepared(self, ck, stream, tail: list):
        """(raw launcher, what goes before the call's own arguments, what after) to launch
        ``ck`` on ``stream`` with no hook set as ``fast`` would, the arguments being the
        call's own then ``tail`` (those fixed per replay: strides, sizes); None where
        there is no raw launcher.  A replay keeps it per stream: a launch is then one
        call with its arguments spliced in, not ``fast``'s lookups and copies (with
        ``HostQueries``: a GQA decode call's host time 25.2 -> 20.0 us on an H200's host,
        session 51, ``bench/probe/host_sections.py``)."""
        raw = self._raw_of(ck)
        if raw is None:
            return None
        return (raw, raw_head(ck, self.grid, stream),
                (*tail, *self.const_values))

    def fast(self, ck, args: list, stream) -> None:
        enter, exit_ = launch_hooks(self._hooks)
        # the launch's metadata is read by a hook only (a profiler's): none set, none made
        # (the kernel's handles were set up by the checked launch this one repeats)
        meta = (ck.launch_metadata(self.grid, stream, *args, *self.const_values)
                if enter is not None or exit_ is not None else None)
        raw = self._raw_of(ck)
        if raw is not None:
            call_raw(raw, ck, self.grid, stream, [*args, *self.const_values], meta, enter,
                     exit_)
            return
        ck.run(*self.grid, stream, ck.function, ck.packed_metadata, meta, enter, exit_,
               *args, *self.const_values)

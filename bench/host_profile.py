"""Host side of a GPU call: time per call in a loop without sync, and its cProfile; and
the device side: each kernel's GPU time per call, from the profiler.

Launches are asynchronous, so a warm loop that never synchronises runs at the host's
pace while the GPU keeps up: that time is the host's.  Shared by ``diagnose.py``,
``backward_gpu.py --host-profile`` and ``doc_mask_gpu.py``.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time


def launch_settings(hooks_as_none: bool = True, raw: bool = True, encoded: bool = True):
    """Set the launch path's switches for an in-process A/B and forget what each launcher
    decided under the last setting: empty launch-hook chains passed as None
    (``runtime.launch.launch_hooks``; off: every chain counts as a hook, Triton's own
    behaviour), the compiled launcher called directly (``launch.raw_launcher``) and Gluon
    descriptors encoded once per address (``runtime.tma_launch``).  Returns a function
    that puts the defaults back."""
    import gc
    from neptune_eq.runtime import bound_call, gluon_launch, launch, tma_launch
    real_set = launch.__dict__.setdefault("_real_set", launch._set)
    launch._set = real_set if hooks_as_none else (lambda hook: hook)
    launch.RAW, tma_launch.ENABLED = raw, encoded
    for o in gc.get_objects():  # (``type``: the heap holds weak proxies of dead objects)
        if type(o) is launch.FastLaunch:
            o._raw.clear()
        elif type(o) is gluon_launch.GluonLauncher:
            o._encoded.clear()
        elif type(o) is bound_call.BoundCall:  # (its launches' prepared raw calls)
            o._plans.clear()
    return lambda: launch_settings()


class NoKeep(dict):
    """A stand-in for a replay's kept buffers (``BoundCall._scratch``, ``._summaries``)
    that keeps nothing: every call allocates, the A/B's other side."""
    def __setitem__(self, key, value):
        pass


def loop_us(fn, calls: int = 200, warmup: int = 10) -> float:
    """Host microseconds per ``fn()`` in a warm loop that never synchronises: the host's
    pace (the GPU keeps up when it is faster)."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host_us


def host_profile(fn, calls: int, top: int, warmup: int = 20) -> tuple[float, str]:
    """(host microseconds per ``fn()`` call, the cProfile table of ``calls`` more calls,
    sorted by own time, ``top`` rows)."""
    import torch
    host_us = loop_us(fn, calls, warmup)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return host_us, buf.getvalue()


def kernel_times(fn, calls: int = 20, warmup: int = 3) -> list[tuple[str, float, int]]:
    """(kernel name, GPU microseconds per ``fn()`` call, launches per call) for each kernel
    ``fn`` runs, from the torch profiler over ``calls`` calls after ``warmup`` untimed ones."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(e.key, e.self_device_time_total / calls, e.count // calls)
            for e in prof.key_averages() if e.self_device_time_total > 0]

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

"""The GPU time of a call, as the choice between tile configs needs it.

``triton.testing.do_bench`` times a call from the host: it counts the host's launch path,
which at decode lengths and short prefills is longer than the kernel, so every config of
such a call times alike and the choice among them is noise (bench/results/
decode_configs_h100.md: the config chosen that way ran 0.71 TB/s in a CUDA graph where
the best offered one ran 0.84).  The host path is the same replayed call for every config
(``bound_call``), so it is no property of a config; what is, is the time the GPU spends
-- launches, the pre-pass and the combine included.

``device_ms`` captures the calls in a CUDA graph and replays it, as a serving engine runs
a decode step, so the host is out of it.  The calls rotate over copies of the inputs that
together exceed the L2 cache: in a model each layer's K/V cache is different memory, so a
decode kernel reads from DRAM; timing it on data left in L2 by the previous call would
favour the config with the most latency hidden, not the one that streams best.
"""
from __future__ import annotations

import math

from ..ir import Program

MIN_REPLAY_MS = 2.0   # one timed replay runs at least this long (event resolution ~5 us)
REPLAYS = 5           # timed replays; the median is returned
MAX_CALLS = 4096      # calls captured in one graph at most


def l2_bytes(device) -> int:
    """The L2 cache size of a CUDA device."""
    import torch
    return torch.cuda.get_device_properties(device).L2_cache_size


def input_copies(inputs: list, l2_bytes: int, most: int = 64) -> int:
    """How many copies of ``inputs`` make the calls read past an L2 cache of ``l2_bytes``
    (twice its size, so LRU keeps none of the next call's data)."""
    size = sum(t.numel() * t.element_size() for t in inputs if hasattr(t, "numel"))
    return max(1, min(most, math.ceil(2 * l2_bytes / max(size, 1))))


def copy_inputs(inputs: list, copies: int) -> list[list]:
    """``copies`` argument lists: the inputs, then clones with the same strides (a replayed
    call is keyed on them)."""
    import torch
    out = [list(inputs)]
    for _ in range(copies - 1):
        out.append([torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
                    if isinstance(t, torch.Tensor) else t for t in inputs])
    return out


def device_ms(call, inputs: list) -> float:
    """Median GPU milliseconds per ``call(args)`` over ``inputs`` (a list of argument lists,
    used in turn), replayed from a CUDA graph.  The calls are made once before the capture
    (compiles, first-call checks and the allocator's pools happen outside it)."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in inputs:
            call(args)
    torch.cuda.current_stream().wait_stream(stream)

    def capture(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for k in range(n):
                call(inputs[k % len(inputs)])
        return g

    def replay_ms(g):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    n = len(inputs)
    g = capture(n)
    replay_ms(g)  # the first replay uploads the graph
    est = replay_ms(g) / n
    if est * n < MIN_REPLAY_MS:  # more calls per replay, a whole number of rotations
        n = min(MAX_CALLS, len(inputs) * math.ceil(MIN_REPLAY_MS / max(est, 1e-4) / len(inputs)))
        del g
        g = capture(n)
        replay_ms(g)
    times = sorted(replay_ms(g) / n for _ in range(REPLAYS))
    return times[len(times) // 2]


# A call at least this long is timed from the host in a few calls, each after an L2
# flush, not by ``do_bench``'s 10 / 40 ms budgets: do_bench always makes 1 + 5 estimate
# calls and at least one warm-up and one timed call more, so a 60 ms prefill at S=32768
# spent ~0.5 s per config (a cold choice of GQA prefill: 11.8 s of timing for 13 configs,
# bench/results/cold_s25/), while at that length one call varies by well under 1%.
LONG_CALL_MS = 5.0
LONG_CALL_SAMPLES = 3


def host_ms(call) -> float:
    """Median milliseconds of ``call()`` timed from the host (its launch path included),
    each run on a flushed L2: ``do_bench`` for short calls, ``LONG_CALL_SAMPLES`` runs for
    calls of ``LONG_CALL_MS`` or more (the first of them also measures the length)."""
    import torch
    from triton.testing import do_bench
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # do_bench's L2 flush

    def run_ms():
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    first = run_ms()
    if first < LONG_CALL_MS:
        del flush
        return do_bench(call, warmup=10, rep=40, return_mode="median")
    times = sorted([first] + [run_ms() for _ in range(LONG_CALL_SAMPLES - 1)])
    return times[len(times) // 2]


def strided_rows(t) -> bool:
    """A tensor whose last dimension is not contiguous (stride 1); a dimension of one
    has no stride that matters."""
    import torch
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1


def timing_tensors(program: Program, given: dict | None, device: str = "cuda") -> dict:
    """The tensors configs are timed on: ``given`` ones (a call's own data: document ids
    decide which blocks a data mask skips, so timing on zeros -- one document -- picks the
    dense case's tiles) where they match the placeholder's shape, dtype and device; random
    floats and zero integers for the rest; fresh outputs."""
    import torch
    out = {}
    for ph in program.inputs:
        dt = getattr(torch, ph.dtype)
        t = (given or {}).get(ph.name)
        if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(ph.shape) and t.dtype == dt \
                and t.device.type == device:
            out[ph.name] = t.contiguous() if strided_rows(t) else t  # as a call passes it
        else:
            out[ph.name] = (torch.randn(ph.shape, device=device).to(dt) if dt.is_floating_point
                            else torch.zeros(ph.shape, dtype=dt, device=device))
    for name in program.outputs:
        out[name] = torch.empty(program.shape_of(name), dtype=getattr(torch, program.dtype_of(name)),
                                device=device)
    return out

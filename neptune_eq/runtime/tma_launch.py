"""Launching a compiled kernel that takes host TMA descriptors, each encoded once per
address rather than once per call.

Triton 3.6 launches a Gluon kernel's host ``TensorDescriptor`` arguments through a Python
wrapper around the compiled launcher (``driver.wrap_handle_tensordesc``): on every launch
it encodes each descriptor into a ``CUtensorMap`` (``make_tensordesc_arg``: the driver's
encode call and the argument lists around it), after ``GluonLauncher`` has made a
``TensorDescriptor`` per slot.  Under cProfile that was 98 of 220 us per call of a causal
dK/dV kernel (four descriptors) at S=2048 on the H200 host (session 31,
``bench/step_host.py --detail``), and an eager causal training step makes three such
calls (the forward, dQ, dK/dV).

A map depends only on the base address, the shape and strides, the element type, and the
block and swizzle that the compiled kernel fixed.  So it is kept under those (per compiled
kernel and slot) and reused while they repeat: the steps of a training loop get their
tensors at the same addresses from torch's caching allocator, and a decode reads the
same cache.  A freed address that is reused with the same shape gets the same map, which
is still right: a map holds no data.

The wrapper's layout is Triton's internal, so ``EncodedLaunch.of`` checks it: 3.6's
``CudaLauncher`` (``launch.launcher_36``: its call layout, no scratch), a closure holding
``launcher``, ``tensordesc_indices`` and ``tensordesc_meta``, descriptors first in the
signature, the driver's argument prefix of the length it expects, and an encoder of
(descriptor, metadata).  Anything else gives None, and the caller keeps Triton's path.  As with
every fast launch, the first use under a launch key is checked bit for bit against
Triton's own launch (``GluonLauncher._check_fast``).
"""
from __future__ import annotations

import os

from .launch import call_raw, launcher_36, positional

KEEP = 256  # maps kept per compiled kernel (all dropped when full, as ``Kernel``'s replays)
_PREFIX = 13  # grid (3), stream, function, flags (2), scratch (2), metadata (2), hooks (2)
ENABLED = os.environ.get("NEPTUNE_EQ_ENCODED_TMA", "1") != "0"


class EncodedLaunch:
    """The raw launcher of one compiled kernel whose first ``n`` arguments are host TMA
    descriptors, with their encoded maps kept by (slot, address, shape, strides, dtype)."""

    def __init__(self, ck, raw, metas: list, encode):
        self.ck, self.raw, self.metas, self.encode = ck, raw, list(metas), encode
        self.maps: dict = {}

    @classmethod
    def of(cls, ck, n: int) -> "EncodedLaunch | None":
        """For ``ck`` (a ``CompiledKernel``) if its launch is Triton 3.6's descriptor
        wrapper around a raw launcher with the ``n`` descriptors first; else None."""
        if not ENABLED:
            return None
        inner = getattr(launcher_36(ck), "launch", None)
        code, cells = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
        if code is None or not cells:
            return None
        free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
        glob = getattr(inner, "__globals__", {})
        try:
            raw, indices, metas = (free["launcher"], free["tensordesc_indices"],
                                   free["tensordesc_meta"])
            prefix, encode = glob["_BASE_ARGS_FORMAT_LEN"], glob["make_tensordesc_arg"]
        except KeyError:
            return None
        if prefix != _PREFIX or sorted(indices) != list(range(n)) or not metas \
                or len(metas) != n or not callable(raw) or positional(encode) != 2:
            return None
        return cls(ck, raw, metas, encode)

    def _map(self, k: int, t, descriptor) -> list:
        """The encoded argument group of slot ``k`` over tensor ``t`` (``descriptor(k)``
        makes the ``TensorDescriptor`` on a miss)."""
        key = (k, t.data_ptr(), t.shape, t.stride(), t.dtype)
        got = self.maps.get(key)
        if got is None:
            got = self.encode(descriptor(k), self.metas[k])
            if len(self.maps) >= KEEP:  # (all at once: one step, safe beside other threads)
                self.maps.clear()
            self.maps[key] = got
        return got

    def launch(self, grid: tuple, stream, tensors: list, descriptor, rest: list) -> None:
        """Launch on grid ``grid``: ``tensors`` are the descriptor slots' tensors in order,
        ``rest`` every later argument (constexprs included, as ``CompiledKernel.run``
        takes them).  No launch hook may be set (the caller checks): a profiler's hook
        reads metadata this path does not make."""
        args = []
        for k, t in enumerate(tensors):
            args += self._map(k, t, descriptor)
        call_raw(self.raw, self.ck, grid, stream, [*args, *rest])

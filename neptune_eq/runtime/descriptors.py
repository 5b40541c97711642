"""Run-time side of tensor-descriptor (TMA) kernels: may this call use them, and the
allocator Triton needs for descriptors made on the device.

A TMA tile load needs a 16-byte aligned base address, a contiguous last dimension, and
every other stride a multiple of 16 bytes (``lowering/descriptors.py`` folds the scalar
indices of the other dims into the base, so those strides must keep it aligned too).  A
call whose tensors break any of this runs the pointer form of the same tiles instead
(``Launcher``): slower, never wrong, never a crash.
"""
from __future__ import annotations

TMA_NEEDS = ("tensor descriptors need a 16-byte aligned base, a contiguous last dimension "
             "and 16-byte multiples as the other strides")


def tma_ok(descriptors: dict, tensors: dict) -> bool:
    """Whether every tensor read or written through a descriptor meets TMA's alignment
    rules.  ``descriptors``: tensor name -> dims used as a tile's row (their stride is the
    descriptor's; dims of extent 1 are indexed by 0 only, so their stride does not matter
    unless it is a row stride)."""
    for name, row_dims in descriptors.items():
        t = tensors.get(name)
        if t is None:
            return False
        if t.data_ptr() & 15:
            return False
        st, shape, elem = t.stride(), t.shape, t.element_size()
        last = len(st) - 1
        if st[last] != 1:
            return False
        for d in range(last):
            if (shape[d] > 1 or d in row_dims) and (st[d] * elem) & 15:
                return False
    return True


def _allocate(size: int, alignment: int, stream):
    import torch
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Descriptors made in the kernel (``tl.make_tensor_descriptor``) live in a global
    scratch buffer that Triton asks an allocator for at launch; without one set Triton 3.6
    raises.  Set ours only where none is set (a user's allocator stays), per thread context
    (Triton keeps it in a ContextVar, so a launch from a new thread checks again)."""
    import triton
    try:
        from triton.runtime import _allocation as al
        current = al._allocator.get() if hasattr(al._allocator, "get") else al._allocator
        if not isinstance(current, al.NullAllocator):
            return
    except (ImportError, AttributeError):  # pragma: no cover - another Triton layout
        pass
    triton.set_allocator(_allocate)

"""Whether this machine runs the warp-specialised Gluon form (``lowering/gluon_ws.py``).

The form issues Hopper instructions (wgmma, TMA, mbarriers, ``setmaxnreg``): it runs on
compute capability 9.0 only, and needs Triton's Gluon (Triton 3.6 or newer).  The Triton
interpreter cannot run Gluon, so CPU runs keep the ``tl`` forms.
``NEPTUNE_EQ_GLUON=0`` turns the form off.
"""
from __future__ import annotations

import os
from functools import lru_cache


def gluon_unavailable() -> str | None:
    """None when the form can run here, else why not (a sentence for reports)."""
    if os.environ.get("NEPTUNE_EQ_GLUON", "1") == "0":
        return "turned off (NEPTUNE_EQ_GLUON=0)"
    return _device_reason()


@lru_cache(maxsize=1)
def _device_reason() -> str | None:
    import torch
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}, the form needs 9.0 (Hopper)"
    try:
        import triton.experimental.gluon.language.nvidia.hopper as hopper
        import triton.experimental.gluon.nvidia.hopper as host
        for need in ("mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait"):
            getattr(hopper, need)
        host.TensorDescriptor
    except (ImportError, AttributeError) as e:
        return f"this Triton has no Gluon for Hopper ({e})"
    return None

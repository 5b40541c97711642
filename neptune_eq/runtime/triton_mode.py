"""Which mode Triton runs in: compiled for the GPU, or interpreted on the CPU.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so this must run before
anything imports triton; it imports nothing heavy itself (``import neptune_eq`` calls it).
"""
from __future__ import annotations

import os
import sys


def enable_interpreter() -> None:
    """Triton reads TRITON_INTERPRET both when a kernel is defined and when it first
    launches, so a process that interprets keeps it set."""
    os.environ["TRITON_INTERPRET"] = "1"


def check_interpreter_importable() -> None:
    """Triton turns its standard library (tl.sum, tl.max…) into interpreted functions only
    if TRITON_INTERPRET is set when it is first imported."""
    import triton.language as tl
    if type(tl.sum).__name__ == "JITFunction":
        raise RuntimeError(
            "Triton was imported in GPU mode before neptune_eq chose the interpreter (no GPU "
            "here), so its standard library cannot run interpreted. Import neptune_eq before "
            "triton, or set TRITON_INTERPRET=1 in the environment before starting Python.")


def prefer_interpreter_without_gpu() -> None:
    """Called on import: on a machine without CUDA, make Triton import in interpreter
    mode (it reads TRITON_INTERPRET when first imported)."""
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    try:
        import torch
        if not torch.cuda.is_available():
            enable_interpreter()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass

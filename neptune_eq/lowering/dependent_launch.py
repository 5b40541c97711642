"""Programmatic dependent launch (PDL, Hopper on): a kernel launched while the kernel before
it still runs, waiting for it only where it first reads what that kernel wrote.

Two launches of one call depend on each other through memory: the summary pre-pass writes
the per-block summaries a data mask's kernel reads (``summary_kernel``), and a split-k
partials kernel writes the fold states its combine reads (``kernelgen``).  Launched
plainly, the second starts only after the first has finished and the GPU's launch path has
run.  Launched dependent (Triton's ``launch_pdl``), its programs become resident while the
first runs and stop at ``griddepcontrol.wait`` (Triton's ``gdc_wait``), which returns once
the first kernel has completed and its writes are visible; everything before the wait --
the launch, the row tile's load, descriptors unless the kernel before makes its own
(``MAKES_DESCRIPTOR``) -- overlaps the kernel before.

This module writes the device side: the ``PDL`` constexpr every kernel of such a module
takes (False in the interpreter and wherever no launch of the module is dependent, so no
instruction is emitted there), the wait placed before the first read, and the Gluon forms'
wait.  ``runtime.launch.dependent_launch`` decides where a launch is dependent.
"""
from __future__ import annotations

import re

# The constexpr of every kernel of a module with a pre-pass or a split-k combine.  The
# pre-pass and a split-k's partials let their dependents launch at once
# (``gdc_launch_dependents`` first thing, ``release_first``): they sit in their wait, and
# the launch is off the critical path.
PDL_FLAG = "PDL"


# Where the GPU can, the first of a call's two or more launches -- the summary pre-pass,
# or split-k's partials -- is launched dependent on whatever kernel ran before it in the
# stream (another operator's, or this operator's last call), and waits for it as its first
# statement, then releases its dependent (``wait_then_release``): its launch
# and the grid's set-up overlap that kernel's last programs, and nothing of it runs before
# that kernel has finished and its writes are visible.  Measured on an H200 (session 56,
# ``bench/probe/first_launch.py``, ``bench/prepass_pdl.py --toggle first``), 20 calls
# from one CUDA graph: GQA decode at 2048 keys 7.01 -> 6.77 us a call back to back, 6.88
# -> 6.55 after an unrelated torch kernel; what the jagged mask's pre-pass adds at 4096
# keys 0.94 -> 0.44 us.  A call of ONE launch (a plain kernel, split-k in one launch) is
# left plain: there it gained 0.15-0.2 us back to back but lost 0.2-0.55 us after a torch
# kernel, in every pass (causal and ALiBi decode at 2048 and 8192).
# ``NEPTUNE_EQ_PDL_FIRST=0`` launches it plainly (the wait then returns at once).
def wait_then_release() -> list[str]:
    """A first launch's opening statements (the pre-pass, split-k's partials, a dynamic
    walk's ranges kernel), whose dependent waits before reading what it writes: wait for
    the kernel before, then release the next launch -- released before the wait, the
    dependent could read inputs the kernel before is still writing."""
    return [f"    if {PDL_FLAG}:", "        tl.extra.cuda.gdc_wait()",
            "        tl.extra.cuda.gdc_launch_dependents()"]


def release_first(kernel: list[str], wait: bool = False) -> list[str]:
    """A kernel's text (``kernelgen._kernel_text``: the signature, ``"):"``, its body)
    releasing its dependent launch as its first statement.  Safe wherever the dependent
    waits (``griddepcontrol.wait``) before reading what this kernel writes: the release
    takes effect once *every* program of this grid has released or exited, so the
    dependent's programs never hold a slot a program of this grid still needs.

    For split-k's partials that was measured against the release at their end (no
    signal, what the combine got before session 52), in CUDA graphs on an H200, GQA decode
    at 2048 keys 8.38 -> 7.50 us a call (the plain launch 8.19) and causal decode's
    two-launch form at 2048 12.35 -> 11.56; at 8192-32768 -1.3% to +0.8%, 20,000 calls
    of each with no stall (``bench/probe/decode_trigger.py``).  Session 24 had reverted
    this signal after three stalled runs on an H100 whose cause was not found."""
    at = kernel.index("):") + 1
    opening = wait_then_release() if wait else [  # (``wait``: the call's first launch)
        f"    if {PDL_FLAG}:  # dependents may launch now: they wait for this grid to finish",
        "        tl.extra.cuda.gdc_launch_dependents()"]
    return kernel[:at] + opening + kernel[at:]


# A tensor descriptor made on the device (``tl.make_tensor_descriptor``) is written into the
# launch's global scratch, which Triton asks torch for at launch and frees when the launch
# call returns -- while the kernel still runs.  The next launch's scratch can then be the
# same bytes (the caching allocator reuses them in stream order), so a dependent launch
# that makes its descriptors before its wait overwrites the descriptors of the kernel
# before while that kernel still reads through them.  On an H200 a split-k TMA forward
# at 300 x 517 keys (the combine making its output's descriptor before its wait) faulted
# with an illegal memory access or hung in its graph replay (session 59,
# ``bench/probe/fault_locate_gpu.py``).  So after a kernel that makes descriptors, a
# dependent waits before making its own.
MAKES_DESCRIPTOR = "tl.make_tensor_descriptor("


def wait_before_reads(body: list[str], written: list[str],
                      after_descriptors: bool = False) -> list[str]:
    """``body`` (a kernel's lines, statements at 4 spaces) with ``if PDL: gdc_wait()``
    before the top-level statement holding its first read of a buffer the kernel before
    wrote (a name of ``written``, read through ``<name>_ptr``): nothing before it may
    depend on that kernel, everything after may.  ``after_descriptors``: the kernel
    before makes descriptors on the device, so the wait also comes before this kernel
    makes its first (``MAKES_DESCRIPTOR``).  A body that reads none is returned as it is."""
    pat = re.compile(r"\b(" + "|".join(re.escape(f"{n}_ptr") for n in written) + r")\b")

    def hazard(line: str) -> bool:
        return bool(pat.search(line)) or (after_descriptors and MAKES_DESCRIPTOR in line)
    first = next((k for k, ln in enumerate(body) if hazard(ln)), None) if written else None
    if first is None:
        return body
    while first > 0 and not re.match(r"    [^\s#]", body[first]):  # the enclosing statement
        first -= 1
    return body[:first] + [f"    if {PDL_FLAG}:  # programmatic dependent launch: wait for "
                           "the kernel before",
                           "        tl.extra.cuda.gdc_wait()"] + body[first:]


# The first read of the pre-pass's summaries waits for it (``griddepcontrol.wait``, Triton's
# ``gdc_wait`` written out: the Gluon forms run only on the GPU): the form is launched
# dependent on the pre-pass, so its launch, shared memory and barrier set-up overlap the
# pre-pass.  Launched plainly, the wait returns at once.
WAIT_FOR_PREPASS = ('tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], '
                    'dtype=tl.int32, is_pure=False, pack=1)')

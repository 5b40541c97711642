"""A backward call at a key met before: its kernels' replays in order, wired once.

``flex_backward.run_backward`` decides on every call which gradient groups run (the
fused kernel, or dQ's and dK/dV's own -- ``chosen_groups``, timed per size bucket), finds
each group's kernel and its row-statistics kernel, and calls each through
``Kernel.__call__``, which looks the call's signature up again.  None of it depends on
the data: it is fixed by the structure, which inputs need a gradient, whether the loss
reads the lse, deterministic mode and the tensors' signatures (shape, strides, dtype,
device).  An eager training step pays it on every step, inside the autograd engine's
thread, where a step's host time is the speed at short lengths (H200, causal S=2048:
``autograd.grad`` 360 us, our backward 203 us of it; bench/results/README.md, session 32).

So the general path records what it ran (``Recorder``), and the next call at that key
runs a ``BackwardPlan``: each kernel's replay (``Kernel.replay_for``, the object
``Kernel.__call__`` would reach) on the same env entries in the same order, then the
same sums and dtype conversions (``finish_gradient``, shared with the general path).  A
replay checks what can still change per call itself (pointer alignment, a launch key
not yet checked, a CUDA graph capture) and takes the general launch then.  A key whose
kernels are not all replayed keeps the general path.  ``NEPTUNE_EQ_BACKWARD_PLAN=0``
turns plans off.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from ..api import _signature

ENABLED = os.environ.get("NEPTUNE_EQ_BACKWARD_PLAN", "1") != "0"
KEEP = 256  # plans kept; all dropped at once past it (a growing sequence length)
_PLANS: dict = {}
_LOCK = threading.Lock()


def plan_key(skey: str, needs: list[bool], tensors: list, d_lse) -> tuple | None:
    """What a backward call's decisions depend on besides the data; None when plans are
    off.  ``tensors``: the call's q, k, v, captured, out, lse and dO."""
    if not ENABLED:
        return None
    sig = _signature(tuple(tensors) if d_lse is None else (*tensors, d_lse))
    if sig is None:
        return None
    return (skey, tuple(needs), d_lse is None, torch.are_deterministic_algorithms_enabled(),
            sig)


def finish_gradient(g, rows: int, heads_per_kv: int | None):
    """A kernel's gradient output as the input's gradient: summed over ``rows`` trailing
    row dims (a captured tensor's partial, ``flex_backward._partial_only``) and over each
    KV head's query heads (GQA: ``heads_per_kv``)."""
    if rows:
        g = g.sum(dim=tuple(range(g.dim() - rows, g.dim())))
    if heads_per_kv:
        g = g.unflatten(1, (g.shape[1] // heads_per_kv, heads_per_kv)).sum(2)
    return g


def add_gradient(got: dict, name: str, g) -> None:
    """``got[name]``, or its sum with ``g``: a gradient computed by several kernels (a
    captured table read at queries and at keys, ``flex_backward._partial_pieces``)."""
    got[name] = g if name not in got else got[name] + g


def as_input_dtype(g, t):
    """``g`` in the dtype of the input ``t`` it is the gradient of (no op when it is)."""
    return g if g is None or g.dtype == t.dtype else g.to(t.dtype)


@dataclass
class Step:
    """One kernel launch of a backward: ``call`` (a replay) on the env entries
    ``inputs``; its outputs become env entries ``outputs`` (row statistics) or the
    gradients of ``outputs`` (``gradients``), finished with ``rows`` / ``expanded``."""
    call: object
    inputs: list[str]
    outputs: tuple[str, ...]
    gradients: bool
    rows: int = 0
    expanded: dict = field(default_factory=dict)


class Recorder:
    """What a general-path call ran: each kernel, the arguments it was called on (the
    signature its replay is kept at) and its ``Step`` less the replay (``keep`` finds it)."""

    def __init__(self):
        self.calls: list[tuple[object, list, Step]] = []

    def row_statistics(self, kern, names: list[str], args: list, stats) -> None:
        self.calls.append((kern, args, Step(None, list(names), tuple(stats), False)))

    def gradients(self, kern, names: list[str], args: list, group, rows: int,
                  expanded: dict) -> None:
        self.calls.append((kern, args, Step(None, list(names), tuple(group), True, rows,
                                            dict(expanded))))


class BackwardPlan:
    """The recorded kernels of a backward key, each at its replay."""

    def __init__(self, steps: list[Step]):
        self.steps = steps

    def run(self, env: dict, names: list[str], tensors: list) -> list:
        """The gradients (None where not computed) of ``names`` (inputs ``tensors``), the
        kernels reading ``env`` (``flex_backward.backward_env``) as on the recorded call."""
        got = {}
        for st in self.steps:
            res = st.call([env[n] for n in st.inputs])
            if not st.gradients:
                env.update(zip(st.outputs, res))
                continue
            for name, g in zip(st.outputs, res):
                add_gradient(got, name, finish_gradient(g, st.rows, st.expanded.get(name)))
        return [as_input_dtype(got.get(n), t) for n, t in zip(names, tensors)]


def get(key) -> BackwardPlan | None:
    """The plan kept for ``key`` (None: none, or the key keeps the general path)."""
    return _PLANS.get(key) if key is not None else None


def keep(key, rec: Recorder) -> None:
    """Keep ``rec``'s calls as the plan of ``key`` -- once each kernel has a replay at the
    signature it was called at (the general call just made makes them); a kernel without
    one (a form the replays do not cover) keeps the key on the general path, not asked
    again."""
    if key is None or key in _PLANS:
        return
    steps = []
    for kern, args, step in rec.calls:
        step.call = kern.replay_for(args)
        if step.call is None:
            steps = None
            break
        steps.append(step)
    with _LOCK:
        if len(_PLANS) >= KEEP:
            _PLANS.clear()
        _PLANS[key] = BackwardPlan(steps) if steps else None


def clear() -> None:
    """Drop every plan (tests; a bench's A/B)."""
    with _LOCK:
        _PLANS.clear()

"""Call-time dispatch of a symbolic program: size -> bucket -> chosen kernel -> launcher.

One saturated e-graph gives a pool of candidate programs with symbolic sizes
(``sizes.py``).  The choice among them depends on the sizes (rolling vs split-k, head
packing, tile config), so it is made per **bucket**: the first call at a size outside
every known bucket specialises each candidate at that size, lowers and ranks them with the
cost model, and keeps the best with the guards its lowering recorded; every later size
whose guards hold (and whose power-of-two class matches) reuses that kernel -- no
saturation, no lowering, and no compile beyond Triton's own specialisations.  A launcher
(grid, split chunks, scratch sizes: host-side facts of one size) is built once per size.

A bucket met at call time on a GPU is timed on the call's tensors when its predicted call
is long enough for the configs' spread to matter (``time_new_buckets``); a shorter one
takes the config a timed bucket of nearby sizes chose, where the same kernel offers it
(``config_like``), else the first of the hand-ordered configs.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

from .choose import CandidateRow, choose, rank
from .costmodel import Device
from ..egraph.extract import Candidate
from ..ir import Program
from ..lowering.lower import LoweringError
from ..runtime.gluon_launch import make_launcher
from ..runtime.launcher import Launcher
from ..runtime.tile_configs import TileConfig, candidate_configs
from ..runtime.timing import timing_tensors
from ..runtime.tuning import agreeing_config, time_configs
from ..sizes import Guards, bind, bucket_of, specialise


MAX_LAUNCHERS = 256  # launchers kept (host-side launch facts of one size each)


@dataclass
class BucketChoice:
    """The kernel chosen for one bucket: valid wherever ``guards`` hold."""
    guards: Guards
    program: Program           # the chosen candidate as the e-graph gave it (symbolic sizes)
    row: CandidateRow          # program specialised at the bucket's first size, plan, kernel
    config: TileConfig
    sizes: dict[str, int]      # the size the choice was made at
    rows: list[CandidateRow] = field(default_factory=list, repr=False)
    # an untimed choice's config timed alone once (``SizeDispatch.measured_ms``), not tuned
    config_ms: float | None = None


def specialised_pool(pool: list[Candidate], values: dict[str, int]) -> tuple[list[Candidate], dict]:
    """Every candidate specialised at ``values``; id(specialised program) -> (its guards,
    the symbolic program it came from)."""
    out, origin = [], {}
    for c in pool:
        g = Guards()
        spec = Candidate(specialise(c.program, values, g), c.cost, c.description)
        origin[id(spec.program)] = (g, c.program)
        out.append(spec)
    return out, origin


def choose_bucket(pool: list[Candidate], values: dict[str, int], target: str, device: Device,
                  tensors: dict | None = None, top_k: int = 1, progress: bool = False,
                  call_tensors: Callable[[], dict] | None = None,
                  known: list[BucketChoice] = (), fp32_dot: str = "ieee") -> BucketChoice:
    """Rank the pool at ``values`` with the cost model; on a GPU with ``tensors`` time the
    best ``top_k`` (superoptimize's first bucket), else take the predicted best.  A bucket
    met at call time passes ``call_tensors`` (the call's tensors, made on demand: timed
    where ``time_new_buckets`` says so) and the buckets ``known`` so far (``config_like``).
    ``fp32_dot``: tl.dot's precision for two fp32 operands, fixed when the kernel was built."""
    spec, origin = specialised_pool(pool, values)
    rows = rank(spec, device, bf16_dot_in_fp32=(target == "interpreter"), fp32_dot=fp32_dot)
    lowerable = [r for r in rows if r.kernel is not None]
    timed_here = tensors is None and call_tensors is not None and bool(lowerable) and \
        time_new_buckets(target, lowerable[0].predicted_us)
    if timed_here:
        tensors = _call_tensors_fitting(call_tensors)
    if target == "cuda" and tensors is None:  # a bucket met at call time, untimed
        if not lowerable:
            raise LoweringError(f"Expected a candidate that lowers at sizes {values}, got none: "
                                + "; ".join(r.status for r in rows))
        row = lowerable[0]
        configs = candidate_configs(row.kernel, target, device.sms)
        row.config = config_like(origin[id(row.program)][1], configs, values, known) or configs[0]
        row.chosen = True
        # untimed, but checked as a timed config is: against the plain launch, on the call
        # (not where the call's tensors were just found not to fit)
        checked = _call_tensors_fitting(call_tensors) if call_tensors is not None and \
            not timed_here and not _capturing() else None
        if checked is not None:
            row.config = agreeing_config(row.program, row.kernel, target, checked, row.config,
                                         configs, values)
    else:
        row = choose(rows, target, tensors, top_k, device.sms, progress, values, device)
    guards, program = origin[id(row.program)]
    return BucketChoice(guards, program, row, row.config, dict(values), rows)


def _capturing() -> bool:
    import torch
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _call_tensors_fitting(call_tensors: Callable[[], dict]) -> dict | None:
    """The call's tensors with fresh outputs to time on, or None (untimed) where those
    outputs do not fit beside what the caller holds -- a training step near the memory
    limit is not made to fail by the timing."""
    import torch
    try:
        return call_tensors()
    except torch.cuda.OutOfMemoryError:
        return None


# A timed bucket's config is carried to an untimed one within this factor in every named
# size: S=2048 takes what S=8192 timed, a first call at S=64 says nothing about S=8192.
CARRY_RATIO = 4


def config_like(program: Program, configs: list[TileConfig], values: dict[str, int],
                known: list[BucketChoice]) -> TileConfig | None:
    """The config the nearest timed bucket (within ``CARRY_RATIO`` in every size) chose,
    where it chose the same candidate and this bucket's kernel offers that config: a
    timing at a nearby length is a better guess than the hand order -- it knows whether
    the Gluon form or the ``tl`` one won for this program on this GPU (H100, session 21:
    Gluon dK/dV 3.35 vs 3.82 ms plain, 3.07 vs 2.76 with softcap, the same order at
    S=2048 and 8192)."""
    def ratios(c: BucketChoice) -> list[float]:
        return [abs(math.log(max(values[s], 1) / max(c.sizes.get(s, values[s]), 1)))
                for s in values]
    near = [c for c in known if c.row.measured_ms is not None and
            (c.program is program or str(c.program) == str(program)) and
            max(ratios(c), default=0.0) <= math.log(CARRY_RATIO) + 1e-9]
    for c in sorted(near, key=lambda c: sum(ratios(c))):
        # the same form and tiles; a split-k factor is a choice of its size, not carried,
        # nor is a Gluon form's walk: a shorter bucket has fewer tiles per SM, where the
        # persistent walk wins most (backward causal S=2048 +14-16%, H200, session 29)
        alike = [k for k in configs if k == k.compiled_as and
                 replace(k, splits=0) == replace(c.config.compiled_as, splits=0)]
        if alike:
            return next((k for k in alike if k.splits == c.config.splits), alike[0])
    return None


# A new bucket whose best candidate is predicted at least this long per call is timed on
# the call by default.  Timing costs seconds once per bucket, kept in the disk cache: a
# training step's five kernels (forward, fused form, row dots, dQ, dK/dV) took 16-27 s
# at S=8192 against 1-6 s untimed (H100, session 22, bench/backward_gpu.py --first-call).
# Untimed, the step ran 1.10-1.22x slower there (graphed: 8.68 vs 7.83 ms plain, 7.00 vs
# 5.72 softcap): ~1 ms per step, repaid within ~2·10^4 steps of one training run, and
# never again on that machine.  Shorter calls (decode, short prefill) keep
# ``config_like``'s pick: their configs differ by tens of microseconds and the calls are
# often host-bound.
TIME_NEW_BUCKET_US = 1000.0


def time_new_buckets(target: str, predicted_us: float | None = None) -> bool:
    """Whether a bucket first met by a call is chosen by timing its configs on that call's
    tensors rather than by ``config_like`` / the cost model.  ``NEPTUNE_EQ_TIME_NEW_BUCKETS``:
    ``auto`` (default) where the predicted call takes at least ``TIME_NEW_BUCKET_US``,
    ``1`` always (like ``torch.backends.cudnn.benchmark``), ``0`` never.  On a GPU only,
    never while a CUDA graph is being captured.  Measured on an H200 (session 15,
    bench/backward_gpu.py): at S=2048 after a first call at 8192, a timed bucket ran the
    graphed training step 1.05x (window), 1.06x (13 documents) and 1.05x (causal) faster
    than the cost model's pick."""
    mode = os.environ.get("NEPTUNE_EQ_TIME_NEW_BUCKETS", "auto") or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"Expected NEPTUNE_EQ_TIME_NEW_BUCKETS to be auto, 0 or 1, got "
                         f"{mode!r}; unset it for auto (time buckets predicted at >= "
                         f"{TIME_NEW_BUCKET_US:.0f} us per call).")
    if target != "cuda" or mode == "0":
        return False
    if mode == "auto" and (predicted_us is None or predicted_us < TIME_NEW_BUCKET_US):
        return False
    import torch
    return not torch.cuda.is_current_stream_capturing()


@dataclass
class SizeDispatch:
    """Per structure: the candidate pool, the buckets chosen so far, a launcher per size."""
    pool: list[Candidate]
    symbols: list[str]
    target: str
    device: Device
    buckets: dict[tuple, list[BucketChoice]] = field(default_factory=dict)
    launchers: OrderedDict = field(default_factory=OrderedDict, repr=False)  # size -> Launcher
    bucket_choices: int = 0    # buckets chosen (lowered + ranked) in this process
    # Called after a bucket is chosen at call time (the entry point re-stores the kernel
    # in the disk cache, so the next process finds bucket -> winner without timing again).
    on_new_bucket: object = field(default=None, repr=False)
    fp32_dot: str = "ieee"     # the precision of fp32 contractions it was built with

    def __getstate__(self):  # launchers hold compiled kernels: process-local
        state = dict(self.__dict__)
        state["launchers"] = OrderedDict()
        state["on_new_bucket"] = None
        state["bucket_choices"] = 0   # counts choices made in this process
        return state

    def add(self, choice: BucketChoice) -> None:
        self.buckets.setdefault(bucket_of(choice.sizes), []).append(choice)

    def _existing(self, values: dict[str, int]) -> BucketChoice | None:
        """The bucket chosen before whose guards hold at ``values``, if any."""
        return next((c for c in self.buckets.get(bucket_of(values), ()) if c.guards.hold(values)),
                    None)

    def choice_for(self, values: dict[str, int], tensors: dict | None = None) -> BucketChoice:
        c = self._existing(values)
        if c is not None:
            return c
        known = [c for cs in self.buckets.values() for c in cs]
        call = (lambda: self._timing_tensors(values, tensors)) if tensors is not None else None
        c = choose_bucket(self.pool, values, self.target, self.device, call_tensors=call,
                          known=known, fp32_dot=self.fp32_dot)
        self.bucket_choices += 1
        self.add(c)
        if self.on_new_bucket is not None:
            self.on_new_bucket()
        return c

    def _timing_tensors(self, values: dict[str, int], tensors: dict) -> dict:
        """The call's inputs, random ones where they do not fit, and fresh outputs."""
        return timing_tensors(bind(self.pool[0].program, values), tensors)

    def measured_ms(self, values: dict[str, int], tensors: dict) -> float | None:
        """GPU ms of a call at ``values`` under its bucket's config: the bucket's own timing,
        or -- a bucket chosen untimed -- that one config timed once on ``tensors`` (the
        call's inputs by name; no tuning, a fraction of a second), as a choice between
        kernels needs (the backward's fused form or two kernels, per bucket).  None off
        the GPU or while a CUDA graph is captured."""
        c = self.choice_for(values, tensors)
        if c.row.measured_ms is not None:
            return c.row.measured_ms
        import torch
        if self.target != "cuda" or torch.cuda.is_current_stream_capturing():
            return None
        if c.config_ms is None:
            timed = self._timing_tensors(values, tensors)
            configs = [c.config]
            if c.config.gluon_ws:  # the timer checks a Gluon form's outputs against a tl run
                configs.insert(0, candidate_configs(c.row.kernel, self.target, self.device.sms)[0])
            got = [(k, ms) for k, ms, _ in time_configs(c.row.program, c.row.kernel, self.target,
                                                       timed, configs, values) if ms is not None]
            if got:
                self._keep_faster(c, *min(got, key=lambda km: km[1]))
        return c.config_ms

    def _keep_faster(self, c: BucketChoice, config: TileConfig, ms: float) -> None:
        """Keep the faster of the configs ``measured_ms`` timed.  A carried Gluon config is
        timed beside the ``tl`` run that checks it, and at short buckets the ``tl`` form can
        win where the longer bucket it came from chose Gluon (H100, session 22: the
        document-mask dQ at S=2048, tl 0.068 vs Gluon 0.090 ms, carried from S=8192) -- a
        time already paid for, so the bucket takes it.  Launchers made from the old config
        are dropped; the disk cache is re-stored (``on_new_bucket``)."""
        c.config_ms = ms
        if config == c.config:
            return
        c.config = c.row.config = config
        for key in [k for k in self.launchers if self._existing(dict(zip(self.symbols, k))) is c]:
            del self.launchers[key]
        if self.on_new_bucket is not None:
            self.on_new_bucket()

    def launcher(self, values: dict[str, int], tensors: dict | None = None) -> Launcher:
        """The launcher at ``values``; ``tensors``: the call's inputs by name, which a new
        bucket's tile configs are timed on where ``time_new_buckets`` says so."""
        key = tuple(values[s] for s in self.symbols)
        la = self.launchers.get(key)
        if la is not None:
            self.launchers.move_to_end(key)
        else:
            c = self.choice_for(values, tensors)
            ks = c.row.kernel.concrete(values)
            la = make_launcher(bind(c.row.program, values), ks, self.target, c.config.at(values),
                          tuple(values[s] for s in ks.size_params))
            self.launchers[key] = la
            if len(self.launchers) > MAX_LAUNCHERS:  # a growing KV cache: keep recent sizes
                self.launchers.popitem(last=False)
        return la

"""Call-time dispatch of a symbolic program: size -> bucket -> chosen kernel -> launcher.

One saturated e-graph gives a pool of candidate programs with symbolic sizes
(``sizes.py``).  The choice among them depends on the sizes (rolling vs split-k, head
packing, tile config), so it is made per **bucket**: the first call at a size outside
every known bucket specialises each candidate at that size, lowers and ranks them with the
cost model, and keeps the best with the guards its lowering recorded; every later size
whose guards hold (and whose power-of-two class matches) reuses that kernel -- no
saturation, no lowering, and no compile beyond Triton's own specialisations.  A launcher
(grid, split chunks, scratch sizes: host-side facts of one size) is built once per size.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .choose import CandidateRow, choose, rank
from .costmodel import Device
from ..egraph.extract import Candidate
from ..ir import Program
from ..runtime.gluon_launch import make_launcher
from ..runtime.launcher import Launcher, TileConfig, candidate_configs
from ..runtime.timing import timing_tensors
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
                  tensors: dict | None = None, top_k: int = 1, progress: bool = False) -> BucketChoice:
    """Rank the pool at ``values`` with the cost model; on a GPU with ``tensors`` time the
    best ``top_k`` (superoptimize's first bucket), else take the predicted best."""
    spec, origin = specialised_pool(pool, values)
    rows = rank(spec, device, bf16_dot_in_fp32=(target == "interpreter"))
    if target == "cuda" and tensors is None:  # a bucket met at call time: no timing
        row = next(r for r in rows if r.kernel is not None)
        row.config = candidate_configs(row.kernel, target, device.sms)[0]
        row.chosen = True
    else:
        row = choose(rows, target, tensors, top_k, device.sms, progress, values, device)
    guards, program = origin[id(row.program)]
    return BucketChoice(guards, program, row, row.config, dict(values), rows)


def time_new_buckets(target: str) -> bool:
    """Whether a bucket first met by a call is chosen by timing its configs on that call's
    tensors (``NEPTUNE_EQ_TIME_NEW_BUCKETS=1``, like ``torch.backends.cudnn.benchmark``:
    seconds once per bucket, kept in the disk cache), rather than by the cost model alone.
    Measured on an H200 (session 15, bench/backward_gpu.py): at S=2048 after a first call
    at 8192, a timed bucket ran the graphed training step 1.05x (window), 1.06x (13
    documents) and 1.05x (causal) faster than the cost model's pick.  Never while a CUDA
    graph is being captured."""
    import os
    if target != "cuda" or os.environ.get("NEPTUNE_EQ_TIME_NEW_BUCKETS", "0") in ("", "0"):
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

    def __getstate__(self):  # launchers hold compiled kernels: process-local
        state = dict(self.__dict__)
        state["launchers"] = OrderedDict()
        state["on_new_bucket"] = None
        state["bucket_choices"] = 0   # counts choices made in this process
        return state

    def add(self, choice: BucketChoice) -> None:
        self.buckets.setdefault(bucket_of(choice.sizes), []).append(choice)

    def choice_for(self, values: dict[str, int], tensors: dict | None = None) -> BucketChoice:
        for c in self.buckets.get(bucket_of(values), ()):
            if c.guards.hold(values):
                return c
        timed = None
        if tensors is not None and time_new_buckets(self.target):
            # the call's inputs, random ones where they do not fit, and fresh outputs
            timed = timing_tensors(bind(self.pool[0].program, values), tensors)
        c = choose_bucket(self.pool, values, self.target, self.device, timed)
        self.bucket_choices += 1
        self.add(c)
        if self.on_new_bucket is not None:
            self.on_new_bucket()
        return c

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

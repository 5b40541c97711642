"""Run the warp-specialised Gluon form (``lowering/gluon_ws.py``) on torch tensors.

Per call the launcher makes host TMA descriptors over 2-D views of the streamed inputs --
``a`` (the row tile, 64 rows per consumer warpgroup), ``b`` and ``c`` (one key block each)
-- and of the output a form stores by TMA (``lowering/gluon_epilogue``), flattened to
(rows of every batch and head, width).  The kernel finds its tile's first row from the
strides (``gluon_ws._row_base``), so the inputs (and that output) must be contiguous; a
call whose tensors are not runs the ``tl`` form of the same tiles instead (slower, never
wrong).  Keys past a head's end that a tile reads belong to the next head or
are zero-filled by TMA; the kernel masks them by the key extent.  A kernel whose mask
reads captured tensors takes their block summaries too, rebuilt per call by the tl
module's pre-pass (``runtime.block_summary``) at the form's row and ``B_L``-key blocks.
The key block is the config's (``gluon_form.KEY_BLOCKS``), not fixed by the form.
"""
from __future__ import annotations

import os
from dataclasses import replace

from ..ir import Program
from ..lowering.dependent_launch import PDL_FLAG
from ..lowering.gluon_tiles import CTA_ROWS, ROWS, sched_size
from ..lowering.gluon_form import KEY_BLOCKS, GluonForm
from ..lowering.kernelgen import KernelSource
from .gluon_device import gluon_unavailable
from .block_summary import SummaryPrepass
from .bound_call import _FRESH, _kept
from .tile_order import one_tile_per_program, tile_order, tile_work
from .launch import (FastLaunch, OutputMaker, current_stream, dependent_launch,
                     dependent_options, first_launch_dependent, host_queries, int_classes,
                     launch_hooks, written_outputs)
from .tma_launch import EncodedLaunch
from .launcher import Launcher, device_sms, import_source, same_outputs
from .tile_configs import TileConfig

GLUON_NEEDS = ("the warp-specialised form needs contiguous streamed inputs and output with "
               "a 16-byte aligned base")


def load_gluon(form: GluonForm):
    """The form's kernel function (imported once per source)."""
    return import_source(form.source, form.name, [form.name], interpret=False)[0]


def gluon_inputs_ok(ks: KernelSource, tensors: dict) -> bool:
    """Whether these tensors can be streamed by the form's descriptors."""
    form = ks.gluon
    # the output a TMA store writes (every form of the plan has the same ``o_store``),
    # where the call names it: the timer allocates its own, contiguous
    out = [form.o_store.tensor] if form.o_store and form.o_store.tensor in tensors else []
    for name in (*form.streamed, *out):
        t = tensors.get(name)
        if t is None or not t.is_contiguous() or t.data_ptr() % 16 or t.dim() < 2:
            return False
        if str(t.dtype).replace("torch.", "") != form.dtype:
            return False
    return True


def make_launcher(program: Program, ks: KernelSource, target: str, config: TileConfig,
                  size_args: tuple = ()):
    """The launcher of ``config``: the Gluon form's for a ``gluon_ws`` config, else the
    ``tl`` kernel's (``launcher.Launcher``)."""
    if config.gluon_ws:
        return GluonLauncher(program, ks, target, config, size_args)
    return Launcher(program, ks, target, config, size_args)


class GluonLauncher:
    """One compiled Gluon form with its argument order and grid (on a Hopper GPU only)."""
    gluon = True         # replayed by ``GluonBoundCall``, not ``bound_call.BoundCall``

    def __init__(self, program: Program, ks: KernelSource, target: str, config: TileConfig,
                 size_args: tuple = ()):
        form = getattr(ks, "gluon", None)
        if form is None:
            raise ValueError(f"Config {config}: this kernel has no warp-specialised Gluon form "
                             "(its plan is outside lowering/gluon_ws.py's scope).")
        why = "the Triton interpreter cannot run Gluon" if target != "cuda" else gluon_unavailable()
        if why is not None:
            raise ValueError(f"Config {config}: the warp-specialised Gluon form cannot run "
                             f"here: {why}. Use a tl config (gluon_ws=False).")
        rows = config.blocks.get(f"B_{ks.block_axis}", CTA_ROWS)
        key_block = config.blocks.get("B_L", form.default_key_block)
        # two consumer warpgroups per program, or one; or the dynamic walk's form
        form = form.form_for(rows, config.dynamic)
        if form is None and config.dynamic:
            raise ValueError(f"Config {config}: a dynamic walk is a form of a data mask's "
                             f"{CTA_ROWS}-row Gluon tiles; this kernel has none at "
                             f"{rows} rows. Drop dynamic=True.")
        if form is None or key_block not in KEY_BLOCKS:
            runs = sorted({f.rows for f in (ks.gluon, ks.gluon.solo, ks.gluon.wide)
                           if f is not None})
            raise ValueError(f"Config {config}: the Gluon form runs programs of "
                             f"{' or '.join(map(str, runs))} rows with key blocks of "
                             f"{' or '.join(map(str, KEY_BLOCKS))}, got {config.blocks}.")
        if config.heads_first and not form.heads_first_ok:
            raise ValueError(f"Config {config}: heads first is a launch order of a Gluon form "
                             "that runs one program per tile and reads its tile off either "
                             "grid; this form does not.")
        self.program, self.ks, self.target, self.config = program, ks, target, config
        self.size_args = tuple(size_args)
        self.form = form
        self.fn = load_gluon(form)
        tiles = (-(-ks.row_extent // rows), ks.grid_size)
        self._order: list[int] = []   # the tile order of a scheduled form (host copy)
        self._order_on: dict = {}      # ... on each device it ran on
        if form.persistent:  # one program per SM (at most one per tile) walks the tiles
            import torch
            sms = device_sms(torch.cuda.current_device())
            n_tiles = tiles[0] * tiles[1]
            # (``per_tile``: the same kernel, a program per tile -- each walks one)
            self.grid = (n_tiles if config.per_tile else min(sms, n_tiles), 1)
            own = form.skips_blocks(key_block)  # (each consumer's own blocks are its work)
            if form.scheduled:  # tiles of unequal work: the balanced order, once
                keys = [n for n in _key_extents(ks) if isinstance(n, int)]
                work = tile_work(tiles[0], rows, max(keys, default=ks.row_extent), key_block,
                                 *form.key_offsets,
                                 consumer_rows=ROWS if own else None,
                                 row_extent=ks.row_extent if own and form.own_past_rows
                                 and isinstance(ks.row_extent, int) else None)
                self._order = (one_tile_per_program(work, tiles[1]) if config.per_tile
                               else tile_order(work, tiles[1], self.grid[0]))
        elif config.per_tile:
            raise ValueError(f"Config {config}: one program per tile is a launch choice of a "
                             "persistent Gluon form; this form already runs one per tile.")
        else:  # (heads first: the kernel reads the order off the grid, gluon_tiles.grid_order)
            self.grid = tiles[::-1] if config.heads_first else tiles
        self.tensors = [n[:-len("_ptr")] for n in form.params]  # summaries last
        self.consts = dict(B_L=key_block, STAGES=config.num_stages,
                           EVEN_L=_even_keys(ks, key_block))
        if form.o_store:  # the output by TMA where its buffers fit (gluon_epilogue)
            self.consts["TMA_O"] = form.tma_store_fits(key_block, config.num_stages)
        self._pre = None
        # the form right after the pre-pass is launched dependent on it (its key range
        # waits for the summaries, ``dependent_launch.WAIT_FOR_PREPASS``); a dynamic walk's
        # ranges kernel comes between them, launched dependent on the pre-pass (it waits
        # first thing, then releases the form, which waits before its warps split)
        dependent = dependent_launch("cuda")
        self.pdl = bool(ks.prepass) and dependent
        if ks.prepass:  # the tl module's pre-pass, at this form's blocks
            pre_fn = import_source(ks.source, ks.name, [ks.prepass.kernel], interpret=False)[0]
            self._pre = SummaryPrepass(ks.prepass, {f"B_{ks.block_axis}": rows,
                                                    "B_L": key_block}, pre_fn,
                                       pdl=self.pdl,
                                       first=first_launch_dependent(ks, dependent),
                                       sizes=dict(zip(ks.size_params, self.size_args)))
        self._ranges, self._sched_n = None, 0
        if form.ranges:  # a dynamic walk: each tile's key range, after the summaries
            kname, source = form.ranges
            fn = import_source(source, kname, [kname], interpret=False)[0]
            self._ranges = FastLaunch(fn, tiles, {"B_L": key_block, PDL_FLAG: self.pdl},
                                      dependent_options({"num_warps": 4, "num_stages": 1},
                                                        self.pdl))
            self._sched_n = sched_size(tiles[0] * tiles[1], self.grid[0])
        self._twin = None
        from triton.experimental.gluon import language as gl
        gdt = getattr(gl, form.dtype)
        self._tiles = [(name, [rows, w], gl.NVMMASharedLayout.get_default_for([rows, w], gdt))
                       for name, rows, w in form.tiles(key_block)]
        # Triton's own launch re-binds ~30 arguments per call (tens of µs, longer than a
        # short prefill runs): after one checked launch per key, ``FastLaunch`` calls the
        # compiled kernel directly, as the tl kernels' ``Launcher`` does
        self.options = dependent_options(form.options(key_block, config.num_stages), self.pdl)
        self._launch = FastLaunch(self.fn, self.grid, self.consts, self.options)
        self._checked: dict = {}
        self._described: dict = {}  # descriptor slot -> (signature, its fields but the base)
        self._encoded: dict = {}  # id(compiled kernel) -> (it, its EncodedLaunch or None)
        self.fast_ok = os.environ.get("NEPTUNE_EQ_FAST_LAUNCH", "1") != "0"
        self.fast_reason = "" if self.fast_ok else "off (NEPTUNE_EQ_FAST_LAUNCH=0)"

    def _descriptors(self, tensors: dict, reuse: bool = False) -> list:
        """The host TMA descriptors of the streamed and resident tiles (``_descriptor``)."""
        return [self._descriptor(k, tensors[name], reuse) for k, (name, _, _) in
                enumerate(self._tiles)]

    def _descriptor(self, k: int, t, reuse: bool = False):
        """Slot ``k``'s host TMA descriptor over ``t``.  With ``reuse`` (a replay), a tensor
        of the signature its slot last described -- shape, strides, dtype -- at a 16-byte
        aligned address gets that descriptor's fields with only its base replaced:
        constructing them (a view, the dataclass's checks) took about a quarter of a causal
        fwd+bwd's host time at S=2048 (11 descriptors a step, 245 of ~1600 us under
        cProfile, H200 host, session 30).  The kept fields hold no tensor."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        _, block, layout = self._tiles[k]
        flat = t.view(-1, t.shape[-1])
        kept = self._described.get(k) if reuse else None
        if kept is not None and kept[0] == (t.shape, t.stride(), t.dtype) \
                and not t.data_ptr() & 15:
            d = object.__new__(TensorDescriptor)
            d.__dict__.update(kept[1])
            d.base = flat
            return d
        d = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)
        self._described[k] = ((t.shape, t.stride(), t.dtype),
                              {f: v for f, v in d.__dict__.items() if f != "base"})
        return d

    def _pointers(self, tensors: dict, dev: int) -> list:
        """The kernel's pointer arguments, in order."""
        if self._order:  # the launcher's own argument, kept on each device it runs on
            if dev not in self._order_on:
                import torch
                self._order_on[dev] = torch.tensor(self._order, dtype=torch.int32, device=dev)
            tensors = {**tensors, "tile_order": self._order_on[dev]}
        return [tensors[n] for n in self.tensors]

    def integer_args(self, tensors: dict) -> tuple[list, tuple]:
        """(the kernel's integer arguments -- every pointer's strides, then the sizes --
        and their classes under Triton's specialisation): fixed by the input signature."""
        import torch
        ints = [s for t in self._pointers(tensors, torch.cuda.current_device())
                for s in t.stride()] + list(self.size_args)
        return ints, int_classes(ints)

    def _args(self, tensors: dict, integers: tuple | None = None) -> tuple[list, tuple]:
        """The kernel's arguments and the key a checked fast launch is reused under."""
        rest, key = self._rest(tensors, integers)
        return self._descriptors(tensors) + rest, key

    def _rest(self, tensors: dict, integers: tuple | None = None,
              pointers: bool = False, dev: int | None = None) -> tuple[list, tuple]:
        """(the kernel's arguments after its descriptors, the launch key); ``integers``:
        ``integer_args`` of these tensors' signature, if known (a replay); ``pointers``:
        the tensors go in as their data pointers (ints: see ``BoundCall.__call__``);
        ``dev``: the current device, where the caller has asked already."""
        if dev is None:
            import torch
            dev = torch.cuda.current_device()
        ptrs = self._pointers(tensors, dev)
        addrs = [t.data_ptr() for t in ptrs]
        ints, classes = integers or self.integer_args(tensors)
        key = (dev, tuple([a & 15 == 0 for a in addrs]), classes)
        return (addrs if pointers else ptrs) + ints, key

    def _summarised(self, tensors: dict) -> tuple[dict, tuple | None]:
        """``tensors`` with fresh (unfilled) summaries -- and a dynamic walk's
        ``tile_sched`` -- and the pre-pass launch that fills them with its arguments;
        (tensors, None) without a data mask."""
        if self._ranges is not None:  # filled by the ranges kernel (``_fast``, ``_slow``)
            import torch  # (a mask reading a tensor at the grid's indices has no summaries)
            device = tensors[self.form.streamed[0]].device
            tensors = {**tensors, "tile_sched": torch.empty(self._sched_n, dtype=torch.int32,
                                                            device=device)}
        if self._pre is None:
            return tensors, None
        sums, launch, args, ints = self._pre.prepare(tensors)
        return {**tensors, **sums}, (launch, args + ints, int_classes(ints))

    def _fast(self, ck: tuple, pre, tensors: dict, rest: list, stream,
              reuse: bool = False) -> None:
        """The checked launches of a call: pre-pass, ranges kernel, the form (``rest``:
        its arguments after the descriptors, ``_rest``)."""
        if pre:
            pre[0].fast(ck[0], pre[1], stream)
        if self._ranges is not None:
            self._ranges.fast(ck[2], rest, stream)
        self._launch_form(ck[1], tensors, rest, stream, reuse)

    def _launch_form(self, ck, tensors: dict, rest: list, stream, reuse: bool) -> None:
        """The form's checked launch: through ``tma_launch.EncodedLaunch`` (descriptors
        encoded once per address) where this Triton's launcher allows it and no launch
        hook (a profiler's) is set, else ``FastLaunch`` with descriptors made here."""
        enc = self._encoded.get(id(ck))
        if enc is None:
            enc = self._encoded[id(ck)] = (ck, EncodedLaunch.of(ck, len(self._tiles)))
        if enc[1] is None or launch_hooks(self._launch._hooks) != (None, None):
            self._launch.fast(ck, self._descriptors(tensors, reuse) + rest, stream)
            return
        enc[1].launch(self._launch.grid, stream, [tensors[n] for n, _, _ in self._tiles],
                      lambda k: self._descriptor(k, tensors[self._tiles[k][0]], reuse),
                      rest + self._launch.const_values)

    def _slow(self, pre, args: list) -> tuple:
        """Triton's own launches of a call, in order; what ``_fast`` replays."""
        pre_ck = pre[0].slow(pre[1]) if pre else None
        ranges_ck = (self._ranges.slow(args[len(self.form.descs):])
                     if self._ranges is not None else None)
        return pre_ck, self._launch.slow(args), ranges_ck

    def _tl_twin(self) -> Launcher:
        """The ``tl`` form of the same tiles, for calls the descriptors cannot take."""
        if self._twin is None:
            self._twin = Launcher(self.program, self.ks, self.target,
                                  replace(self.config, gluon_ws=False, num_warps=8), self.size_args)
        return self._twin

    def __call__(self, tensors: dict):
        if not gluon_inputs_ok(self.ks, tensors):
            return self._tl_twin()(tensors)
        for name in self.ks.scattered:  # every program adds its rows' terms into these
            tensors[name].zero_()
        tensors, pre = self._summarised(tensors)
        rest, key = self._rest(tensors)
        key = key + (pre[2] if pre else (),)  # the pre-pass's sizes count too
        ck = self._checked.get(key) if self.fast_ok else None
        if ck is not None:
            self._fast(ck, pre, tensors, rest, current_stream(key[0]))
            return
        ck = self._slow(pre, self._descriptors(tensors) + rest)
        if self.fast_ok:
            self._check_fast(tensors, key, ck)

    def _check_fast(self, tensors: dict, key: tuple, ck) -> None:
        """Launch the fast way into fresh outputs (and fresh summaries); keep it only if
        they are bit-identical to Triton's own launch (atomically summed outputs: equal up
        to the order of the adds)."""
        import torch
        fresh = {n: (torch.zeros_like if n in self.ks.scattered else torch.empty_like)(tensors[n])
                 for n in self.program.outputs}
        fresh, pre = self._summarised({**tensors, **fresh})
        rest, key2 = self._rest(fresh)
        if key2 + (pre[2] if pre else (),) != key:
            return  # fresh outputs align differently: check on a later call
        compared = list(self.program.outputs) + [s.name for s in self.ks.summaries]
        try:
            self._fast(ck, pre, fresh, rest, current_stream(key[0]))
            same = same_outputs(self.ks, tensors, fresh, compared)
        except Exception as e:  # noqa: BLE001 - Triton internals differ: keep its launch
            self.fast_ok, self.fast_reason = False, f"off: direct launch failed ({e})"
            return
        if same:
            self._checked[key] = ck
        else:
            self.fast_ok, self.fast_reason = False, "off: direct launch differed from Triton's"

    def compile(self, tensors: dict) -> None:
        """Compile without launching (Triton's ``warmup``), as ``Launcher.compile``."""
        if not gluon_inputs_ok(self.ks, tensors):
            return self._tl_twin().compile(tensors)
        args = self._args(self._summarised(tensors)[0])[0]
        self.fn.warmup(*args, grid=self.grid, **self.consts, **self.options)
        if self._ranges is not None:
            self._ranges.fn.warmup(*args[len(self.form.descs):], grid=self._ranges.grid,
                                   **self._ranges.consts, **self._ranges.options)


class GluonBoundCall:
    """A Gluon launcher's call at an input signature met before (``bound_call``'s
    counterpart), for short calls whose host time is the step's: the outputs are
    allocated from the signature, the integer arguments (strides, sizes) were read once,
    and a launch key checked before launches the compiled kernel directly -- without the
    general call's per-call work (reading the named sizes off the inputs, checking them,
    finding the size's launcher, reading every stride).  H100, causal S=2048, where the
    general call left a fwd+bwd on the Gluon forms host-bound (1016 us of host per step
    for 401 us of kernels, ``bench/backward_gpu.py --host-profile``).  The descriptors
    are made per call (they hold the data pointers); a call whose key was not checked
    (a first call, a pointer off 16-byte alignment) takes the launcher's own path.  A data
    mask's summary pre-pass is launched per call ahead of the form, its plan fixed by the
    signature and its summaries kept per stream as ``bound_call.BoundCall`` keeps them:
    without the replay a short call was host-bound -- jagged sequences at S=8192 on the
    one-consumer form, 0.140 ms on the device, took 0.347 ms a call (148 us of host,
    H100, session 37).  A dynamic walk's scheduler buffer (``tile_sched``, which its
    ranges kernel fills after the pre-pass) is kept per stream the same way."""

    def __init__(self, launcher: GluonLauncher, names: list[str], tensors: dict,
                 outputs: list[str]):
        if launcher.form.ranges and launcher._pre is None:
            raise ValueError("a dynamic walk's ranges kernel reads the summaries of a "
                             "pre-pass; this launcher has none")
        if not gluon_inputs_ok(launcher.ks, tensors):
            raise ValueError("inputs the descriptors cannot stream run the tl twin")
        self.launcher, self.names, self.outputs = launcher, list(names), list(outputs)
        self.device = tensors[self.names[0]].device
        self.out_specs = [(tuple(tensors[n].shape), tensors[n].dtype) for n in self.outputs]
        self.make_outputs = OutputMaker(self.out_specs, self.device)
        self.zeroed = [k for k, n in enumerate(self.outputs) if n in launcher.ks.scattered]
        example = dict(tensors)
        self.pre = None  # (captured tensors' names, summaries, launch, its int arguments)
        if launcher._pre is not None:  # the summaries' strides are the signature's too
            xs, (outs, tail, launch) = launcher._pre.plan_for(example)
            ints = [v for x in xs for v in (*x.shape, *x.stride())] + tail
            self.pre = ([t for t, _ in launcher._pre.pre.tensors], outs, launch, ints,
                        int_classes(ints))
            example.update(self._new_summaries())
        self._summaries: dict = {}  # (stream, thread) -> this signature's summaries
        self._scheds: dict = {}     # ... a dynamic walk's ``tile_sched``
        if launcher.form.ranges:
            example["tile_sched"] = self._new_sched()
        self.integers = launcher.integer_args(example)

    def _new_summaries(self) -> dict:
        """Summaries of this signature by name, unfilled (each call's pre-pass fills them)."""
        specs = self.pre[1]
        made = written_outputs([(sh, dt) for _, sh, dt in specs], self.device)
        return {n: t for (n, _, _), t in zip(specs, made)}

    def _new_sched(self):
        """A dynamic walk's scheduler buffer, unfilled (each call's ranges kernel fills it
        and zeroes its tile counter)."""
        import torch
        return torch.empty(self.launcher._sched_n, dtype=torch.int32, device=self.device)

    def __call__(self, inputs: list) -> list:
        """Launch on ``inputs`` (tensors of this signature, in call order); the outputs."""
        outs = self.make_outputs()
        tensors = {**dict(zip(self.names, inputs)), **dict(zip(self.outputs, outs))}
        la = self.launcher
        if la.fast_ok:
            host = host_queries()
            dev = host.device()
            stream = host.stream(dev)
            pre, run = None, tensors
            if self.pre:  # this call's summaries (kept per stream) and their pre-pass launch
                names, _, launch, ints, classes = self.pre
                kept = _FRESH if host.capturing() else stream
                sums = _kept(self._summaries, kept, self._new_summaries)
                run = {**tensors, **sums}
                if la.form.ranges:
                    run["tile_sched"] = _kept(self._scheds, kept, self._new_sched)
                # pointers as ints, as ``BoundCall`` launches (``run`` holds the tensors
                # until the launches are issued: fresh summaries under a graph capture too)
                pre = (launch, [tensors[n].data_ptr() for n in names]
                       + [t.data_ptr() for t in sums.values()] + ints, classes)
            rest, key = la._rest(run, self.integers, pointers=True, dev=dev)
            ck = la._checked.get(key + (pre[2] if pre else (),))
            if ck is not None:
                for k in self.zeroed:  # every program adds its rows' terms into these
                    outs[k].zero_()
                if pre:
                    la._fast(ck, pre, run, rest, stream, reuse=True)
                else:
                    la._launch_form(ck[1], run, rest, stream, reuse=True)
                return outs
        la(tensors)
        return outs


def sm90_spec(program: Program, ks: KernelSource, stages: int = 2,
              key_block: int | None = None, form: GluonForm | None = None) -> dict:
    """The form's kernel signature for an offline sm_90 compile (``tests/sm90_compile.py``
    compiles it without a GPU: the interpreter cannot run Gluon, so this is how the CPU
    tests check every emitted form): pointer dtypes, descriptor tiles (rows, width, dtype),
    constexprs; every other argument is an i32.  ``form``: the plan's form (default) or
    its one-consumer form."""
    form = form or ks.gluon
    key_block = key_block or form.default_key_block
    short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32",
             "int64": "i64", "bool": "i1"}
    dtypes = {f"{t}_ptr": "*" + short[program.dtype_of(t)]
              for t in [ph.name for ph in program.inputs] + list(program.outputs)}
    for sp in ks.summaries:  # a summary has its tensor's dtype (booleans as int32)
        dt = program.dtype_of(sp.tensor)
        dtypes[f"{sp.name}_ptr"] = "*" + short["int32" if dt == "bool" else dt]
    if form.scheduled:
        dtypes["tile_order_ptr"] = "*i32"
    if form.ranges:
        dtypes["tile_sched_ptr"] = "*i32"
    return {"gluon": True, "num_warps": 4, "num_stages": 1,
            "options": form.options(key_block, stages),
            "dtypes": dtypes,
            "descs": {d: [rows, width, form.dtype]
                      for d, (_, rows, width) in zip(form.descs, form.tiles(key_block))},
            "constexprs": {"B_L": key_block, "STAGES": stages,
                           "EVEN_L": _even_keys(ks, key_block),
                           **({"TMA_O": form.tma_store_fits(key_block, stages)}
                              if form.o_store else {})}}


def _even_keys(ks: KernelSource, bl: int) -> bool:
    """The form's EVEN_L: every key extent is a whole number of ``bl``-key blocks (a named
    size not yet bound to a value counts as not)."""
    return all(isinstance(n, int) and n % bl == 0 for n in _key_extents(ks))


def _key_extents(ks: KernelSource) -> list:
    """The extents the key loop runs over (ints, or names of sizes not yet bound), as the
    kernel's EVEN_L flag records them."""
    return ks.even_flags.get("EVEN_L", ("B_L", []))[1]

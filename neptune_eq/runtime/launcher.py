"""Run: load generated Triton source, launch it on torch tensors, pick a tile config.

``target="auto"`` runs on CUDA when a GPU is present, else through the Triton
interpreter on CPU (slow; keep shapes small).  Tile configs are timed on the GPU only;
without one the defaults are used.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import os
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..lowering.kernelgen import COMBINE_ROWS, KernelSource
from ..lowering.dependent_launch import PDL_FLAG
from .block_summary import SummaryPrepass, build_summaries
from .descriptors import ensure_allocator, tma_ok
from .launch import (FastLaunch, _triton_int_specialisation, class_launch_key, current_stream,
                     dependent_launch, dependent_options, first_launch_dependent, launch_key,
                     written_outputs)
from ..ir import Program, ProgramError
from ..sizes import check_index_span
from .index_check import check_data_indices
from .triton_mode import check_interpreter_importable, enable_interpreter
from .tile_configs import TileConfig



def resolve_target(target: str) -> str:
    import torch
    if target not in ("auto", "cuda", "interpreter"):
        raise ValueError(f"Expected target 'auto', 'cuda' or 'interpreter', got {target!r}.")
    if target == "auto":
        if torch.cuda.is_available():
            return "cuda"
        warnings.warn("No CUDA GPU is visible: generated kernels run in the Triton interpreter on "
                      "CPU (slow; keep shapes small), and the cost model alone chooses the kernel. "
                      "Pass target='interpreter' to silence this.", RuntimeWarning, stacklevel=3)
        return "interpreter"
    if target == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("target='cuda' but torch sees no CUDA device; use target='auto' to "
                           "fall back to the Triton interpreter on CPU.")
    return target


def _cache_dir() -> Path:
    base = os.environ.get("NEPTUNE_EQ_CACHE") or os.path.join(tempfile.gettempdir(), "neptune_eq_cache")
    d = Path(base) / "kernels"
    d.mkdir(parents=True, exist_ok=True)
    return d


_LOADED_KERNELS: dict[tuple[str, bool], list] = {}  # (source, interpret) -> kernels


def load_kernel(ks: KernelSource, interpret: bool) -> list:
    """Import the generated module (Triton needs real source files); its kernels in
    launch order.  Remembered per source: a kernel with runtime sizes gets a launcher per
    size, and must not re-hash and re-stat its module every time."""
    done = _LOADED_KERNELS.get((ks.source, interpret))
    if done is not None:
        return done
    fns = _import_kernel(ks, interpret)
    _LOADED_KERNELS[(ks.source, interpret)] = fns
    return fns


def _import_kernel(ks: KernelSource, interpret: bool) -> list:
    return import_source(ks.source, ks.name, ks.kernel_names, interpret)


def import_source(source: str, name: str, kernel_names: list[str], interpret: bool) -> list:
    """The named kernels of a generated module, imported from a file in the cache folder
    (Triton and Gluon read a kernel's source from its file).  Thread-safe: the timer
    compiles configs on a thread pool, and two configs of one module (ring depths, key
    blocks) must neither share a temporary file nor see a module half executed."""
    digest = hashlib.sha256((source + str(interpret)).encode()).hexdigest()[:16]
    modname = f"neptune_eq_generated_{digest}"
    with _IMPORT_LOCK:
        if modname in sys.modules:
            return [getattr(sys.modules[modname], n) for n in kernel_names]
        path = _cache_dir() / f"{name}_{digest}.py"
        if not path.exists():  # (another process may write it too: each its own file)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(source)
            os.replace(tmp, path)
        if interpret:
            enable_interpreter()
            check_interpreter_importable()
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[modname]  # (never half a module for the next caller)
            raise
        return [getattr(mod, n) for n in kernel_names]


_IMPORT_LOCK = threading.Lock()


def same_outputs(ks: KernelSource, want: dict, got: dict, names) -> bool:
    """Whether a direct launch wrote what Triton's own launch did, for the tensors
    ``names``: bit for bit, except outputs summed atomically, which add in no fixed
    order (equal up to rounding)."""
    import torch
    return all(torch.allclose(want[n], got[n], rtol=1e-4, atol=1e-6) if n in ks.scattered
               else torch.equal(want[n].contiguous().view(torch.uint8),
                                got[n].contiguous().view(torch.uint8)) for n in names)


# kernel variant (source, constexprs, warps, stages, one-launch) -> launch key -> checked
# compiled kernels: shared by the launchers of one kernel at different runtime sizes.
_CHECKS_BY_VARIANT: dict[tuple, dict[tuple, list]] = {}
_INT_SPEC: list = []   # [Triton's int specialisation or None], looked up once


def _int_specialisation():
    if not _INT_SPEC:
        try:
            _INT_SPEC.append(_triton_int_specialisation())
        except Exception:  # noqa: BLE001 - an unexpected Triton: keep Triton's own launch
            _INT_SPEC.append(None)
    return _INT_SPEC[0]


@dataclass
class Launcher:
    """One compiled kernel (or partial + combine) with its argument order and grid.
    On a GPU, launches go through ``launch.FastLaunch`` once checked."""
    program: Program
    ks: KernelSource
    target: str
    config: TileConfig
    size_args: tuple = ()   # values of ks.size_params: a launcher serves one concrete size
    fns: list = field(default=None, repr=False)

    def __post_init__(self):
        self.fns = load_kernel(self.ks, self.target == "interpreter")
        consts = dict(self.ks.tunables)
        consts.update(self.config.blocks)
        for flag, (block, extents) in (self.ks.even_flags or {}).items():
            consts[flag] = all(n % consts[block] == 0 for n in extents)
        if self.config.warp_specialize and not self.config.tma:
            raise ValueError(f"Config {self.config}: warp specialisation needs tma=True (Triton "
                             "specialises only loops whose loads are all TMA loads).")
        # lowering choices (constexprs of every generated kernel, ``lowering/descriptors``);
        # a kernel without descriptor tiles has nothing to switch
        tma = self.config.tma and bool(getattr(self.ks, "descriptors", None))
        if self.config.vector_dot and not getattr(self.ks, "vector_dot", False):
            raise ValueError(f"Config {self.config}: this kernel's contractions have no "
                             "CUDA-core form (it has more than codegen.VDOT_ROWS rows).")
        consts.update(TMA=tma, WS=tma and self.config.warp_specialize,
                      LOOP_STAGES=self.config.loop_stages or self.config.num_stages,
                      VDOT=self.config.vector_dot,
                      ONE_LOOP=self.config.one_loop and getattr(self.ks, "one_loop", False))
        # the kernel after the pre-pass, and a split-k combine after the partials, are
        # launched dependent on the kernel before where the GPU can
        # (``launch.dependent_launch``): their launch overlaps that kernel.  After a pre-pass
        # that only guards ids (no summaries) the kernel never waits: the two run side by side
        dependent = dependent_launch(self.target)
        self.pdl = bool(self.ks.prepass) and dependent
        # ... and a call's first of two or more launches (the pre-pass, split-k's partials)
        # on whatever kernel ran before it in the stream, which it waits for first thing
        # (``lowering/dependent_launch.wait_then_release``: measured there)
        self.pdl_first = (first_launch_dependent(self.ks, dependent)
                          and (bool(self.ks.prepass) or not self.config.fused))
        # The combine after the partials is compiled to wait for them and launched
        # dependent, as called and in CUDA graphs; the partials release it first thing
        # (``dependent_launch.release_first``).  As called that gained 1.3-1.5 us a call
        # (launches queued behind a busy GPU, session 40); graphed, GQA decode at 2048
        # keys 8.19 -> 7.50 us against the plain launch (H200, session 52,
        # ``bench/probe/decode_trigger.py``).  NEPTUNE_EQ_PDL_COMBINE=0 turns it off.
        self.pdl_combine = (bool(self.ks.split_extent) and dependent
                            and os.environ.get("NEPTUNE_EQ_PDL_COMBINE", "1") != "0")
        if self.ks.summaries or self.ks.split_extent:  # (the modules with the flag)
            consts[PDL_FLAG] = self.pdl or self.pdl_combine or self.pdl_first
        self.consts = consts
        self.tma = tma
        self._pointer_twin = None  # the pointer form, for calls whose tensors TMA cannot take
        self.options = dict(num_warps=self.config.num_warps, num_stages=self.config.num_stages)
        self.stride_of = sorted({t for t, _ in self.ks.stride_params})
        self.fast_ok = (self.target == "cuda"
                        and os.environ.get("NEPTUNE_EQ_FAST_LAUNCH", "1") != "0")
        self.fast_reason = "" if self.fast_ok else "off (interpreter or NEPTUNE_EQ_FAST_LAUNCH=0)"
        self._checked: dict[tuple, list] = {}
        self._int_class = None
        # Block summaries are rebuilt from the data on every call by one pre-pass launch
        # (the last kernel of the module); a kernel cached before the pre-pass existed
        # builds them with torch.
        self._pre = (SummaryPrepass(self.ks.prepass, consts, self.fns[-1],
                                    pdl=self.pdl, first=self.pdl_first,
                                    sizes=dict(zip(self.ks.size_params, self.size_args)))
                     if self.ks.prepass else None)
        self._last_summaries: dict = {}
        if self.size_args and self.fast_ok:
            # A kernel with runtime sizes meets a new size on most calls (a growing KV
            # cache), and one launcher serves one size: checks are shared by every
            # launcher of this kernel variant and keyed on Triton's own classes of the
            # integer arguments, so a size of a class already checked launches directly.
            self._int_class = _int_specialisation()
            if self._int_class is None:
                self.fast_ok, self.fast_reason = False, "off (runtime sizes on this Triton)"
            else:
                variant = (self.ks.source, tuple(sorted(consts.items())),
                           self.config.num_warps, self.config.num_stages, self.config.fused)
                self._checked = _CHECKS_BY_VARIANT.setdefault(variant, {})
                if "failed" in self._checked:  # a launcher of this variant failed its check
                    self.fast_ok, self.fast_reason = False, self._checked["failed"]
        self._sems: dict = {}  # (device, stream) -> zeroed counters of the one-launch split-k
        self._chunks = self.chunking() if self.ks.split_extent else None
        self._launches = self._plan_launches()

    def grid(self) -> tuple[int, int]:
        blk = self.config.blocks.get(f"B_{self.ks.block_axis}", self.ks.tunables[f"B_{self.ks.block_axis}"])
        return (-(-self.ks.row_extent // blk), self.ks.grid_size)

    def chunking(self) -> tuple[int, int]:
        """(CHUNK, NSPLIT): chunks of whole key blocks, at most ``splits`` of them."""
        bl = self.config.blocks.get("B_L", self.ks.tunables["B_L"])
        blocks = -(-self.ks.split_extent // bl)
        per = -(-blocks // max(1, self.config.splits))
        chunk = per * bl
        return chunk, -(-self.ks.split_extent // chunk)

    def _combine_shape(self, nsplit: int, spread_width: bool = True) -> tuple[int, dict, int]:
        """(B_P, constexpr overrides, programs along grid axis 2) of the combine kernel.
        Each step folds B_P partials as one tile of B_P x rows x width (at most
        ``COMBINE_TILE`` values); where the combine may spread the width axis over
        programs, it takes all partials in one step and as many programs as that leaves
        width for."""
        rows, tile = self._combine_rows(fused=not spread_width), COMBINE_TILE
        all_p = 1 << max(1, (nsplit - 1).bit_length())
        if self.ks.combine_width and spread_width:
            axis, ext = self.ks.combine_width
            bp = min(all_p, 64)
            bw = max(16, min(ext, _pow2_floor(tile // (bp * rows))))
            # A decode's combine has few rows: spread the width further while its programs
            # do not yet fill the SMs once, down to one 128-byte line of fp32 a row
            programs = self._combine_grid(rows)[0] * self.ks.grid_size
            while bw > COMBINE_LINE and programs * -(-ext // bw) < self._sms():
                bw //= 2
            bp = max(2, min(bp, _pow2_floor(max(1, tile // (rows * bw)))))
            return bp, {f"B_{axis}": bw}, -(-ext // bw)
        width = max(self.ks.scratch.values())
        return max(2, min(64, tile // (rows * width), all_p)), {}, 1

    def _sms(self) -> int:
        """Streaming multiprocessors of the GPU this launcher runs on (an H100/H200's
        132 in the interpreter, where the combine's shape only has to be valid)."""
        if self.target != "cuda":
            return 132
        import torch
        return device_sms(torch.cuda.current_device())

    def _combine_rows(self, fused: bool) -> int:
        """Rows a combine folds per program (``kernelgen.COMBINE_ROWS``): the
        row block where it is full, else the row count rounded up to a power of two.
        A two-launch combine that runs later passes (``combine_min_rows``) takes fewer,
        down to that minimum, until it has ``COMBINE_PROGRAMS``: linear + cross-entropy's
        target logit, a gathered dot over K per row, ran in 4 programs of 128 rows."""
        rows = self.consts[f"B_{self.ks.block_axis}"]
        if self.ks.row_extent < rows:
            rows = 1 << max(0, (self.ks.row_extent - 1).bit_length())
        least = self.ks.combine_min_rows
        if fused or not least:
            return rows
        per = _pow2_floor(max(1, self.ks.row_extent * self.ks.grid_size // COMBINE_PROGRAMS))
        return max(least, min(rows, per))

    def _combine_grid(self, rows: int) -> tuple[int, int]:
        return (-(-self.ks.row_extent // rows), self.ks.grid_size)

    def _plan_launches(self):
        """One FastLaunch per kernel, in launch order: fixed per launcher."""
        # the launch after the pre-pass, or the call's first
        first = dependent_options(self.options, self.pdl or (self.pdl_first and not self._pre))
        if not self.ks.split_extent:
            return [FastLaunch(self.fns[0], self.grid(), self.consts, first)]
        _, nsplit = self._chunks
        if self.config.fused:  # one program per row block combines: no width split
            bp = self._combine_shape(nsplit, spread_width=False)[0]
            return [FastLaunch(self.fns[2], self.grid() + (nsplit,),
                               {**self.consts, "B_P": bp, COMBINE_ROWS: self._combine_rows(True)},
                               first)]
        bp, over, nw = self._combine_shape(nsplit)
        rows = self._combine_rows(False)
        return [FastLaunch(self.fns[0], self.grid() + (nsplit,), self.consts, first),
                FastLaunch(self.fns[1], self._combine_grid(rows) + (nw,),
                           {**self.consts, **over, "B_P": bp, COMBINE_ROWS: rows},
                           dependent_options(self.options, self.pdl_combine))]

    def _arg_lists(self, tensors: dict) -> tuple[list[list], tuple | None, int | None, list]:
        """Arguments of each kernel in launch order, the fast-launch key, the stream the
        launches go to (looked up once per call; None in the interpreter), and the
        launches themselves (the summary pre-pass first, when the kernel has one)."""
        for name in self.ks.scattered:  # every program adds its rows' terms into these
            tensors[name].zero_()
        pre = None
        if self._pre is not None:  # the masks' data changes per call: summarise it (O(S))
            sums, pre_launch, pre_args, pre_ints = self._pre.prepare(tensors)
            pre = (pre_launch, pre_args + pre_ints)
            tensors = {**tensors, **sums}
            self._last_summaries = sums
        elif self.ks.summaries:
            tensors = {**tensors, **build_summaries(self.ks.summaries, tensors, self.consts)}
        args = [tensors[n[:-4]] for n in self.ks.params]
        st = {t: tensors[t].stride() for t in self.stride_of}
        strides = [st[t][k] for t, k in self.ks.stride_params] + list(self.size_args)
        key = None
        if self.fast_ok:
            ints = strides + pre_ints if pre else strides  # the pre-pass's sizes count too
            key = (class_launch_key(args, ints, self._int_class) if self._int_class
                   else launch_key(args, ints))
        lists, key, stream = self._main_arg_lists(args, strides, key)
        if pre is None:
            return lists, key, stream, self._launches
        return [pre[1]] + lists, key, stream, [pre[0]] + self._launches

    def _main_arg_lists(self, args: list, strides: list, key) -> tuple[list[list], tuple, int]:
        import torch
        stream = None  # needed by the direct launch and the one-launch split-k's counters
        if key is not None:
            stream = current_stream(key[0])
        elif self.target == "cuda" and self.config.fused:
            stream = current_stream(torch.cuda.current_device())
        if not self.ks.split_extent:
            return [args + strides], key, stream
        chunk, nsplit = self._chunks
        rows = nsplit * self.ks.grid_size * self.ks.row_extent
        sizes = [rows * w for w in self.ks.scratch.values()]
        # one scratch allocation, cut into the fold states (each 16-byte aligned)
        pad = [-(-n // 4) * 4 for n in sizes]
        buf = written_outputs([((sum(pad),), torch.float32)], args[0].device)[0]
        ws = [buf[at:at + n] for n, at in zip(sizes, itertools.accumulate([0] + pad))]
        if self.config.fused:
            sem = self._semaphores(args[0].device, stream)
            return [args + ws + [sem] + strides + [chunk, nsplit]], key, stream
        return [args + ws + strides + [chunk], args + ws + strides + [nsplit]], key, stream

    def _semaphores(self, device, stream):
        """Arrival counters of the one-launch split-k, one per row-block program: zero
        before a launch, and the last arrival resets its own, so they stay zero between
        launches.  One buffer per stream: launches on different streams may overlap."""
        import torch
        where = (device, stream)
        sem = self._sems.get(where)
        if sem is None:
            rows, grid = self.grid()
            sem = self._sems[where] = torch.zeros(rows * grid, dtype=torch.int32, device=device)
        return sem

    def _pointer_form(self, tensors: dict):
        """``self``, or the same tiles with pointer loads when these tensors break TMA's
        alignment rules (a view with odd strides, a head dim of 8 bytes ...)."""
        if not self.tma:
            return self
        if tma_ok(self.ks.descriptors, tensors):
            if self.target == "cuda":
                ensure_allocator()  # per call: Triton keeps the allocator per thread context
            return self
        if self._pointer_twin is None:
            self._pointer_twin = Launcher(self.program, self.ks, self.target,
                                          self.config.pointer_form, self.size_args)
        return self._pointer_twin

    def __call__(self, tensors: dict):
        run = self._pointer_form(tensors)
        if run is not self:
            return run(tensors)
        arg_lists, key, stream, steps = self._arg_lists(tensors)
        if self.target == "interpreter":
            check_data_indices(self.program, tensors)  # data on the host: torch's rule
            for fl, a in zip(steps, arg_lists):
                fl.fn[fl.grid](*a, **fl.consts, **fl.options)
            return
        cks = self._checked.get(key) if key is not None else None
        if cks is not None:
            for fl, ck, a in zip(steps, cks, arg_lists):
                fl.fast(ck, a, stream)
            return
        cks = [fl.slow(a) for fl, a in zip(steps, arg_lists)]
        if key is not None:
            self._check_fast(tensors, key, cks, steps)

    def compile(self, tensors: dict) -> None:
        """Compile every kernel of this launcher for ``tensors`` without launching it
        (Triton's ``warmup``): what ``compile_in_parallel`` runs on its threads."""
        if self.tma and not tma_ok(self.ks.descriptors, tensors):
            return self._pointer_form(tensors).compile(tensors)
        arg_lists, _, _, steps = self._arg_lists(tensors)
        for fl, a in zip(steps, arg_lists):
            fl.fn.warmup(*a, grid=fl.grid, **fl.consts, **fl.options)

    def _check_fast(self, tensors: dict, key: tuple, cks: list, steps: list) -> None:
        """Launch the fast way into fresh outputs (and fresh summaries); keep it only if
        both are bit-identical to Triton's own launch."""
        import torch
        outs = {n: torch.empty_like(tensors[n]) for n in self.program.outputs}
        want = {**{n: tensors[n] for n in outs}, **self._last_summaries}
        arg_lists, key2, stream, _ = self._arg_lists({**tensors, **outs})
        if key2 != key:
            return  # fresh outputs align differently: check on a later call
        got = {**outs, **self._last_summaries}
        try:
            for fl, ck, a in zip(steps, cks, arg_lists):
                fl.fast(ck, a, stream)
            same = same_outputs(self.ks, want, got, want)
        except Exception as e:  # noqa: BLE001 - Triton internals differ: keep the normal path
            self._fast_off(f"off: direct launch failed ({e})")
            return
        if same:
            self._checked[key] = cks
        else:
            self._fast_off("off: direct launch differed from Triton's")

    def _fast_off(self, reason: str) -> None:
        self.fast_ok, self.fast_reason = False, reason
        if self._int_class is not None:  # shared: the launchers of other sizes stop too
            self._checked["failed"] = reason


# Values per combine step (B_P x rows x width).  The one-launch combine shares the
# registers of the key loop before it (ptxas, sm_90: a 64 x 1 x 128 fp32 step spilled 36-64
# bytes after a 16 x 64 tensor-core loop; 32 x 1 x 128 none).  The two-launch combine
# spreads the width over more programs at this tile than at 8192: GQA decode's combine
# (32 partials x 8 heads) ran 2.60 vs 3.16 us at 2048 keys and 2.81 vs 3.33 at 8192, the
# decode 0.90 vs 0.84 TB/s from DRAM (H200, bench/results/decode_s24/).
COMBINE_TILE = 4096
COMBINE_PROGRAMS = 512  # a combine with later passes: about 4 programs an SM of an H100/H200
# The narrowest width a two-launch combine program takes while spreading the width to fill
# the SMs (``Launcher._combine_shape``): 32 fp32 values, one 128-byte line of a row.  Batched
# GQA decode's combine (B=4, 32/8 heads, 8 partials, 32 programs at 128 wide) ran 2.96 us at
# 128 wide, 2.18 at 64 and 1.74 at 32 (128 programs; cuDNN's reduction 2.13); B=1's (8
# programs a width, 16 partials) 2.60 at 64 wide, 2.18 at 32 and 2.51 at 16 (H200, session
# 49, ``bench/decode_configs.py --kernels --combine-tile``, bench/results/s49/).
COMBINE_LINE = 32


@functools.lru_cache(maxsize=None)
def device_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (asked once)."""
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def check_inputs(program: Program, args, kwargs, target: str, symbolic: bool = False) -> dict:
    """Bind positional/keyword tensors to placeholders with clear errors (``symbolic``:
    named sizes are read off the tensors by ``sizes.sizes_of``, not checked here)."""
    import torch
    names = [ph.name for ph in program.inputs]
    if len(args) > len(names):
        raise TypeError(f"Expected at most {len(names)} positional tensors ({names}), got {len(args)}.")
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"Unknown input {k!r}; the program's inputs are {names}.")
        if k in bound:
            raise TypeError(f"Input {k!r} given twice (positionally and by name).")
        bound[k] = v
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeError(f"Missing input(s) {missing}; call with {', '.join(names)} in this order "
                        "or by name.")
    want_device = "cuda" if target == "cuda" else "cpu"
    for ph in program.inputs:
        t = bound[ph.name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"Expected {ph.name} to be a torch.Tensor, got {type(t).__name__}.")
        if not symbolic and tuple(t.shape) != ph.shape:
            raise ProgramError(f"Expected {ph.name} with shape {ph.shape}, got {tuple(t.shape)}; "
                               "the kernel is specialised to the shapes it was built for — call "
                               "ne.superoptimize again for new shapes.")
        if str(t.dtype).replace("torch.", "") != ph.dtype:
            raise ProgramError(f"Expected {ph.name} with dtype {ph.dtype}, got "
                               f"{str(t.dtype).replace('torch.', '')}; convert it with "
                               f".to(torch.{ph.dtype}).")
        check_index_span(ph.name, t)
        if t.device.type != want_device:
            raise ProgramError(f"Expected {ph.name} on {want_device} (target {target}), got "
                               f"{t.device}; move it with .to('{want_device}').")
    return bound

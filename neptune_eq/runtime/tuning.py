"""Tuning: compile tile configs in parallel, then time them on the GPU one by one.

Each config's launcher comes from ``gluon_launch.make_launcher``: a ``tl`` kernel's
``Launcher`` or, for a ``gluon_ws`` config, the warp-specialised Gluon form's.

Every config is checked before it is timed: its outputs on the timing inputs must agree
with those of the same kernel launched plainly (``plain_config``: pointer loads, no
software pipelining, split-k in two launches).  Translation validation runs the kernel's
source in the interpreter at small sizes; what the GPU compiler makes of a pipelined
loop it never sees.  On an H200 (Triton 3.6) T5's split-k forward at S = 1024 -- 64 × 64
tiles, 4 warps, 3 stages -- came back wrong in every row, and right at 1 stage or 8
warps (session 60, ``bench/probe/splitk_fused_check_gpu.py``); the timer had chosen it.
"""
from __future__ import annotations

import dataclasses
import os
import warnings

from ..errors import DeviceFaultError
from ..ir import Program
from ..lowering.kernelgen import KernelSource
from .bound_call import BoundCall
from .descriptors import TMA_NEEDS, tma_ok
from .gluon_launch import GLUON_NEEDS, gluon_inputs_ok, load_gluon, make_launcher
from .launcher import load_kernel
from .tile_configs import TileConfig


def compile_threads() -> int:
    """Threads that compile tile configs at once (``NEPTUNE_EQ_COMPILE_THREADS``; 1 turns
    it off).  Triton's compile spends most of its time in MLIR/LLVM passes and ptxas, which
    do not hold the GIL, so threads overlap them."""
    env = os.environ.get("NEPTUNE_EQ_COMPILE_THREADS")
    if env is not None:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"Expected NEPTUNE_EQ_COMPILE_THREADS to be a positive int, got {env!r}.")
        return int(env)
    return max(1, min(16, os.cpu_count() or 1))


# (source, config) -> why it failed to compile on a thread: the timer records it without
# compiling it a second time (a failed warp-specialised compile costs seconds)
_COMPILE_FAILED: dict[tuple[str, str], str] = {}


def compile_in_parallel(jobs: list[tuple[Program, KernelSource, TileConfig]], target: str,
                        tensors: dict, values: dict | None = None) -> None:
    """Compile the (program, kernel, config) jobs on a thread pool before they are timed
    one by one: a cold choice compiles a dozen or more configs, ~1 s each.  A config that
    fails here is left for ``time_configs`` to record with its reason."""
    from concurrent.futures import ThreadPoolExecutor
    from ..sizes import bind
    threads = compile_threads()
    if target != "cuda" or threads == 1 or len(jobs) < 2:
        return
    values = values or {}
    # a persistent Gluon form launched one program per tile, or a form's programs launched
    # heads first, is the same kernel: its twin compiles it (on two threads at once each
    # compiled it anew: window prefill's cold build took 18.8-19.5 s against 14.5, H100,
    # session 29)
    jobs = [(p, ks, cfg) for p, ks, cfg in jobs if cfg == cfg.compiled_as or not any(
        k is ks and c == cfg.compiled_as for _, k, c in jobs)]

    def one(job):
        program, ks, cfg = job
        if ks.size_params:
            program, ks = bind(program, values), ks.concrete(values)
        try:
            make_launcher(program, ks, target, cfg.at(values),
                          tuple(values[s] for s in ks.size_params)).compile(tensors)
        except Exception as e:  # noqa: BLE001 - recorded when the config is timed
            msg = str(e).strip().splitlines()
            _COMPILE_FAILED[(ks.source, str(cfg.at(values)))] = msg[-1] if msg else type(e).__name__

    for ks in {id(k): k for _, k, _ in jobs}.values():  # import each module once, not racing
        load_kernel(ks.concrete(values) if ks.size_params else ks, False)
        if any(k is ks and cfg.gluon_ws for _, k, cfg in jobs):
            load_gluon(ks.gluon)
    with ThreadPoolExecutor(threads, thread_name_prefix="neptune_eq-compile") as pool:
        list(pool.map(one, jobs))


# A short call's Gluon config is timed on the GPU alone, as the tl configs are: timed from
# the host on a flushed L2 (as until session 45) it was charged what the graph replay of
# the tl configs is not -- GQA 64/8 S=512 on an H200: the Gluon form 24.3 us from the host
# against the tl 64x64 tile's 23.6 on the GPU, which as called took 28.7 us (SDPA 23.3).
# What the host timing guarded against still can: a launch path slower than the kernel
# (Triton's per-call re-binding made softcap S=512 run 25 TFLOP/s against 202, commit
# e89a83f).  Where the call timed from the host takes more than HOST_SLACK times the
# GPU's time -- and than the reference tl config's call from the host, whose time is its
# GPU's all the same -- the host time is the config's.  Against the GPU's time alone, a
# ~45 us call whose every launch path takes 80-100 us from the host was charged the
# host's time by its jitter, the Gluon form's only: jagged sequences at 4096 keys, bf16,
# H200, 84.5 us against the tl one-loop tile's 63.8 on the GPU, so the slower tiles ran
# (61.4 against 45.2 us graphed; session 55, bench/results/s55/).
HOST_SLACK = 2.0


def gluon_short_ms(device_ms: float, host_ms: float, reference_host_ms: float = 0.0) -> float:
    """A short call's Gluon config time: the GPU's, unless its call from the host takes
    more than ``HOST_SLACK`` times that and the reference tl config's call from the host
    (then its own launch path bounds it as called)."""
    slow = host_ms > HOST_SLACK * max(device_ms, reference_host_ms)
    return host_ms if slow else device_ms


def plain_config(configs: list[TileConfig]) -> TileConfig | None:
    """The launch every config is checked against: the first ``tl`` config's tiles and
    warps (the first config's, if all are Gluon), with pointer loads, no software
    pipelining and split-k's combine in its own launch -- the form closest to the source
    that translation validation ran."""
    if not configs:
        return None
    first = next((c for c in configs if not c.gluon_ws), configs[0])
    return dataclasses.replace(first, num_stages=1, loop_stages=0, tma=False,
                               warp_specialize=False, gluon_ws=False, fused=False,
                               per_tile=False, heads_first=False, dynamic=False)


def time_configs(program: Program, ks: KernelSource, target: str, tensors: dict,
                 configs: list[TileConfig], values: dict | None = None, host: bool = False,
                 check: bool = True) -> list[tuple[TileConfig, float | None, str]]:
    """Time every config on the GPU (median ms per call); failures are recorded, not
    raised.  ``values``: the named sizes of ``tensors`` when the kernel takes them at run
    time.  The time is the GPU's (``runtime.timing.device_ms``: replayed from a CUDA
    graph, over copies of the inputs that exceed L2); ``host=True`` times the call from
    the host instead (``timing.host_ms``: host launch path included, for reports).
    ``check``: each config's outputs must first agree with ``plain_config``'s on these
    inputs, or it fails (a re-timing of configs already checked passes False)."""
    from ..sizes import bind
    from . import timing
    values = values or {}
    if ks.size_params:
        program, ks = bind(program, values), ks.concrete(values)
    size_args = tuple(values[s] for s in ks.size_params)
    names = [ph.name for ph in program.inputs]
    inputs = [tensors[n] for n in names]
    out = []
    tma_here = tma_ok(getattr(ks, "descriptors", {}) or {}, tensors)
    copies = None
    # the plain launch's outputs, what every config is checked by
    reference, plain_why = _plain_outputs(program, ks, target, tensors, plain_config(configs),
                                          values, size_args) if check else (None, "")
    ref_call, ref_host = None, None  # the first tl config's call, its host time (lazy)
    for cfg in configs:
        if cfg.tma and not tma_here:  # it would time the pointer form: say so instead
            out.append((cfg, None, f"skipped: {TMA_NEEDS} (these inputs do not)"))
            continue
        if cfg.gluon_ws and not gluon_inputs_ok(ks, tensors):
            out.append((cfg, None, f"skipped: {GLUON_NEEDS} (these inputs do not)"))
            continue
        why = _COMPILE_FAILED.get((ks.source, str(cfg.at(values))))
        if why is not None:
            out.append((cfg, None, f"failed: {why}"))
            continue
        try:
            la = make_launcher(program, ks, target, cfg.at(values), size_args)
            la(tensors)  # compiles, and checks the direct launch under this key
            if check:
                why = (_disagreement(tensors, reference, program.outputs) if reference
                       else plain_why if cfg.gluon_ws else "")
                if why:
                    out.append((cfg, None, f"failed: {why}"))
                    continue
                if reference is None and target == "cuda" and not cfg.gluon_ws:
                    # no plain launch ran: the first tl config that did checks the rest
                    reference = {n: tensors[n].clone() for n in program.outputs}
            is_reference = not cfg.gluon_ws and ref_call is None
            # Timed as a call will run: replayed (``bound_call``).
            try:
                call = BoundCall(la, names, tensors, program.outputs)
            except ValueError:  # a form the replay does not cover: the general call
                call = lambda args: la({**tensors, **dict(zip(names, args))})  # noqa: E731
            ref_call = call if is_reference else ref_call
            if host:
                ms = timing.host_ms(lambda: call(inputs))
            else:
                if copies is None:
                    l2 = timing.l2_bytes(inputs[0].device)
                    copies = timing.copy_inputs(inputs, timing.input_copies(inputs, l2))
                ms = timing.device_ms(call, copies)
                if cfg.gluon_ws:  # its own launch path: charged where it, not the GPU, bounds
                    host_ms = timing.host_ms(lambda: call(inputs))
                    if host_ms > HOST_SLACK * ms and ref_call is not None and ref_host is None:
                        ref_host = timing.host_ms(lambda: ref_call(inputs))
                    ms = gluon_short_ms(ms, host_ms, ref_host or 0.0)
            out.append((cfg, float(ms), "ok"))
        except Exception as e:  # a config that does not compile (e.g. out of shared memory)
            msg = str(e).strip().splitlines()
            if target == "cuda" and context_lost():
                raise _fault(cfg, ks, msg) from e
            out.append((cfg, None, f"failed: {msg[-1] if msg else type(e).__name__}"))
    if all(ms is None for _, ms, _ in out):
        warnings.warn("No tile config compiled on the GPU: " + "; ".join(s for *_, s in out))
    return out


def _fault(cfg: TileConfig, ks: KernelSource, msg: list[str]) -> DeviceFaultError:
    return DeviceFaultError(
        f"The GPU faulted while config {cfg} of kernel {ks.name} ran "
        f"({msg[0] if msg else 'no message'}); this process's CUDA context is lost and "
        "nothing more can run in it. Start a new process; NEPTUNE_EQ_TMA=0 (no tensor "
        "descriptors) or NEPTUNE_EQ_GLUON=0 (no Gluon forms) leave forms out, and "
        "bench/probe/fault_locate_gpu.py names the launch. Please report it with this "
        "message.")


def context_lost() -> bool:
    """Whether the CUDA context is dead: a failed config that only failed to compile or
    ran out of resources leaves it working, a kernel that faulted (a sticky error) does
    not, and then every later config, check and call would fail too -- further from the
    cause."""
    import torch
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any error here is the context's
        return True
    return False


def agreeing_config(program: Program, ks: KernelSource, target: str, tensors: dict,
                    config: TileConfig, configs: list[TileConfig], values: dict | None = None
                    ) -> TileConfig:
    """A bucket chosen untimed (``dispatch.choose_bucket``) launches ``config`` unmeasured;
    it is still checked as a timed config is: on ``tensors`` its outputs must agree with
    the plain launch's (``plain_config`` of ``configs``), else the plain config is taken,
    with a warning.  Where the plain launch cannot run, ``config`` stays (as before this
    check).  Two launches, nothing timed."""
    from ..sizes import bind
    values = values or {}
    if ks.size_params:
        program, ks = bind(program, values), ks.concrete(values)
    size_args = tuple(values[s] for s in ks.size_params)
    plain = plain_config([config, *configs])
    if config == plain:
        return config
    reference, _ = _plain_outputs(program, ks, target, tensors, plain, values, size_args)
    if reference is None:
        return config
    try:
        make_launcher(program, ks, target, config.at(values), size_args)(tensors)
        why = _disagreement(tensors, reference, program.outputs)
    except Exception as e:  # noqa: BLE001 - a config that cannot launch here is not taken
        msg = str(e).strip().splitlines()
        if context_lost():
            raise _fault(config, ks, msg) from e
        why = f"it failed: {msg[-1] if msg else type(e).__name__}"
    if not why:
        return config
    warnings.warn(f"Kernel {ks.name}: config {config} was not taken at sizes {values} ({why}); "
                  f"the plain launch {plain} runs there instead.")
    return plain


def _plain_outputs(program: Program, ks: KernelSource, target: str, tensors: dict,
                   cfg: TileConfig | None, values: dict, size_args: tuple
                   ) -> tuple[dict | None, str]:
    """({output: its value} of the plain launch ``cfg`` (``plain_config``) on ``tensors``,
    "") -- or (None, why it did not run): ``time_configs`` then checks the configs against
    the first ``tl`` config that runs, and a Gluon config before it fails."""
    if cfg is None or target != "cuda" or not _on_gpu(tensors):  # (the interpreter runs
        return None, "no plain launch ran to check it against"  # the source as written)
    try:
        make_launcher(program, ks, target, cfg.at(values), size_args)(tensors)
    except Exception as e:  # noqa: BLE001 - the configs are then left unchecked
        msg = str(e).strip().splitlines()
        if context_lost():
            raise _fault(cfg, ks, msg) from e
        return None, f"its plain launch ({cfg}) failed: {msg[-1] if msg else type(e).__name__}"
    return {n: tensors[n].clone() for n in program.outputs}, ""


def _on_gpu(tensors: dict) -> bool:
    return any(getattr(t, "is_cuda", False) for t in tensors.values())


def _disagreement(tensors: dict, reference: dict, outputs: list[str]) -> str:
    """Why a config's outputs cannot be trusted on the timing inputs, or "".  It and the
    plain launch compute the plan's terms; they differ by accumulation order (and a Gluon
    form's SFU tanh), so they agree within a few 16-bit roundings of the output's scale;
    a wrong kernel is off by O(1), or NaN."""
    for n in outputs:
        got, ref = tensors[n].float(), reference[n].float()
        if not bool((got.isfinite() == ref.isfinite()).all()):
            return (f"its {n} has NaN/inf where the reference launch's has none, or none "
                    "where it has")
        fin = ref.isfinite()
        scale = max(1.0, ref[fin].abs().max().item()) if fin.any() else 1.0
        err = (got[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
        if err > _AGREE.get(str(tensors[n].dtype), 1e-2) * scale:
            return (f"its {n} differs from the reference launch's (the plain launch: pointer "
                    f"loads, one stage) by {err:.3g} (scale {scale:.3g}): a miscompile, not "
                    "used")
    return ""


# how far two correct forms' outputs may differ, relative to the output's scale: a few
# roundings of the output dtype (a wrong kernel is off by O(1), or NaN)
_AGREE = {"torch.float16": 1e-2, "torch.bfloat16": 6e-2, "torch.float32": 1e-3}

"""How a replay launches (``runtime.gluon_launch``, ``runtime.tma_launch``,
``runtime.launch``): a Gluon replay's host descriptors keep their fields and take a new
base; an encoded launch passes the raw launcher exactly what Triton 3.6's descriptor
wrapper would, encoding each map once per address; a fast launch calls the compiled
launcher as Triton 3.6 does and makes the launch metadata only for a hook.  (Split from
``test_bound_call.py``, which checks what a replay binds.)"""
import pytest
import torch

def test_a_replay_reuses_its_descriptors_fields_with_a_new_base():
    """A Gluon replay's host TMA descriptors: a tensor of the signature its slot described
    last gets the same fields with its own base (no view-and-check constructor per call);
    the kept fields hold no tensor; another signature, or a base the TMA cannot take (not
    16-byte aligned), goes through the constructor and its checks."""
    from types import SimpleNamespace as NS
    from triton.experimental.gluon import language as gl
    from neptune_eq.runtime.gluon_launch import GluonLauncher
    layout = gl.NVMMASharedLayout.get_default_for([64, 16], gl.float16)
    la = NS(_tiles=[("q", [64, 16], layout)], _described={})
    la._descriptor = lambda k, t, reuse=False: GluonLauncher._descriptor(la, k, t, reuse)
    q = torch.randn(1, 2, 100, 16).half()
    first, = GluonLauncher._descriptors(la, {"q": q})
    q2 = torch.randn(1, 2, 100, 16).half()
    again, = GluonLauncher._descriptors(la, {"q": q2}, reuse=True)
    assert again.base.data_ptr() == q2.data_ptr() and again.base.shape == (200, 16)
    assert {f: v for f, v in vars(again).items() if f != "base"} == \
        {f: v for f, v in vars(first).items() if f != "base"}
    assert again.shape == [200, 16] and again.strides == [16, 1]
    assert not any(isinstance(v, torch.Tensor) for v in la._described[0][1].values())
    other, = GluonLauncher._descriptors(la, {"q": torch.randn(1, 2, 50, 16).half()}, reuse=True)
    assert other.shape == [100, 16]
    off = torch.randn(2 * 50 * 16 + 1).half()[1:].view(1, 2, 50, 16)  # 2-byte aligned
    with pytest.raises(AssertionError, match="16-byte"):
        GluonLauncher._descriptors(la, {"q": off}, reuse=True)


# Triton 3.6's descriptor wrapper (``driver.wrap_handle_tensordesc``), restated for the
# tests of ``tma_launch.EncodedLaunch``: it encodes each descriptor argument per launch
_WRAPPER = """
def wrap(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner
"""


def _wrapped_kernel(indices=(0, 1), prefix=13, scratch=0):
    """A compiled kernel whose launch is the wrapper above around a recording launcher;
    (kernel, what each launch passed, how many descriptors were encoded)."""
    from types import SimpleNamespace as NS
    launched, encoded = [], []

    def encode(desc, meta):
        encoded.append(desc)
        return [("map", desc["ptr"], meta), *desc["shape"], *desc["strides"]]
    ns = {"_BASE_ARGS_FORMAT_LEN": prefix, "make_tensordesc_arg": encode}
    exec(_WRAPPER, ns)
    inner = ns["wrap"](lambda *a: launched.append(a), set(indices), ["m0", "m1"])

    class CudaLauncher:  # Triton 3.6's call: scratch goes in before the metadata
        launch_cooperative_grid, launch_pdl, profile_scratch_size = False, True, 0

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            self.launch(gridX, gridY, gridZ, stream, function, False, True, None, None, *args)
    run = CudaLauncher()
    run.launch, run.global_scratch_size = inner, scratch
    return NS(run=run, function="fn", packed_metadata="meta"), launched, encoded


def test_a_descriptor_is_encoded_once_per_address_and_launched_as_triton_would():
    """``tma_launch.EncodedLaunch``: the raw launcher gets exactly the arguments Triton's
    descriptor wrapper would pass it, each slot's map encoded once per (address, shape,
    strides, dtype) and reused while they repeat -- a new address, shape or stride is
    encoded afresh, and the maps are dropped once ``KEEP`` are kept."""
    from neptune_eq.runtime import tma_launch
    from neptune_eq.runtime.tma_launch import EncodedLaunch
    ck, launched, encoded = _wrapped_kernel()
    enc = EncodedLaunch.of(ck, 2)
    assert enc is not None
    a, b = torch.randn(4, 8), torch.randn(6, 8)

    def desc(t):
        return {"ptr": t.data_ptr(), "shape": list(t.shape), "strides": list(t.stride())}
    # Triton's own path: CudaLauncher.__call__ with no scratch, then the wrapper
    ck.run(2, 1, 1, "s", "fn", "meta", None, None, None, desc(a), desc(b), 5, "ptr", 16)
    made = []
    enc.launch((2, 1, 1), "s", [a, b], lambda k: made.append(k) or desc([a, b][k]),
               [5, "ptr", 16])
    assert launched[0] == launched[1] and made == [0, 1]
    assert launched[1][13] == ("map", a.data_ptr(), "m0") and launched[1][18] == ("map", b.data_ptr(), "m1")
    enc.launch((2, 1, 1), "s", [a, b], lambda k: made.append(k), [5, "ptr", 16])
    assert made == [0, 1] and launched[2] == launched[1] and len(encoded) == 4  # 2 Triton's
    c = torch.randn(6, 8)
    enc.launch((2, 1, 1), "s", [a, c], lambda k: made.append(k) or desc([a, c][k]), [5])
    assert made == [0, 1, 1] and launched[3][18] == ("map", c.data_ptr(), "m1")
    t = b.t().contiguous().t()  # same address class, other strides: a map of its own
    enc.launch((2, 1, 1), "s", [a, t], lambda k: made.append(k) or desc([a, t][k]), [5])
    assert made[-1] == 1 and launched[4][21:23] == (1, 6)
    old = tma_launch.KEEP
    try:
        tma_launch.KEEP = len(enc.maps)
        enc.launch((1, 1, 1), "s", [c, c], lambda k: desc(c), [5])
        assert list(enc.maps) == [(k, c.data_ptr(), c.shape, c.stride(), c.dtype) for k in (0, 1)]
    finally:
        tma_launch.KEEP = old


def test_a_gluon_form_launches_encoded_unless_a_profiler_hook_is_set():
    """``GluonLauncher._launch_form``: with the launch hooks empty (Triton 3.6's chains)
    a checked launch goes through ``EncodedLaunch`` -- no descriptor made on a repeat --
    and with a hook added (a profiler) through ``FastLaunch`` with descriptors made per
    call, so the hook gets its metadata."""
    from types import SimpleNamespace as NS
    from triton.knobs import HookChain
    from neptune_eq.runtime.gluon_launch import GluonLauncher
    ck, launched, encoded = _wrapped_kernel()
    hooks, fast, made = NS(enter=HookChain(), exit=HookChain()), [], []
    a, b = torch.randn(4, 8), torch.randn(6, 8)

    def descriptor(k, t, reuse=False):
        made.append(k)
        return {"ptr": t.data_ptr(), "shape": list(t.shape), "strides": list(t.stride())}
    la = NS(_tiles=[("a", None, None), ("b", None, None)], _encoded={},
            _launch=NS(grid=(2, 1, 1), const_values=[16], _hooks=(hooks, "enter", "exit"),
                       fast=lambda ck, args, stream: fast.append(args)),
            _descriptor=descriptor,
            _descriptors=lambda ts, reuse=False: [descriptor(0, ts["a"]), descriptor(1, ts["b"])])
    for _ in range(2):
        GluonLauncher._launch_form(la, ck, {"a": a, "b": b}, ["p", 3], "s", True)
    assert len(launched) == 2 and made == [0, 1] and not fast and len(encoded) == 2
    assert launched[1][-3:] == ("p", 3, 16)
    hooks.enter.add(print)
    GluonLauncher._launch_form(la, ck, {"a": a, "b": b}, ["p", 3], "s", True)
    assert len(launched) == 2 and fast == [[descriptor(0, a), descriptor(1, b), "p", 3]]


def test_an_encoded_launch_is_offered_only_for_the_wrapper_it_knows(monkeypatch):
    """``EncodedLaunch.of`` declines -- the caller keeps Triton's own path -- where the
    launch is not that wrapper: descriptors not first, another argument prefix, a kernel
    with global scratch, a plain launcher, or ``NEPTUNE_EQ_ENCODED_TMA=0``."""
    from types import SimpleNamespace as NS
    from neptune_eq.runtime import tma_launch
    from neptune_eq.runtime.tma_launch import EncodedLaunch
    assert EncodedLaunch.of(_wrapped_kernel(indices=(1, 2))[0], 2) is None
    assert EncodedLaunch.of(_wrapped_kernel(prefix=12)[0], 2) is None
    assert EncodedLaunch.of(_wrapped_kernel(scratch=64)[0], 2) is None
    assert EncodedLaunch.of(_wrapped_kernel()[0], 3) is None
    plain = NS(run=NS(launch=print, global_scratch_size=0, profile_scratch_size=0))
    assert EncodedLaunch.of(plain, 2) is None and EncodedLaunch.of("compiled", 1) is None
    later, _, _ = _wrapped_kernel()  # a launcher taking metadata and hooks before scratch
    type(later.run).__call__ = lambda self, gx, gy, gz, st, fn, meta, lmeta, enter, exit_, *a: 0
    assert EncodedLaunch.of(later, 2) is None
    monkeypatch.setattr(tma_launch, "ENABLED", False)
    assert EncodedLaunch.of(_wrapped_kernel()[0], 2) is None


def test_a_fast_launch_calls_the_compiled_launcher_as_triton_3_6_would(monkeypatch):
    """``launch.raw_launcher``: a checked fast launch calls the compiled launcher under
    ``CompiledKernel.run`` directly, with exactly what 3.6's ``CudaLauncher.__call__``
    passes it; a launcher with scratch to allocate, a Python launcher (a descriptor
    wrapper), another call layout, or ``NEPTUNE_EQ_RAW_LAUNCH=0`` goes through ``run``."""
    import functools
    from types import SimpleNamespace as NS
    from neptune_eq.runtime import launch
    launched = []

    class CudaLauncher:  # Triton 3.6's, as far as the direct call depends on it
        launch_cooperative_grid, launch_pdl = False, True
        global_scratch_size = profile_scratch_size = 0
        launch = functools.partial(lambda *a: launched.append(("raw",) + a))  # not Python code

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            launched.append(("run",))
            self.launch(gridX, gridY, gridZ, stream, function, False, True, None, None, *args)
    ck = NS(run=CudaLauncher(), function="fn", packed_metadata="packed")
    fl = launch.FastLaunch(lambda: None, (3,), {"B": 16}, {})
    fl._hooks = (NS(enter=None, exit=None), "enter", "exit")
    ck.run(3, 1, 1, "stream", "fn", "packed", None, None, None, "x", 7, 16)  # Triton's way
    fl.fast(ck, ["x", 7], "stream")
    assert launched[0] == ("run",) and launched[1] == launched[2] and len(launched) == 3
    # a replay's prepared call (the call's own arguments, then a fixed tail) launches the
    # same, the PDL flag as Triton's launch sets it
    raw, head, tail = fl.prepared(ck, "stream", [7])
    raw(*head, "x", *tail)
    assert launched[-1] == launched[1] and launched[1][1 + 6] is True  # (grid x3, stream,
    del launched[3:]                                   # function, cooperative, PDL, ...)
    for change in ({"global_scratch_size": 64}, {"launch": lambda *a: None}):
        other = NS(run=CudaLauncher(), function="fn", packed_metadata="packed")
        for k, val in change.items():
            setattr(other.run, k, val)
        assert launch.raw_launcher(other) is None
    later = NS(run=NS(launch=CudaLauncher.launch, global_scratch_size=0, profile_scratch_size=0,
                      launch_cooperative_grid=False, launch_pdl=True))
    assert launch.raw_launcher(later) is None  # (not 3.6's call layout)
    monkeypatch.setattr(launch, "RAW", False)
    fl2 = launch.FastLaunch(lambda: None, (3,), {"B": 16}, {})
    fl2._hooks = fl._hooks
    fl2.fast(ck, ["x", 7], "stream")
    assert launched[-2] == ("run",) and launched[-1] == launched[1]


def test_a_fast_launch_makes_the_launch_metadata_only_for_a_hook(monkeypatch):
    """Triton reads a launch's metadata only to hand it to a launch hook (a profiler's):
    with no hook the fast launch passes None instead of building it; with one set it is
    built and passed, so profilers still see every launch."""
    from types import SimpleNamespace as NS
    from neptune_eq.runtime import launch
    made, runs = [], []
    ck = NS(function="fn", packed_metadata="packed",
            launch_metadata=lambda *a: made.append(a) or {"name": "k"},
            run=lambda *a: runs.append(a))
    fl = launch.FastLaunch(lambda: None, (3,), {"B": 16}, {})
    hooks = NS(enter=None, exit=None)
    fl._hooks = (hooks, "enter", "exit")
    fl.fast(ck, ["x", 7], "stream")
    assert not made and runs[-1][:9] == (3, 1, 1, "stream", "fn", "packed", None, None, None)
    assert runs[-1][9:] == ("x", 7, 16)
    hooks.enter = print
    fl.fast(ck, ["x", 7], "stream")
    assert made and runs[-1][6] == {"name": "k"} and runs[-1][7] is print
    # Triton 3.6 on: the hooks are chains, always present -- empty is no hook
    from triton.knobs import HookChain
    hooks.enter, hooks.exit, made[:] = HookChain(), HookChain(), []
    fl.fast(ck, ["x", 7], "stream")
    assert not made and runs[-1][6:9] == (None, None, None)
    hooks.exit.add(print)  # a profiler's hook: both chains passed, with the metadata
    fl.fast(ck, ["x", 7], "stream")
    assert made and runs[-1][7] is hooks.enter and runs[-1][8] is hooks.exit


def test_host_queries_take_the_functions_under_the_public_calls(monkeypatch):
    """``launch.HostQueries`` (what a replay asks per call): torch's own device and
    capture functions and Triton's stream getter, found once; the public calls where a
    torch lacks them; a profiler's launch hook seen whenever it is set."""
    from types import SimpleNamespace as NS
    import triton.runtime
    from triton import knobs
    from neptune_eq.runtime.launch import HostQueries

    def stream_of(device):
        return ("stream", device)
    monkeypatch.setattr(triton.runtime, "driver", NS(active=NS(get_current_stream=stream_of)))

    def get_device():
        return 3
    monkeypatch.setattr(torch._C, "_cuda_getDevice", get_device, raising=False)
    host = HostQueries()
    assert host.device is get_device and host.stream is stream_of
    assert host.stream(host.device()) == ("stream", 3)
    if hasattr(torch._C, "_cuda_isCurrentStreamCapturing"):
        assert host.capturing is torch._C._cuda_isCurrentStreamCapturing
    monkeypatch.delattr(torch._C, "_cuda_getDevice")
    monkeypatch.delattr(torch._C, "_cuda_isCurrentStreamCapturing", raising=False)
    public = HostQueries()
    assert public.device == torch.cuda.current_device
    assert public.capturing == torch.cuda.is_current_stream_capturing
    assert not public.hooks_set()
    knobs.runtime.launch_enter_hook.add(print)
    try:
        assert public.hooks_set()
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    assert not public.hooks_set()

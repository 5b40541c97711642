"""A call at a signature met before is replayed (``runtime.bound_call``): the replay's
arguments and launch key equal the general launcher's for every kernel form (plain,
symbolic sizes, the summary pre-pass, split-k in two launches and in one, the pointer
twin of a TMA config), and a replay on new data, a new stride or a new size is right."""
from dataclasses import replace

import threading

import pytest
import torch

import neptune_eq as ne
from neptune_eq import api
from neptune_eq.dropin import flex
from neptune_eq.frontend import examples
from neptune_eq.interp import evaluate
from neptune_eq.runtime import launcher as launcher_mod, tuning
from neptune_eq.runtime.bound_call import BoundCall
from neptune_eq.runtime.launch import int_classes
from neptune_eq.runtime.launcher import Launcher
from neptune_eq.runtime.tile_configs import TileConfig

from helpers import count_calls, filled_shapes, random_inputs

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without")


@pytest.fixture
def keyed(monkeypatch):
    """Launch keys computed on CPU as on a GPU (device 0), so they can be compared."""
    def fake_key(tensors, ints, spec=None):
        return (0, tuple([t.data_ptr() & 15 == 0 for t in tensors]), spec(ints) if spec else tuple(ints))
    monkeypatch.setattr(launcher_mod, "class_launch_key", fake_key)
    monkeypatch.setattr(launcher_mod, "launch_key", fake_key)
    monkeypatch.setattr(launcher_mod, "current_stream", lambda device: None)

    def enable(la, classes=False):
        la.fast_ok = True
        la._int_class = int_classes if classes else None
        return la
    return enable


def _norm(args: list, known: dict) -> list:
    """An argument list with tensors the call owns by identity, fresh ones (summaries,
    scratch) by layout, and integers by value."""
    return [(known.get(id(a), "fresh"), tuple(a.shape), a.stride(), a.dtype)
            if isinstance(a, torch.Tensor) else a for a in args]


def _same_as_launcher(bc: BoundCall, names: list, tensors: dict) -> None:
    la = bc.launcher
    inputs = [tensors[n] for n in names]
    outs = [tensors[n] for n in bc.outputs]
    vals = inputs + outs
    if bc.pre:
        vals += [torch.empty(shape, dtype=dt) for _, shape, dt in bc.pre[1]]
    known = {id(t): n for n, t in tensors.items()}
    want, key, _, steps = la._arg_lists(tensors)
    got = bc.arg_lists(vals, None)
    known.update({id(t): "sem" for t in la._sems.values()})
    assert [_norm(a, known) for a in got] == [_norm(a, known) for a in want]
    assert bc.steps == steps
    if key is not None:
        align = tuple([vals[k].data_ptr() & 15 == 0 for k in bc.param_slots])
        assert (0, align, bc.int_key) == key


def _bound(kern) -> BoundCall:
    (bc,) = [b for b in kern._bound.values() if b is not None]
    return bc


def test_plain_kernel_replays_same_arguments_and_key(keyed):
    kern = ne.superoptimize(examples.attention(1, 2, 20, 37, 16, "float32"), target="interpreter",
                            cache=False)
    prog = kern.input_program
    names = [ph.name for ph in prog.inputs]
    ins = random_inputs(prog)
    kern(*[ins[n] for n in names])
    bc = _bound(kern)
    keyed(bc.launcher)
    out = torch.empty(prog.shape_of(prog.outputs[0]))
    _same_as_launcher(BoundCall(bc.launcher, names, {**ins, prog.outputs[0]: out}, prog.outputs),
                      names, {**ins, prog.outputs[0]: out})


@pytest.mark.parametrize("fused", [False, True])
def test_split_k_replays_same_arguments_and_key(keyed, fused):
    out = ne.attention(1, 4, 1, 300, 32, "float16", kv_heads=4)
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    row = next(r for r in kern.candidates if r.kernel is not None and r.kernel.split_extent)
    prog = kern.input_program
    ins = random_inputs(prog)
    la = keyed(Launcher(row.program, row.kernel, "interpreter",
                        TileConfig({"B_i": 16, "B_L": 16}, 4, 1, 3, fused=fused)))
    tensors = {**ins, "o": torch.empty(1, 4, 1, 32, dtype=torch.float16)}
    names = [ph.name for ph in prog.inputs]
    bc = BoundCall(la, names, tensors, ["o"])
    _same_as_launcher(bc, names, tensors)
    got = bc([ins[n] for n in names])[0]          # and the replay itself is right
    ref = evaluate(prog, ins)["o"]
    assert (got.double() - ref).abs().max().item() <= 2e-3 * max(1, ref.abs().max().item())
    # the fold states' scratch is kept per stream: the next call on new data reuses it
    key = (None, threading.get_ident())  # (the interpreter's stream, this thread)
    kept = [t.data_ptr() for t in bc._scratch[key]]
    ins2 = {n: (t * 3 if t.is_floating_point() else t) for n, t in ins.items()}
    got2 = bc([ins2[n] for n in names])[0]
    assert [t.data_ptr() for t in bc._scratch[key]] == kept
    ref2 = evaluate(prog, ins2)["o"]
    assert (got2.double() - ref2).abs().max().item() <= 2e-3 * max(1, ref2.abs().max().item())
    # the kernels write the scratch before they read it: under deterministic algorithms
    # it is not NaN-filled first (nor the output), and the result is the same
    try:
        torch.use_deterministic_algorithms(True)
        fresh, got3 = BoundCall(la, names, tensors, ["o"]), []
        assert filled_shapes(lambda: got3.append(fresh([ins[n] for n in names])[0])) == []
        assert torch.equal(got3[0], got)
    finally:
        torch.use_deterministic_algorithms(False)


def test_tma_config_on_unaligned_strides_binds_the_pointer_twin(keyed):
    kern = ne.superoptimize(examples.attention(1, 1, 16, 24, 16, "float16"), target="interpreter",
                            cache=False)
    prog = kern.input_program
    ins = random_inputs(prog)
    odd = torch.zeros(1, 1, 24, 20, dtype=torch.float16)[..., :16]  # 40-byte rows: no TMA
    odd.copy_(ins["k"])
    la = Launcher(kern.program, kern.kernel_source, "interpreter", replace(kern.config, tma=True))
    names = [ph.name for ph in prog.inputs]
    tensors = {**ins, "k": odd, "o": torch.empty(prog.shape_of("o"), dtype=torch.float16)}
    bc = BoundCall(la, names, tensors, ["o"])
    assert bc.launcher is la._pointer_twin and not bc.launcher.tma
    _same_as_launcher(bc, names, tensors)
    got = bc([tensors[n] for n in names])[0]
    ref = evaluate(prog, {**ins, "k": odd})["o"]
    assert (got.double() - ref).abs().max().item() <= 2e-3 * max(1, ref.abs().max().item())


def test_document_mask_replays_pre_pass_and_main_kernel(keyed):
    """The doc-mask kernel (pre-pass + main kernel, symbolic sizes): same arguments as the
    launcher, and repeated calls with new documents, new data and a new length are right."""
    s = 40
    doc = torch.repeat_interleave(torch.arange(5, dtype=torch.int32), 8)

    def documents(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, s, 16, generator=g) for _ in range(3)]
    ne.flex_attention(q, k, v, mask_mod=documents)
    kern = next(st.kernel for st in flex.STRUCTURES.values()
                if st.kernel is not None and any(b is not None and b.pre for b in st.kernel._bound.values()))
    bc = next(b for b in kern._bound.values() if b is not None and b.pre)
    keyed(bc.launcher, classes=True)
    names = [ph.name for ph in kern.input_program.inputs]
    outs = {n: torch.empty(t) for n, t in zip(bc.outputs, [spec[0] for spec in bc.out_specs])}
    tensors = {**dict(zip(names, [q, k, v, doc])), **outs}
    _same_as_launcher(BoundCall(bc.launcher, names, tensors, bc.outputs), names, tensors)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention as torch_flex
    for step in range(3):   # new ids in the same tensor, new data, then a new length
        doc.copy_(torch.sort(torch.randint(0, 3 + step, (doc.numel(),), generator=g)).values)
        q, k, v = [torch.randn(1, 2, doc.numel(), 16, generator=g) for _ in range(3)]
        got = ne.flex_attention(q, k, v, mask_mod=documents)
        bm = create_block_mask(documents, 1, 1, doc.numel(), doc.numel(), device="cpu")
        want = torch_flex(q, k, v, block_mask=bm)
        assert (got - want).abs().max().item() < 1e-4, step
        if step == 1:
            doc = torch.repeat_interleave(torch.arange(7, dtype=torch.int32), 7)


def test_summaries_are_kept_per_stream_and_thread_on_the_gpu(monkeypatch):
    """On the GPU a replay's pre-pass writes into summaries kept per (stream, thread):
    the next call on that stream rewrites them before its kernel reads them (stream
    order); another thread or stream gets its own, and a call captured in a CUDA graph
    fresh ones (the graph keeps them).  The interpreter always allocates."""
    doc = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), 6)
    q = torch.randn(1, 2, doc.numel(), 16)
    ne.flex_attention(q, q, q, mask_mod=lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j))
    bc = next(b for st in flex.STRUCTURES.values() if st.kernel is not None
              for b in st.kernel._bound.values() if b is not None and b.pre)
    assert bc._summary_buffers("s0", False) is not bc._summary_buffers("s0", False)
    assert not bc._summaries
    monkeypatch.setattr(bc, "interpret", False)
    first = bc._summary_buffers("s0", False)
    assert [(tuple(t.shape), t.dtype) for t in first] == [(tuple(sh), dt) for _, sh, dt in bc.pre[1]]
    assert bc._summary_buffers("s0", False) is first
    assert bc._summary_buffers("s1", False) is not first
    other = []
    th = threading.Thread(target=lambda: other.append(bc._summary_buffers("s1", False)))
    th.start()
    th.join()
    assert other[0] is not bc._summary_buffers("s1", False)
    n = len(bc._summaries)
    assert bc._summary_buffers("s1", True) is not bc._summary_buffers("s1", True)
    assert len(bc._summaries) == n


def test_replay_reads_new_data_and_each_stride_gets_its_own(monkeypatch):
    kern = ne.superoptimize(examples.attention(1, 2, 20, 37, 16, "float32"), target="interpreter",
                            cache=False)
    prog = kern.input_program
    names = [ph.name for ph in prog.inputs]
    checks = count_calls(monkeypatch, api, "check_inputs")
    for seed in range(3):
        torch.manual_seed(seed)
        ins = random_inputs(prog)
        ref = evaluate(prog, ins)[prog.outputs[0]]
        got = kern(*[ins[n] for n in names])
        assert (got.double() - ref).abs().max().item() < 1e-4, seed
    assert checks[0] == 1          # the later calls were replays
    # a transposed view (other strides): its own signature, still right
    ins = random_inputs(prog)
    q_t = ins["q"].transpose(2, 3).contiguous().transpose(2, 3)
    got = kern(*[q_t if n == "q" else ins[n] for n in names])
    ref = evaluate(prog, ins)[prog.outputs[0]]
    assert (got.double() - ref).abs().max().item() < 1e-4
    assert checks[0] == 2 and len(kern._bound) == 2
    with pytest.raises(ne.ProgramError, match="shape"):   # a wrong shape still explains itself
        kern(*[ins[n][..., :-1] if n == "q" else ins[n] for n in names])


def test_deterministic_mode_writes_outputs_without_a_fill_first():
    """Under ``torch.use_deterministic_algorithms(True)`` torch fills new tensors with NaN,
    one launch each (83 us of a window fwd+bwd's 831 us, H200); the kernels write every
    output element, so their outputs skip it -- first call and replays alike -- and the
    results are the same."""
    kern = ne.superoptimize(examples.attention(1, 2, 20, 37, 16, "float32"), target="interpreter",
                            cache=False)
    prog = kern.input_program
    ins = random_inputs(prog)
    args = [ins[ph.name] for ph in prog.inputs]
    want = kern(*args)
    try:
        torch.use_deterministic_algorithms(True)
        assert torch.empty(3).isnan().all()  # (what torch does to a new tensor here)
        kern2 = ne.superoptimize(examples.attention(1, 2, 20, 37, 16, "float32"),
                                 target="interpreter", cache=False)
        for k in (kern2, kern2, kern):  # a first call, its replay, a kernel bound before
            got = []
            assert filled_shapes(lambda: got.append(k(*args))) == []
            assert torch.equal(got[0], want)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.utils.deterministic.fill_uninitialized_memory  # the user's setting, untouched


def test_deterministic_mode_fills_no_summary_of_a_document_mask():
    """The pre-pass writes every block's summary, so under deterministic algorithms its
    outputs are not NaN-filled first either -- and the masked attention is unchanged."""
    doc = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), 7)
    q = torch.randn(1, 2, doc.numel(), 16)

    def call():
        return ne.flex_attention(q, q, q, mask_mod=lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j))
    want = call()
    try:
        torch.use_deterministic_algorithms(True)
        for _ in range(2):  # a first call and a replay
            got = []
            assert filled_shapes(lambda: got.append(call())) == []
            assert torch.equal(got[0], want)
    finally:
        torch.use_deterministic_algorithms(False)


def test_configs_are_timed_as_replayed_calls(monkeypatch):
    """``time_configs`` times each config the way a call runs it (a replay), and the
    replay it times computes the right thing -- here in the interpreter, the GPU timer
    replaced by one run of the first input copy."""
    from neptune_eq.runtime import timing

    def one_run(call, copies):
        call(copies[0])
        return 1.0
    monkeypatch.setattr(timing, "device_ms", one_run)
    monkeypatch.setattr(timing, "l2_bytes", lambda device: 0)
    replays = count_calls(monkeypatch, BoundCall, "__call__")
    kern = ne.superoptimize(examples.attention(1, 2, 20, 37, 16, "float32"), target="interpreter",
                            cache=False)
    prog = kern.input_program
    ins = random_inputs(prog)
    out = torch.full(prog.shape_of("o"), float("nan"))
    res = tuning.time_configs(kern.program, kern.kernel_source, "interpreter",
                                    {**ins, "o": out}, [kern.config])
    assert res == [(kern.config, 1.0, "ok")] and replays[0] == 1
    ref = evaluate(prog, ins)["o"]   # the replay it timed, run once more, is right
    call = BoundCall(Launcher(kern.program, kern.kernel_source, "interpreter", kern.config),
                     [ph.name for ph in prog.inputs], {**ins, "o": out}, ["o"])
    assert (call([ins[ph.name] for ph in prog.inputs])[0].double() - ref).abs().max() < 1e-4


def test_timing_copies_exceed_l2_and_keep_strides():
    """The GPU timer rotates over copies of the inputs that together hold twice the L2
    cache (a call never finds the previous call's data there); each copy has the same
    strides (a replay is keyed on them) and the same values."""
    from neptune_eq.runtime.timing import copy_inputs, input_copies
    k = torch.randn(4, 6, 8).transpose(1, 2)        # a non-contiguous view
    q = torch.randn(4, 8)
    size = (k.numel() + q.numel()) * 4
    assert input_copies([q, k], l2_bytes=10 * size) == 20
    assert input_copies([q, k], l2_bytes=size // 10) == 1
    assert input_copies([q, k], l2_bytes=10 ** 12, most=64) == 64
    copies = copy_inputs([q, k, 3], 3)
    assert len(copies) == 3 and copies[0][0] is q
    for c in copies[1:]:
        assert c[1].stride() == k.stride() and torch.equal(c[1], k) and c[1].data_ptr() != k.data_ptr()
        assert torch.equal(c[0], q) and c[2] == 3


def test_gpu_calls_get_rows_with_a_contiguous_last_dimension():
    """On the GPU a tensor whose last dimension is strided is copied to contiguous rows
    before the kernel sees it (FlashAttention's input rule; Triton 3.6 miscompiled a
    row-stride-1 query at some tiles); contiguous tensors and other arguments pass as
    they are, and a dimension of one needs no copy."""
    from neptune_eq.api import _rows_contiguous
    q = torch.randn(1, 2, 20, 24)
    col = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # strides (960, 480, 1, 20)
    one = torch.randn(3, 1)[::2]                                # last dim 1: any stride works
    args = (q, col, 7, one)
    out = _rows_contiguous(args)
    assert out[0] is q and out[2] == 7 and out[3] is one
    assert out[1].stride(-1) == 1 and torch.equal(out[1], col)
    assert _rows_contiguous((q, 3)) == (q, 3)


def test_a_replay_is_found_before_the_rows_check_and_strided_rows_still_get_copied(monkeypatch):
    """On the GPU a call looks its signature up first (every kept signature has contiguous
    rows, so a hit needs no rows check); a call with strided rows misses, is copied, and
    then replays under the copies' signature -- right either way, never re-bound."""
    kern = ne.superoptimize(examples.attention(1, 2, 20, 37, 16, "float32"), target="interpreter",
                            cache=False)
    prog = kern.input_program
    names = [ph.name for ph in prog.inputs]
    ins = random_inputs(prog)
    ref = evaluate(prog, ins)[prog.outputs[0]]
    kern(*[ins[n] for n in names])
    monkeypatch.setattr(kern, "target", "cuda")  # the GPU's call path (launches stay CPU)
    checks = count_calls(monkeypatch, api, "check_inputs")
    rows = count_calls(monkeypatch, api, "_rows_contiguous")
    got = kern(*[ins[n] for n in names])
    assert (got.double() - ref).abs().max().item() < 1e-4
    assert checks[0] == 0 and rows[0] == 0        # a hit: no bind, no rows check
    q_t = ins["q"].transpose(2, 3).contiguous().transpose(2, 3)   # stride 1 off the last dim
    for _ in range(2):
        got = kern(*[q_t if n == "q" else ins[n] for n in names])
        assert (got.double() - ref).abs().max().item() < 1e-4
    assert checks[0] == 0 and rows[0] == 2         # copied, then the contiguous replay
    assert len(kern._bound) == 1


def test_a_gluon_launcher_is_replayed_with_outputs_from_the_signature(monkeypatch):
    """A kernel whose size bucket runs the Gluon form replays a signature met before
    (``GluonBoundCall``): no re-binding of the named sizes and no stride reads, fresh
    outputs of the signature's shapes; a launch key the launcher checked launches the
    compiled kernel directly with the launcher's arguments (atomically summed outputs
    zeroed first), any other key goes through the launcher's own call.  A form with a
    per-call pre-pass (summaries, a dynamic walk's tile ranges) is not replayed."""
    from types import SimpleNamespace as NS
    from neptune_eq.runtime import gluon_launch
    from neptune_eq.runtime.gluon_launch import GluonBoundCall, GluonLauncher
    calls, fast = [], []

    class FakeGluon:  # GluonLauncher's key and argument code (the interpreter cannot run Gluon)
        gluon, fast_ok, _order, size_args = True, True, [], (7,)
        ks = NS(summaries=(), scattered=("o",),
                gluon=NS(streamed=("q", "k", "v"), dtype="float32", ranges=None))
        tensors = ["q", "k", "v", "o"]
        _checked = {}
        _pointers, integer_args, _args = (GluonLauncher._pointers, GluonLauncher.integer_args,
                                          GluonLauncher._args)
        _rest, _launch_form, _encoded = GluonLauncher._rest, GluonLauncher._launch_form, {}
        _tiles = [("q", None, None)]
        # (a compiled kernel that is not Triton's: ``EncodedLaunch.of`` declines it)
        _launch = NS(fast=lambda ck, args, stream: fast.append((ck, args)),
                     _hooks=(NS(hook=None), "hook", "hook"))

        def _descriptors(self, tensors, reuse=False):
            return ["desc:" + str(tensors["q"].data_ptr())]

        def __call__(self, tensors):
            calls.append(tensors)
            tensors["o"].fill_(1.0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(gluon_launch, "current_stream", lambda device: "stream")
    kern = ne.superoptimize(examples.attention(1, 2, "S", "S", 16, "float32"),
                            target="interpreter", cache=False, sizes={"S": 24})
    la = FakeGluon()
    monkeypatch.setattr(kern._dispatch, "launcher", lambda values, tensors=None: la)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    kern(q, k, v)
    (replay,) = kern._bound.values()
    assert isinstance(replay, GluonBoundCall)
    binds = count_calls(monkeypatch, api.Kernel, "_bind_symbolic")
    strides = count_calls(monkeypatch, FakeGluon, "integer_args")
    q2 = torch.randn(1, 2, 24, 16)
    out = kern(q2, k, v)          # key not checked: the launcher's own call
    assert binds[0] == 0 and strides[0] == 0 and len(calls) == 2 and not fast
    assert calls[-1]["q"] is q2 and calls[-1]["o"] is out and calls[-1]["o"] is not calls[0]["o"]
    assert out.shape == (1, 2, 24, 16) and bool((out == 1).all())
    _, key = la._args(calls[-1])
    la._checked[key + ((),)] = ("pre", "compiled")
    out = kern(q, k, v)          # checked: launched directly
    (ck, args), = fast
    assert ck == "compiled" and len(calls) == 2 and bool((out == 0).all())  # zeroed, not filled
    ints = [s for t in (q, k, v, out) for s in t.stride()] + [7]
    assert args == [f"desc:{q.data_ptr()}", q, k, v, out] + ints
    with pytest.raises(ValueError, match="pre-pass"):
        GluonBoundCall(NS(ks=NS(summaries=("doc",))), ["q", "k", "v"], calls[0], ["o"])
    with pytest.raises(ValueError, match="pre-pass"):  # a dynamic walk's tile ranges
        GluonBoundCall(NS(ks=NS(summaries=(), gluon=NS(ranges=("k", "src")))), ["q", "k", "v"],
                       calls[0], ["o"])


def test_host_timing_runs_a_long_call_three_times_and_a_short_one_by_do_bench(monkeypatch):
    """``timing.host_ms``: a call of ``LONG_CALL_MS`` or more is timed in
    ``LONG_CALL_SAMPLES`` runs (the median; the first run counts), a shorter one by
    ``do_bench``'s budgets -- each run after an L2 flush."""
    import triton.testing
    from neptune_eq.runtime import timing
    clock = {"ms": 0.0, "runs": [], "flushes": 0}

    class Event:  # elapsed time = what the call under test "took"
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock["ms"]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.at - self.at

    class Flush:
        def zero_(self):
            clock["flushes"] += 1
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: Flush())
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **k: ("do_bench", k))

    def call_taking(times):
        def call():
            clock["ms"] += times[len(clock["runs"]) % len(times)]
            clock["runs"].append(1)
        return call
    assert timing.host_ms(call_taking([9.0, 7.0, 8.5])) == 8.5   # the median of three runs
    assert len(clock["runs"]) == timing.LONG_CALL_SAMPLES == clock["flushes"] == 3
    clock["runs"].clear()
    assert timing.host_ms(call_taking([0.2])) == ("do_bench", {"warmup": 10, "rep": 40,
                                                              "return_mode": "median"})


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

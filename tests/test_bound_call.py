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
    # what a GPU replay launches: the same lists with every tensor as its data pointer
    ptrs = bc.arg_lists([t.data_ptr() for t in vals], None, False, pointers=True)
    assert ptrs == [[x.data_ptr() if isinstance(x, torch.Tensor) else x for x in a] for a in got]
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


def _split_k_replay(keyed, fused: bool = False):
    """(BoundCall, program, inputs by name, example tensors) of a split-k decode (4 heads,
    300 keys) in the interpreter, at 16-row, 16-key tiles in one or two launches."""
    out = ne.attention(1, 4, 1, 300, 32, "float16", kv_heads=4)
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    row = next(r for r in kern.candidates if r.kernel is not None and r.kernel.split_extent)
    prog = kern.input_program
    ins = random_inputs(prog)
    la = keyed(Launcher(row.program, row.kernel, "interpreter",
                        TileConfig({"B_i": 16, "B_L": 16}, 4, 1, 3, fused=fused)))
    tensors = {**ins, "o": torch.empty(1, 4, 1, 32, dtype=torch.float16)}
    return BoundCall(la, [ph.name for ph in prog.inputs], tensors, ["o"]), prog, ins, tensors


@pytest.mark.parametrize("fused", [False, True])
def test_split_k_replays_same_arguments_and_key(keyed, fused):
    bc, prog, ins, tensors = _split_k_replay(keyed, fused)
    la, names = bc.launcher, bc.names
    _same_as_launcher(bc, names, tensors)
    got = bc([ins[n] for n in names])[0]          # and the replay itself is right
    ref = evaluate(prog, ins)["o"]
    assert (got.double() - ref).abs().max().item() <= 2e-3 * max(1, ref.abs().max().item())
    # the fold states' scratch is kept per stream: the next call on new data reuses it
    key = (None, threading.get_ident())  # (the interpreter's stream, this thread)
    kept = [t.data_ptr() for t in bc._scratch[key][0]]
    ins2 = {n: (t * 3 if t.is_floating_point() else t) for n, t in ins.items()}
    got2 = bc([ins2[n] for n in names])[0]
    assert [t.data_ptr() for t in bc._scratch[key][0]] == kept
    assert bc._scratch[key][1] == kept  # the pointers a GPU launch passes as ints
    # under a CUDA graph capture the scratch is fresh and goes in as tensors (they hold
    # it past the launch), while the rest are pointers
    vals = [ins2[n] for n in names] + [torch.empty(1, 4, 1, 32, dtype=torch.float16)]
    lists = bc.arg_lists([t.data_ptr() for t in vals], None, True, pointers=True)
    fresh = [a for a in lists[0] if isinstance(a, torch.Tensor)]
    assert len(fresh) == len(kept) and all(t.data_ptr() not in kept for t in fresh)
    assert all(not isinstance(a, torch.Tensor) for a in lists[0][:len(bc.param_slots)])
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
    # (this structure: q, k, v and doc -- an earlier test's jagged mask, which also reads
    # offsets, may be in the process too)
    kern = next(st.kernel for st in flex.STRUCTURES.values()
                if st.kernel is not None and len(st.kernel.input_program.inputs) == 4
                and any(b is not None and b.pre for b in st.kernel._bound.values()))
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
                gluon=NS(streamed=("q", "k", "v"), dtype="float32", ranges=None, o_store=None))
        form, _pre = ks.gluon, None
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
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # (integer_args asks)
    monkeypatch.setattr(gluon_launch, "host_queries", lambda: _FakeHost(False))
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
    # the pointers go to the launcher as ints (no data_ptr() or driver query per launch)
    assert args == [f"desc:{q.data_ptr()}"] + [t.data_ptr() for t in (q, k, v, out)] + ints
    with pytest.raises(ValueError, match="ranges kernel"):  # a dynamic walk's tile ranges
        GluonBoundCall(NS(form=NS(ranges=("k", "src")), _pre=None), ["q", "k", "v"],
                       calls[0], ["o"])


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_gluon_form_with_a_pre_pass_is_replayed_with_its_summaries_kept(monkeypatch, dynamic):
    """A data mask's Gluon form is replayed too (``GluonBoundCall``): per call, the
    pre-pass's arguments -- the captured tensors, this stream's kept summaries, the
    signature's integers -- go with the form's launch under a key that counts the
    pre-pass's integer classes; the summaries are the launcher's pre-pass plan's shapes
    and are the same buffers on the next call on this stream.  A dynamic walk's
    scheduler buffer (``tile_sched``, filled by its ranges kernel) is kept so too."""
    from neptune_eq.runtime import gluon_launch
    from neptune_eq.runtime.gluon_launch import GluonBoundCall, GluonLauncher
    doc = ne.placeholder((40,), "int32", "doc")
    kern = ne.superoptimize(ne.attention(1, 2, 40, 40, 16, "float32",
                                         mask_mod=lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)),
                            target="interpreter", cache=False)
    tl = Launcher(kern.program, kern.kernel_source, "interpreter", kern.config)
    assert tl._pre is not None
    launched, general = [], []

    class FakeGluon:  # GluonLauncher's replay code around a real pre-pass plan
        gluon, fast_ok, _order, size_args = True, True, [], ()
        ks = kern.kernel_source
        form = type("Form", (), {"ranges": ("r", "src") if dynamic else None,
                                 "streamed": ("q", "k", "v")})()
        _pre, _sched_n = tl._pre, 11
        tensors = [p[:-len("_ptr")] for p in ks.params] + (["tile_sched"] if dynamic else [])
        _checked = {}
        _pointers, integer_args, _rest = (GluonLauncher._pointers, GluonLauncher.integer_args,
                                          GluonLauncher._rest)

        def _fast(self, ck, pre, tensors, rest, stream, reuse=False):
            launched.append((ck, pre, tensors, rest, stream))

        def __call__(self, tensors):
            general.append(tensors)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # (integer_args asks)
    monkeypatch.setattr(gluon_launch, "host_queries", lambda: _FakeHost(False))
    monkeypatch.setattr(gluon_launch, "gluon_inputs_ok", lambda ks, tensors: True)
    la = FakeGluon()
    kern._launcher = la
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    ids = torch.tensor([0] * 15 + [1] * 25, dtype=torch.int32)
    names = [ph.name for ph in kern.input_program.inputs]
    args = [{"q": q, "k": k, "v": v, "doc": ids}[n] for n in names]
    kern(*args)                   # the general call, then the replay is made
    (replay,) = kern._bound.values()
    assert isinstance(replay, GluonBoundCall) and replay.pre is not None
    kern(*args)                   # no key checked yet: the launcher's own call
    assert len(general) == 2 and not launched
    xs, (specs, tail, launch) = tl._pre.plan_for({"doc": ids})
    ints = [v for x in xs for v in (*x.shape, *x.stride())] + tail
    run = {**general[-1], **dict(zip([n for n, _, _ in specs],
                                     [torch.empty(sh, dtype=dt) for _, sh, dt in specs]))}
    if dynamic:
        run["tile_sched"] = torch.empty(11, dtype=torch.int32)
    _, key = la._rest(run, replay.integers)
    la._checked[key + (int_classes(ints),)] = ("pre", "form")
    kern(*args)
    kern(*args)
    assert len(general) == 2 and len(launched) == 2
    (ck, pre, tensors, rest, stream), second = launched
    assert ck == ("pre", "form") and stream == "stream" and pre[0] is launch
    sums = [tensors[n] for n, _, _ in specs]
    assert [tuple(t.shape) for t in sums] == [tuple(sh) for _, sh, _ in specs]
    ptr = [t.data_ptr() for t in [ids] + sums]  # pointers go in as ints
    assert pre[1] == ptr + ints and pre[2] == int_classes(ints)
    assert all(a is b for a, b in zip(sums, [second[2][n] for n, _, _ in specs]))  # kept
    assert rest[:len(la.tensors)] == [tensors[n].data_ptr() for n in la.tensors]
    assert ("tile_sched" in tensors) == dynamic
    if dynamic:
        sched = tensors["tile_sched"]
        assert sched.dtype == torch.int32 and sched.shape == (11,)
        assert second[2]["tile_sched"] is sched and rest[len(la.tensors) - 1] == sched.data_ptr()


@pytest.mark.parametrize("shape", [(), (0, 3), (2, 3, 4, 5), (1, 64, 1, 128), (2, 4, 3, 3, 2)])
def test_output_maker_makes_fresh_contiguous_tensors_of_the_specs(shape):
    from neptune_eq.runtime.launch import OutputMaker
    make = OutputMaker([(shape, torch.float16), ((3,), torch.int32)], torch.device("cpu"))
    a, b = make(), make()
    for (x, y), (sh, dt) in zip(zip(a, b), make.specs):
        assert x.shape == sh and x.dtype == dt and x.is_contiguous() and x.device.type == "cpu"
        assert x.numel() == 0 or x.data_ptr() != y.data_ptr()  # a call never shares storage
    try:  # deterministic algorithms: the storage is taken as it comes, not NaN-filled
        torch.use_deterministic_algorithms(True)
        (x, _), = [make()]
        assert x.shape == shape and x.is_contiguous()
    finally:
        torch.use_deterministic_algorithms(False)


class _FakeHost:
    """``HostQueries`` of a faked GPU: device 0, one stream, no capture; ``hooked``: a
    profiler's launch hook is set."""

    def __init__(self, hooked: bool):
        self.hooked = hooked
        self.device = lambda: 0
        self.stream = lambda device: "stream"
        self.capturing = lambda: False

    def hooks_set(self):
        return self.hooked


@pytest.mark.parametrize("hooked", [False, True])
def test_a_gpu_replay_launches_the_checked_kernels_with_pointers_as_ints(keyed, hooked):
    """The GPU path of a replay, with the GPU faked: every launch of a checked key gets the
    argument lists of ``arg_lists`` with each tensor as its data pointer (an int: Triton's
    launcher then neither calls data_ptr() nor asks the driver), the kept split-k scratch
    among them, and the call returns fresh outputs of the signature.  With no launch hook
    set each launch is its ``prepared`` call, made once per stream and checked kernels;
    with a profiler's hook set, ``FastLaunch.fast`` (which hands the hook its metadata)."""
    bc, _, ins, _ = _split_k_replay(keyed)
    la, names = bc.launcher, bc.names
    launched, prepared = [], []

    class Step:
        def fast(self, ck, a, stream):
            launched.append(("fast", ck, list(a), stream))

        def prepared(self, ck, stream, tail):
            prepared.append(ck)

            def raw(*a):  # (head..., the call's own arguments..., tail...)
                launched.append(("raw", ck, list(a[2:]), a[1]))
            return raw, ("head", stream), tuple(tail)

    bc.interpret = False
    bc.host = _FakeHost(hooked)
    bc.steps = [Step() for _ in bc.steps]
    inputs = [ins[n] for n in names]
    assert all(t.data_ptr() & 15 == 0 for t in inputs)  # (and the fresh output: every key aligned)
    checked = la._checked[(0, (True,) * len(bc.param_slots), bc.int_key)] = ["partials", "combine"]
    for _ in range(2):
        launched.clear()
        outs = bc(inputs)
        assert [(how, ck) for how, ck, _, _ in launched] == [
            ("fast" if hooked else "raw", ck) for ck in checked]
        assert all(s == "stream" for _, _, _, s in launched)
        assert outs[0].shape == (1, 4, 1, 32) and outs[0].is_contiguous()
        want = bc.arg_lists(inputs + outs, "stream", False)  # the same lists, with tensors
        assert [a for _, _, a, _ in launched] == [
            [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in w] for w in want]
        assert not any(isinstance(x, torch.Tensor) for _, _, a, _ in launched for x in a)
    assert prepared == ([] if hooked else checked)  # made once, kept for the stream
    if not hooked:  # other checked kernels under the key: the plan is made again
        la._checked[(0, (True,) * len(bc.param_slots), bc.int_key)] = ["p2", "c2"]
        bc(inputs)
        assert prepared == checked + ["p2", "c2"]
        # captured into a CUDA graph: the same plan (the combine launched dependent
        # there too), the scratch fresh -- its tensors, not their pointers, go to the
        # launch, so the graph's pool keeps them alive for its replays
        bc.host.capturing = lambda: True
        launched.clear()
        bc(inputs)
        assert prepared == checked + ["p2", "c2"]
        assert [ck for _, ck, _, _ in launched] == ["p2", "c2"]
        assert any(isinstance(x, torch.Tensor) for x in launched[0][2])  # fresh scratch

"""Symbolic sizes: one saturation per structure serves every size, in the interpreter."""
import pickle

import pytest
import torch

import neptune_eq as ne
from neptune_eq.frontend import examples
from neptune_eq.egraph.saturate import EGraphStage
from neptune_eq.interp import evaluate
from neptune_eq.sizes import Guards, Size, SymInt, bind, bucket_of, sizes_of


@pytest.fixture
def saturations(monkeypatch):
    """Counts e-graph saturations in this test."""
    count = [0]
    real = EGraphStage.saturate

    def counted(self, *a, **kw):
        count[0] += 1
        return real(self, *a, **kw)
    monkeypatch.setattr(EGraphStage, "saturate", counted)
    return count


def _reference(kern, values, ins):
    prog = bind(kern.input_program, values)
    return evaluate(prog, ins)[prog.outputs[0]]


def _check(kern, values, ins, tol=2e-5):
    got = kern(*ins.values())
    ref = _reference(kern, values, ins)
    assert got.shape == ref.shape
    assert torch.isfinite(got).all()
    err = (got.double() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), (values, err)


def test_prefill_at_many_sizes_saturates_once(saturations):
    out = ne.attention(1, 2, "S", "S", 16, "float32", mask_mod=lambda b, h, i, j: j <= i)
    kern = ne.superoptimize(out, target="interpreter", cache=False, sizes={"S": 40})
    for s in (40, 33, 1, 5, 17, 64, 100):
        ins = {n: torch.randn(1, 2, s, 16) for n in "qkv"}
        _check(kern, {"S": s}, ins)
    assert saturations[0] == 1 and kern.saturations == 1
    assert kern._dispatch.bucket_choices >= 3       # 1, 5, 17, 100 are new buckets ...
    assert len(kern._dispatch.launchers) == 7        # ... 33 reused 40's kernel


def test_growing_decode_reuses_buckets(saturations):
    out = ne.attention(1, 4, 1, "T", 16, "float32", kv_heads=2)
    kern = ne.superoptimize(out, target="interpreter", cache=False, sizes={"T": 24})
    q = torch.randn(1, 4, 1, 16)
    kv = torch.randn(2, 1, 2, 70, 16)
    for t in range(20, 70, 7):  # the KV cache grows
        ins = {"q": q, "k": kv[0, :, :, :t].contiguous(), "v": kv[1, :, :, :t].contiguous()}
        _check(kern, {"T": t}, ins)
    assert saturations[0] == 1
    assert kern._dispatch.bucket_choices == 2  # 17-32 was chosen at build; 33-64, 65-128 new
    assert all("valid where" in b for b in kern.buckets)


def test_a_non_attention_chain_with_two_named_sizes():
    out = examples.softmax("N", "M", "float32")
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    for n, m in ((3, 20), (7, 129), (1, 1)):
        x = torch.randn(n, m) * 30  # large magnitudes: the max shift must be right
        _check(kern, {"N": n, "M": m}, {"x": x})


def test_symbolic_kernel_round_trips_through_the_disk_cache(tmp_path, monkeypatch, saturations):
    monkeypatch.setenv("NEPTUNE_EQ_CACHE", str(tmp_path))
    out = lambda: examples.softmax("N", 24, "float32")  # noqa: E731
    first = ne.superoptimize(out(), target="interpreter")
    again = ne.superoptimize(out(), target="interpreter")
    assert (first.cache_status, again.cache_status) == ("miss", "hit") and saturations[0] == 1
    _check(again, {"N": 9}, {"x": torch.randn(9, 24)})
    assert "n_N" in again.source


def test_inputs_that_disagree_on_a_size_are_refused():
    kern = ne.superoptimize(ne.attention(1, 2, "S", "S", 16, "float32"), target="interpreter",
                            cache=False, sizes={"S": 8})
    with pytest.raises(ne.ProgramError, match="Size S is 8 in dim 2 of q but 9"):
        kern(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16))
    with pytest.raises(ne.ProgramError, match="dim 3 must be 16"):
        kern(torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))


def test_bad_sizes_argument():
    with pytest.raises(ValueError, match="positive int for each named size"):
        ne.superoptimize(examples.softmax("N", 8), target="interpreter", cache=False,
                         sizes={"M": 3})


def test_symint_prints_code_computes_its_value_and_records_guards():
    g = Guards()
    s = SymInt.symbol("S", 40, g)
    e = -(-s // 16) * 16 - 1
    assert (str(e), e.hint, e.at({"S": 33})) == ("(((0 - ((0 - n_S) // 16)) * 16) - 1)", 47, 47)
    assert s < 64 and not s <= 16
    assert g.hold({"S": 33}) and not g.hold({"S": 70}) and not g.hold({"S": 16})
    assert int(s) == 40 and not g.hold({"S": 41})   # a plain int pins the exact size
    e2, g2 = pickle.loads(pickle.dumps((e, g)))
    assert e2.at({"S": 100}) == 111 and g2.hold({"S": 40})


def test_sizes_are_read_off_the_tensors():
    prog = ne.build_program(ne.attention(2, 2, "Sq", "Skv", 16, "float32"))
    ins = {"q": torch.zeros(2, 2, 3, 16), "k": torch.zeros(2, 2, 5, 16), "v": torch.zeros(2, 2, 5, 16)}
    assert sizes_of(prog, ins) == {"Sq": 3, "Skv": 5}
    assert bucket_of({"Sq": 3, "Skv": 5}) == bucket_of({"Sq": 4, "Skv": 8}) != bucket_of({"Sq": 5, "Skv": 8})
    with pytest.raises(ne.ProgramError):
        Size("not a name")


@pytest.mark.parametrize("fused", [False, True])
def test_a_split_k_kernel_generated_at_one_size_is_right_at_others(fused):
    """The split-k decode chosen for T = 4096 takes T, the chunking and the scratch size at
    run time: launched at other T (cheap in the interpreter), it equals the reference."""
    from neptune_eq.choosing.choose import rank
    from neptune_eq.choosing.costmodel import device_for
    from neptune_eq.choosing.dispatch import specialised_pool
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import candidate_configs
    kern = ne.superoptimize(ne.attention(1, 2, 1, "T", 16, "float32"), target="interpreter",
                            cache=False, sizes={"T": 64})
    spec, _ = specialised_pool(kern._dispatch.pool, {"T": 4096})
    row = next(r for r in rank(spec, device_for("H200"), True) if r.plan and r.plan.split)
    assert "n_T" in row.kernel.source and "4096" not in row.kernel.source
    for t in (37, 100):
        values = {"T": t}
        ks = row.kernel.concrete(values)
        cfg = candidate_configs(ks, "interpreter")[0]
        cfg.fused = fused
        ins = {"q": torch.randn(1, 2, 1, 16), "k": torch.randn(1, 2, t, 16), "v": torch.randn(1, 2, t, 16)}
        out = torch.empty(1, 2, 1, 16)
        Launcher(bind(row.program, values), ks, "interpreter", cfg.at(values), (t,))({**ins, "o": out})
        ref = _reference(kern, values, ins)
        assert cfg.splits > 1 and (out.double() - ref).abs().max().item() < 1e-5


def test_buckets_chosen_at_call_time_are_cached_for_the_next_process(tmp_path, monkeypatch, saturations):
    monkeypatch.setenv("NEPTUNE_EQ_CACHE", str(tmp_path))
    x = ne.placeholder(("N", 12), "float32", "x")
    j, k = ne.reduce_axis(12, "j"), ne.reduce_axis(12, "k")
    mx = ne.compute(("N",), lambda i: ne.max(x[i, j], axis=j), "mx")
    y = ne.compute(("N",), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k), "y")
    kern = ne.superoptimize(y, target="interpreter", sizes={"N": 3})
    kern(torch.randn(40, 12))                      # 33-64: a bucket chosen at the call
    assert kern._dispatch.bucket_choices == 1
    again = ne.superoptimize(y, target="interpreter", sizes={"N": 3})
    assert again.cache_status == "hit" and again is not kern
    x40 = torch.randn(40, 12)
    got = again(x40)
    assert again._dispatch.bucket_choices == 0     # found in the cache: nothing chosen again
    ref = (x40.double() - x40.double().amax(1, keepdim=True)).exp().sum(1)
    assert torch.allclose(got.double(), ref, rtol=1e-5)
    assert saturations[0] == 1


def test_new_buckets_are_timed_on_the_call_where_long_enough(monkeypatch):
    """A bucket first met by a call is chosen by timing on that call's own tensors (with
    fresh outputs) where ``time_new_buckets`` says so -- on a GPU only, for calls the cost
    model predicts at >= ``TIME_NEW_BUCKET_US`` (``auto``), always (``1``) or never
    (``0``), never while a graph is captured; the tensors are made only then."""
    from neptune_eq.choosing import dispatch
    seen = []
    real = dispatch.choose_bucket

    def spy(pool, values, target, device, tensors=None, *a, call_tensors=None, **kw):
        seen.append(call_tensors() if call_tensors and dispatch.time_new_buckets(target, 1e9)
                    else None)
        return real(pool, values, target, device, None, *a, **kw)
    monkeypatch.setattr(dispatch, "choose_bucket", spy)
    monkeypatch.setattr(dispatch, "timing_tensors", lambda prog, given: (dict(given), prog))
    out = ne.attention(1, 2, "S", "S", 16, "float32")
    kern = ne.superoptimize(out, target="interpreter", cache=False, sizes={"S": 40})
    kern(*[torch.randn(1, 2, 100, 16) for _ in range(3)])  # the interpreter: never timed
    monkeypatch.setattr(dispatch, "time_new_buckets", lambda target, us=None: True)  # a GPU
    ins = [torch.randn(1, 2, 7, 16) for _ in range(3)]
    kern(*ins)
    assert seen[-2] is None  # (100, then 7)
    given, prog = seen[-1]
    assert list(given) == ["q", "k", "v"] and all(given[n] is t for n, t in zip("qkv", ins))
    assert prog.shape_of("o") == (1, 2, 7, 16)  # the bucket's program at the call's sizes
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    long, short = dispatch.TIME_NEW_BUCKET_US, dispatch.TIME_NEW_BUCKET_US / 10
    assert not dispatch.time_new_buckets("interpreter", long)
    monkeypatch.delenv("NEPTUNE_EQ_TIME_NEW_BUCKETS", raising=False)    # auto
    assert dispatch.time_new_buckets("cuda", long) and not dispatch.time_new_buckets("cuda", short)
    monkeypatch.setenv("NEPTUNE_EQ_TIME_NEW_BUCKETS", "1")
    assert dispatch.time_new_buckets("cuda", short)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not dispatch.time_new_buckets("cuda", long)  # never inside a graph capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("NEPTUNE_EQ_TIME_NEW_BUCKETS", "0")
    assert not dispatch.time_new_buckets("cuda", long)
    monkeypatch.setenv("NEPTUNE_EQ_TIME_NEW_BUCKETS", "yes")
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        dispatch.time_new_buckets("cuda", long)


def test_an_untimed_bucket_takes_the_config_the_nearest_timed_bucket_chose(monkeypatch):
    """On a GPU a bucket met at call time and not timed reuses the config that timing
    chose at the nearest size (within 4x in every size) for the same candidate (Gluon or
    ``tl`` form, tile shape) where its kernel offers it; else the first hand-ordered one."""
    from dataclasses import replace
    from neptune_eq.choosing import dispatch
    from neptune_eq.choosing.costmodel import DEVICES
    from neptune_eq.runtime.tile_configs import candidate_configs
    out = ne.attention(1, 2, "S", "S", 16, "float32")
    kern = ne.superoptimize(out, target="interpreter", cache=False, sizes={"S": 40})
    pool, dev = kern._dispatch.pool, DEVICES["H100"]
    monkeypatch.setenv("NEPTUNE_EQ_TIME_NEW_BUCKETS", "0")
    first = dispatch.choose_bucket(pool, {"S": 12000}, "cuda", dev)  # nothing known: untimed
    configs = candidate_configs(first.row.kernel, "cuda", dev.sms)
    assert first.config == configs[0] and first.row.measured_ms is None
    near, far = configs[2], configs[3]

    def timed(values, config):
        c = dispatch.choose_bucket(pool, values, "cuda", dev)
        c.config = config
        c.row = replace(c.row, measured_ms=1.0)
        return c
    known = [timed({"S": 32768}, far), timed({"S": 8192}, near)]
    assert all(c.program is first.program for c in known)  # (the same candidate at each)
    got = dispatch.choose_bucket(pool, {"S": 12000}, "cuda", dev, known=known)
    assert got.config == near and got.row.measured_ms is None  # 8192 is nearer than 32768
    # a Gluon form's walk is not carried: the shorter bucket takes the persistent one
    walked = [known[0], replace(known[1], config=replace(near, per_tile=True))]
    assert dispatch.choose_bucket(pool, {"S": 12000}, "cuda", dev, known=walked).config == near
    assert dispatch.choose_bucket(pool, {"S": 140000}, "cuda", dev,  # > 4x 32768: too far
                                  known=known).config == configs[0]
    known[1].config = replace(near, blocks={"B_i": 48, "B_L": 48})  # not offered here
    assert dispatch.choose_bucket(pool, {"S": 12000}, "cuda", dev, known=known).config == far
    untimed = replace(known[0], row=replace(known[0].row, measured_ms=None))
    assert dispatch.choose_bucket(pool, {"S": 12000}, "cuda", dev,
                                  known=[untimed]).config == configs[0]
    other = replace(known[0], program=next(c.program for c in pool if c.program is not
                                           first.program))  # another candidate's timing
    assert dispatch.choose_bucket(pool, {"S": 12000}, "cuda", dev,
                                  known=[other]).config == configs[0]
    # with the call's tensors, the pick is checked against the plain launch on them
    # (``tuning.agreeing_config``, faked here: it turns the pick down)
    asked = []

    def agreeing(program, ks, target, tensors, config, cfgs, values):
        asked.append((config, tensors, values))
        return configs[0]
    monkeypatch.setattr(dispatch, "agreeing_config", agreeing)
    got = dispatch.choose_bucket(pool, {"S": 12000}, "cuda", dev, known=known,
                                 call_tensors=lambda: {"the": "call"})
    assert got.config == configs[0] and asked == [(far, {"the": "call"}, {"S": 12000})]


def test_an_untimed_buckets_config_is_timed_once_when_a_choice_needs_its_time(monkeypatch):
    """``SizeDispatch.measured_ms``: a timed bucket gives its own timing; a bucket chosen
    untimed has its one config timed once on the call's tensors (no tuning) and kept;
    off the GPU, or while a graph is captured, there is no time."""
    from neptune_eq.choosing import dispatch
    out = ne.attention(1, 2, "S", "S", 16, "float32")
    kern = ne.superoptimize(out, target="interpreter", cache=False, sizes={"S": 40})
    assert kern.bucket_ms({"S": 40}, {}) is None            # the interpreter: no GPU time
    d = dispatch.SizeDispatch(kern._dispatch.pool, ["S"], "cuda", kern._dispatch.device)
    timed = []

    def one_timing(program, ks, target, tensors, configs, values):
        timed.append((configs, values))
        return [(k, 0.25, "ok") for k in configs]
    monkeypatch.setattr(dispatch, "time_configs", one_timing)
    monkeypatch.setattr(dispatch, "timing_tensors", lambda prog, given: dict(given))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("NEPTUNE_EQ_TIME_NEW_BUCKETS", "0")   # chosen untimed
    assert d.measured_ms({"S": 3000}, {}) == 0.25 == d.measured_ms({"S": 3000}, {})
    (c,) = [c for cs in d.buckets.values() for c in cs]
    assert timed == [([c.config], {"S": 3000})] and c.row.measured_ms is None
    c.row.measured_ms = 1.5                                   # a bucket timed when chosen
    assert d.measured_ms({"S": 3000}, {}) == 1.5 and len(timed) == 1
    from dataclasses import replace  # a Gluon config: timed after a tl run it is checked by
    c.row.measured_ms, c.config = None, replace(c.config, gluon_ws=True)
    assert d.measured_ms({"S": 3000}, {}) == 0.25   # (the cached time of the earlier config)
    c.config_ms = None
    d.measured_ms({"S": 3000}, {})
    assert [k.gluon_ws for k in timed[-1][0]] == [False, True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert d.measured_ms({"S": 100}, {}) is None and len(timed) == 2


def test_an_untimed_bucket_keeps_the_faster_of_the_configs_it_timed(monkeypatch):
    """A carried Gluon config is timed beside the tl run that checks it; where tl is
    faster (or Gluon failed) the bucket switches to tl, drops launchers made from the old
    config and re-stores itself; where Gluon is faster it stays."""
    from dataclasses import replace
    from neptune_eq.choosing import dispatch
    out = ne.attention(1, 2, "S", "S", 16, "float32")
    kern = ne.superoptimize(out, target="interpreter", cache=False, sizes={"S": 40})
    d = dispatch.SizeDispatch(kern._dispatch.pool, ["S"], "cuda", kern._dispatch.device)
    stored = []
    d.on_new_bucket = lambda: stored.append(1)
    times = {}
    monkeypatch.setattr(dispatch, "time_configs", lambda program, ks, target, tensors, configs,
                        values: [(k, times[k.gluon_ws], "ok" if times[k.gluon_ws] else "failed")
                                 for k in configs])
    monkeypatch.setattr(dispatch, "timing_tensors", lambda prog, given: dict(given))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("NEPTUNE_EQ_TIME_NEW_BUCKETS", "0")
    for tl_ms, gluon_ms, stays in ((0.068, 0.090, False), (0.2, 0.1, True), (0.2, None, False)):
        c = d.choice_for({"S": 3000})
        c.config = c.row.config = replace(c.config, gluon_ws=True)
        c.config_ms, times[False], times[True] = None, tl_ms, gluon_ms
        d.launchers[(3000,)] = d.launchers[(3001,)] = "stale"
        n = len(stored)
        assert d.measured_ms({"S": 3000}, {}) == (gluon_ms if stays else tl_ms)
        assert c.config.gluon_ws is stays and c.row.config is c.config
        assert ((3000,) in d.launchers) is stays and ((3001,) in d.launchers) is stays
        assert len(stored) == n + (not stays)

"""Generated Triton kernels (interpreter on CPU) equal the fp64 reference interpreter."""
import re

import pytest
from hypothesis import given, settings, strategies as st
import torch

import neptune_eq as ne
from neptune_eq.frontend import examples
from helpers import check_kernel


@pytest.mark.parametrize("n, m", [(5, 37), (1, 16), (17, 50), (3, 1)])
def test_softmax_kernel(n, m):
    kern = check_kernel(examples.softmax(n, m))
    assert kern.plan.n_passes == 2
    assert "for l0 in tl.range(" in kern.source and "tl.exp" in kern.source


def test_softmax_large_magnitude_scores_do_not_overflow():
    check_kernel(examples.softmax(4, 40), scale=1e4)


@pytest.mark.parametrize("shape, dtype", [
    ((1, 2, 20, 37, 24), "float16"),   # sizes that are not multiples of the blocks
    ((2, 1, 16, 32, 16), "float32"),
    ((1, 1, 5, 3, 8), "bfloat16"),     # fewer keys than one block
])
def test_attention_kernel_is_single_pass_and_correct(shape, dtype):
    kern = check_kernel(examples.attention(*shape, dtype))
    assert kern.plan.n_passes == 1
    src = kern.source
    # QKᵀ and P·V, nothing templated: in the key loop over whole blocks, and again in the
    # ragged last block's loop (compiled only where the extent is off the block size)
    assert src.count("tl.dot(") == 4 and src.count("for l0 in tl.range(") == 1
    tail = src.index("if not (EVEN_L or WS):  # the ragged last key block")
    assert src.count("tl.dot(", tail) == 2 and src.index("for l0 in tl.range(") < tail


def test_attention_large_scores_stay_finite():
    check_kernel(examples.attention(1, 1, 9, 21, 16, "float32"), scale=30.0)


def test_a_row_max_of_scaled_scores_is_taken_before_the_scale(monkeypatch):
    """max_j(s·c) = c·max_j(s) for c > 0, exactly: the kernels take each block's row max
    over the raw scores and scale the row once, one multiply per score fewer (measured
    +5-9% on the Gluon form at head dim 128, session 34), and the outputs are
    bit-identical to the per-score form's -- fully masked rows and large scores too."""
    from neptune_eq.lowering import lower
    shape = (1, 2, 20, 37, 64)  # head dim 64: the Gluon form exists too

    def kernel():
        return ne.superoptimize(ne.attention(*shape, "float16", mask_mod=lambda b, h, q, kv:
                                             (q >= kv) & (q < 17)),
                                target="interpreter", cache=False)
    new = kernel()
    for ks in (new.kernel_source.source, new.kernel_source.gluon.source):
        maxes = re.findall(r"(\w+) = (?:tl|gl)\.max\((?:tl|gl)\.where\(mask_L\[None, :\], (\w+), "
                           r"([-\d.e+]+)\), axis=1\)\n\s+\w+ = \1 \* ([\d.e-]+)\n", ks)
        assert maxes and len(maxes) == ks.count(".max("), ks
        for _, _, fill, c in maxes:  # the padding fill keeps the identity once scaled
            assert float(fill) * float(c) == pytest.approx(-1e30)
    assert "mx: each block's max/min over the unscaled body, scaled once per row" in new.explain()
    monkeypatch.setattr(lower, "MAX_BEFORE_SCALE", False)
    old = kernel()
    assert "scaled once per row" not in old.explain()
    assert not re.search(r"\.max\(\w+\.where\(mask_L\[None, :\], qk,", old.kernel_source.gluon.source)
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(s, generator=g) * 8).half() for s in ((1, 2, 20, 64), (1, 2, 37, 64),
                                                                  (1, 2, 37, 64)))
    a, b = new(q, k, v), old(q, k, v)
    assert torch.equal(a, b) and (a[:, :, 17:] == 0).all() and a.isfinite().all()


@pytest.mark.parametrize("c, fill, taken", [
    (0.125, -8e30, True),      # the softmax scale under a causal select
    (1.0, -1e30, True),
    (-0.5, -1e30, False),      # max(x·c) = c·min(x) for c < 0: not this identity
    (1e-7, -1e30, False),      # MASKED / c would leave fp32's range
    (1e-5, -1e33, False),      # the select's own fill over c would round to -inf
    (1e6, -1e30, True),
])
def test_a_max_commutes_only_with_a_positive_scale_whose_fill_stays_finite(c, fill, taken):
    from neptune_eq.ir import Term, positive_scale
    s, p = Term("var", (), "s"), Term("var", (), "p")
    body = Term("where", (p, Term("mul", (s, Term("flt", (), c))), Term("flt", (), fill)))
    got = positive_scale(body)
    assert (got is not None) == taken
    if taken:
        inner, scale = got
        assert scale == c and inner.op == "where" and inner.args[1] == s
        assert inner.args[2].val * c == pytest.approx(fill)


def test_plain_multi_pass_program_also_lowers_correctly():
    from neptune_eq.egraph.rulefiles import shipped_rule_files
    files = [f for f in shipped_rule_files() if f.stem != "rolling"]
    kern = check_kernel(examples.attention(1, 2, 7, 19, 8, "float32"), rules=files)
    assert kern.plan.n_passes == 2 and kern.source.count("for l0 in tl.range(") == 2


def test_kernel_call_errors():
    kern = ne.superoptimize(examples.softmax(3, 5), target="interpreter")
    with pytest.raises(ne.ProgramError, match=r"Expected x with shape \(3, 5\)"):
        kern(torch.randn(3, 6))
    with pytest.raises(ne.ProgramError, match="dtype float32"):
        kern(torch.randn(3, 5).half())
    with pytest.raises(TypeError, match="Missing input"):
        kern()
    out = kern(x=torch.randn(3, 5))
    assert out.shape == (3, 5) and out.dtype == torch.float32


def test_triton_imported_first_in_gpu_mode_gives_a_clear_error():
    import subprocess
    import sys
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import triton.language; "
            "import neptune_eq as ne; from neptune_eq.frontend import examples; "
            "ne.superoptimize(examples.softmax(2, 3), target='interpreter')(__import__('torch').randn(2, 3))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "Import neptune_eq before triton" in r.stderr


def _fake_gpu_launches(monkeypatch):
    """Run the fast-launch logic on CPU: Triton's launch and the direct launch both run
    the interpreted kernel (CUDA device and stream lookups stubbed)."""
    from neptune_eq.runtime import launch
    from neptune_eq.runtime import launcher as runtime
    calls = []
    monkeypatch.setattr(runtime, "launch_key",
                        lambda ts, ints: (0, tuple(t.data_ptr() & 15 == 0 for t in ts), tuple(ints)))
    monkeypatch.setattr(runtime, "current_stream", lambda dev: None)

    def slow(fl, args):
        calls.append("slow")
        fl.fn[fl.grid](*args, **fl.consts, **fl.options)
        return "compiled"

    def fast(fl, ck, args, stream):
        calls.append("fast")
        fl.fn[fl.grid](*args, **fl.consts, **fl.options)
    monkeypatch.setattr(launch.FastLaunch, "slow", slow)
    monkeypatch.setattr(launch.FastLaunch, "fast", fast)
    return calls


@pytest.mark.parametrize("corrupt", [False, True])
def test_fast_launch_is_used_only_after_it_reproduces_tritons_launch(monkeypatch, corrupt):
    from neptune_eq.runtime import launch
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import candidate_configs
    kern = ne.superoptimize(examples.softmax(3, 10), target="interpreter", cache=False)
    calls = _fake_gpu_launches(monkeypatch)
    if corrupt:
        real_fast = launch.FastLaunch.fast

        def bad(fl, ck, args, stream):
            real_fast(fl, ck, args, stream)
            args[1].add_(1.0)  # the output pointer of softmax: a wrong answer
        monkeypatch.setattr(launch.FastLaunch, "fast", bad)
    la = Launcher(kern.program, kern.kernel_source, "cuda", candidate_configs(kern.kernel_source, "interpreter")[0])
    assert la.fast_ok
    x = torch.randn(3, 10)
    for _ in range(3):
        y = torch.empty(3, 10)
        la({"x": x, "y": y})
        assert torch.allclose(y, torch.softmax(x, -1), atol=1e-5)  # never the corrupted output
    if corrupt:
        assert not la.fast_ok and "differed" in la.fast_reason and calls.count("slow") >= 2
    else:
        # slow + one checked fast launch, then only fast launches
        assert calls == ["slow", "fast", "fast", "fast"] and len(la._checked) == 1


_EDGES = st.one_of(st.integers(-2 ** 40, 2 ** 40), st.integers(0, 64),
                   st.integers(2 ** 31 - 40, 2 ** 31 + 40), st.integers(-2 ** 31 - 40, -2 ** 31 + 40),
                   st.integers(2 ** 63 - 40, 2 ** 64 - 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(_EDGES, min_size=1, max_size=40))
def test_int_classes_are_at_least_as_fine_as_tritons(ints):
    """Integers in one class of ``launch.int_classes`` are specialised alike by Triton
    itself: a direct launch keyed on the classes never reuses a kernel that Triton would
    have compiled differently."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from neptune_eq.runtime.launch import int_classes
    seen = {}
    for v, c in zip(ints, int_classes(ints)):
        native = native_specialize_impl(BaseBackend, v, False, True, True)
        assert seen.setdefault(c, native) == native, (v, c, native, seen)


def test_runtime_size_launchers_share_checked_launches_by_tritons_class(monkeypatch):
    """A kernel with runtime sizes gets a launcher per size; one checked direct launch
    serves every size that Triton specialises the same way (a growing KV cache does not
    pay a check per step), and a new class (N % 16 == 0) is checked once again."""
    from neptune_eq.runtime import launcher as runtime
    from neptune_eq.sizes import bind
    x = ne.placeholder(("N", 10), "float32", "x")
    j, k = ne.reduce_axis(10, "j"), ne.reduce_axis(10, "k")
    mx = ne.compute(("N",), lambda i: ne.max(x[i, j], axis=j), "mx")
    y = ne.compute(("N",), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k), "y")
    kern = ne.superoptimize(y, target="interpreter", cache=False, sizes={"N": 5})
    calls = _fake_gpu_launches(monkeypatch)
    monkeypatch.setattr(runtime, "class_launch_key", lambda ts, ints, spec: (
        0, tuple(t.data_ptr() & 15 == 0 for t in ts), spec(ints)))
    runtime._CHECKS_BY_VARIANT.clear()
    # one bucket (33..64); 48 and 64 are another Triton class (% 16) and variant (even rows)
    for n, expect in ((33, ["slow", "fast"]), (35, ["fast"]), (37, ["fast"]),
                      (48, ["slow", "fast"]), (64, ["fast"])):
        vals = {"N": n}
        c = kern._dispatch.choice_for(vals)
        ks = c.row.kernel.concrete(vals)
        la = runtime.Launcher(bind(c.row.program, vals), ks, "cuda", c.config.at(vals),
                              tuple(vals[s] for s in ks.size_params))
        assert la.fast_ok, la.fast_reason
        xs = torch.randn(n, 10, dtype=torch.float32)
        del calls[:]
        out = torch.empty(n)
        la({"x": xs, "y": out})
        assert calls == expect, (n, calls)
        ref = (xs.double() - xs.double().amax(1, keepdim=True)).exp().sum(1)
        assert torch.allclose(out.double(), ref, rtol=1e-5)


_SLOPED = {  # score mods linear in the key index (ALiBi and its relatives)
    "alibi causal, rows that see nothing": (
        lambda sl: lambda s, b, h, i, j: s + sl[h] * (j - i),
        lambda b, h, i, j: (j <= i) & (i >= 5)),
    "offset, reversed sign": (lambda sl: lambda s, b, h, i, j: s + sl[h] * ((i + 3) - j), None),
    "the key index alone": (lambda sl: lambda s, b, h, i, j: s - sl[h] * j, None),
    "a slope from the head index": (  # (j − i)·(h + 1)·c = (j − i)·((h + 1)·c)
        lambda sl: lambda s, b, h, i, j: s + (j - i) * (h + 1) * -0.0625, None),
}


@pytest.mark.parametrize("name", list(_SLOPED))
def test_a_score_term_linear_in_the_key_index_leaves_the_block_as_a_shift(name, tmp_path):
    """slope·(j − i) = slope·c + slope·(l0 − m0 − r): the key lanes' part is one vector made
    once before the loops, the rest a value per row and block that joins the row max and
    exp2's row term (``block_shift``: one fused multiply-add per score instead of a
    subtract, a conversion and a multiply, and no [rows, keys] tile live in the loop).
    Right against fp64 in the interpreter (odd lengths, rows that see nothing, scores x8,
    the slope large and small); the Gluon form takes the split too and compiles for sm_90
    (its outputs are checked on the GPU: bench/gluon_probe/float_index_ab.py)."""
    score, mask = _SLOPED[name]
    sl = ne.placeholder((2,), "float32", "slopes")
    kern = check_kernel(ne.attention(1, 2, 21, 37, 64, "float16", score_mod=score(sl),
                                     mask_mod=mask), scale=8.0, cache=False)
    assert "a·(j − i) in the scores: the key lanes' term made once, a shift per row and block" \
        in kern.explain()
    consumer = kern.kernel_source.gluon.source.split("def _consumer")[1]
    for ks, loop in ((kern.kernel_source.source, "for l0 in"), (consumer, "for jb in")):
        lanes = re.search(r"\* \(-?\(\((tl\.arange\(0, B_L\)|cols)\).*", ks)
        assert lanes and lanes.start() < ks.index(loop), ks  # made before the key loops
        assert "[:, None]" not in lanes.group(0), lanes.group(0)  # a vector, not a tile
        assert "offs_L[None, :] - " not in ks and re.search(r"\(\(l0\)", ks), ks
    if name.startswith("alibi"):
        from sm90_compile import compile_for_sm90
        from neptune_eq.runtime.gluon_launch import sm90_spec
        path = tmp_path / "alibi.py"
        path.write_text(kern.kernel_source.gluon.source)
        res = compile_for_sm90(path, kern.kernel_source.gluon.name,
                               sm90_spec(kern.program, kern.kernel_source))
        assert res["ok"] and res["wgmma"], res


def test_the_block_shift_agrees_with_the_plain_form_in_decode_and_at_every_size(monkeypatch):
    """The split-k decode takes the shift too; the outputs match the plain form's to
    rounding at several sizes of a symbolic key length."""
    from neptune_eq.lowering import block_shift
    sl = ne.placeholder((2,), "float32", "slopes")

    def kernel():
        out = ne.attention(1, 2, 1, "T", 64, "float32", score_mod=lambda s, b, h, i, j:
                           s + sl[h] * (j - (i + 40)))
        return ne.superoptimize(out, target="interpreter", cache=False, sizes={"T": 40})
    new = kernel()
    assert "(tl.arange(0, B_L))" in new.source and "shift per row and block" in new.explain()
    monkeypatch.setattr(block_shift, "ENABLED", False)
    old = kernel()
    assert "(tl.arange(0, B_L))" not in old.source and "shift per" not in old.explain()
    g = torch.Generator().manual_seed(2)
    slopes = torch.tensor([1.0, 0.03125])
    for t in (40, 7, 300):
        q, k, v = (torch.randn(1, 2, n, 64, generator=g) * 3 for n in (1, t, t))
        a, b = new(q, k, v, slopes), old(q, k, v, slopes)
        assert (a - b).abs().max() < 1e-5, t



def test_a_plan_without_a_row_max_keeps_the_bias_in_the_scores():
    """The split pays where a row max takes the shift; a pass of sums only (a backward's)
    keeps a·(j − i) per element: there the lane tile's registers cost more than the adds
    it saves (ALiBi's backward alone 458-463 vs 485 TFLOP/s, H200, session 35)."""
    from neptune_eq.lowering import block_shift
    x = ne.placeholder((9, 30), "float32", "x")
    a = ne.placeholder((1,), "float32", "a")
    j = ne.reduce_axis(30, "j")
    y = ne.compute((9,), lambda i: ne.sum(x[i, j] * (a[0] * (j - i)), axis=j), "y")
    kern = check_kernel(y, cache=False)
    assert not block_shift.active(kern.plan) and "shift per" not in kern.explain()
    assert "(tl.arange(0, B_L))" not in kern.source

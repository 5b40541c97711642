"""The error catalogue: every kind of bad input gets a clear error (what was expected,
what was given, what to try) or a recorded fallback -- never a crash deep inside egglog or
Triton, never wrong numbers."""
from types import SimpleNamespace

import pytest
import torch

import neptune_eq as ne
from neptune_eq.frontend import examples
from neptune_eq.ir import Definition, Placeholder, Program, Term, validate, var


def _x():
    return ne.placeholder((4, 7), "float32", "x")


def _bad_index_count():
    x, j = _x(), ne.reduce_axis(7, "j")
    return ne.compute((4,), lambda i: ne.sum(x[i], axis=j), "y")


def _unbound_reduce_axis():
    x, j = _x(), ne.reduce_axis(7, "j")
    return ne.compute((4,), lambda i: x[i, j], "y")


def _reused_reduce_axis():
    x, j = _x(), ne.reduce_axis(7, "j")
    return ne.compute((4,), lambda i: ne.sum(ne.sum(x[i, j], axis=j), axis=j), "y")


def _wrong_extent():
    x, j = _x(), ne.reduce_axis(9, "j")
    return ne.compute((4,), lambda i: ne.sum(x[i, j], axis=j), "y")


def _shape_mismatch():
    x, j = _x(), ne.reduce_axis(7, "j")
    return ne.compute((5,), lambda i: ne.sum(x[i, j], axis=j), "y")


def _unsupported_operand():
    return ne.sum(_x(), axis=ne.reduce_axis(7, "j"))


def _cyclic():
    return validate(Program([Placeholder("x", (4,), "float32")],
                            [Definition("a", ("i",), Term("ref", (var("i"),), "b"), "float32"),
                             Definition("b", ("i",), Term("ref", (var("i"),), "a"), "float32")],
                            ["b"], {"i": 4}))


@pytest.mark.parametrize("make, expected", [
    (_bad_index_count, r"Expected 2 indices for x with shape \(4, 7\), got 1; index every"),
    (_unbound_reduce_axis, r"not bound here .* reduce over it with ne.sum"),
    (_reused_reduce_axis, r"already binds it; use a fresh ne.reduce_axis"),
    (_wrong_extent, r"extent 7 but is indexed by 'j\S*' of extent 9; use an axis of extent 7"),
    (_shape_mismatch, r"dim 0 of x has extent 4 but is indexed by 'i' of extent 5"),
    (_unsupported_operand, r"Expected a neptune_eq expression or a number, got Tensor"),
    (lambda: ne.placeholder((4,), "float8", "z"), r"Expected dtype in .* got 'float8'"),
    (lambda: Term("softplus", ()), r"Unknown op 'softplus'; expected one of"),
    (_cyclic, r"Expected acyclic definitions, got the cycle"),
    (lambda: ne.attention(1, 6, 4, 4, 8, kv_heads=4), r"Expected q heads \(6\) to be a multiple of kv"),
])
def test_malformed_programs(make, expected):
    with pytest.raises(ne.ProgramError, match=expected):
        out = make()
        ne.superoptimize(out, target="interpreter", cache=False)


@pytest.fixture(scope="module")
def alibi_kernel():
    slopes = ne.placeholder((2,), "float32", "slopes")
    out = ne.attention(1, 2, 5, 9, 8, "float32", score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i))
    return ne.superoptimize(out, target="interpreter", cache=False)


def _qkv(dtype=torch.float32, device="cpu"):
    return [torch.randn(1, 2, n, 8, dtype=dtype, device=device) for n in (5, 9, 9)]


@pytest.mark.parametrize("args, kwargs, exc, expected", [
    (lambda: [torch.randn(1, 2, 5, 9)] + _qkv()[1:] + [torch.ones(2)], {}, ne.ProgramError,
     r"Expected q with shape \(1, 2, 5, 8\), got \(1, 2, 5, 9\); .* call ne.superoptimize again"),
    (lambda: _qkv(torch.float16) + [torch.ones(2)], {}, ne.ProgramError,
     r"Expected q with dtype float32, got float16; convert it with .to\(torch.float32\)"),
    (lambda: _qkv(device="meta") + [torch.ones(2)], {}, ne.ProgramError,
     r"Expected q on cpu \(target interpreter\), got meta; move it with .to\('cpu'\)"),
    (lambda: _qkv(), {}, TypeError, r"Missing input\(s\) \['slopes'\]"),
    (lambda: _qkv() + [[1.0, 2.0]], {}, TypeError, r"Expected slopes to be a torch.Tensor, got list"),
    (lambda: _qkv(), {"bias": torch.ones(2)}, TypeError, r"Unknown input 'bias'; the program's inputs"),
])
def test_bad_call_arguments(alibi_kernel, args, kwargs, exc, expected):
    with pytest.raises(exc, match=expected):
        alibi_kernel(*args(), **kwargs)


def test_non_contiguous_and_overlapping_inputs_give_right_numbers(alibi_kernel):
    """Strides are kernel arguments: views are read where they live, never misread."""
    from neptune_eq.interp import evaluate
    q, k, v = _qkv()
    slopes = torch.ones(2)
    qt = torch.randn(1, 2, 8, 5).transpose(-1, -2)       # non-contiguous
    kx = torch.randn(1, 1, 9, 8).expand(1, 2, 9, 8)      # overlapping (stride 0)
    got = alibi_kernel(qt, kx, v, slopes)
    prog = alibi_kernel.input_program
    ref = evaluate(prog, {"q": qt.contiguous().double(), "k": kx.contiguous().double(),
                          "v": v.double(), "slopes": slopes.double()})["o"]
    assert (got.double() - ref).abs().max().item() < 1e-5


def test_no_gpu_falls_back_to_the_interpreter_with_a_warning():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.warns(RuntimeWarning, match="No CUDA GPU is visible: .* Triton interpreter"):
        kern = ne.superoptimize(examples.softmax(2, 5), cache=False)
    assert kern.target == "interpreter"
    with pytest.raises(RuntimeError, match="target='cuda' but torch sees no CUDA device"):
        ne.superoptimize(examples.softmax(2, 5), target="cuda", cache=False)


def test_a_candidate_that_fails_to_compile_is_skipped_and_recorded(monkeypatch):
    from neptune_eq.choosing import choose
    real, calls = choose.load_kernel, []

    def flaky(ks, interpret):
        calls.append(ks.name)
        if len(calls) == 1:
            raise SyntaxError("invalid syntax in generated kernel (simulated)")
        return real(ks, interpret)
    monkeypatch.setattr(choose, "load_kernel", flaky)
    kern = ne.superoptimize(examples.softmax(3, 10), target="interpreter", cache=False)
    first, chosen = kern.candidates[0], kern.chosen_row
    assert first.status.startswith("failed to compile") and "simulated" in first.status
    assert chosen is not first and chosen.rank == 2 and "failed to compile" in kern.candidate_table()
    x = torch.randn(3, 10)
    assert torch.allclose(kern(x), torch.softmax(x, -1), atol=1e-5)


def test_bad_options():
    with pytest.raises(ValueError, match="Expected top_k to be a positive int"):
        ne.superoptimize(examples.softmax(2, 5), target="interpreter", top_k=0)
    with pytest.raises(ValueError, match="Expected target 'auto', 'cuda' or 'interpreter', got 'tpu'"):
        ne.superoptimize(examples.softmax(2, 5), target="tpu")
    with pytest.raises(TypeError, match=r"Expected limits to be ne.Limits\(...\), got dict"):
        ne.superoptimize(examples.softmax(2, 5), target="interpreter", limits={"rows": 10})
    with pytest.raises(ValueError, match="Expected Limits.match_limit to be a positive int or None"):
        ne.Limits(match_limit=0)
    with pytest.raises(ValueError, match="Expected Limits.rows to be a positive int, got -5"):
        ne.Limits(rows=-5)


def test_a_kernel_that_faults_the_gpu_while_timed_is_a_device_fault_error(monkeypatch):
    """A config whose kernel faults (an illegal memory access: the CUDA context is lost)
    stops the timer with ``DeviceFaultError`` naming the kernel and the config -- every
    later config, check and call would fail too, further from the cause (session 58's
    fault surfaced in translation validation).  A config that merely fails (a compile,
    shared memory) with the context alive is recorded and the next one timed."""
    from neptune_eq.dropin import flex_backward
    from neptune_eq.runtime import tuning
    kern = ne.superoptimize(examples.attention(1, 1, 16, 32, 16, "float16"), target="interpreter",
                            cache=False)
    ins = {n: torch.randn(kern.program.shape_of(n)).half() for n in ("q", "k", "v", "o")}

    class Faulting:
        def __init__(self, *a, **k):
            pass

        def __call__(self, tensors):
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    monkeypatch.setattr(tuning, "make_launcher", Faulting)
    monkeypatch.setattr(tuning, "context_lost", lambda: False)
    res = tuning.time_configs(kern.program, kern.kernel_source, "cuda", ins, [kern.config])
    assert res == [(kern.config, None, "failed: more")]
    monkeypatch.setattr(tuning, "context_lost", lambda: True)
    with pytest.raises(ne.DeviceFaultError, match=r"faulted while config .* of kernel "
                       r"neptune_o .*an illegal memory access.*new process"):
        tuning.time_configs(kern.program, kern.kernel_source, "cuda", ins, [kern.config])

    def fault(*a, **k):  # ... and the flex backward passes it on as it is
        raise ne.DeviceFaultError("faulted")
    monkeypatch.setattr("neptune_eq.api.superoptimize", fault)
    with pytest.raises(ne.DeviceFaultError, match="^faulted$"):
        flex_backward._superoptimize(SimpleNamespace(target="cuda", fp32_precision="highest"),
                                     kern, ("q",), {}, None)


def test_an_input_past_32_bit_offsets_is_refused():
    """The kernels compute element offsets in 32-bit integers (a program id times a
    stride): an input whose last element lies 2^31 or more past its first -- a batched
    decode's KV cache of 256 x 8 x 32768 x 128 -- would be addressed wrongly, so the call
    refuses it, saying how to split it.  Meta tensors: the shapes without the memory."""
    kern = ne.superoptimize(ne.attention(1, 2, "S", "S", 16, "float32"), target="interpreter",
                            cache=False, sizes={"S": 40})
    under = torch.empty((1, 2, 2 ** 26, 16), device="meta")  # 2^31 - 1 past: allowed
    with pytest.raises(ne.ProgramError, match="Expected q on cpu"):
        kern(under, under, under)
    over = torch.empty((1, 2, 2 ** 27, 16), device="meta")
    with pytest.raises(ne.ProgramError, match=r"span fewer than 2\^31 elements .* shape "
                       r"\(1, 2, 134217728, 16\) .* Split the call"):
        kern(over, over, over)
    with pytest.raises(ne.ProgramError, match="Expected query to span fewer than 2"):
        ne.flex_attention(over, over, over)  # (before its first call times any kernel)

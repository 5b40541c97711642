import dataclasses

import torch

import neptune_eq as ne
from neptune_eq.frontend import examples
from neptune_eq.interp import FOLD_BLOCKS, Interpreter, evaluate
from neptune_eq.ir import Term, var


def test_interpreter_softmax_matches_torch():
    p = ne.build_program(examples.softmax(5, 7))
    x = torch.randn(5, 7, dtype=torch.float64)
    assert torch.allclose(evaluate(p, {"x": x})["y"], torch.softmax(x, -1), atol=1e-12)


def test_interpreter_attention_matches_sdpa():
    p = ne.build_program(examples.attention(2, 3, 5, 9, 8, "float32"))
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (5, 9, 9))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(evaluate(p, {"q": q, "k": k, "v": v})["o"], ref, atol=1e-10)


def _rolled_softmax(corr: Term, n: int = 11):
    p = ne.build_program(examples.softmax(4, n))
    k = p.defs[1].body.val  # the reduce axis name (made unique per process)
    run = Term("run", (var("i"),), "mx")
    body = Term("exp", (Term("sub", (Term("load", (var("i"), var(k)), "x"), run)),))
    den = dataclasses.replace(p.defs[1], body=Term("rollsum", (body, corr), k))
    return p, p.with_defs([p.defs[0], den, p.defs[2]])


def test_folds_are_evaluated_block_by_block():
    good = Term("exp", (Term("sub", (Term("prev", (var("i"),), "mx"),
                                     Term("run", (var("i"),), "mx"))),))
    plain, rolled = _rolled_softmax(good)
    x = torch.randn(4, 11, dtype=torch.float64) * 5
    for block in (1, 2, 3, 11):
        assert torch.allclose(evaluate(rolled, {"x": x}, block=block)["y"],
                              evaluate(plain, {"x": x})["y"], atol=1e-12)


def test_a_wrong_correction_gives_a_wrong_answer():
    _, rolled = _rolled_softmax(Term("flt", (), 1.0))
    x = torch.randn(4, 11, dtype=torch.float64) * 5
    assert not torch.allclose(evaluate(rolled, {"x": x}, block=2)["y"], torch.softmax(x, -1))


def test_running_values_from_one_pass_equal_each_computed_alone():
    """A fold reads its producers' running values at every block end from one start;
    ``prefix_value`` computes them all in one pass (a cumulative max for a reduction, the
    fold's own accumulator as it passes each end for a fold) -- each equal to the
    reduction or fold stopped at that end, computed alone."""
    good = Term("exp", (Term("sub", (Term("prev", (var("i"),), "mx"),
                                     Term("run", (var("i"),), "mx"))),))
    _, rolled = _rolled_softmax(good, 50)
    x = torch.randn(4, 50, dtype=torch.float64) * 5
    it = Interpreter(rolled, {"x": x}, block=3)
    for d in rolled.defs[:2]:  # the row max (a reduction), the denominator (a fold)
        assert d.body.kind == ("reduce" if d is rolled.defs[0] else "fold")
        env = {a: it._arange(a) for a in d.axes}
        for lo, hi in ((0, 1), (0, 3), (0, 27), (0, 50), (5, 6), (5, 20), (5, 50), (7, 16)):
            got = it.prefix_value(d.name, lo, hi)
            alone = Interpreter(rolled, {"x": x}, block=3).eval(d.body, env,
                                                                 {d.body.val: (lo, hi)})
            assert got.axes == alone.axes
            assert torch.allclose(got.t, alone.t, rtol=1e-13, atol=0), (d.name, lo, hi)


def test_a_long_fold_is_evaluated_in_at_most_fold_blocks_blocks_and_still_checks():
    """Past FOLD_BLOCKS blocks of the given length a fold takes longer blocks (a check at
    a decode's real length: 8192 keys), still many of them: right with the right
    correction, wrong with a wrong one."""
    n = 4 * FOLD_BLOCKS + 37
    good = Term("exp", (Term("sub", (Term("prev", (var("i"),), "mx"),
                                     Term("run", (var("i"),), "mx"))),))
    plain, rolled = _rolled_softmax(good, n)
    x = torch.randn(4, n, dtype=torch.float64) * 5
    want = evaluate(plain, {"x": x})["y"]
    assert torch.allclose(evaluate(rolled, {"x": x}, block=1)["y"], want, atol=1e-12)
    _, wrong = _rolled_softmax(Term("flt", (), 1.0), n)
    assert not torch.allclose(evaluate(wrong, {"x": x}, block=1)["y"], want)

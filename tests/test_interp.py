import dataclasses

import torch

import neptune_eq as ne
from neptune_eq.frontend import examples
from neptune_eq.interp import evaluate
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


def _rolled_softmax(corr: Term):
    p = ne.build_program(examples.softmax(4, 11))
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

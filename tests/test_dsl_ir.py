import pytest

import neptune_eq as ne
from neptune_eq.frontend import examples
from neptune_eq.ir import ProgramError


def test_softmax_program_keeps_producers_by_name():
    p = ne.build_program(examples.softmax(4, 6))
    assert [d.name for d in p.defs] == ["mx", "den", "y"]
    assert "mx[i]" in str(p) and p.outputs == ["y"]
    assert [ph.name for ph in p.inputs] == ["x"]


def test_placeholders_keep_declaration_order():
    p = ne.build_program(examples.attention(1, 1, 3, 5, 4))
    assert [ph.name for ph in p.inputs] == ["q", "k", "v"]


@pytest.mark.parametrize("build, message", [
    (lambda x, j: ne.compute((4,), lambda i: ne.sum(x[i], axis=j), "bad"), "Expected 2 indices"),
    (lambda x, j: ne.compute((4,), lambda i: ne.sum(x[i, j], axis=i), "bad"), "reduce_axis"),
    (lambda x, j: ne.compute((4,), lambda i: x[i, j], "bad"), "not bound"),
    (lambda x, j: ne.compute((4,), lambda i, c: x[i, c], "bad"), "index arguments"),
])
def test_malformed_programs_get_clear_errors(build, message):
    x = ne.placeholder((4, 6), "float32", "x")
    j = ne.reduce_axis(6, "j")
    with pytest.raises(ProgramError, match=message):
        ne.build_program(build(x, j))


@pytest.mark.parametrize("outputs", [5, None, [], ["y"]])
def test_what_is_not_a_program_output_is_said_so(outputs):
    """ne.build_program / ne.superoptimize of something that is no ne.compute tensor (or list
    of them): a ProgramError naming what was expected, not Python's TypeError."""
    with pytest.raises(ProgramError, match="Expected a ne.compute tensor or a list of them"):
        ne.build_program(outputs)
    with pytest.raises(ProgramError, match="Expected a ne.compute tensor or a list of them"):
        ne.superoptimize(outputs)


def test_reduce_axis_reused_in_two_reductions_is_rejected():
    x = ne.placeholder((4, 6), "float32", "x")
    j = ne.reduce_axis(6, "j")
    a = ne.compute((4,), lambda i: ne.sum(x[i, j], axis=j), "a")
    b = ne.compute((4,), lambda i: ne.max(x[i, j], axis=j) + a[i], "b")
    with pytest.raises(ProgramError, match="already used"):
        ne.build_program(b)


def test_axis_extent_mismatch_is_rejected():
    x = ne.placeholder((4, 6), "float32", "x")
    j = ne.reduce_axis(5, "j")
    with pytest.raises(ProgramError, match="extent 6"):
        ne.build_program(ne.compute((4,), lambda i: ne.sum(x[i, j], axis=j), "s"))


def test_expressions_have_no_truth_value():
    x = ne.placeholder((4,), "float32", "x")
    with pytest.raises(ProgramError, match="ne.where"):
        ne.compute((4,), lambda i: x[i] if x[i] > 0 else 0.0, "r")


def test_bad_sizes_and_dtypes():
    with pytest.raises(ProgramError, match="positive int"):
        ne.placeholder((0, 3), "float32", "x")
    with pytest.raises(ProgramError, match="dtype"):
        ne.placeholder((2, 3), "float8", "x")

from pathlib import Path

import pytest
import torch

import neptune_eq as ne
from neptune_eq.frontend import examples
from neptune_eq.egraph.rulefiles import RuleFileError, shipped_rule_files
from neptune_eq.egraph.saturate import EGraphStage
from neptune_eq.egraph.extract import EGraphView, extract_program
from neptune_eq.interp import evaluate
from neptune_eq.lowering.lower import plan


def _optimize(out, rule_files=None):
    p = ne.build_program(out)
    st = EGraphStage(p, rule_files)
    trace = st.saturate()
    view = EGraphView.from_json(st.serialize())
    return p, trace, view, extract_program(view, p)


def _has_op(view, op):
    return any(n.op == op for nodes in view.classes.values() for n in nodes)


CORE = [f for f in shipped_rule_files() if f.stem != "layout"]  # no exp -> exp2


def test_softmax_rolling_update_fires_and_is_single_pass():
    p, trace, view, cand = _optimize(examples.softmax(4, 9), CORE)
    assert trace.fired().get("rolling-sum", 0) >= 1
    assert trace.stop_reason == "saturated"
    den = cand.program.definition("den").body
    assert den.op == "rollsum"
    assert str(den.args[1]) == "exp((prev:mx[i] - run:mx[i]))"  # h(t) = t·exp(m − m')
    assert plan(cand.program).n_passes == 2  # online max+sum, then normalise


def test_attention_derives_the_flashattention2_recurrence():
    p, trace, view, cand = _optimize(examples.attention(1, 2, 5, 9, 8, "float32"), CORE)
    o = cand.program.definition("o").body
    # delayed normalisation: o = rollsum(exp(s - m')·v; corr = exp(m - m')) / l
    assert o.op == "div" and o.args[0].op == "rollsum" and o.args[1].op == "ref"
    assert str(o.args[0].args[1]) == "exp((prev:mx[z, y, i] - run:mx[z, y, i]))"
    assert cand.program.definition("den").body.op == "rollsum"
    tp = plan(cand.program)
    assert tp.n_passes == 1 and len(tp.passes[0].folds) == 3
    ins = {n: torch.randn(s, dtype=torch.float64) for n, s in
           (("q", (1, 2, 5, 8)), ("k", (1, 2, 9, 8)), ("v", (1, 2, 9, 8)))}
    for block in (1, 4):
        assert torch.allclose(evaluate(cand.program, ins, block=block)["o"],
                              evaluate(p, ins)["o"], atol=1e-10)


def test_without_the_rolling_rule_file_no_single_pass_candidate_exists():
    files = [f for f in shipped_rule_files() if f.stem != "rolling"]
    p, trace, view, cand = _optimize(examples.attention(1, 1, 5, 9, 8, "float32"), files)
    assert "rolling-sum" not in trace.rules
    assert not _has_op(view, "RollSum")
    assert plan(cand.program).n_passes == 2  # max first, then the sums


def _write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "user.egg"
    f.write_text(text)
    return f


@pytest.mark.parametrize("text, message", [
    ("; x\n(rewrite (Exp x) (Exp x) :name \"ok-rule\")\n(rewrite (Exp x) (Bogus x) :name \"bad-rule\")\n",
     r"user.egg:3 \(rule 'bad-rule'\)"),
    ("(rewrite (Exp x) (Exp x)\n", r"user.egg:2: parse error"),
    ("(rewrite (Exp x) (Exp x))\n", "needs a name"),
    ("(rewrite (Exp x) (Exp x) :name \"Bad_Name\")\n", "kebab-case"),
    ("(rewrite (Exp x) (Exp x) :name \"mul-one-right\")\n", "duplicate"),
    ("(rule ((= e (Exp x))) ((union e (Exp y))) :name \"unbound\")\n", r"user.egg:1"),
    ("(datatype Foo (Bar))\n", "only rewrite, birewrite and rule"),
])
def test_bad_rule_files_are_rejected_with_file_line_and_reason(tmp_path, text, message):
    p = ne.build_program(examples.softmax(2, 3))
    st = EGraphStage(p)
    before = st.rows()
    with pytest.raises(RuleFileError, match=message):
        st.load_rules(_write(tmp_path, text))
    assert st.rows() == before and "user" not in st.rulesets


def test_a_rule_file_is_checked_once_per_text_and_again_when_edited(tmp_path, monkeypatch):
    """A rule file is checked on a scratch e-graph once per text (every kernel a training
    step builds loads the shipped files again); an edited file is checked again, and a
    name another loaded file holds is still refused, from the kept check too."""
    from neptune_eq.egraph import rulefiles
    checked, real = [], rulefiles._parse_and_check
    monkeypatch.setattr(rulefiles, "_parse_and_check",
                        lambda path, *a: checked.append(path.name) or real(path, *a))
    p = ne.build_program(examples.softmax(2, 3))
    mine = _write(tmp_path, '; exp(x) = exp(x)\n(rewrite (Exp x) (Exp x) :name "same-exp")\n')
    for _ in range(2):
        assert [i.name for i in EGraphStage(p).load_rules(mine)] == ["same-exp"]
    assert checked.count("user.egg") == 1
    twin = tmp_path / "twin.egg"
    twin.write_text(mine.read_text())
    EGraphStage(p).load_rules(twin)            # its own check: another path
    st = EGraphStage(p)
    st.load_rules(mine)
    with pytest.raises(RuleFileError, match=r"twin.egg:2 \(rule 'same-exp'\): duplicate"):
        st.load_rules(twin)
    mine.write_text('; x\n(rewrite (Exp x) (Bogus x) :name "same-exp")\n')
    with pytest.raises(RuleFileError, match="same-exp"):
        EGraphStage(p).load_rules(mine)
    assert checked.count("user.egg") == 2 and checked.count("twin.egg") == 1


def test_layout_rules_rewrite_the_correction_to_exp2():
    p, trace, view, cand = _optimize(examples.softmax(4, 9))
    corr = cand.program.definition("den").body.args[1]
    assert str(corr) == "exp2(((prev:mx[i] - run:mx[i]) * 1.4426950408889634))"


def test_growth_past_the_row_budget_stops_and_keeps_the_best_so_far(tmp_path):
    from neptune_eq.egraph.saturate import Limits
    blowup = tmp_path / "blowup.egg"
    blowup.write_text(
        "; (a − b)·c = a·c − b·c\n"
        "(rewrite (Mul (Sub a b) (Flt c)) (Sub (Mul a (Flt c)) (Mul b (Flt c))) :name \"dist\")\n"
        "; (a·c₁)·c₂ = a·(c₁·c₂)\n"
        "(rewrite (Mul (Mul a (Flt c1)) (Flt c2)) (Mul a (Flt (* c1 c2))) :name \"fold\")\n")
    p = ne.build_program(examples.attention(1, 1, 5, 9, 8, "float32"))
    st = EGraphStage(p, None, [blowup])
    trace = st.saturate(Limits(rows=3000, match_limit=None))  # back-off off: it would hold it
    assert trace.stop_reason == "row limit"
    assert trace.iterations[-1].stage.endswith("(rolled back)") and st.rows() <= 3000
    cand = extract_program(EGraphView.from_json(st.serialize()), p)
    ins = {n: torch.randn(1, 1, s, 8, dtype=torch.float64) for n, s in (("q", 5), ("k", 9), ("v", 9))}
    assert torch.allclose(evaluate(cand.program, ins)["o"], evaluate(p, ins)["o"], atol=1e-12)


def test_back_off_bans_an_explosive_rule_and_still_saturates(tmp_path):
    from neptune_eq.egraph.saturate import Limits
    ac = tmp_path / "ac.egg"
    ac.write_text("; a·b = b·a\n(rewrite (Mul a b) (Mul b a) :name \"mul-comm\")\n"
                  "; (a·b)·c = a·(b·c)\n"
                  "(rewrite (Mul (Mul a b) c) (Mul a (Mul b c)) :name \"mul-assoc\")\n")
    p = ne.build_program(examples.attention(1, 1, 5, 9, 8, "float32"))
    st = EGraphStage(p, None, [ac])
    trace = st.saturate(Limits(match_limit=20, ban_length=2))
    bans = [(it.iteration, r, until) for it in trace.iterations for r, until in it.banned.items()]
    assert ("mul-comm" in {r for _, r, _ in bans}) and all(until > i for i, _, until in bans)
    assert "back-off: mul-comm matched too often" in str(trace)
    # a banned rule is left out until its ban ends (or nothing else changes) ...
    first_ban, _, until = bans[0]
    assert trace.iterations[first_ban - 1].matches.get(bans[0][1], 0) == 0
    # ... and every rule is back in before the stage may call itself saturated
    assert trace.stop_reason == "saturated"
    assert trace.iterations[-1].matches.get("mul-comm", 0) <= 20 << 3
    cand = extract_program(EGraphView.from_json(st.serialize()), p)
    ins = {n: torch.randn(1, 1, s, 8, dtype=torch.float64) for n, s in (("q", 5), ("k", 9), ("v", 9))}
    assert torch.allclose(evaluate(cand.program, ins)["o"], evaluate(p, ins)["o"], atol=1e-12)


def test_without_back_off_the_explosive_rule_keeps_matching(tmp_path):
    from neptune_eq.egraph.saturate import Limits
    ac = tmp_path / "ac.egg"
    ac.write_text("; a·b = b·a\n(rewrite (Mul a b) (Mul b a) :name \"mul-comm\")\n")
    p = ne.build_program(examples.attention(1, 1, 5, 9, 8, "float32"))
    st = EGraphStage(p, None, [ac])
    trace = st.saturate(Limits(match_limit=None))
    assert not any(it.banned for it in trace.iterations)
    assert any(it.matches.get("mul-comm", 0) > 20 for it in trace.iterations)


def test_folds_whose_exponent_reads_a_running_non_maximum_are_banned():
    """exp(x - R) rolled over a running R stays bounded only when R is a running maximum
    entering with a negative sign (FlashAttention); over a running sum the fold is exact
    in real arithmetic but overflows fp32 mid-loop, so it is refused and the chain keeps
    its two-pass program (which is right at scores where the fold gave NaN)."""
    from neptune_eq.egraph.verify import check_fold
    from neptune_eq.ir import Term, var
    x = Term("load", (var("i"), var("j")), "x")
    shifted = Term("exp", (Term("sub", (x, Term("run", (), "p"))),))
    corr = Term("exp", (Term("sub", (Term("prev", (), "p"), Term("run", (), "p"))),))
    fold = Term("rollsum", (shifted, corr), "j")
    assert check_fold(fold).ok and check_fold(fold, frozenset({"p"})).ok
    refused = check_fold(fold, frozenset())
    assert not refused.ok and "not a maximum" in refused.detail
    grows = Term("exp", (Term("add", (x, Term("run", (), "p"))),))
    assert not check_fold(Term("rollsum", (grows, corr), "j"), frozenset({"p"})).ok
    # a wrong correction (the sign of the shift flipped) is refuted, not proved
    flipped = Term("exp", (Term("sub", (Term("run", (), "p"), Term("prev", (), "p"))),))
    wrong = check_fold(Term("rollsum", (shifted, flipped), "j"))
    assert not wrong.eq3 and "counter-example" in wrong.detail

    xs = ne.placeholder((1, 37), "float32", "x")
    w = ne.placeholder((1, 37), "float32", "w")
    j, k = ne.reduce_axis(37, "j"), ne.reduce_axis(37, "k")
    p = ne.compute((1,), lambda i: ne.sum(xs[i, j], axis=j), "p")
    out = ne.compute((1,), lambda i: ne.sum(ne.exp(xs[i, k] - p[i]) * w[i, k], axis=k), "out")
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    assert not any(n.kind == "fold" for d in kern.program.defs for n in d.body.walk())
    g = torch.Generator().manual_seed(21266)
    ins = {"x": torch.randn(1, 37, generator=g, dtype=torch.float64) * 30,
           "w": torch.randn(1, 37, generator=g, dtype=torch.float64)}
    ref = evaluate(kern.input_program, ins)["out"]
    got = kern(ins["x"].float(), ins["w"].float()).double()
    assert torch.isfinite(got).all() and ((got - ref).abs() <= 1e-4 * ref.abs().max()).all()


def test_fold_proofs_see_constants_in_their_exact_form_found_once():
    """A fold's constants reach sympy in their simplest exact form (log2 e as 1/log 2,
    so exp2(x·log2 e) = exp(x) is provable); the search for it runs once per value."""
    import sympy
    from neptune_eq.egraph import verify
    assert verify._exact(1.4426950408889634) == 1 / sympy.log(2)
    assert verify._exact(0.125) == sympy.Rational(1, 8) and verify._exact(30) == 30
    assert verify._exact(0.08838834764831845) is verify._exact(0.08838834764831845)


def test_a_comparison_in_arithmetic_counts_one_or_zero_in_the_fold_check():
    """``score * (kv_idx <= q_idx)`` (torch multiplies by the condition as 0 / 1): the fold
    checks read the comparison as a number -- an opaque symbol, as index arithmetic is --
    not as a crash inside sympy; one reading a running value has no algebraic form (the
    fold is refused, not proved); the whole mod matches torch's flex_attention."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from neptune_eq.egraph.verify import NotAlgebraic, to_sympy
    from neptune_eq.ir import Term, var
    x = Term("load", (var("i"), var("j")), "x")
    got = to_sympy(Term("mul", (x, Term("le", (var("j"), var("i"))))))
    assert len(got.free_symbols) == 2 and got.is_Mul
    with pytest.raises(NotAlgebraic):
        to_sympy(Term("mul", (x, Term("le", (x, Term("run", (), "m"))))))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 19, 16, generator=g) for _ in range(3))

    def gated(score, b, h, q_idx, kv_idx):
        return score * (kv_idx <= q_idx)
    out = ne.flex_attention(q, k, v, score_mod=gated)
    assert (out - torch_flex(q, k, v, score_mod=gated)).abs().max() < 1e-4

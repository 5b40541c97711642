"""The rule system: each chain is derived into its fused form (and the fused program
equals the plain one in the reference interpreter); checks, user rules, explanations."""
import re

import pytest
import torch

import neptune_eq as ne
from neptune_eq.frontend import examples
from neptune_eq.egraph.saturate import EGraphStage
from neptune_eq.egraph.extract import CostModel, EGraphView, Extraction, extract_program
from neptune_eq.interp import evaluate
from neptune_eq.lowering.lower import plan
from helpers import check_kernel

N, M, E = 4, 11, 5


def _chain(name):
    return examples.reduction_chain(name, N, M, E)


def _saturate(out, core=False):
    p = ne.build_program(out)
    files = [f for f in ne.rules.shipped_rule_files() if not core or f.stem != "layout"]
    st = EGraphStage(p, files)
    trace = st.saturate()
    view = EGraphView.from_json(st.serialize())
    return p, trace, view


def _fold_corrections(view, program, op):
    """Best correction term of every fold e-node with constructor ``op``."""
    ex = Extraction.run(view, CostModel(program, allow_split_k=True))
    return [str(ex.term(n.children[2])) for nodes in view.classes.values() for n in nodes
            if n.op == op]


CHAINS = examples.CHAINS


@pytest.mark.parametrize("name", CHAINS)
def test_chain_is_fused_into_one_pass_and_equals_the_plain_program(name):
    p, trace, view = _saturate(_chain(name))
    cand = extract_program(view, p)
    assert plan(cand.program).passes.__len__() == 1, cand.program
    ins = {ph.name: torch.rand(ph.shape, dtype=torch.float64) + 0.1 for ph in p.inputs}
    want = evaluate(p, ins)[p.outputs[0]]
    for block in (1, 3, M):
        assert torch.allclose(evaluate(cand.program, ins, block=block)[p.outputs[0]], want,
                              atol=1e-12)


@pytest.mark.parametrize("name, op, corr", [
    ("log-sum-exp", "RollSum", "exp((prev:mx[i] - run:mx[i]))"),
    ("rms-matmul", "RollSum", "sqrt((prev:ss[i] / run:ss[i]))"),      # h = t·√(s/s')
    ("normalised", "RollSum", "(prev:s[i] / run:s[i])"),             # h = t·s/s'
    ("max-consumer", "RollMax", "(prev:tot[i] - run:tot[i])"),        # h = t + (Σ − Σ')
])
def test_rolling_update_derives_and_simplifies_the_correction(name, op, corr):
    p, trace, view = _saturate(_chain(name), core=True)
    assert corr in _fold_corrections(view, p, op)
    assert trace.fired().get("rolling-max" if op == "RollMax" else "rolling-sum", 0) >= 1


@pytest.mark.parametrize("name", CHAINS)
def test_fused_chains_run_as_kernels(name):
    check_kernel(_chain(name))


def test_attention_holds_rolling_and_split_k_candidates():
    kern = ne.superoptimize(examples.attention(1, 2, 5, 9, 8, "float32"), target="interpreter")
    kinds = [c["description"].split(":")[0] for c in kern.candidates]
    assert {"rolling", "split-k", "plain"} <= set(kinds)
    assert next(c for c in kern.candidates if c["chosen"])["description"].startswith("rolling")
    split = next(c["program"] for c in kern.candidates if c["description"].startswith("split-k"))
    ins = {n: torch.randn(1, 2, s, 8, dtype=torch.float64) for n, s in (("q", 5), ("k", 9), ("v", 9))}
    want = evaluate(kern.input_program, ins)["o"]
    for parts in (1, 2, 4):
        assert torch.allclose(evaluate(split, ins, parts=parts)["o"], want, atol=1e-12)
    assert all(c.ok for c in kern.trace.fold_checks) and kern.trace.fold_checks


def test_explain_lists_the_rolling_steps_and_the_identities_used():
    kern = ne.superoptimize(examples.attention(1, 1, 5, 9, 8, "float32"), target="interpreter")
    text = kern.explain()
    steps = kern.derivation
    used = {r.name for s in steps for r in s.rules}
    assert {"rolling-sum", "exp-div", "neg-sub-neg"} <= used
    roll = next(s for s in steps if any(r.name == "rolling-sum" for r in s.rules))
    assert roll.before.op == "sum" and roll.after.op == "rollsum"
    assert "rules/rolling.egg:" in text and "→" in text


def test_shipped_rules_all_pass_the_check():
    results = [r for f in ne.rules.shipped_rule_files() for r in ne.rules.check(f)]
    assert results and not [r for r in results if r.status in ("UNSOUND", "unchecked")]
    assert sum(r.status == "proved" for r in results) >= 10


def test_an_unsound_rule_fails_the_check_with_a_counter_example(tmp_path):
    bad = tmp_path / "bad.egg"
    bad.write_text('; exp(a − b) = exp(a) − exp(b)   (wrong)\n'
                   '(rewrite (Exp (Sub a b)) (Sub (Exp a) (Exp b)) :name "bad-exp")\n')
    (r,) = ne.rules.check(bad)
    assert r.status == "UNSOUND" and "counter-example" in r.detail and r.where.endswith("bad.egg:2")


def test_a_user_rule_file_changes_the_chosen_program(tmp_path):
    rule = tmp_path / "mine.egg"
    rule.write_text("; a / √s = a · rsqrt(s)\n"
                    '(rewrite (Div a (Sqrt s)) (Mul a (Rsqrt s)) :name "div-sqrt-to-rsqrt")\n')
    assert ne.rules.check(rule)[0].status in ("proved", "tested")
    before = ne.superoptimize(_chain("rms-matmul"), target="interpreter")
    assert "tl.rsqrt" not in before.source and "tl.sqrt" in before.source
    after = check_kernel(_chain("rms-matmul"), extra_rules=[rule])
    assert "tl.rsqrt" in after.source and "div-sqrt-to-rsqrt" in after.trace.fired()
    assert str(after.program) != str(before.program)
    ne.rules.load(rule)
    try:
        assert "tl.rsqrt" in ne.superoptimize(_chain("rms-matmul"), target="interpreter").source
    finally:
        ne.rules.unload_all()


def test_a_masked_score_reaches_exp2_as_one_fused_multiply_add():
    """Causal attention: ``scale-out-of-where`` moves the softmax scale out of the mask's
    select, so exp2's argument is ``w·(c·log2 e) − m·log2 e`` -- one fused multiply-add per
    score, as for an unmasked one -- and the mask still becomes the loop's upper bound."""
    kern = ne.superoptimize(ne.attention(1, 1, 9, 9, 8, "float32",
                                         mask_mod=lambda b, h, q, kv: q >= kv),
                            target="interpreter", cache=False)
    den = next(ln for ln in str(kern.program).splitlines() if ln.startswith("den["))
    assert re.search(r"exp2\(\(\(where\(\(i >= \w+\), sum\[\w+\]\(.*\), -[\d.e+]+\) \* [\d.e-]+\) "
                     r"- \(run:mx\[[^\]]*\] \* 1\.44", den), den
    assert "scale-out-of-where" in {r.name for s in kern.derivation for r in s.rules}
    assert plan(kern.program).passes[0].hi_offset == 1  # the mask is still a loop bound

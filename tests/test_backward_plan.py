"""A backward met before runs its recorded kernels' replays (``dropin/backward_plan``):
the same gradients, bit for bit, as the general path, which it skips -- GQA's head sums
and a learnable captured tensor's row sums included; a new signature or deterministic
mode is a new key; a kernel without a replay keeps the general path."""
import pytest
import torch

import neptune_eq as ne
from neptune_eq.dropin import backward_plan, flex_backward


def _step(q, k, v, slopes, g):
    def alibi(score, b, h, i, j):
        return score + slopes[h // 2] * (j - i)
    out = ne.flex_attention(q, k, v, score_mod=alibi, mask_mod=lambda b, h, i, j: i >= j,
                            enable_gqa=True)
    return torch.autograd.grad(out, (q, k, v, slopes), g)


def _inputs(s, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(1, 4, s, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, s, 8, requires_grad=True) for _ in range(2))
    slopes = torch.tensor([0.5, -0.25], requires_grad=True)
    return q, k, v, slopes, torch.randn(1, 4, s, 8)


@pytest.fixture
def spy(monkeypatch):
    """Counts the general path's group choices (a plan makes none)."""
    calls = []
    real = flex_backward.chosen_groups
    monkeypatch.setattr(flex_backward, "chosen_groups",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    backward_plan.clear()
    yield calls
    backward_plan.clear()


def test_a_backward_met_before_runs_its_plan_bit_for_bit(spy, monkeypatch):
    t = _inputs(11)
    first = _step(*t)
    assert len(spy) == 1 and any(p is not None for p in backward_plan._PLANS.values())
    (plan,) = [p for p in backward_plan._PLANS.values() if p is not None]
    assert sum(st.gradients for st in plan.steps) >= 2  # dK/dV (+dQ) and the slopes' partial
    again = _step(*t)
    assert len(spy) == 1  # the plan ran: no group choice, no look-up through Kernel.__call__
    for a, b in zip(first, again):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    t2 = _inputs(11, seed=1)  # other data at the same signature: the plan, right values
    got = _step(*t2)
    monkeypatch.setattr(backward_plan, "ENABLED", False)
    ref = _step(*t2)
    assert len(spy) == 2  # plans off: the general path
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_a_new_signature_or_deterministic_mode_is_a_new_key(spy):
    _step(*_inputs(11))
    _step(*_inputs(11))
    assert len(spy) == 1
    _step(*_inputs(13))  # another length: another signature
    assert len(spy) == 2
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        det = _step(*_inputs(13))
        assert len(spy) == 3
        det2 = _step(*_inputs(13))
        assert len(spy) == 3
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(det, det2):
        assert torch.equal(a, b)
    keys = [k for k in backward_plan._PLANS if k[3]]
    assert len(keys) == 1  # the deterministic plan is apart from the other mode's


def test_a_kernel_without_a_replay_keeps_the_general_path(spy, monkeypatch):
    monkeypatch.setattr(ne.Kernel, "replay_for", lambda self, args: None)
    _step(*_inputs(11))
    _step(*_inputs(11))
    assert len(spy) == 2 and list(backward_plan._PLANS.values()) == [None]

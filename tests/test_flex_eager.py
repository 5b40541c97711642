"""Eager ``ne.flex_attention`` traces the mods once per environment, not once per call
(``eager_env.eager_structure``): a repeated call reuses the structure and fetches the
captured tensors afresh; anything the structure depends on that changes traces again."""
import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import neptune_eq as ne
from neptune_eq.dropin import flex

from helpers import count_calls

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without")


@pytest.fixture
def traces(monkeypatch):
    return count_calls(monkeypatch, flex, "trace")


def qkv(s=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, s, 16, generator=g) for _ in range(3)]


def close(got, want):
    return (got - want).abs().max().item() < 1e-4


def make_bias(table, cap):
    def mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap + table[h]
    return mod


def test_repeat_calls_trace_once_and_read_the_new_tensor(traces):
    table = torch.tensor([0.5, -1.0])
    mod = make_bias(table, 20.0)
    q, k, v = qkv()
    ne.flex_attention(q, k, v, score_mod=mod)
    n = traces[0]
    ne.flex_attention(q, k, v, score_mod=mod)
    q2, k2, v2 = qkv(s=26, seed=1)                     # a new length: same structure
    assert close(ne.flex_attention(q2, k2, v2, score_mod=mod), torch_flex(q2, k2, v2, score_mod=mod))
    assert traces[0] == n
    table.mul_(3)                                       # in place: read at the call
    assert close(ne.flex_attention(q, k, v, score_mod=mod), torch_flex(q, k, v, score_mod=mod))
    other = make_bias(torch.tensor([2.0, 3.0]), 20.0)   # a new closure, same code
    assert close(ne.flex_attention(q, k, v, score_mod=other), torch_flex(q, k, v, score_mod=other))
    assert traces[0] == n                               # same fingerprint: the new tensor is fetched


def test_a_changed_constant_or_nested_function_traces_again(traces):
    q, k, v = qkv()
    ne.flex_attention(q, k, v, score_mod=make_bias(torch.zeros(2), 20.0))
    n = traces[0]
    cap30 = make_bias(torch.zeros(2), 30.0)             # softcap 20 -> 30: a new structure
    assert close(ne.flex_attention(q, k, v, score_mod=cap30), torch_flex(q, k, v, score_mod=cap30))
    assert traces[0] == n + 1

    def inner_a(s):
        return s * 2

    def inner_b(s):
        return s - 1

    box = [inner_a]

    def mod(score, b, h, q_idx, kv_idx):
        return box[0](score)
    ne.flex_attention(q, k, v, score_mod=mod)
    box[0] = inner_b                                    # same outer function, new inner code
    assert close(ne.flex_attention(q, k, v, score_mod=mod), torch_flex(q, k, v, score_mod=mod))
    assert traces[0] == n + 3


def test_a_reshaped_table_traces_again(traces):
    q, k, v = qkv()
    mod = make_bias(torch.zeros(2), 20.0)
    ne.flex_attention(q, k, v, score_mod=mod)
    n = traces[0]
    mod2 = make_bias(torch.zeros(2, 1)[:, 0].clone().reshape(2), 20.0)  # same shape: no trace
    ne.flex_attention(q, k, v, score_mod=mod2)
    assert traces[0] == n
    wide = torch.zeros(3)                               # another shape: traced
    mod3 = make_bias(wide, 20.0)
    assert close(ne.flex_attention(q, k, v, score_mod=mod3), torch_flex(q, k, v, score_mod=mod3))
    assert traces[0] == n + 1


BIAS = torch.tensor([0.5, -1.0])


def global_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h]


def test_flat_environments_are_rechecked_in_place(traces, monkeypatch):
    """Mods whose environment is only leaves (cells, named globals, defaults holding
    tensors, scalars, library objects) skip the walk (``eager_env._Flat``); every change
    the walk would see still re-keys: a rebound global, a tensor resized in place, a
    closure cell reassigned."""
    global BIAS
    from neptune_eq.dropin import eager_env
    walks = count_calls(monkeypatch, eager_env, "_Walk")
    q, k, v = qkv()
    ne.flex_attention(q, k, v, score_mod=global_bias)
    assert (id(global_bias), id(None)) in eager_env._FLAT_HITS
    n, w = traces[0], walks[0]
    ne.flex_attention(q, k, v, score_mod=global_bias)
    assert walks[0] == w                                # re-checked in place, not walked
    BIAS = torch.tensor([3.0, 1.0])                     # rebound, same shape: fetched anew
    assert close(ne.flex_attention(q, k, v, score_mod=global_bias),
                 torch_flex(q, k, v, score_mod=global_bias))
    assert traces[0] == n
    BIAS.resize_(3).copy_(torch.tensor([1.0, 2.0, 7.0]))  # resized in place: traced again
    assert close(ne.flex_attention(q, k, v, score_mod=global_bias),
                 torch_flex(q, k, v, score_mod=global_bias))
    assert traces[0] == n + 1
    cap = 20.0

    def capped(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    ne.flex_attention(q, k, v, score_mod=capped)
    m = traces[0]
    ne.flex_attention(q, k, v, score_mod=capped)
    assert traces[0] == m
    cap = 5.0                                           # the cell itself changes: traced again
    assert close(ne.flex_attention(q, k, v, score_mod=capped), torch_flex(q, k, v, score_mod=capped))
    assert traces[0] == m + 1
    BIAS = torch.tensor([0.5, -1.0])


def test_a_tensor_the_mask_computes_from_data_is_this_call_s(traces):
    """A mask computing a tensor from one it closes over -- ``(doc > 0)[q_idx]``: torch
    runs ``doc > 0`` eagerly while the mod is traced -- gets that tensor from this call's
    data: changed in place or rebound, the next call reads the new values (it used to
    read the first call's).  Such a mod is traced on every call, once: one kernel input,
    not one per use of the mask.  A literal the mod makes (``torch.tensor([...])[h]``)
    stays a constant of the structure, traced once."""
    import torch.nn.functional as F
    q, k, v = qkv()
    causal = torch.ones(21, 21, dtype=torch.bool).tril()
    doc = torch.zeros(21, dtype=torch.int32)

    def mask(b, h, q_idx, kv_idx):
        return (doc > 0)[q_idx] | (q_idx >= kv_idx)

    def want():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(doc > 0)[:, None] | causal)
    assert close(ne.flex_attention(q, k, v, mask_mod=mask), want())
    n = traces[0]
    doc[5:] = 1                                          # in place: rows 5.. see every key
    assert close(ne.flex_attention(q, k, v, mask_mod=mask), want())
    doc = torch.zeros(21, dtype=torch.int32)             # rebound
    assert close(ne.flex_attention(q, k, v, mask_mod=mask), want())
    assert traces[0] == n + 2                            # once per call
    st, captured = flex.trace(flex.check(q, k, v, None, False, False), None, mask,
                              {"B": 1, "L": 21, "S": 21})
    assert len(captured) == 1 and "captured0[i]" in str(st.program)
    lit = make_literal_bias()
    ne.flex_attention(q, k, v, score_mod=lit)
    m = traces[0]
    assert close(ne.flex_attention(q, k, v, score_mod=lit), torch_flex(q, k, v, score_mod=lit))
    assert traces[0] == m


def make_literal_bias():
    def mod(score, b, h, q_idx, kv_idx):
        return score + torch.tensor([0.5, -1.0])[h]
    return mod

"""Reads at an index computed from data (``offsets[doc[i]]``) follow torch's rule
(``lowering/data_indices.py``): -n <= i < n, a negative index counting from the end --
padding tokens often carry document id -1 -- and anything else an error of the call,
never a value read off the end of a tensor."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import neptune_eq as ne
from neptune_eq.dropin import flex
from neptune_eq.interp import evaluate
from neptune_eq.ir import ProgramError

S, D, N_OFFS = 40, 8, 5


def torch_attention(q, k, v, visible):
    """Attention with a [L, S] boolean mask, in float64: torch's own reading of the mod."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return p @ v.double()


@pytest.fixture(scope="module")
def jagged_kernel():
    doc = ne.placeholder((S,), "int32", "doc")
    offsets = ne.placeholder((N_OFFS,), "int32", "offsets")
    out = ne.attention(1, 1, S, S, D, "float32",
                       mask_mod=lambda b, h, i, j: (j >= offsets[doc[i]]) & (j <= i))
    return ne.superoptimize(out, target="interpreter")


def qkv(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 1, S, D, generator=g) for _ in range(3)]


def check_like_torch(kern, ids, offs, seed=0):
    q, k, v = qkv(seed)
    got = kern(q=q, k=k, v=v, doc=ids, offsets=offs).double()
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    want = torch_attention(q, k, v, (j >= offs[ids.long()][i]) & (j <= i))  # torch wraps
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    ref = evaluate(kern.input_program, dict(q=q, k=k, v=v, doc=ids, offsets=offs))["o"]
    assert torch.allclose(ref, want, atol=1e-9)  # the reference interpreter: the same rule


def test_the_kernel_wraps_and_clamps_an_index_read_from_data(jagged_kernel):
    """offsets is read at doc's values: every such read's index is clamped into the table,
    the rows' own read wraps a negative id first; doc, read at the row index, is not."""
    lines = [ln.strip() for ln in jagged_kernel.source.splitlines()]
    defs = dict(ln.split(" = ", 1) for ln in lines if " = " in ln and ln.split(" = ")[0].isidentifier())
    idx = [ln.split("tl.load(offsets_ptr + ", 1)[1].split(" * offsets_s0")[0]
           for ln in lines if "tl.load(offsets_ptr + " in ln]
    assert idx
    assert all(defs[i].startswith("tl.minimum(tl.maximum(") and defs[i].endswith(f"{N_OFFS} - 1)")
               for i in idx), [defs[i] for i in idx]
    assert any(defs[i].startswith("tl.minimum(tl.maximum(tl.where((") and "< 0" in defs[i]
               for i in idx)
    assert not any("tl.where(" in ln for ln in lines if "tl.load(doc_ptr + offs" in ln)


def test_padding_id_minus_one_reads_the_last_offset(jagged_kernel):
    """Padding rows with document id -1 read offsets[-1], the packed length: they see no
    key and their output is 0 -- what torch (and FlexAttention) computes."""
    ids = torch.tensor([0] * 12 + [1] * 10 + [2] * 8 + [-1] * 10, dtype=torch.int32)
    offs = torch.tensor([0, 12, 22, 30, S], dtype=torch.int32)
    check_like_torch(jagged_kernel, ids, offs)
    q, k, v = qkv(0)
    got = jagged_kernel(q=q, k=k, v=v, doc=ids, offsets=offs)
    assert (got[0, 0, 30:] == 0).all()
    # padding at the front, and an id counting back to a middle entry
    check_like_torch(jagged_kernel, torch.tensor([-1] * 6 + [0] * 14 + [-3] * 20,
                                                 dtype=torch.int32), offs, seed=1)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(-N_OFFS, N_OFFS - 1), min_size=S, max_size=S),
       offs=st.lists(st.integers(0, S), min_size=N_OFFS, max_size=N_OFFS),
       sort_ids=st.booleans(), sort_offs=st.booleans())
def test_any_index_torch_accepts_gives_torchs_result(jagged_kernel, ids, offs, sort_ids,
                                                      sort_offs):
    """Random ids in [-n, n) -- sorted or not -- and random offsets -- nondecreasing (the
    block tests bound the read by the table's ends) or not: the kernel computes what torch
    computes, so no block holding a visible pair is skipped."""
    ids = sorted(ids) if sort_ids else ids
    offs = sorted(offs) if sort_offs else offs
    check_like_torch(jagged_kernel, torch.tensor(ids, dtype=torch.int32),
                     torch.tensor(offs, dtype=torch.int32))


@pytest.mark.parametrize("bad", [N_OFFS, 99, -N_OFFS - 1])
def test_an_id_past_the_table_is_an_error_not_a_value(jagged_kernel, bad):
    ids = torch.tensor([0] * 20 + [1] * 20, dtype=torch.int32)
    offs = torch.tensor([0, 20, 40, 40, 40], dtype=torch.int32)
    q, k, v = qkv(0)
    jagged_kernel(q=q, k=k, v=v, doc=ids, offsets=offs)  # a good call first: a replay
    ids[7] = bad
    with pytest.raises(ProgramError, match=rf"in \[-{N_OFFS}, {N_OFFS}\).*got {bad}"):
        jagged_kernel(q=q, k=k, v=v, doc=ids, offsets=offs)


def test_flex_attention_checks_each_call_of_a_structure():
    """The drop-in: a structure traced on good ids, then called with a stray id -- the
    same structure, new data -- raises; a padding id -1 is torch's last offset."""
    doc = torch.tensor([0] * 16 + [1] * 16, dtype=torch.int32)
    offsets = torch.tensor([0, 16, 32], dtype=torch.int32)

    def jagged(b, h, q_idx, kv_idx):
        return (kv_idx >= offsets[doc[q_idx]]) & (q_idx >= kv_idx)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    ne.flex_attention(q, k, v, mask_mod=jagged)
    doc[20:] = -1
    got = ne.flex_attention(q, k, v, mask_mod=jagged)
    assert (got[:, :, 20:] == 0).all() and torch.isfinite(got).all()
    doc[3] = 3
    with pytest.raises(ProgramError, match=r"'offsets' \(3 entries\).*got 3"):
        ne.flex_attention(q, k, v, mask_mod=jagged)


def test_the_reference_interpreter_rejects_an_index_past_the_table(jagged_kernel):
    q, k, v = qkv(0)
    ids = torch.zeros(S, dtype=torch.int32)
    ids[3] = -N_OFFS - 2
    with pytest.raises(ProgramError, match="torch's rule"):
        evaluate(jagged_kernel.input_program, dict(q=q, k=k, v=v, doc=ids,
                                                   offsets=torch.zeros(N_OFFS, dtype=torch.int32)))


def test_score_mod_and_key_side_reads_follow_the_rule_too():
    """A bias table read at a document id in a score_mod (no mask, no pre-pass), and a
    decode whose key-side ids index the offsets: negative ids wrap as in torch; a stray
    one raises."""
    S = 32
    bias = torch.randn(4, dtype=torch.float32)
    doc = torch.tensor([-4, -1, 0, 3] * (S // 4), dtype=torch.int32)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[doc[q_idx]]
    q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
    before = set(flex.STRUCTURES)
    got = ne.flex_attention(q, k, v, score_mod=biased).double()
    s = (q.double() @ k.double().transpose(-1, -2)) / 4.0 + bias.double()[doc.long()][:, None]
    assert torch.allclose(got, torch.softmax(s, -1) @ v.double(), atol=1e-5)
    doc[5] = 4
    with pytest.raises(ProgramError, match=r"'bias' \(4 entries\).*got 4"):
        ne.flex_attention(q, k, v, score_mod=biased)
    # on the GPU the host does not see the ids: a pre-pass guards them (nothing to
    # summarise, so it only asserts), and the attention kernel does not wait for it
    (src,) = {flex.STRUCTURES[sk].kernel.source for sk in set(flex.STRUCTURES) - before}
    main, pre = src.split("_check_ids(")
    assert "guard: every entry of doc indexes bias inside [-4, 4)" in pre
    assert "tl.device_assert(" in pre and "gdc_wait" not in main
    offsets = torch.tensor([0, 10, 25, 40], dtype=torch.int32)
    ids = torch.tensor([-2] * 4 + [0] * 6 + [1] * 15 + [2] * 15, dtype=torch.int32)

    def keys(b, h, q_idx, kv_idx):
        return kv_idx >= offsets[ids[kv_idx]]
    q1, k1, v1 = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    got = ne.flex_attention(q1, k1, v1, mask_mod=keys).double()
    j = torch.arange(40)[None, :]
    assert torch.allclose(got, torch_attention(q1, k1, v1, j >= offsets[ids.long()][j]), atol=1e-5)


def _ids_checked(mod_of, shape=(2, 40), table=4, L=33, **kw):
    """``checked_ids`` of attention over L rows whose score_mod reads ``bias[<ids>]``."""
    from neptune_eq.frontend.dsl import build_program
    from neptune_eq.lowering.data_indices import checked_ids
    doc = ne.placeholder(shape, "int32", "doc")
    bias = ne.placeholder((table,), "float32", "bias")
    out = ne.attention(2, 1, L, L, D, "float32",
                       score_mod=lambda s, b, h, i, j: s + bias[mod_of(doc, b, i)], **kw)
    return {(c.tensor, c.box, c.n, c.table) for c in checked_ids(build_program(out))}


def test_the_device_checks_exactly_the_ids_entries_that_are_read():
    """Which entries of an id tensor the GPU pre-pass asserts (``IdCheck``): all of them
    where the kernel reads them all, per sample or not; the box read at a shifted or
    constant index; nothing -- the clamp, and the host check on CPU -- where a box cannot
    say what is read (a diagonal)."""
    assert _ids_checked(lambda d, b, i: d[b, i], shape=(2, 33)) == {("doc", (None, None), 4, "bias")}
    assert _ids_checked(lambda d, b, i: d[b, i]) == {("doc", (None, (0, 33)), 4, "bias")}
    assert _ids_checked(lambda d, b, i: d[b, i + 2]) == {("doc", (None, (2, 33)), 4, "bias")}
    assert _ids_checked(lambda d, b, i: d[1, i]) == {("doc", ((1, 1), (0, 33)), 4, "bias")}
    assert _ids_checked(lambda d, b, i: d[i, i], shape=(33, 33)) == set()


def test_per_sample_ids_in_a_score_mod_are_guarded_on_the_device():
    """``bias[doc[b, q]]`` -- per-sample document ids, as batched packing writes them: the
    drop-in's kernel carries a guard over all of doc (the GPU's check of them), the call
    follows torch's rule on CPU, and a stray id raises."""
    S = 24
    bias = torch.randn(5, dtype=torch.float32)
    doc = torch.randint(-5, 5, (2, S), dtype=torch.int32)

    def per_sample(score, b, h, q_idx, kv_idx):
        return score + bias[doc[b, q_idx]]
    q, k, v = (torch.randn(2, 2, S, 16) for _ in range(3))
    before = set(flex.STRUCTURES)
    got = ne.flex_attention(q, k, v, score_mod=per_sample).double()
    s = (q.double() @ k.double().transpose(-1, -2)) / 4.0 \
        + bias.double()[doc.long()][:, None, :, None]
    assert torch.allclose(got, torch.softmax(s, -1) @ v.double(), atol=1e-5)
    (src,) = {flex.STRUCTURES[sk].kernel.source for sk in set(flex.STRUCTURES) - before}
    assert "guard: every entry of doc indexes bias inside [-5, 5)" in src.split("_check_ids(")[1]
    doc[1, 7] = 5
    with pytest.raises(ProgramError, match=r"'bias' \(5 entries\).*got 5"):
        ne.flex_attention(q, k, v, score_mod=per_sample)


def test_ids_read_at_a_shift_run_as_written_and_are_guarded(monkeypatch):
    """``bias[doc[q_idx + 1]]`` (doc one longer than the rows) and a decode's
    ``bias[doc[q_idx + S - 1]]``: both in bounds only near the call's sizes, so the check
    against the reference keeps the ints (or, for the decode, takes the call's sizes);
    both are right, and the shifted read's ids are guarded on the GPU over the entries
    read, ``doc[1 : 1 + L]`` with L a runtime size.  Where the check at the call's sizes
    would be too large, the error says how to write the shift instead."""
    from neptune_eq.choosing import translation_validation as tv
    S = 40
    bias = torch.randn(5, dtype=torch.float32)
    doc = torch.randint(-5, 5, (S + 1,), dtype=torch.int32)

    def shifted(score, b, h, q_idx, kv_idx):
        return score + bias[doc[q_idx + 1]]
    q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
    before = set(flex.STRUCTURES)
    got = ne.flex_attention(q, k, v, score_mod=shifted).double()
    s = (q.double() @ k.double().transpose(-1, -2)) / 4.0 + bias.double()[doc[1:].long()][:, None]
    assert torch.allclose(got, torch.softmax(s, -1) @ v.double(), atol=1e-5)
    (src,) = {flex.STRUCTURES[sk].kernel.source for sk in set(flex.STRUCTURES) - before}
    assert "guard: every entry of doc[1:(1 + n_L)] indexes bias inside [-5, 5)" in src
    doc[0] = 99  # never read
    ne.flex_attention(q, k, v, score_mod=shifted)
    doc[7] = 5
    with pytest.raises(ProgramError, match=r"'bias' \(5 entries\).*got 5"):
        ne.flex_attention(q, k, v, score_mod=shifted)

    ids = torch.randint(-5, 5, (S,), dtype=torch.int32)

    def last(score, b, h, q_idx, kv_idx):
        return score + bias[ids[q_idx + (S - 1)]]
    q1 = torch.randn(1, 2, 1, 16)
    got = ne.flex_attention(q1, k, v, score_mod=last).double()
    s = (q1.double() @ k.double().transpose(-1, -2)) / 4.0 + bias.double()[ids[-1].long()]
    assert torch.allclose(got, torch.softmax(s, -1) @ v.double(), atol=1e-5)
    monkeypatch.setattr(tv, "MAX_REAL_WORK", 100)
    with pytest.raises(ProgramError, match=r"in bounds only at the call's sizes.*offset\[0\]"):
        ne.flex_attention(q1, k[:, :, :S - 1], v[:, :, :S - 1],
                          score_mod=lambda sc, b, h, qi, ki: sc + bias[ids[qi + (S - 2)]])

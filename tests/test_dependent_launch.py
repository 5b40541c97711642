"""The kernel after a data mask's summary pre-pass is launched dependent on it
(programmatic dependent launch, ``lowering/summary_kernel.PDL_FLAG``): it may start while
the pre-pass runs, so it must wait for the pre-pass before its first read of a summary and
never after.  Compiled here for sm_90 without a GPU; the GPU A/B (same output bit for bit,
the time the pre-pass adds) is ``bench/prepass_pdl.py``."""
import re

import pytest

import neptune_eq as ne
from neptune_eq.lowering.gluon_tiles import WAIT_FOR_PREPASS, gl_main, key_range
from neptune_eq.lowering.summary_kernel import wait_for_summaries
from neptune_eq.runtime import launcher as launcher_mod
from neptune_eq.runtime.block_summary import dependent_launch, dependent_options
from neptune_eq.runtime.launcher import Launcher
from neptune_eq.runtime.tile_configs import TileConfig

WAIT = "tl.extra.cuda.gdc_wait()"


def _doc_attention(L=77, S=77, **kw):
    doc = ne.placeholder((S,), "int32", "doc")
    return ne.superoptimize(ne.attention(1, 2, L, S, 64, "float16",
                                         mask_mod=lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i),
                                         **kw),
                            target="interpreter", cache=False)


def _body(source: str, kernel: str) -> list[str]:
    return source.split(f"def {kernel}(")[1].split("):\n", 1)[1].split("\n\n\n")[0].splitlines()


def test_the_wait_comes_before_the_statement_holding_the_first_summary_read():
    body = ["    a = tl.load(q_ptr)",
            "    # a comment at the top level",
            "    for j in range(0, n):",
            "        # nested",
            "        x = tl.load(bs_doc_ptr + j)",
            "    y = tl.load(bs_doc_ptr)"]
    got = wait_for_summaries(body, ["bs_doc"])
    assert got[:2] == body[:2] and got[2:4] == ["    if PDL:  # programmatic dependent launch: "
                                                "the summaries are the pre-pass's",
                                                f"        {WAIT}"]
    assert got[4:] == body[2:]
    assert wait_for_summaries(body, ["bs_other"]) == body  # reads no summary: untouched
    assert wait_for_summaries(body, []) == body


def test_a_data_mask_kernel_waits_once_after_its_row_loads_and_its_prepass_releases_it():
    kern = _doc_attention()
    ks = kern.kernel_source
    body = _body(ks.source, ks.name)
    reads = [k for k, ln in enumerate(body)
             if any(f"{sp.name}_ptr" in ln for sp in ks.summaries)]
    waits = [k for k, ln in enumerate(body) if WAIT in ln]
    assert len(waits) == 1 and waits[0] < reads[0] and body[waits[0] - 1].strip() == "if PDL:  " \
        "# programmatic dependent launch: the summaries are the pre-pass's"
    # the row tile's loads need no summary: they are issued before the wait
    assert any(re.search(r"\bq_ptr\b|q_desc", ln) for ln in body[:waits[0]])
    assert "PDL: tl.constexpr" in ks.source.split(f"def {ks.name}(")[1].split("):")[0]
    pre = ks.source.split(f"def {ks.prepass.kernel}(")[1]
    assert "PDL: tl.constexpr" in pre and "tl.extra.cuda.gdc_launch_dependents()" in pre
    # a kernel without summaries has no flag: nothing to wait for
    plain = ne.superoptimize(ne.attention(1, 2, 77, 77, 64, "float16"), target="interpreter",
                             cache=False).kernel_source.source
    assert "PDL" not in plain and "gdc_" not in plain


def test_only_the_launch_right_after_the_prepass_is_dependent(monkeypatch):
    """A split-k data mask (decode: partials, then a combine): the partials kernel waits
    and is launched dependent; the combine, launched after it, is not (it has no wait).
    The interpreter never launches dependent (``PDL`` False: neither instruction emitted)."""
    kern = _doc_attention(L=1, S=300)
    row = next(r for r in kern.candidates if r.kernel is not None and r.kernel.split_extent)
    ks = row.kernel
    assert ks.prepass
    cfg = TileConfig(blocks={"B_i": 16, "B_L": 32}, num_warps=4, num_stages=2, splits=4)
    plain = Launcher(row.program, ks, "interpreter", cfg)
    assert not plain.pdl and plain.consts["PDL"] is False and not dependent_launch("interpreter")
    assert all("launch_pdl" not in fl.options for fl in plain._launches)
    monkeypatch.setattr(launcher_mod, "dependent_launch", lambda target: True)
    dep = Launcher(row.program, ks, "interpreter", cfg)   # (built, not run: PDL needs a GPU)
    assert dep.pdl and dep.consts["PDL"] is True and dep._pre.consts["PDL"] is True
    first, combine = dep._launches
    assert first.options.get("launch_pdl") is True and "launch_pdl" not in combine.options
    partial = _body(ks.source, f"{ks.name}_partial")
    comb = _body(ks.source, f"{ks.name}_combine")
    assert sum(WAIT in ln for ln in partial) == 1 and not any(WAIT in ln for ln in comb)
    assert dependent_options({"num_warps": 4}, False) == {"num_warps": 4}


def test_the_gluon_forms_key_range_waits_before_reading_summaries():
    kern = _doc_attention()
    rng = gl_main(key_range(kern.plan, "k", data=True))
    wait = rng.index(gl_main([WAIT_FOR_PREPASS])[0])
    first_read = next(k for k, ln in enumerate(rng) if "bs_" in ln and "_ptr" in ln)
    assert wait < first_read
    assert WAIT_FOR_PREPASS not in key_range(kern.plan, "k", data=False)
    # the ranges kernel of a dynamic walk is launched plainly (and runs in the interpreter)
    assert WAIT_FOR_PREPASS not in key_range(kern.plan, "k", data=True, dependent=False)
    form = kern.kernel_source.gluon
    assert form is not None and form.source.count("griddepcontrol.wait") == 1


@pytest.mark.parametrize("pdl", [False, True])
def test_a_dependent_call_in_the_interpreter_is_the_plain_call(pdl, monkeypatch):
    """``NEPTUNE_EQ_PDL`` changes nothing in the interpreter (the flag stays off there)."""
    import torch
    monkeypatch.setenv("NEPTUNE_EQ_PDL", "1" if pdl else "0")
    kern = _doc_attention(L=40, S=40)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).half() for _ in range(3))
    doc = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor([10, 17, 13]))
    got = kern(q, k, v, doc)
    same = doc[:, None] == doc[None, :]
    vis = same & torch.ones(40, 40, dtype=torch.bool).tril()
    s = (q.float() @ k.float().transpose(-1, -2)) / 8.0
    ref = torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ v.float()
    out = got[0] if isinstance(got, (tuple, list)) else got
    assert (out.float() - ref).abs().max() < 2e-3

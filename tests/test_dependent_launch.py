"""The kernel after a data mask's summary pre-pass, and a split-k combine after its
partials, are launched dependent on the kernel before (programmatic dependent launch,
``lowering/dependent_launch.py``): each may start while that kernel runs, so it must
wait for it before its first read of what it wrote (summaries, fold states) and never
after.  Compiled here for sm_90 without a GPU; the GPU A/B (same output bit for bit,
the time the pre-pass adds) is ``bench/prepass_pdl.py``."""
import re
from dataclasses import replace

import pytest

import neptune_eq as ne
from neptune_eq.lowering.dependent_launch import (MAKES_DESCRIPTOR, WAIT_FOR_PREPASS,
                                                   wait_before_reads, wait_then_release)
from neptune_eq.lowering.gluon_tiles import gl_main, key_range
from neptune_eq.runtime import launcher as launcher_mod
from neptune_eq.runtime.launch import dependent_launch, dependent_options
from neptune_eq.runtime.launcher import Launcher
from neptune_eq.runtime.tile_configs import TileConfig

WAIT = "tl.extra.cuda.gdc_wait()"
RELEASE = "tl.extra.cuda.gdc_launch_dependents()"


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
    got = wait_before_reads(body, ["bs_doc"])
    assert got[:2] == body[:2] and got[2:4] == ["    if PDL:  # programmatic dependent launch: "
                                                "wait for the kernel before",
                                                f"        {WAIT}"]
    assert got[4:] == body[2:]
    assert wait_before_reads(body, ["bs_other"]) == body  # reads no summary: untouched
    assert wait_before_reads(body, []) == body


def test_a_data_mask_kernel_waits_once_after_its_row_loads_and_its_prepass_releases_it():
    kern = _doc_attention()
    ks = kern.kernel_source
    body = _body(ks.source, ks.name)
    reads = [k for k, ln in enumerate(body)
             if any(f"{sp.name}_ptr" in ln for sp in ks.summaries)]
    waits = [k for k, ln in enumerate(body) if WAIT in ln]
    assert len(waits) == 1 and waits[0] < reads[0] and body[waits[0] - 1].strip() == "if PDL:  " \
        "# programmatic dependent launch: wait for the kernel before"
    # the row tile's loads need no summary: they are issued before the wait
    assert any(re.search(r"\bq_ptr\b|q_desc", ln) for ln in body[:waits[0]])
    assert "PDL: tl.constexpr" in ks.source.split(f"def {ks.name}(")[1].split("):")[0]
    pre = ks.source.split(f"def {ks.prepass.kernel}(")[1]
    assert "PDL: tl.constexpr" in pre
    # the pre-pass is the call's first launch: it waits for the kernel before it in the
    # stream, then releases the attention kernel -- in that order, first thing
    pre_body = _body(ks.source, ks.prepass.kernel)
    assert [ln.strip() for ln in pre_body[1:4]] == ["if PDL:", WAIT, RELEASE]
    assert sum(WAIT in ln for ln in pre_body) == 1 and ks.waits_first
    # a kernel without summaries or pre-pass has no flag: a call of one launch is launched
    # plainly (launched dependent it lost 0.2-0.55 us after a torch kernel, session 56)
    plain = ne.superoptimize(ne.attention(1, 2, 77, 77, 64, "float16"), target="interpreter",
                             cache=False).kernel_source
    assert "PDL" not in plain.source and "gdc_" not in plain.source and not plain.waits_first


def _split_row(kern):
    return next(r for r in kern.candidates if r.kernel is not None and r.kernel.split_extent)


def _split_launchers(row, monkeypatch):
    """(plain, dependent) launchers of a split-k candidate's two-launch config; the
    dependent one built with the GPU's answer forced (built, not run: PDL needs a GPU)."""
    cfg = TileConfig(blocks={"B_i": 16, "B_L": 32}, num_warps=4, num_stages=2, splits=4)
    plain = Launcher(row.program, row.kernel, "interpreter", cfg)
    monkeypatch.setattr(launcher_mod, "dependent_launch", lambda target: True)
    return plain, Launcher(row.program, row.kernel, "interpreter", cfg)


def test_each_launch_waits_for_the_one_before_and_only_its_reads(monkeypatch):
    """A split-k data mask over two queries (pre-pass, partials, combine; a one-query
    decode has no pre-pass): the partials wait for the pre-pass's summaries, the combine
    for the partials' fold states, each launched dependent.  The interpreter never
    launches dependent (``PDL`` False: neither instruction emitted)."""
    row = _split_row(_doc_attention(L=2, S=300))
    ks = row.kernel
    assert ks.prepass
    plain, dep = _split_launchers(row, monkeypatch)
    assert not plain.pdl and plain.consts["PDL"] is False and not dependent_launch("interpreter")
    assert all("launch_pdl" not in fl.options for fl in plain._launches)
    assert dep.pdl and dep.consts["PDL"] is True and dep._pre.consts["PDL"] is True
    partials, combine = dep._launches
    assert partials.options.get("launch_pdl") is True and combine.options.get("launch_pdl") is True
    # the pre-pass, the call's first launch, is launched dependent on the kernel before it
    assert dep._pre.options.get("launch_pdl") is True and "launch_pdl" not in plain._pre.options
    partial = _body(ks.source, f"{ks.name}_partial")
    comb = _body(ks.source, f"{ks.name}_combine")
    assert sum(WAIT in ln for ln in partial) == 1 and sum(WAIT in ln for ln in comb) == 1
    first_read = next(k for k, ln in enumerate(comb) if re.search(r"\bws_\w+_ptr\b", ln))
    assert next(k for k, ln in enumerate(comb) if WAIT in ln) < first_read
    # the partials release the combine first thing (it waits before reading them); after
    # the pre-pass they are not the first launch, so they do not wait first
    assert partial[:2] == ["    if PDL:  # dependents may launch now: they wait for this "
                           "grid to finish", f"        {RELEASE}"]
    assert sum(RELEASE in ln for ln in partial + comb) == 1
    # the one-launch form (its last chunk combines) follows only the pre-pass, and has no
    # dependent to release
    fused = _body(ks.source, f"{ks.name}_fused")
    assert sum(WAIT in ln for ln in fused) == 1 and not any(RELEASE in ln for ln in fused)
    assert dependent_options({"num_warps": 4}, False) == {"num_warps": 4}


def test_a_combine_after_partials_that_make_descriptors_waits_before_making_its_own():
    """Device-made descriptors live in a per-launch scratch that torch frees (and may hand
    to the next launch) while the kernel still runs; the combine, launched dependent,
    would overwrite its partials' descriptors if it made its own before its wait (an
    illegal memory access or a hang on an H200, session 59).  A kernel after a pre-pass,
    which makes none, keeps making them before its wait (its overlap with the pre-pass)."""
    row = _split_row(ne.superoptimize(ne.attention(1, 2, 300, 517, 64, "bfloat16"),
                                      target="interpreter", cache=False))
    ks = row.kernel
    partial, comb = _body(ks.source, f"{ks.name}_partial"), _body(ks.source, f"{ks.name}_combine")
    assert any(MAKES_DESCRIPTOR in ln for ln in partial)
    made = next(k for k, ln in enumerate(comb) if MAKES_DESCRIPTOR in ln)
    assert next(k for k, ln in enumerate(comb) if WAIT in ln) < made
    body = ["    d = tl.make_tensor_descriptor(o_ptr, shape=[n], strides=[1], block_shape=[B])",
            "    x = tl.load(ws_ptr)"]
    assert wait_before_reads(body, ["ws"])[0] == body[0]  # the kernel before makes none
    assert WAIT in wait_before_reads(body, ["ws"], after_descriptors=True)[1]
    doc = _doc_attention(L=300, S=300).kernel_source  # pre-pass, then the main kernel
    main = _body(doc.source, doc.name)
    assert (next(k for k, ln in enumerate(main) if MAKES_DESCRIPTOR in ln)
            < next(k for k, ln in enumerate(main) if WAIT in ln))


def test_a_plain_decode_s_combine_waits_for_its_partials(monkeypatch):
    """No data mask, no pre-pass: the partials are the call's first launch -- launched
    dependent on the kernel before them in the stream, they wait for it, then release the
    combine, first thing; the combine is launched dependent (where the GPU can; captured
    in a CUDA graph too) and waits.  ``NEPTUNE_EQ_PDL_COMBINE=0`` and
    ``NEPTUNE_EQ_PDL_FIRST=0`` launch both plainly, and without the flag on neither
    instruction is emitted."""
    row = _split_row(ne.superoptimize(ne.attention(1, 4, 1, 300, 32, "float16", kv_heads=4),
                                      target="interpreter", cache=False))
    ks = row.kernel
    assert not ks.summaries and not ks.prepass
    _, dep = _split_launchers(row, monkeypatch)
    partials, combine = dep._launches
    assert not dep.pdl and dep.pdl_combine and dep.pdl_first and dep.consts["PDL"] is True
    assert partials.options.get("launch_pdl") is True and combine.options.get("launch_pdl") is True
    partial = _body(ks.source, f"{ks.name}_partial")
    assert [ln.strip() for ln in partial[:3]] == ["if PDL:", WAIT, RELEASE]
    assert partial[:3] == wait_then_release()
    assert sum(WAIT in ln for ln in partial) == 1
    assert sum(WAIT in ln for ln in _body(ks.source, f"{ks.name}_combine")) == 1
    # the one-launch form is the call's only launch: launched plainly, it waits for nothing
    fused = _body(ks.source, f"{ks.name}_fused")
    assert not any(WAIT in ln or RELEASE in ln for ln in fused)
    one = Launcher(row.program, ks, "interpreter", replace(dep.config, fused=True))
    assert not one.pdl_first and "launch_pdl" not in one._launches[0].options
    monkeypatch.setenv("NEPTUNE_EQ_PDL_COMBINE", "0")
    first = Launcher(row.program, ks, "interpreter", dep.config)
    assert not first.pdl_combine and first.pdl_first and first.consts["PDL"] is True
    assert first._launches[0].options.get("launch_pdl") is True
    assert "launch_pdl" not in first._launches[1].options
    monkeypatch.setenv("NEPTUNE_EQ_PDL_FIRST", "0")
    off = Launcher(row.program, ks, "interpreter", dep.config)
    assert not off.pdl_combine and off.consts["PDL"] is False
    assert all("launch_pdl" not in fl.options for fl in off._launches)


def test_the_gluon_forms_key_range_waits_before_reading_summaries():
    kern = _doc_attention()
    rng = gl_main(key_range(kern.plan, "k", data=True))
    wait = rng.index(gl_main([WAIT_FOR_PREPASS])[0])
    first_read = next(k for k, ln in enumerate(rng) if "bs_" in ln and "_ptr" in ln)
    assert wait < first_read
    assert WAIT_FOR_PREPASS not in key_range(kern.plan, "k", data=False)
    # the ranges kernel of a dynamic walk waits at its top with tl's own wait (it also runs
    # in the interpreter, which has no inline assembly)
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


def _reads_wait_first(text: str, names: list[str], wait: str) -> bool:
    """In ``text`` (one function), the wait comes before every read of ``names``' pointers."""
    lines = text.splitlines()
    reads = [k for k, ln in enumerate(lines) if any(re.search(rf"\b{n}_ptr\b", ln) for n in names)]
    waits = [k for k, ln in enumerate(lines) if wait in ln]
    return bool(waits) and all(waits[0] < k for k in reads)


def test_every_kernel_reading_summaries_waits_first_forward_and_backward(monkeypatch):
    """The invariant PDL needs, over every form a document mask takes: in each kernel of
    the module but the pre-pass (the tl forward, the backward's dK/dV and dQ kernels), and
    in each Gluon form's main function (its partitions start after it), the wait comes
    before every read of a summary.  A read before it could see the last call's summaries."""
    import test_gluon_sums as gs
    fwd = _doc_attention()
    kernels = [fwd] + [gs._backward_kernel(monkeypatch, g, mask=gs.DOC_CAUSAL)
                       for g in (("k", "v"), ("q",))]
    for kern in kernels:
        ks = kern.kernel_source
        names = [sp.name for sp in ks.summaries]
        assert names and ks.prepass
        reading = [fn for fn in ks.source.split("@triton.jit")[1:]
                   if not fn.lstrip().startswith(f"def {ks.prepass.kernel}(")
                   and any(f"{n}_ptr" in fn.split("):\n", 1)[1] for n in names)]
        assert reading, ks.name
        for fn in reading:
            assert _reads_wait_first(fn.split("):\n", 1)[1], names, WAIT), (ks.name, fn[:80])
        form = ks.gluon
        assert form is not None, ks.gluon_why
        main = form.source[form.source.index(f"def {form.name}("):]
        body = main.split("):\n", 1)[1]
        assert _reads_wait_first(body, names, "griddepcontrol.wait"), form.name
        # the partitions run after the warp split, which comes after the wait
        assert body.index("griddepcontrol.wait") < body.index("gl.warp_specialize(")


def test_a_decode_s_partials_release_and_its_combine_waits_when_compiled_for_sm90(tmp_path):
    """Compiled for sm_90 with ``PDL`` on (offline: the compiler of this Triton; the GPU
    machine's 3.6 ran it, ``bench/probe/decode_trigger.py``): the partials' PTX waits for
    the kernel before them and releases its dependents, the combine's waits and never
    releases; both are launched dependent."""
    from sm90_compile import compile_for_sm90
    row = _split_row(ne.superoptimize(ne.attention(1, 8, 1, 300, 64, "float16", kv_heads=2),
                                      target="interpreter", cache=False))
    ks = row.kernel
    path = tmp_path / "decode_module.py"
    path.write_text(ks.source)
    flags = {"TMA": False, "WS": False, "LOOP_STAGES": 2, "VDOT": False, "ONE_LOOP": False,
             "PDL": True, **{f: False for f in ks.even_flags}}
    base = {**ks.tunables, "B_i": 16, "B_L": 32, **flags}
    dtypes = {p: "*fp16" for p in ks.params}
    dtypes.update({f"{w}_ptr": "*fp32" for w in ks.scratch})
    got = {}
    for kernel, extra in (("partial", {}), ("combine", {"B_P": 16, "B_IC": 8})):
        spec = {"dtypes": dtypes, "constexprs": {**base, **extra}, "num_warps": 4,
                "num_stages": 2, "options": {"launch_pdl": True}}
        got[kernel] = compile_for_sm90(path, f"{ks.name}_{kernel}", spec, timeout=300)
    assert got["partial"]["ok"] and got["combine"]["ok"], got
    assert got["partial"]["pdl_launch_dependents"] and got["partial"]["pdl_wait"]
    assert got["combine"]["pdl_wait"] and not got["combine"]["pdl_launch_dependents"]
    assert got["combine"]["launch_pdl"] and got["partial"]["launch_pdl"]


@pytest.mark.parametrize("batched", [False, True])
def test_a_document_mask_gqa_decode_compiles_for_sm90_with_its_key_test(tmp_path, batched):
    """A GQA decode at the cache's end with a document mask (packed rows, the row-side
    read one element, the key range counted on the chunk's own ids: no pre-pass; batched:
    each sequence its own ids, ``doc[b, j]``): its partials compile for sm_90 with ``PDL``
    on, waiting only for the kernel before them, then releasing the combine, first thing."""
    from sm90_compile import compile_for_sm90
    S = 300
    if batched:
        doc = ne.placeholder((2, S), "int32", "doc")
        mask = lambda b, h, i, j: doc[b, i + S - 1] == doc[b, j]  # noqa: E731
    else:
        doc = ne.placeholder((S,), "int32", "doc")
        mask = lambda b, h, i, j: doc[i + S - 1] == doc[j]  # noqa: E731
    kern = ne.superoptimize(ne.attention(2 if batched else 1, 8, 1, S, 64, "float16", kv_heads=2,
                                         mask_mod=mask), target="interpreter", cache=False)
    row = _split_row(kern)
    ks = row.kernel
    assert row.plan.packed and not ks.summaries and ks.prepass is None
    path = tmp_path / "doc_decode_module.py"
    path.write_text(ks.source)
    consts = {**ks.tunables, "B_i": 16, "B_L": 32, "TMA": False, "WS": False, "LOOP_STAGES": 2,
              "VDOT": False, "ONE_LOOP": False, "PDL": True, **{f: False for f in ks.even_flags}}
    dtypes = {p: "*i32" if p == "doc_ptr" else "*fp16" for p in ks.params}
    dtypes.update({f"{w}_ptr": "*fp32" for w in ks.scratch})
    got = compile_for_sm90(path, f"{ks.name}_partial", {
        "dtypes": dtypes, "constexprs": consts, "num_warps": 4, "num_stages": 2,
        "options": {"launch_pdl": True}}, timeout=300)
    assert got["ok"], got
    assert got["pdl_wait"] and got["pdl_launch_dependents"] and got["launch_pdl"]
    partial = _body(ks.source, f"{ks.name}_partial")
    assert sum(WAIT in ln for ln in partial) == 1 and partial[:3] == wait_then_release()


def _gluon_launcher(monkeypatch, kern, config):
    """A GluonLauncher built without a GPU (its compile, SM count and device faked; its
    launch plan is what is checked, never run)."""
    import torch

    from neptune_eq.runtime import gluon_launch
    monkeypatch.setattr(gluon_launch, "gluon_unavailable", lambda: None)
    monkeypatch.setattr(gluon_launch, "load_gluon", lambda form: None)
    monkeypatch.setattr(gluon_launch, "device_sms", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return gluon_launch.GluonLauncher(kern.program, kern.kernel_source, "cuda", config)


@pytest.mark.parametrize("first", [True, False])
def test_a_dynamic_walk_chains_its_three_launches(first, monkeypatch):
    """Pre-pass, ranges kernel, form: each launched dependent on the one before where the
    GPU can -- the pre-pass on the kernel before the call (``NEPTUNE_EQ_PDL_FIRST``),
    waiting for it and releasing the ranges kernel first thing; the ranges kernel waiting
    for the summaries, then releasing the form; the form waiting before its warps split
    (the texts: ``test_gluon_ws``).  Without dependent launch, all three plain."""
    from neptune_eq.runtime import gluon_launch
    from neptune_eq.runtime.tile_configs import dynamic_configs
    kern = _doc_attention()
    config = dynamic_configs(kern.kernel_source)[0]
    monkeypatch.setenv("NEPTUNE_EQ_PDL_FIRST", "1" if first else "0")
    monkeypatch.setattr(gluon_launch, "dependent_launch", lambda target: True)
    la = _gluon_launcher(monkeypatch, kern, config)
    assert la.form.ranges and la._pre.consts["PDL"] is True
    assert la._pre.options.get("launch_pdl", False) is first
    assert la._ranges.consts["PDL"] is True and la._ranges.options.get("launch_pdl") is True
    assert la.options.get("launch_pdl") is True
    monkeypatch.setattr(gluon_launch, "dependent_launch", lambda target: False)
    plain = _gluon_launcher(monkeypatch, kern, config)
    assert plain._pre.consts["PDL"] is False and plain._ranges.consts["PDL"] is False
    assert not any("launch_pdl" in o for o in (plain._pre.options, plain._ranges.options,
                                                plain.options))

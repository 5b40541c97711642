"""The warp-specialised Gluon form of a pass of sums (lowering/gluon_sums.py): the
backward's dK/dV pass -- and the fused one adding dQ atomically -- derived from the plain
backward program, emitted as producer / consumer warpgroups and compiled here for sm_90
without a GPU.  Its numbers are checked on the GPU by bench/gluon_backward_validate.py
(against fp64 autograd, odd lengths, fully masked rows, scores x8)."""
import re
from dataclasses import replace

import pytest
import torch

from sm90_compile import compile_for_sm90
from neptune_eq.dropin import eager_env, flex, flex_backward
from neptune_eq.lowering import gluon_sums
from neptune_eq.lowering.lower import LoweringError
from neptune_eq.runtime.gluon_launch import sm90_spec

CAUSAL = lambda b, h, q, kv: q >= kv  # noqa: E731


def _backward_kernel(monkeypatch, group, d=128, mask=CAUSAL):
    """The drop-in's backward kernel for ``group`` (dK/dV beside dQ's own kernel, or all
    three with dQ added atomically), bf16, named sizes."""
    seen = []
    real = eager_env.eager_structure

    def spy(*a, **kw):  # the structure key of this call (new, or one traced before)
        out = real(*a, **kw)
        seen.append(out[0])
        return out
    monkeypatch.setattr(eager_env, "eager_structure", spy)
    q = torch.randn(1, 2, 40, d, dtype=torch.bfloat16)
    flex.flex_attention(q, q, q, mask_mod=mask)
    st = flex.STRUCTURES[seen[-1]]
    return flex_backward.backward_kernel(st, group, {"B": 1, "L": 40, "S": 40},
                                         shared=group == ("k", "v"), lse_grad=False)[1]


@pytest.mark.parametrize("d", [128, 64])
def test_the_dkdv_pass_compiles_for_sm90_as_producer_and_consumers(tmp_path, monkeypatch, d):
    """K and V stay resident (64 rows per consumer warpgroup), Q and dO stream through
    a ring each; Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ issue at the block's start and each is waited
    for where the block math first reads it; dV and dK accumulate by wgmma."""
    kern = _backward_kernel(monkeypatch, ("k", "v"), d)
    form = kern.kernel_source.gluon
    assert isinstance(form, gluon_sums.GluonSumsForm), kern.kernel_source.gluon_why
    assert form.resident == ("k", "v") and form.streams == ("q", "d_o")
    assert form.key_blocks == ((64,) if d == 128 else (64, 128))
    src = form.source
    first_read = {m: src.index(f"= {m} *") if f"= {m} *" in src else src.index(f"= {m} +")
                  for m in ("mma0", "mma1")}
    for m, at in first_read.items():
        wait = src.index(f"{m} = warpgroup_mma_wait(")
        assert src.index(f"{m} = warpgroup_mma(") < wait < at, m
    assert re.search(r"d_v = warpgroup_mma\(op\d, ring1\.index\(st\), d_v, is_async=True\)", src)
    # each block's lse and row-dot loads are issued before its ring waits (their latency
    # hides behind the wait), the block's math after
    loops = [lp for lp in src.split("for jb in range(")[1:] if "warpgroup_mma(" in lp]
    assert len(loops) == 4  # causal: edge, interior, edge, then the ragged last block
    for lp in loops:
        for vec in ("mx_ptr", "g_den_1_ptr"):
            assert lp.index(f"gl.load({vec}") < lp.index("mbarrier.wait(ready0") < lp.index("gl.exp2(")
    # causal: tiles of unequal work, walked by persistent programs in the launcher's
    # balanced order; the producer loads a tile's rows once both consumers released the
    # last tile's, and the ring runs on across tiles
    assert form.persistent and form.scheduled and "tile_order_ptr" in form.params
    producer = src.split("def _producer(")[1].split("def _consumer(")[0]
    assert producer.index("mbarrier.wait(rows_empty, (it & 1) ^ 1)") < producer.index("tma_load(r0_desc")
    assert "s = (base + jb) % STAGES" in producer and "base += n_blocks" in producer
    consumer = src.split("def _consumer(")[1].split("@gluon.jit")[0]
    assert "mbarrier.wait(rows_bar, it & 1)" in consumer
    assert consumer.index("mbarrier.arrive(rows_empty") < consumer.index("gl.store(d_k_ptr")
    _compiles(tmp_path, "dkdv", kern, kern.kernel_source)
    # one program per tile (the walk off): the first keys, which see the most rows, first
    monkeypatch.setattr(gluon_sums, "PERSISTENT", False)
    single = gluon_sums.generate(kern.plan, form.name)
    assert not single.persistent and "gl.program_id(0)  # long rows first" in single.source
    assert "rows_empty" not in single.source and "tile_order" not in single.source
    _compiles(tmp_path, "dkdv_single", kern, replace(kern.kernel_source, gluon=single))


def _compiles(tmp_path, name, kern, ks):
    path = tmp_path / f"{name}.py"
    path.write_text(ks.gluon.source)
    res = compile_for_sm90(path, ks.gluon.name, sm90_spec(kern.program, ks, key_block=64))
    assert res["ok"], res["error"]
    assert res["tma"] and res["wgmma"] and res["setmaxnreg"], res


@pytest.mark.parametrize("group,mask,mode", [(("q",), CAUSAL, "scheduled"),
                                             (("k", "v"), None, "round_robin")])
def test_dq_and_unmasked_passes_walk_their_tiles_persistently(tmp_path, monkeypatch, group,
                                                              mask, mode):
    """dQ's kernel under a causal mask (query block i sees key blocks up to i: unequal
    work, the launcher's order) and an unmasked dK/dV pass (equal work: round robin) are
    persistent programs too, and compile."""
    kern = _backward_kernel(monkeypatch, group, mask=mask)
    form = kern.kernel_source.gluon
    assert isinstance(form, gluon_sums.GluonSumsForm), kern.kernel_source.gluon_why
    assert form.persistent and form.scheduled == (mode == "scheduled")
    walk = ("first = gl.load(tile_order_ptr" if mode == "scheduled" else
            "for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):")
    assert form.source.count(walk) == 2  # the producer's and the consumers' walk
    _compiles(tmp_path, mode, kern, kern.kernel_source)


def test_the_fused_pass_adds_dq_through_a_transposed_tile_and_is_not_offered(tmp_path,
                                                                           monkeypatch):
    """dQ = Σ_keys dS·K: each warpgroup stores its dSᵀ tile; once both halves are in,
    each reads both back as the wgmma's transposed left operand against its half of K's
    columns and adds that 64×64 product atomically (masked by the query rows); a free
    barrier keeps the next block from overwriting a tile still read.  Right on the GPU,
    1.3x slower than the tl fused form: built, compiled, not offered to the timer."""
    kern = _backward_kernel(monkeypatch, ("k", "v", "q"))
    form = kern.kernel_source.gluon
    assert isinstance(form, gluon_sums.GluonSumsForm), kern.kernel_source.gluon_why
    assert form.transposed == 1 and form.key_blocks == () and not form.persistent
    src = form.source
    # both warpgroups' dSᵀ halves against this warpgroup's half of K's columns
    for h in (0, 1):
        assert (f"tbuf0.index({h}).permute((1, 0)), rows0.index({h}).slice(WHICH * 64, 64, "
                "dim=1)") in src
    order = ["mbarrier.wait(tfree0, (g & 1) ^ 1)", "tbuf0.index(WHICH).store(",
             "fence_async_shared()", "mbarrier.arrive(tfull0, count=1)",
             "mbarrier.wait(tfull0, g & 1)", "sc0 = warpgroup_mma(", "sc0 = warpgroup_mma_wait(",
             "gl.atomic_add(d_q_ptr", "mbarrier.arrive(tfree0, count=1)"]
    at = [src.index(x) for x in order]
    assert at == sorted(at), order
    assert "gl.convert_layout(mask_L, H_ROWS)[:, None]" in src
    assert "(WHICH * 64 + gl.arange(0, 64, H_COLS))[None, :] * d_q_s3" in src
    path = tmp_path / "fused.py"
    path.write_text(src)
    res = compile_for_sm90(path, form.name, sm90_spec(kern.program, kern.kernel_source,
                                                       key_block=64))
    assert res["ok"], res["error"]
    assert res["shared"] >= 2 * 128 * 128 * 2 + 2 * 64 * 64 * 2, res  # K, V rows, dSᵀ tiles


def test_a_sum_that_is_not_a_product_keeps_the_tl_form():
    """The skeleton refuses, with a reason, what it cannot issue as wgmma: the scheduler
    rejects a block whose sum is not a loop-axis product."""
    em = type("E", (), {"first": [("mma0", "k", "q")], "acc": []})()
    with pytest.raises(LoweringError, match="not a loop-axis contraction"):
        gluon_sums._scheduled_body(["        d_v_new = d_v + t3"], em, {"d_v"}, {"q": "ring0"})


DOC = torch.tensor([0] * 13 + [1] * 20 + [2] * 7, dtype=torch.int32)  # 3 documents, 40 keys


def DOC_CAUSAL(b, h, q, kv):  # noqa: N802 - a mask_mod, named like the others
    return (DOC[q] == DOC[kv]) & (q >= kv)


@pytest.mark.parametrize("group", [("k", "v"), ("q",)])
def test_a_document_mask_bounds_both_gradient_loops_by_the_summaries(tmp_path, monkeypatch,
                                                                    group):
    """A mask over captured document ids: each program's block range comes from the
    per-call summaries (as in the forward's Gluon form) -- the may range bounds what the
    producer streams, the must range (blocks every row sees whole) runs unmasked -- in
    dK/dV's loop over queries and dQ's over keys alike."""
    kern = _backward_kernel(monkeypatch, group, mask=DOC_CAUSAL)
    ks = kern.kernel_source
    form = ks.gluon
    assert isinstance(form, gluon_sums.GluonSumsForm), ks.gluon_why
    assert ks.summaries and all(f"{sp.name}_ptr" in form.params for sp in ks.summaries)
    assert not form.persistent  # (work known only on the device: one program per tile)
    src = form.source
    main = src[src.index(f"def {form.name}("):]
    assert "dm_lo =" in main and "n_blocks = gl.maximum(gl.cdiv(j_hi - j_lo, B_L), 1)" in main
    loops = [lp for lp in src.split("for jb in range(")[1:] if "warpgroup_mma(" in lp]
    assert len(loops) == 4 and "interior: no mask" in src
    assert "dm_lo - j_lo" in src and "dm_hi - j_lo" in src   # the interior cut by the data
    path = tmp_path / "doc.py"
    path.write_text(src)
    res = compile_for_sm90(path, form.name, sm90_spec(kern.program, ks, key_block=64))
    assert res["ok"], res["error"]
    assert res["tma"] and res["wgmma"], res
    assert res["pdl_wait"], res  # launched dependent on the pre-pass: it waits for it

"""The three-consumer Gluon form at head dim 64 (``gluon_ws._wide_form``): 192-row programs.

The interpreter cannot run Gluon, so the form is compiled for sm_90 on CPU
(``sm90_compile.py``) and its shape checked here; its numbers are checked on the GPU by
``bench/gluon_validate.py --only-wide`` (against fp32 torch) and timed by
``bench/gluon_probe/wide_form.py``.
"""
import pytest
import torch

import neptune_eq as ne
from sm90_compile import compile_for_sm90
from neptune_eq.lowering import gluon_ws
from neptune_eq.runtime import tile_configs
from neptune_eq.runtime.gluon_launch import sm90_spec

IDS = torch.tensor([0] * 40 + [1] * 60 + [2] * 100, dtype=torch.int32)


@pytest.fixture(autouse=True)
def _wide_on(monkeypatch):
    """On by default; ``NEPTUNE_EQ_GLUON_WIDE=0`` turns it off (read at generation)."""
    monkeypatch.setattr(gluon_ws, "WIDE", True)


def _attention(d: int, **mods):
    return ne.superoptimize(ne.attention(1, 2, 200, 200, d, "float16", **mods),
                            target="interpreter", cache=False)


def _causal(d: int = 64):
    return _attention(d, mask_mod=lambda b, h, q, kv: q >= kv)


def test_a_head_dim_64_form_comes_with_three_consumers():
    """Three consumer warpgroups of 64 rows each share every key block: each releases the
    row tiles and the ring's slots (barrier counts of 3), and the register file is split
    160 / 160 for the worker consumers and 24 for the producer (the default consumer takes
    the rest, 168: 3 x 128 threads and the producer's warpgroup in 64K registers)."""
    form = _causal().kernel_source.gluon
    wide = form.wide
    assert wide is not None and wide.consumers == 3 and wide.rows == 192
    assert wide.wide is None and wide.solo is None and wide.key_blocks == (64, 128)
    src = wide.source
    assert src.count("(_consumer, (") == 3 and "], [4, 4, 1], [160, 160, 24])" in src
    assert "allocate_shared_memory(DTYPE, [3, 64, D]" in src
    assert "mbarrier.init(q_empty, count=3)" in src
    assert "mbarrier.init(b_empty.index(i), count=3)" in src
    assert "my_first = row_block * 192 + WHICH * 64" in src
    assert 160 * 2 * 128 + (256 - 88) * 128 + 24 * 128 <= 65536


def test_only_head_dim_64_plans_without_a_data_mask_get_it(monkeypatch):
    """At head dim 128 three consumers' tiles do not fit their registers; a data mask's
    pre-pass runs ``tl`` tiles of the program's rows, which must be a power of 2.  Off
    (``WIDE``), no form has one."""
    assert _causal(128).kernel_source.gluon.wide is None
    docs = _attention(64, mask_mod=lambda b, h, q, kv: (IDS[q] == IDS[kv]) & (q >= kv))
    assert docs.kernel_source.gluon.wide is None
    monkeypatch.setattr(gluon_ws, "WIDE", False)
    assert _causal().kernel_source.gluon.wide is None


def test_its_configs_are_timed_beside_the_two_consumer_forms(monkeypatch):
    """192-row programs at both key blocks with a 2-deep ring, walked as the two-consumer
    form's (persistent, and one program per tile); ``form_for(192)`` finds it."""
    ks = _causal().kernel_source
    monkeypatch.setattr(tile_configs, "gluon_unavailable", lambda: None)
    cfgs = [c for c in tile_configs.candidate_configs(ks, "cuda") if c.blocks.get("B_i") == 192]
    assert [(c.blocks["B_L"], c.num_stages, c.per_tile, c.gluon_ws) for c in cfgs] == \
        [(64, 2, False, True), (64, 2, True, True), (128, 2, False, True), (128, 2, True, True)]
    assert ks.gluon.form_for(192) is ks.gluon.wide and ks.gluon.form_for(128) is ks.gluon


@pytest.mark.parametrize("key_block", [64])
def test_it_compiles_for_sm90_without_spills_at_64_keys(tmp_path, key_block):
    """ptxas fits each consumer in its 160 registers at 64-key blocks (at 128 it spills
    ~800 bytes a thread: S, P and O live at once -- measured faster all the same, see
    ``_wide_form``); the program launches at 128 registers a thread (512 threads)."""
    kern = _causal()
    wide = kern.kernel_source.gluon.wide
    path = tmp_path / "wide.py"
    path.write_text(wide.source)
    spec = {**sm90_spec(kern.program, kern.kernel_source, 2, key_block, form=wide),
            "resources": True}
    res = compile_for_sm90(path, wide.name, spec)
    assert res["ok"], res["error"]
    assert res["tma"] and res["wgmma"] and res["setmaxnreg"], res
    assert res["registers"] <= 128 and res["spill_stores"] == 0, res
    assert res["wgmma_serialized"] is None, res


def test_causal_warpgroups_compute_only_their_own_blocks(monkeypatch):
    """Under a causal bound the first warpgroups' rows end before the tile's last keys:
    each computes its own ``my_n`` blocks and releases the rest unread (waiting for each
    load, so its ring phases stay in step) -- at every key block with three consumers, at
    64 with two (a test on the constexpr ``B_L``).  Global forms keep every block
    (measured slower with only the last tile's skip, ``gluon_ws.OWN_BLOCKS``); with
    ``OWN_CONSUMERS`` = 3 only the three-consumer forms skip; off, none does."""
    form = _causal().kernel_source.gluon
    assert form.wide.own_blocks and form.own_blocks
    for f, test in ((form.wide, "if B_L <= 128:"), (form, "if B_L <= 64:")):
        consumer = f.source.split("def _consumer(")[1].split("@gluon.jit")[0]
        assert f"{test}\n            my_n = gl.minimum(n_blocks," in consumer
        skip = consumer.split("released unread")[1]
        assert skip.index("mbarrier.wait(b_ready") < skip.index("mbarrier.arrive(b_empty")
        assert skip.index("mbarrier.wait(c_ready") < skip.index("mbarrier.arrive(c_empty")
    glob = _attention(64).kernel_source.gluon
    assert not glob.own_blocks and not glob.wide.own_blocks and "my_n" not in glob.wide.source
    monkeypatch.setattr(gluon_ws, "OWN_CONSUMERS", 3)
    form = _causal().kernel_source.gluon
    assert form.wide.own_blocks and not form.own_blocks
    monkeypatch.setattr(gluon_ws, "OWN_BLOCKS", False)
    assert not _causal().kernel_source.gluon.wide.own_blocks

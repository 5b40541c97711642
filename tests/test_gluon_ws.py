"""The warp-specialised Gluon form (lowering/gluon_ws.py): emitted from the same plans as
the tl kernels, compiled here for sm_90 without a GPU (the interpreter cannot run Gluon),
offered to the timer only where a Hopper GPU runs it.  Its numbers are checked on the GPU
by bench/gluon_validate.py (against an fp32 torch reference on odd lengths, fully masked
rows and large-magnitude scores)."""
import functools
import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neptune_eq as ne
from sm90_compile import compile_for_sm90
from neptune_eq.choosing.choose import prune_configs
from neptune_eq.choosing.costmodel import DEFAULT_DEVICE, DEVICES
from neptune_eq.dropin import flex
from neptune_eq.lowering import gluon_ws
from neptune_eq.runtime import gluon_launch, tile_configs
from neptune_eq.runtime.gluon_launch import make_launcher, sm90_spec
from neptune_eq.runtime.tile_configs import TileConfig, candidate_configs
from neptune_eq.runtime.tile_order import one_tile_per_program, tile_order, tile_work


def _kernel(d=64, dtype="float16", s=77, **mods):
    return ne.superoptimize(ne.attention(1, 2, s, s, d, dtype, **mods), target="interpreter",
                            cache=False)


VARIANTS = {
    "global-fp16-d64": dict(d=64),
    "causal-bf16-d128": dict(d=128, dtype="bfloat16", mask_mod=lambda b, h, q, kv: q >= kv),
    "alibi": dict(score_mod=lambda s, b, h, q, kv: s + (kv - q) * (h + 1) * -0.0625),
    "softcap-causal": dict(score_mod=lambda s, b, h, q, kv: 30.0 * ne.tanh(s / 30.0),
                           mask_mod=lambda b, h, q, kv: q >= kv),
    "window": dict(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < 32)),
}


def test_every_variant_compiles_for_sm90_as_producer_and_consumers(tmp_path):
    """Each form compiles to PTX and cubin for sm_90 with TMA loads, wgmma and the
    producer/consumer register split -- the drop-in's (named sizes B, L, S; lse output)
    too."""
    kerns = {name: _kernel(**kw) for name, kw in VARIANTS.items()}
    q = torch.randn(1, 2, 40, 64, dtype=torch.float16)
    flex.flex_attention(q, q, q, return_lse=True)
    (st,) = [s for s in flex.STRUCTURES.values() if s.kernel is not None
             and s.kernel.program.shape_of(s.kernel.program.inputs[0].name)[-1] == 64
             and s.kernel.program.dtype_of(s.kernel.program.inputs[0].name) == "float16"]
    kerns["flex-dropin-lse"] = st.kernel
    for name, kern in kerns.items():
        ks = kern.kernel_source
        assert ks.gluon is not None, f"{name}: {ks.gluon_why}"
        path = tmp_path / f"{name}.py"
        path.write_text(ks.gluon.source)
        res = compile_for_sm90(path, ks.gluon.name, {**sm90_spec(kern.program, ks), "resources": True})
        assert res["ok"], f"{name}: {res['error']}"
        assert res["tma"] and res["wgmma"] and res["setmaxnreg"], (name, res)
        assert res["shared"] > 2 * 64 * 64 * 2, (name, res)  # the row tiles and the ring
        assert res["wgmma_serialized"] is None, (name, res)  # ptxas pipelines the products
        # the output tile goes by TMA (gluon_epilogue); a row vector (lse) by pointers
        assert ks.gluon.o_store is not None, name
        others = [o for o in kern.program.outputs if o != ks.gluon.o_store.tensor]
        assert all(f"gl.store({o}_ptr" in ks.gluon.source for o in others), name


def test_the_key_block_is_a_launch_choice_apart_from_the_value_width(tmp_path):
    """Head dim 64 with 128-key blocks and head dim 128 with 64-key blocks: the score tile
    (``S_LAYOUT``, B_L columns) and the rolling state (``O_LAYOUT``, the value's columns)
    are two accumulator layouts; a row vector scaling the state takes the state's row
    slice.  Each compiles for sm_90, causal and with a document mask too."""
    cases = {"global-d64-keys128": (dict(d=64), 128),
             "causal-d64-keys128": (dict(d=64, mask_mod=VARIANTS["causal-bf16-d128"]["mask_mod"]), 128),
             "causal-d128-keys64": (VARIANTS["causal-bf16-d128"], 64),
             "documents-d128-keys64": (dict(d=128, **DATA_VARIANTS["documents-causal"]), 64)}
    for name, (kw, key_block) in cases.items():
        kern = _kernel(**kw)
        ks = kern.kernel_source
        src = ks.gluon.source
        # the state's update converts the correction into the state's rows, nothing else
        assert re.search(r"gl\.convert_layout\(\w+, O_ROWS\)\[:, None\]", src), name
        assert "gl.full([64, " in src and "O_LAYOUT)" in src, name
        spec = sm90_spec(kern.program, ks, key_block=key_block)
        assert spec["descs"]["b_desc"][0] == spec["descs"]["c_desc"][0] == key_block
        assert spec["descs"]["c_desc"][1] == kw.get("d", 64)
        path = tmp_path / f"{name}.py"
        path.write_text(src)
        res = compile_for_sm90(path, ks.gluon.name, spec)
        assert res["ok"], f"{name}: {res['error']}"
        assert res["tma"] and res["wgmma"] and res["setmaxnreg"], (name, res)


def test_an_affine_mask_cuts_the_loop_and_the_interior_body_drops_it():
    """Causal: edge / interior / edge loops per warpgroup (then the ragged last block,
    compiled only off a block multiple), no per-block branch (a wgmma accumulator in
    flight cannot cross an if/else), the interior body computes no mask and only the
    ragged block tests the key extent."""
    src = _kernel(**VARIANTS["causal-bf16-d128"]).kernel_source.gluon.source
    loops = [ln for ln in src.splitlines() if ln.strip().startswith("for jb in range(")]
    assert [ln.split("#")[1].strip() for ln in loops[1:]] == [
        "edge", "interior: no mask", "edge", "the ragged last block",
        "past this warpgroup's keys: released unread"]  # (at 64-key blocks)
    interior = src.split("# interior: no mask")[1].split("for jb in range(")[0]
    assert ">=" not in interior and "if " not in interior
    # only the ragged last block tests the key extent
    edges = src.split("for jb in range(")[2:]
    assert [("| EVEN_L" in e.split("\n    if ")[0]) for e in edges] == [False, False, False, True,
                                                                       False]
    # the second contraction of block j-1 is issued before block j's math and waited after
    assert interior.index("warpgroup_mma(p_op") < interior.index("gl.exp2(")
    assert interior.index("gl.exp2(") < interior.index("warpgroup_mma_wait(0")


DOC = ne.placeholder((77,), "int32", "doc")
OFFSETS = ne.placeholder((5,), "int32", "offsets")
PREFIX = ne.placeholder((1,), "int32", "prefix")
DATA_VARIANTS = {  # masks over captured tensors with a key-range form (block_ranges)
    "documents-causal": dict(mask_mod=lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv)),
    "jagged": dict(mask_mod=lambda b, h, q, kv: (kv >= OFFSETS[DOC[q]]) & (q >= kv)),
    "prefix-lm": dict(mask_mod=lambda b, h, q, kv: (kv < PREFIX[b]) | (q >= kv)),
}


@functools.cache  # (the drop-in registers its structure once per process)
def _data_mask_kernels():
    """The data-mask variants' kernels, and the drop-in's document mask (named sizes)."""
    kerns = {name: _kernel(**kw) for name, kw in DATA_VARIANTS.items()}
    q = torch.randn(1, 2, 40, 64, dtype=torch.float16)
    ids = torch.tensor([0] * 15 + [1] * 25, dtype=torch.int32)
    before = set(flex.STRUCTURES)  # other tests' structures stay in the registry
    flex.flex_attention(q, q, q, mask_mod=lambda b, h, i, j: (ids[i] == ids[j]) & (i >= j))
    (st,) = [s for key, s in flex.STRUCTURES.items() if key not in before
             and s.kernel is not None and s.kernel.kernel_source.summaries]
    kerns["flex-dropin-documents"] = st.kernel
    return kerns


def _check_data_mask_body(name: str, src: str) -> None:
    """The consumer's loops: the blocks every row sees whole run a body without the
    mask's loads, the others load and test it."""
    loops = src.split("for jb in range(")[2:]   # the consumer's: edge, interior, edge
    # (a causal bound's warpgroups release the blocks past their rows' keys unread)
    skip = ["past this warpgroup's keys: released unread"] if "my_n" in src else []
    assert [lp.split("#")[1].split("\n")[0].strip() for lp in loops] == \
        ["edge", "interior: no mask", "edge", "the ragged last block", *skip], name
    # the mask's per-key work (documents: a read of doc at the keys) in edge loops only
    assert len(loops[1].splitlines()) < len(loops[0].splitlines()), name
    if name.startswith(("documents", "flex")):
        assert re.search(r"\w+_ptr \+ offs_L", loops[0]), name
        assert not re.search(r"\w+_ptr \+ offs_L", loops[1]), name


def _compiles(tmp_path, name: str, program, ks, pipelined: bool = True,
              key_block: int | None = None) -> None:
    """``pipelined``: ptxas keeps the wgmma pipeline (no C7513 serialization)."""
    path = tmp_path / f"{name}.py"
    path.write_text(ks.gluon.source)
    res = compile_for_sm90(path, ks.gluon.name, {**sm90_spec(program, ks, key_block=key_block),
                                                 "resources": True})
    assert res["ok"], f"{name}: {res['error']}"
    assert res["tma"] and res["wgmma"] and res["setmaxnreg"], (name, res)
    if pipelined:
        assert res["wgmma_serialized"] is None, (name, res)
    # a data mask's form is launched dependent on its summaries' pre-pass (a dynamic
    # walk's: on its ranges kernel, which reads them): it waits for it
    assert res["pdl_wait"] == bool(ks.summaries), (name, res)


def test_the_deferred_product_keeps_its_operand_live_until_its_wait():
    """Every loop issues block j-1's P·c and then computes block j's P: the operand of the
    product in flight passes through the wait that retires it (``p_used``), so LLVM cannot
    write the next P into its registers while the tensor cores read them.  (Where it did
    -- Triton 3.6, every data mask and the window -- ptxas serialized each wgmma of the
    kernel: a one-document mask ran 17% slower than causal attention, H200.)"""
    kerns = {**_data_mask_kernels(), "window": _kernel(**VARIANTS["window"])}
    for name, kern in kerns.items():
        consumer = kern.kernel_source.gluon.source.split("def _consumer(")[1].split("@gluon.jit")[0]
        loops = consumer.split("for jb in range(")[1:]
        if "released unread" in loops[-1]:  # (no product: blocks past the warpgroup's keys)
            loops.pop()
        assert len(loops) == 4, name
        for lp in loops:
            issue = lp.index("warpgroup_mma(p_op, c_bufs.index(prev)")
            keep = lp.index("p_used = p_op")
            nxt = lp.index("p_op = ", keep + len("p_used = p_op"))  # the block's own P
            wait = lp.index("= warpgroup_mma_wait(0, deps=(")
            assert issue < keep < nxt < wait, name
            assert re.search(r"(\w+), p_used = warpgroup_mma_wait\(0, deps=\(\1, p_used\)\)",
                             lp[wait - 40:]), name


def test_data_masks_narrow_the_key_range_and_compile_for_sm90(tmp_path):
    """A mask over captured tensors: the program's key range comes from the per-call
    summaries before the warpgroups split (the producer streams only those blocks), the
    blocks every row sees whole run a body without the mask's loads, the others load and
    test it; the drop-in's document mask (named sizes) has the form too."""
    for name, kern in _data_mask_kernels().items():
        ks = kern.kernel_source
        assert ks.gluon is not None, f"{name}: {ks.gluon_why}"
        src = ks.gluon.source
        main = src.split(f"def {ks.gluon.name}(")[1]
        assert "dm_lo = " in main and "n_blocks = " in main, name
        assert ks.gluon.ranges is None and "tile_sched" not in src, name
        n_sum = len(ks.summaries)  # the per-call summaries are the last pointers, as in tl
        assert [sp.name + "_ptr" for sp in ks.summaries] == ks.gluon.params[len(ks.gluon.params) - n_sum:]
        _check_data_mask_body(name, src)
        # prefix-LM at 77 keys -- one block and a ragged one -- is still serialized by
        # ptxas (Triton 3.6 and 3.9; without the ragged block's loop it is not); at 3000
        # keys it is pipelined (bench/gluon_probe/wgmma_serialization.py)
        _compiles(tmp_path, name, kern.program, ks, pipelined=name != "prefix-lm")


def test_the_dynamic_walk_takes_tiles_from_a_counter_and_compiles_for_sm90(tmp_path):
    """A data mask's form comes with its dynamic walk (``GluonForm.dynamic``, a second
    compile the timer weighs at 64-key blocks): each tile's key range comes from the
    ranges kernel, the producer takes tiles with an atomic add and posts them to the
    consumers, who read each tile's range from ``tile_sched``; the tiles are taken heads
    first; the blocks' bodies are those of the one-tile form."""
    for name, kern in _data_mask_kernels().items():
        dyn = kern.kernel_source.gluon.dynamic
        assert dyn is not None and dyn.persistent and dyn.key_blocks == (64,), name
        assert dyn.dynamic is None and dyn.solo is None and not dyn.heads_first_ok, name
        ks = replace(kern.kernel_source, gluon=dyn)
        src = ks.gluon.source
        assert "row_block = n_rb - 1 - t // (num_tiles // n_rb)" in src, name
        kname, ranges = ks.gluon.ranges
        assert "dm_lo = " in ranges and "n_blocks = " in ranges, name
        assert "tile_sched_ptr, 0, mask=" in ranges  # one program zeroes the counter
        # launched dependent on the pre-pass: the ranges kernel waits for it, then lets the
        # form launch, first thing; the form waits for it before its warps split, and
        # reads nothing from memory before that
        top = ranges.split(f"def {kname}(")[1].split("):\n", 1)[1].splitlines()[:3]
        assert [ln.strip() for ln in top] == ["if PDL:", "tl.extra.cuda.gdc_wait()",
                                              "tl.extra.cuda.gdc_launch_dependents()"], name
        main = src.split(f"def {ks.gluon.name}(")[1].split("):\n", 1)[1]
        before = main[:main.index("griddepcontrol.wait")]
        assert main.count("griddepcontrol.wait") == 1 and "gl.warp_specialize(" not in before
        assert "load" not in before and "_ptr" not in before, name
        producer = src.split("def _producer(")[1].split("def _consumer(")[0]
        consumer = src.split("def _consumer(")[1].split("@gluon.jit")[0]
        assert "gl.atomic_add(tile_sched_ptr, 1)" in producer, name
        assert "gl.atomic_add" not in consumer and "next_dm_lo = gl.load(tile_sched_ptr" in consumer
        # the per-call summaries, then the scheduler's buffer, are the last pointers
        n_sum = len(ks.summaries)
        assert [sp.name + "_ptr" for sp in ks.summaries] + ["tile_sched_ptr"] == \
            ks.gluon.params[len(ks.gluon.params) - n_sum - 1:]
        _check_data_mask_body(name, src)
        if name in ("documents-causal", "flex-dropin-documents"):
            _compiles(tmp_path, name, kern.program, ks, key_block=64)
        # offered to the timer beside the one-tile configs, at its own key blocks only
        dyn_cfgs = [c for c in gluon_configs_of(kern) if c.dynamic]
        assert dyn_cfgs and all(c.blocks["B_L"] == 64 and not c.heads_first
                                and not c.per_tile for c in dyn_cfgs), name
    for name in ("causal-bf16-d128", "window"):  # affine masks have no dynamic walk
        kern = _kernel(**VARIANTS[name])
        assert kern.kernel_source.gluon.dynamic is None
        assert not any(c.dynamic for c in gluon_configs_of(kern)), name


def gluon_configs_of(kern) -> list[TileConfig]:
    """The Gluon configs the timer would weigh for ``kern`` on a Hopper GPU."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tile_configs, "gluon_unavailable", lambda: None)
        return tile_configs.gluon_configs(kern.kernel_source)


def test_tiles_of_equal_work_run_persistent_programs():
    """Without a mask moving the key range -- or with one bounding it on both sides, a
    sliding window -- every (row block, head) tile has the same work: one program per SM
    walks them round robin, and the producer's next rows wait on the consumers' release;
    a data mask keeps one program per tile (long rows first; its dynamic walk is a second
    form, test_the_dynamic_walk_takes_tiles_from_a_counter_and_compiles_for_sm90)."""
    for name in ("global-fp16-d64", "alibi", "window"):
        form = _kernel(**VARIANTS[name]).kernel_source.gluon
        assert form.persistent, name
        assert "for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):" in form.source
        producer = form.source.split("def _producer(")[1].split("def _consumer(")[0]
        assert producer.index("mbarrier.wait(q_empty") < producer.index("tma_load(a_desc")
    form = _kernel(**DATA_VARIANTS["documents-causal"]).kernel_source.gluon
    assert not form.persistent and "num_tiles" not in form.source and form.ranges is None


def test_causal_tiles_walk_the_launchers_balanced_order(tmp_path):
    """Tiles of unequal work (causal: row block r sees r + 1 key blocks) are persistent
    too, walking the order the launcher computes (a ``tile_order`` pointer: each
    program's first entry, then tile ids); the form compiles for sm_90 so."""
    kern = _kernel(**VARIANTS["causal-bf16-d128"])
    ks = kern.kernel_source
    form = ks.gluon
    assert form.persistent and form.scheduled and form.key_offsets == (None, 1)
    assert form.params[-1] == "tile_order_ptr"
    for part in ("def _producer(", "def _consumer("):
        body = form.source.split(part)[1].split("@gluon.jit")[0]
        assert "t = gl.load(tile_order_ptr + gl.num_programs(0) + 1 + k)" in body, part
    path = tmp_path / "causal.py"
    path.write_text(form.source)
    res = compile_for_sm90(path, form.name, sm90_spec(kern.program, ks))
    assert res["ok"], res["error"]
    assert res["tma"] and res["wgmma"] and res["setmaxnreg"], res


@settings(max_examples=60, deadline=None)
@given(n_rb=st.integers(1, 40), heads=st.integers(1, 70), programs=st.integers(1, 140),
       hi=st.sampled_from([None, 1, 300]), lo=st.sampled_from([None, -255, 0]))
def test_the_tile_order_is_a_permutation_and_balanced(n_rb, heads, programs, hi, lo):
    """Every tile once, each program's entries contiguous; no program's work exceeds the
    average by more than the longest tile (list scheduling's bound), where round robin
    can exceed it by far more."""
    work = tile_work(n_rb, 128, n_rb * 128, 128, lo, hi)
    order = tile_order(work, heads, programs)
    starts, ids = order[:programs + 1], order[programs + 1:]
    assert starts[0] == 0 and starts[-1] == len(ids) == n_rb * heads
    assert all(a <= b for a, b in zip(starts, starts[1:]))
    assert sorted(ids) == list(range(n_rb * heads))
    load = [sum(work[n_rb - 1 - t % n_rb] for t in ids[a:b]) for a, b in zip(starts, starts[1:])]
    assert max(load) <= sum(load) / programs + max(work)


@pytest.mark.parametrize("heads, seq, rows", [(64, 5000, 128), (64, 5000, 192), (32, 8192, 128),
                                              (8, 8192, 128)])
@pytest.mark.parametrize("own", [False, True])
def test_the_tile_orders_end_is_balanced_too(heads, seq, rows, own):
    """Causal tiles on 132 programs: the most loaded program within 1% of the average
    (the heads' last group merged to at least ``TAIL_WAVES`` tiles a program; with two
    waves' worth it was 5-9% over, the measured tail of session 46) -- and within 1.5%
    with each warpgroup's own blocks as a tile's work (``own``, the launcher's weights
    since session 47: 1.1% at 192-row tiles, S=5000, where the order computed from whole
    tiles' blocks is 5.1% over under these weights)."""
    n_rb = -(-seq // rows)
    work = tile_work(n_rb, rows, seq, 128, None, 1, *((64, seq) if own else ()))
    order = tile_order(work, heads, 132)
    starts, ids = order[:133], order[133:]
    load = [sum(work[n_rb - 1 - t % n_rb] for t in ids[a:b]) for a, b in zip(starts, starts[1:])]
    assert max(load) <= (1.015 if own else 1.01) * sum(load) / 132


@settings(max_examples=40, deadline=None)
@given(n_rb=st.integers(1, 40), heads=st.integers(1, 70),
       hi=st.sampled_from([None, 1, 300]), lo=st.sampled_from([None, -255, 0]))
def test_one_tile_per_program_runs_heads_in_turn_longest_first(n_rb, heads, hi, lo):
    """A persistent form launched one program per tile: program p walks exactly the
    p-th tile; every tile once; heads in turn, each head's row blocks longest first (the
    order the hardware's block scheduler balances)."""
    work = tile_work(n_rb, 128, n_rb * 128, 128, lo, hi)
    order = one_tile_per_program(work, heads)
    n = n_rb * heads
    starts, ids = order[:n + 1], order[n + 1:]
    assert starts == list(range(n + 1)) and sorted(ids) == list(range(n))
    assert [t // n_rb for t in ids] == sorted(t // n_rb for t in ids)
    for h in range(heads):
        w = [work[n_rb - 1 - t % n_rb] for t in ids[h * n_rb:(h + 1) * n_rb]]
        assert w == sorted(w, reverse=True)


def test_tile_work_counts_each_warpgroups_own_blocks():
    """Per consumer warpgroup: the blocks its rows see, one past the rows, plus one each
    for the start and store (``gluon_tiles.consumer_blocks``).  Causal 192-row tiles of
    128-key blocks at S=500: tile 0's first two warpgroups see 1 block of its 2, tile 1's
    first 2 of its 3; the last tile's third warpgroup holds no row."""
    assert tile_work(3, 192, 500, 128, None, 1, 64, 500) == [1 + 1 + 2 + 3,
                                                              2 + 3 + 3 + 3,
                                                              4 + 4 + 1 + 3]
    assert tile_work(2, 128, 256, 128, None, None, 64, 200) == [2 + 2 + 2, 2 + 2 + 2]
    assert tile_work(2, 128, 256, 128, None, None, 64, 150) == [2 + 2 + 2, 2 + 1 + 2]


def test_tile_work_follows_the_key_range():
    """Causal at 128-row tiles and keys: row block r visits r + 1 blocks (+1 for its
    start and store); a window of 256 at most 3; global every block."""
    assert tile_work(4, 128, 512, 128, None, 1) == [2, 3, 4, 5]
    assert tile_work(4, 128, 512, 128, -255, 1) == [2, 3, 4, 4]
    assert tile_work(3, 128, 300, 64, None, None) == [6, 6, 6]
    with pytest.raises(ValueError, match="at least one program"):
        tile_order([1], 1, 0)


def test_plans_outside_the_skeleton_keep_only_tl_forms(monkeypatch):
    """Split-k decode, a head dim the skeleton does not issue: no Gluon form, and why;
    a decode (one query row) is not offered 128-row programs."""
    decode = ne.superoptimize(ne.attention(1, 2, 1, 300, 64), target="interpreter", cache=False)
    split = [r.kernel for r in decode.candidates if r.plan is not None and r.plan.split]
    assert split and all(ks.gluon is None and "unsplit" in ks.gluon_why for ks in split)
    monkeypatch.setattr(tile_configs, "gluon_unavailable", lambda: None)
    assert not any(c.gluon_ws for c in candidate_configs(decode.kernel_source, "cuda"))
    odd = _kernel(d=48).kernel_source
    assert odd.gluon is None and "widths" in odd.gluon_why
    # a data mask with no key-range form needs a per-block test: not in the Gluon form
    parity = _kernel(mask_mod=lambda b, h, q, kv: DOC[kv] % 2 == 0).kernel_source
    assert parity.summaries and parity.gluon is None and "per-block" in parity.gluon_why


def test_gluon_configs_are_offered_only_where_a_hopper_gpu_runs_them(monkeypatch):
    ks = _kernel().kernel_source
    assert not any(c.gluon_ws for c in candidate_configs(ks, "interpreter"))
    monkeypatch.setattr(tile_configs, "gluon_unavailable", lambda: "no CUDA GPU")
    assert not any(c.gluon_ws for c in candidate_configs(ks, "cuda"))
    monkeypatch.setattr(tile_configs, "gluon_unavailable", lambda: None)
    cfgs = candidate_configs(ks, "cuda")
    gl = [c for c in cfgs if c.gluon_ws and c.blocks["B_i"] == 128]
    # 128-key blocks (head dim 64 too) at each ring that fits in shared memory; 64-key
    # blocks (a 2-deep ring) also where the key range is narrow (a window); each walked
    # by persistent programs and launched one program per tile (the same kernel).  (Head
    # dim 64's three-consumer form, 192 rows: tests/test_gluon_wide.py.)
    assert [(c.blocks["B_L"], c.num_stages, c.per_tile) for c in gl] == \
        [(128, 2, False), (128, 2, True), (128, 3, False), (128, 3, True)]
    window = candidate_configs(_kernel(d=128, **VARIANTS["window"]).kernel_source, "cuda")
    assert [(c.blocks["B_L"], c.num_stages) for c in window if c.gluon_ws] == \
        [(64, 2), (64, 2), (128, 2), (128, 2), (128, 3), (128, 3)]
    docs = candidate_configs(_data_mask_kernels()["documents-causal"].kernel_source, "cuda")
    assert not any(c.per_tile for c in docs)  # (one program per tile already)
    # ... each launched heads first too, the dynamic walk's form at 64-key blocks, and the
    # one-consumer form's 64-row programs (tests/test_gluon_solo.py) at a 2-deep ring
    assert [(c.blocks["B_i"], c.blocks["B_L"], c.num_stages, c.heads_first, c.dynamic)
            for c in docs if c.gluon_ws] == \
        [(128, 64, 2, False, False), (128, 64, 2, True, False), (128, 128, 2, False, False),
         (128, 128, 2, True, False), (128, 128, 3, False, False), (128, 128, 3, True, False),
         (128, 64, 2, False, True),
         (64, 64, 2, False, False), (64, 64, 2, True, False), (64, 128, 2, False, False),
         (64, 128, 2, True, False)]
    assert "dynamic-walk" in str(docs[[c.dynamic for c in docs].index(True)])
    assert not any(c.heads_first or c.blocks.get("B_i") == 64 for c in gl + window if c.gluon_ws)
    assert "one-program-per-tile" in str(gl[1]) and gl[1].as_dict()["per_tile"]
    assert _kernel(d=128).kernel_source.gluon.ring_bytes(128, 3) == 224 * 1024
    kept = prune_configs(_kernel().candidates[0].plan, cfgs, DEVICES[DEFAULT_DEVICE])
    assert [c for c in kept if c.gluon_ws and c.blocks["B_i"] == 128] == gl  # a separate
    # form: each ring depth timed; and the three-consumer form's four configs
    assert len([c for c in kept if c.gluon_ws and c.blocks["B_i"] == 192]) == 4
    assert "gluon-ws" in str(gl[0]) and gl[0].as_dict()["gluon_ws"]


def test_a_gluon_config_off_hopper_is_a_clear_error():
    kern = _kernel()
    cfg = TileConfig({"B_i": 128, "B_L": 64}, 4, 2, gluon_ws=True)
    with pytest.raises(ValueError, match="interpreter cannot run Gluon"):
        make_launcher(kern.program, kern.kernel_source, "interpreter", cfg)
    odd = _kernel(d=48)
    with pytest.raises(ValueError, match="no warp-specialised Gluon form"):
        make_launcher(odd.program, odd.kernel_source, "cuda", cfg)


def test_a_dynamic_walk_without_a_data_mask_is_a_clear_error(monkeypatch):
    """``TileConfig.dynamic`` names a data mask's second form: asked of a kernel without one
    (causal attention's tiles are walked in the launcher's order) it says so, before any
    compile."""
    monkeypatch.setattr(gluon_launch, "gluon_unavailable", lambda: None)
    kern = _kernel(**VARIANTS["causal-bf16-d128"])
    cfg = TileConfig({"B_i": 128, "B_L": 64}, 4, 2, gluon_ws=True, dynamic=True)
    with pytest.raises(ValueError, match="dynamic walk is a form of a data mask"):
        make_launcher(kern.program, kern.kernel_source, "cuda", cfg)


def test_non_contiguous_inputs_fall_back_to_the_tl_form():
    """The descriptors view inputs as (rows, width): a transposed view cannot be one."""
    ks = _kernel().kernel_source
    q = torch.randn(1, 77, 2, 64, dtype=torch.float16).transpose(1, 2)
    good = torch.randn(1, 2, 77, 64, dtype=torch.float16)
    assert gluon_launch.gluon_inputs_ok(ks, {"q": good, "k": good, "v": good})
    assert not gluon_launch.gluon_inputs_ok(ks, {"q": q, "k": good, "v": good})
    assert not gluon_launch.gluon_inputs_ok(ks, {"q": good.bfloat16(), "k": good, "v": good})
    assert replace(TileConfig({}, gluon_ws=True), gluon_ws=False).gluon_ws is False


def test_the_timer_rejects_a_config_that_disagrees_with_the_plain_launch():
    """A Gluon form is not translation-validated itself, and what the GPU compiler makes
    of a pipelined loop no interpreter sees: on the timing inputs every config's outputs
    must match the plain launch's (``tuning.plain_config``), or it is recorded as
    failed."""
    from neptune_eq.runtime.tuning import _disagreement
    ref = {"o": torch.randn(4, 64, dtype=torch.float16)}
    close = {"o": ref["o"] + 1e-3}
    assert _disagreement(close, ref, ["o"]) == ""
    assert "differs" in _disagreement({"o": ref["o"] + 0.5}, ref, ["o"])
    nan = ref["o"].clone()
    nan[1, 3] = float("nan")
    assert "NaN" in _disagreement({"o": nan}, ref, ["o"])
    lse = {"lse": torch.tensor([float("-inf"), 3.0])}  # a fully masked row agrees as -inf
    assert _disagreement({"lse": torch.tensor([float("-inf"), 3.0001])}, lse, ["lse"]) == ""


def _turn_events(consumer: str) -> list[str]:
    """The consumer's product issues, product waits and turn events, in source order."""
    out = []
    for ln in consumer.splitlines():
        s = ln.strip()
        if s.startswith("mbarrier.wait(turn."):
            out.append("take")
        elif s.startswith("mbarrier.arrive(turn.index(1 - WHICH)"):
            out.append("pass")
        elif "warpgroup_mma_wait(" in s:
            out.append("await")
        elif "warpgroup_mma(" in s:
            out.append("issue")
    return out


@pytest.mark.parametrize("name", ["global-fp16-d64", "causal-bf16-d128", "window",
                                  "documents-causal"])
def test_pingpong_consumers_issue_their_products_in_turn(tmp_path, monkeypatch, name):
    """With ``gluon_ws.PINGPONG`` each consumer takes its turn before it issues a block's
    products and hands the turn over before it waits for any of them (so one warpgroup's
    softmax runs beside the other's products), at every issue site -- block 0, each key
    loop, the ragged block, the last deferred product -- and the form still compiles for
    sm_90 (causal and a document mask).  Off, the source has no turns."""
    kern = _kernel(**(VARIANTS.get(name) or DATA_VARIANTS[name]))
    assert "turn" not in kern.kernel_source.gluon.source  # off by default
    monkeypatch.setattr(gluon_ws, "PINGPONG", True)
    form = gluon_ws.generate(kern.plan, kern.kernel_source.gluon.name)
    consumer = form.source.split("def _consumer(")[1].split("@gluon.jit")[0]
    events = _turn_events(consumer)
    held = False
    for ev in events:  # issue only while holding the turn; never await while holding it
        assert (ev != "issue" or held) and (ev != "await" or not held), events
        assert (ev != "take" or not held) and (ev != "pass" or held), events
        held = {"take": True, "pass": False}.get(ev, held)
    assert not held and events.count("take") >= 3, events
    # turn numbers: block 0's, block jb's, the last product's (see pingpong_turns)
    for n in ("(base + it) & 1", "(base + it + jb) & 1", "(base + it + n_blocks) & 1"):
        assert f"mbarrier.wait(turn.index(WHICH), {n})" in consumer, n
    assert "if WHICH == 1:" in consumer and "mbarrier.arrive(turn.index(0), count=1)" in consumer
    if name in ("causal-bf16-d128", "documents-causal"):  # (a compile is seconds: two suffice)
        _compiles(tmp_path, name, kern.program, replace(kern.kernel_source, gluon=form))


def test_the_output_tile_goes_by_tma_where_its_buffers_fit(tmp_path, monkeypatch):
    """The rolling state's normalised tile is written to shared memory and stored by the
    TMA engine (``gluon_epilogue``) under ``TMA_O``, with the pointer store kept for a
    tile past the rows and for ``TMA_O`` off; an lse row vector keeps its pointer store.
    A 3-deep ring of 128-key blocks at width 128 leaves no room for the buffers: that
    config compiles with ``TMA_O`` off, inside the 227 KiB an SM gives a program."""
    from neptune_eq.lowering import gluon_epilogue
    kern = _kernel(d=128, s=77)  # 77 rows: the second 64-row tile runs past them
    form = kern.kernel_source.gluon
    assert form.o_store is not None and form.o_store.tensor == kern.program.outputs[0]
    assert form.descs[-1] == "o_desc" and form.tiles(128)[-1] == ("o", 64, 128)
    src = form.source
    assert "tma_store(o_desc, [" in src and src.count("tma.store_wait(0)") == 2
    # the buffer is rewritten only after its last store read it, and fenced before the next
    order = [src.index(k) for k in ("tma.store_wait(0)  # this buffer", "o_smem.index(WHICH).store(",
                                    "fence_async_shared()", "tma_store(o_desc")]
    assert order == sorted(order)
    # the program waits for its last store after its walk, before the main kernel
    assert src.index("tma.store_wait(0)  # the last tile") < src.index(f"def {form.name}(")
    assert re.search(r"if my_first \+ 64 <= 77:.*\n(.*\n){4}\s*else:.*\n\s*gl\.store\(o_ptr", src)
    assert form.tma_store_fits(128, 2) and not form.tma_store_fits(128, 3)
    assert _kernel(d=64, s=77).kernel_source.gluon.tma_store_fits(128, 3)
    for stages in (2, 3):
        spec = {**sm90_spec(kern.program, kern.kernel_source, stages, 128), "resources": True}
        assert spec["constexprs"]["TMA_O"] == (stages == 2)
        path = tmp_path / f"ring{stages}.py"
        path.write_text(src)
        res = compile_for_sm90(path, form.name, spec)
        assert res["ok"], res["error"]
        assert res["shared"] <= 227 * 1024, res
    # a non-contiguous output cannot be the descriptor's: the call runs the tl twin
    good = torch.randn(1, 2, 77, 128, dtype=torch.float16)
    bad = torch.randn(1, 77, 2, 128, dtype=torch.float16).transpose(1, 2)
    ins = {"q": good, "k": good, "v": good}
    assert gluon_launch.gluon_inputs_ok(kern.kernel_source, {**ins, "o": good.clone()})
    assert not gluon_launch.gluon_inputs_ok(kern.kernel_source, {**ins, "o": bad})
    # the switch off: pointer stores only, as before
    monkeypatch.setattr(gluon_epilogue, "TMA_STORE", False)
    off = ne.superoptimize(ne.attention(1, 2, 77, 77, 128, "float16"), target="interpreter",
                           cache=False).kernel_source.gluon
    assert off.o_store is None and "o_desc" not in off.source and len(off.descs) == 3

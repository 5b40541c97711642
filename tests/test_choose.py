"""Choosing the kernel: split-k lowering (two kernels), head packing, the GPU cost model's
decisions, k-best extraction, and the candidate table."""
import pytest
import torch

import neptune_eq as ne
from neptune_eq.frontend import examples
from neptune_eq.choosing.choose import structure_of
from neptune_eq.interp import evaluate
from neptune_eq.runtime.launcher import Launcher
from neptune_eq.runtime.tile_configs import candidate_configs
from neptune_eq.lowering.split_plan import split_factors
from helpers import random_inputs


def _causal(sq, skv):
    return lambda b, h, q, k: k <= q + (skv - sq)


def _run_row(row, program, ins, splits=None, fused=False):
    cfg = candidate_configs(row.kernel, "interpreter")[0]
    if splits:
        cfg.splits, cfg.fused = splits, fused
    outs = {n: torch.empty(program.shape_of(n), dtype=getattr(torch, program.dtype_of(n)))
            for n in program.outputs}
    la = Launcher(row.program, row.kernel, "interpreter", cfg)
    la({**ins, **outs})
    if fused:  # the last arrival of every row block reset its counter for the next launch
        assert [int(s.abs().sum()) for s in la._sems.values()] == [0]
    return outs[program.outputs[0]]


def _split_row(kern):
    return next(r for r in kern.candidates if r.plan is not None and r.plan.split)


def test_decode_chooses_split_k_and_long_prefill_chooses_rolling():
    dec = ne.superoptimize(ne.attention(1, 32, 1, 8192, 128, mask_mod=_causal(1, 8192)),
                           target="interpreter", device="H200", cache=False)
    pre = ne.superoptimize(ne.attention(1, 32, 4096, 4096, 128, mask_mod=_causal(4096, 4096)),
                           target="interpreter", device="H200", cache=False)
    assert dec.plan.split and dec.launches == ["neptune_o_partial", "neptune_o_combine"]
    assert not pre.plan.split and pre.launches == ["neptune_o"]
    # .candidates says why: predicted times for both strategies
    for kern, winner in ((dec, "split-k"), (pre, "rolling")):
        table = kern.candidate_table()
        assert "split-k" in table and "rolling" in table and "<- chosen" in table
        chosen = kern.chosen_row
        assert chosen.description.startswith(winner) and chosen.rank == 1
        others = [r for r in kern.candidates if not r.chosen and r.estimate]
        assert all(r.predicted_us >= chosen.predicted_us for r in others)


@pytest.mark.parametrize("fused", [False, True], ids=["two-launches", "one-launch"])
@pytest.mark.parametrize("hq, hkv, skv, dtype, splits", [
    (4, 4, 70, "float32", 3),      # odd key count, chunks not multiples of the extent
    (8, 2, 100, "float16", 2),     # GQA: 4 heads of a group packed into one row block
    (6, 3, 33, "float32", 5),      # more splits than key blocks: empty chunks combine to 0
])
def test_split_k_decode_kernels_equal_the_reference(hq, hkv, skv, dtype, splits, fused):
    out = ne.attention(1, hq, 1, skv, 16, dtype, kv_heads=hkv, mask_mod=_causal(1, skv),
                       score_mod=lambda s, b, h, q, k: s + 0.01 * (k - q))
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    row = _split_row(kern)
    assert row.plan.packed == ((("y", hq // hkv)) if hq != hkv else None)
    ins = random_inputs(kern.input_program)
    for _ in range(2):  # twice: the one-launch form's counters must be zero again
        got = _run_row(row, kern.input_program, ins, splits, fused)
        ref = evaluate(kern.input_program, ins)["o"]
        tol = 2e-3 if dtype == "float16" else 1e-5
        assert (got.double() - ref).abs().max().item() <= tol
    assert "_combine" in row.kernel.source and "atomic_add(sem" in row.kernel.source


@pytest.mark.parametrize("programs,extent,block", [(32, 32768, 128), (8, 32768, 64),
                                                    (32, 2048, 32), (200, 4096, 64)])
def test_split_factors_fill_whole_waves_without_a_short_last_one(programs, extent, block):
    # 32 heads at 32768 keys: 4 / 8 / 16 splits, not 5 / 9 / 17 (160 programs on 132
    # SMs left a 28-program wave: 3.40 against 4.37 TB/s on the H200, session 48)
    sms = 132
    got = split_factors(programs, extent, block, sms)
    most = max(1, extent // (2 * block))
    for f in got:  # within [1, most], and the most programs that fit k waves
        assert 1 <= f <= most
        assert f == 1 or f == most or any(f * programs <= k * sms < (f + 1) * programs
                                          for k in (1, 2, 4))
    if programs == 32 and extent == 32768:
        assert got == [4, 8, 16]


@pytest.mark.parametrize("fused", [False, True], ids=["two-launches", "one-launch"])
def test_split_k_combine_in_several_steps_rebases_the_running_state(fused, monkeypatch):
    """One loop folds every state's partials a tile a step: the running max moves between
    steps (scores x30, so a stale base would be off by e^30), and a query that sees no key
    (two of the four packed heads: their mask is false everywhere) stays exactly 0."""
    from neptune_eq.runtime import launcher as runtime
    monkeypatch.setattr(runtime, "COMBINE_TILE", 16)  # 2 partials x 4 rows x 16 wide a step
    out = ne.attention(1, 8, 1, 90, 16, "float32", kv_heads=2,
                       mask_mod=lambda b, h, q, k: (k <= q + 89) & (h % 4 < 2),
                       score_mod=lambda s, b, h, q, k: s * 30.0)
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    row = _split_row(kern)
    combine = row.kernel.source.split("_combine(")[1].split("@triton.jit")[0]
    assert combine.count("for sp0 in range(0, NSPLIT, B_P)") == 1  # one loop, every state
    la = Launcher(row.program, row.kernel, "interpreter", candidate_configs(row.kernel, "interpreter")[0])
    assert la._combine_shape(7, spread_width=not fused)[0] == 2  # so 7 splits take 4 steps
    ins = random_inputs(kern.input_program)
    got = _run_row(row, kern.input_program, ins, 7, fused)
    ref = evaluate(kern.input_program, ins)["o"]
    assert (got.double() - ref).abs().max().item() <= 1e-5
    assert torch.equal(got[0, 2:4], torch.zeros_like(got[0, 2:4]))


def test_split_k_combine_spreads_the_head_dim_over_programs(monkeypatch):
    """Decode has few rows: the combine kernel folds the real ones only (two packed
    heads, not the 16-row block), splits the output width (padded 48 -> 64, four programs
    of 16, the last partly masked) and folds the partials two at a time."""
    from neptune_eq.runtime import launcher as runtime
    monkeypatch.setattr(runtime, "COMBINE_TILE", 32)
    out = ne.attention(1, 4, 1, 70, 48, "float32", kv_heads=2, mask_mod=_causal(1, 70))
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    row = _split_row(kern)
    assert row.kernel.combine_width == ("e", 64) and "pid_width" in row.kernel.source
    la = Launcher(row.program, row.kernel, "interpreter", candidate_configs(row.kernel, "interpreter")[0])
    assert la._combine_rows(fused=False) == 2 and la._combine_shape(3) == (2, {"B_e": 16}, 4)
    ins = random_inputs(kern.input_program)
    got = _run_row(row, kern.input_program, ins, 3)
    ref = evaluate(kern.input_program, ins)["o"]
    assert (got.double() - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("d, sms, width", [(128, 1, 128), (128, 132, 32), (128, 4, 64),
                                             (48, 132, 32), (48, 1, 64)])
def test_split_k_combine_spreads_its_width_until_it_fills_the_sms(d, sms, width, monkeypatch):
    """Two KV heads make two combine programs at full width: the width is halved while
    the programs are fewer than the SMs, down to 32 fp32 values (one 128-byte line) a
    row and no further -- each width right, the padded head dim 48 too (its last program
    partly masked)."""
    monkeypatch.setattr(Launcher, "_sms", lambda self: sms)
    out = ne.attention(1, 4, 1, 70, d, "float32", kv_heads=2, mask_mod=_causal(1, 70))
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    row = _split_row(kern)
    la = Launcher(row.program, row.kernel, "interpreter", candidate_configs(row.kernel, "interpreter")[0])
    padded = 1 << (d - 1).bit_length()
    assert la._combine_shape(3) == (4, {"B_e": width}, padded // width)
    ins = random_inputs(kern.input_program)
    got = _run_row(row, kern.input_program, ins, 3)
    ref = evaluate(kern.input_program, ins)["o"]
    assert (got.double() - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("chain", examples.CHAINS + ["softmax"])
def test_split_k_of_every_chain_equals_the_reference(chain, monkeypatch):
    """Partials re-based by the derived h: log-sum-exp (a fold output), h = sqrt(s/s'),
    h = s/s', the centered matmul, a max consumer, softmax's column epilogue.  A small
    combine tile makes the combine take several steps and split the width where it may."""
    from neptune_eq.runtime import launcher as runtime
    monkeypatch.setattr(runtime, "COMBINE_TILE", 64)
    out = (examples.softmax(3, 70) if chain == "softmax"
           else examples.reduction_chain(chain, 5, 70, 40))  # width 40: 3 of 4 programs
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    if not any(r.plan is not None and r.plan.split for r in kern.candidates):
        pytest.skip(f"{chain}: no split-k candidate lowers ({[r.status for r in kern.candidates]})")
    for fused in (False, True):
        row = _split_row(kern)
        # scores up to ~±60: far apart partials, yet exp(x)·v stays in fp32 range for the
        # chains with no max to subtract
        ins = random_inputs(kern.input_program, scale=20.0)
        got = _run_row(row, kern.input_program, ins, 3, fused)
        ref = evaluate(kern.input_program, ins)[kern.input_program.outputs[0]]
        assert (got.double() - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_split_k_fully_masked_rows_return_zero():
    out = ne.attention(1, 2, 1, 40, 16, "float32", mask_mod=lambda b, h, q, k: k < 0)
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    ins = random_inputs(kern.input_program)
    for fused in (False, True):
        got = _run_row(_split_row(kern), kern.input_program, ins, 3, fused)
        assert torch.equal(got, torch.zeros_like(got))


def test_head_packing_shares_kv_loads():
    kern = ne.superoptimize(ne.attention(1, 8, 1, 64, 16, "float32", kv_heads=2),
                            target="interpreter", cache=False)
    assert kern.plan.packed == ("y", 4)
    assert "head-group packing" in kern.plan.describe()
    # K and V are indexed by the program's KV head only: one tile per block, shared by 4 heads
    assert "k_ptr + ax_z * k_s0 + ax_y * k_s1" in kern.source
    no_pack = ne.superoptimize(ne.attention(1, 8, 64, 64, 16, "float32", kv_heads=2),
                               target="interpreter", cache=False)
    assert no_pack.plan.packed is None  # long rows: no packing


def test_k_best_candidates_are_distinct_structures():
    kern = ne.superoptimize(examples.attention(1, 2, 40, 72, 32, "float16"), target="interpreter",
                            cache=False)
    structures = [structure_of(r.plan) for r in kern.candidates if r.plan]
    assert len(structures) == len(set(structures)) >= 3
    ranks = [r.rank for r in kern.candidates]
    assert ranks == sorted(ranks) == list(range(1, len(ranks) + 1))


def test_only_boundary_blocks_evaluate_the_mask():
    kern = ne.superoptimize(ne.attention(1, 1, 40, 40, 16, "float32", mask_mod=_causal(40, 40)),
                            target="interpreter", cache=False)
    src = kern.source
    assert src.count("for l0 in ") == 2 and "# interior: no mask" in src
    interior = src.split("# interior: no mask")[1].split("for l0 in range")[0]
    assert "<=" not in interior and "offs_L" in interior  # the causal compare is gone there
    assert "only boundary blocks" in kern.plan.describe()


def test_cost_model_sees_register_spills_and_wgmma_shapes():
    """config_seconds knows what ptxas makes of a tile shape (calibrated on the sm_90
    cross-compile, bench/results/static_sm90.md): two [rows x 128] fp32 accumulators in
    one loop (dK and dV) overflow 255 registers at 128 rows on 4 warps, fit at 64 rows
    with tensor descriptors; fewer than 64 rows per warpgroup cannot be wgmma."""
    from neptune_eq.api import make_plan
    from neptune_eq.choosing.choose import prune_configs
    from neptune_eq.choosing.costmodel import (DEVICES, config_seconds, registers_per_thread,
                                               wgmma_shape)
    from neptune_eq.runtime.tile_configs import TileConfig
    h, n, e = 32, 4096, 128   # heads give the grid its fill, as batch x heads does
    p = ne.placeholder((h, n, n), "float32", "p")
    do = ne.placeholder((h, n, e), "bfloat16", "do")
    q = ne.placeholder((h, n, e), "bfloat16", "q")
    v = ne.placeholder((h, n, e), "bfloat16", "v")
    i, i2, f = ne.reduce_axis(n, "i"), ne.reduce_axis(n, "i2"), ne.reduce_axis(e, "f")
    dv = ne.compute((h, n, e), lambda y, j, c: ne.sum(p[y, i, j] * do[y, i, c], axis=i), "dv")
    # dK's shape: dP = dO·Vᵀ inside the loop, V's [rows x e] tile loop-invariant
    dk = ne.compute((h, n, e), lambda y, j, c: ne.sum(
        ne.sum(do[y, i2, f] * v[y, j, f], axis=f) * q[y, i2, c], axis=i2), "dk")
    plan = make_plan(ne.build_program([dv, dk]))
    assert plan.whole_axes and len(plan.passes) == 1 and len(plan.passes[0].folds) == 2
    assert registers_per_thread(plan, 128, 32, 4, tma=True) > 255     # 256 for the states
    assert registers_per_thread(plan, 64, 64, 4, tma=True) <= 255
    assert registers_per_thread(plan, 64, 64, 4, tma=False) > \
        registers_per_thread(plan, 64, 64, 4, tma=True)              # no resident operands
    assert [wgmma_shape(r, w) for r, w in ((32, 4), (64, 4), (64, 8), (128, 8))] == \
        [False, True, False, True]
    dev = DEVICES["H200"]
    blk = f"B_{plan.block_axis}"

    def cfg(r, k, w, tma=True):
        return TileConfig({blk: r, "B_L": k}, w, 3, 0, tma=tma)
    assert config_seconds(plan, dev, cfg(128, 32, 4)) > config_seconds(plan, dev, cfg(64, 64, 4))
    kept = prune_configs(plan, [cfg(128, 32, 4), cfg(64, 64, 4), cfg(128, 64, 8),
                                cfg(32, 128, 4)], dev)
    assert {str(c) for c in kept} == {str(cfg(64, 64, 4)), str(cfg(128, 64, 8))}  # no spills
    # pointer forms hold V's tile in registers too: every shape here is predicted to spill,
    # so only the POINTER_MIN best predicted are timed
    shapes = ((128, 64, 8), (128, 128, 8), (64, 64, 4), (128, 32, 4), (64, 128, 4))
    kept = prune_configs(plan, [cfg(r, k, w, tma=False) for r, k, w in shapes], dev)
    assert len(kept) == 3 and str(cfg(128, 32, 4, tma=False)) not in {str(c) for c in kept}


def test_configs_are_timed_on_the_given_tensors_where_they_fit():
    """A call's own tensors (document ids decide which blocks a data mask skips) are what
    tile configs are timed on; a tensor of another shape or dtype is replaced, not used."""
    from neptune_eq.runtime.timing import timing_tensors
    prog = ne.build_program(examples.attention(1, 2, 8, 12, 16, "float32"))
    q = torch.randn(1, 2, 8, 16)
    wrong = torch.randn(1, 2, 12, 8)          # k of the wrong shape
    got = timing_tensors(prog, {"q": q, "k": wrong, "v": torch.randn(1, 2, 12, 16).double()},
                         device="cpu")
    assert got["q"] is q
    assert got["k"] is not wrong and tuple(got["k"].shape) == (1, 2, 12, 16)
    assert got["v"].dtype == torch.float32                      # float64 given: replaced
    assert set(got) == {"q", "k", "v", *prog.outputs}


def test_the_decode_grid_leaves_out_the_kinds_that_never_won():
    """A decode's GPU configs leave out what never was the best of a measured case
    (``tile_configs.GRID_EVIDENCE``): tensor descriptors, 128 keys at 8 warps, a
    split in two below 128 keys, and one-launch split-k where a program packs several
    rows (GQA's heads of a group); a one-row decode keeps its one-launch form."""
    def grid(hq, hkv):
        kern = ne.superoptimize(ne.attention(1, hq, 1, 8192, 128, "float16", kv_heads=hkv,
                                             mask_mod=_causal(1, 8192)),
                                target="interpreter", device="H200", cache=False)
        assert kern.kernel_source.split_extent, "a split-k decode"
        return kern.kernel_source.row_extent, candidate_configs(kern.kernel_source, "cuda")
    for hq, hkv in ((32, 32), (64, 8)):
        rows, cfgs = grid(hq, hkv)
        assert rows == hq // hkv and cfgs
        assert not any(c.tma or c.warp_specialize for c in cfgs)
        assert not any(c.num_warps == 8 and c.blocks["B_L"] == 128 for c in cfgs)
        assert {c.blocks["B_L"] for c in cfgs if c.splits == 2} == {128}
        assert any(c.fused for c in cfgs) == (rows == 1)


def test_a_split_k_candidate_is_timed_only_where_rows_leave_sms_idle(monkeypatch):
    """A prefill's row programs fill the GPU, so its split-k candidate (never faster than
    the rolling one in 48 measured prefills: ``tile_configs.GRID_EVIDENCE``) is recorded,
    not compiled -- unless nothing else compiles; a decode's split-k is timed."""
    from neptune_eq.choosing import choose as ch
    timed = []

    def fake_time(program, ks, target, tensors, configs, values=None, host=False):
        timed.append(ks.split_extent)
        return [] if fail and not ks.split_extent else [(configs[0], 1.0 + len(timed), "ok")]
    monkeypatch.setattr(ch, "compile_in_parallel", lambda *a, **k: None)
    monkeypatch.setattr(ch, "time_configs", fake_time)

    def choice(sq, skv):
        kern = ne.superoptimize(ne.attention(1, 32, sq, skv, 128, "float16"), target="interpreter",
                                top_k=2, cache=False)
        rows = [r for r in kern.candidates if r.kernel is not None]
        for r in rows:
            r.chosen, r.config, r.measured_ms, r.status = False, None, None, ""
        timed.clear()
        return ch.choose(rows, "cuda", None, 2, 132), rows
    fail = False
    best, rows = choice(4096, 4096)                             # 32 row blocks x 32 heads
    assert {bool(r.kernel.split_extent) for r in rows[:2]} == {True, False}
    assert timed == [0] and not best.kernel.split_extent
    assert next(r for r in rows if r.kernel.split_extent).status.startswith("not timed: split-k")
    fail = True                                                 # the rolling one fails: split-k runs
    best, _ = choice(4096, 4096)
    assert timed == [0, best.kernel.split_extent] and best.kernel.split_extent
    fail = False
    best, rows = choice(1, 8192)                                # a decode: split-k is timed
    assert rows[0].kernel.split_extent and timed[0] == rows[0].kernel.split_extent
    # 4 row blocks x 32 heads = 128 programs on 132 SMs: a split gains at most 132/128,
    # less than it was ever measured to cost (SPLIT_LEAST_COST); at 2 row blocks it may
    best, rows = choice(512, 512)
    assert timed and not any(timed) and not best.kernel.split_extent
    assert ch.rows_fill_gpu(next(r for r in rows if r.kernel.split_extent).kernel, 132)
    best, rows = choice(256, 512)
    assert not ch.rows_fill_gpu(next(r for r in rows if r.kernel.split_extent).kernel, 132)


def test_fewest_launches_win_among_configs_within_the_tie():
    """A config is chosen by GPU time, but split-k in one launch beats two launches when
    it is within ``LAUNCH_TIE`` of them (a host launch costs more than the graph shows);
    outside the tie the faster one wins."""
    from neptune_eq.choosing.choose import LAUNCH_TIE, fastest
    kern = ne.superoptimize(ne.attention(1, 32, 1, 8192, 128, mask_mod=_causal(1, 8192)),
                            target="interpreter", device="H200", cache=False)
    ks = kern.kernel_source
    assert ks.split_extent, "a split-k decode"
    two, one = (c for c in candidate_configs(ks, "cuda")[:2])
    assert (two.fused, one.fused) == (False, True)
    assert fastest([(two, 1.00), (one, 1.00 * LAUNCH_TIE * 0.999)], ks)[0] == one
    assert fastest([(two, 1.00), (one, 1.00 * LAUNCH_TIE * 1.01)], ks)[0] == two
    assert fastest([(one, 2.0), (two, 1.0)], ks) == (two, 1.0)


def test_near_ties_are_timed_again_and_ranked_by_median(monkeypatch):
    """One timing per config can misorder forms this close (jagged at S=32768 on an H200:
    Gluon 1.84-1.95 ms over three rounds, the tl tiles 2.06-2.12, and a cold choice took
    the tl tiles).  Configs within ``RETIME_SPREAD`` of the fastest are timed
    ``RETIME_ROUNDS`` more times and ranked by median; a config standing alone is not
    timed again; the re-timings check nothing (every config was checked against the plain
    launch when first timed), so a Gluon config runs alone."""
    from types import SimpleNamespace
    from neptune_eq.choosing import choose as ch
    from neptune_eq.runtime.tile_configs import TileConfig
    tl_a = TileConfig({"B_i": 64, "B_L": 64}, 4, 3)
    tl_b = TileConfig({"B_i": 128, "B_L": 64}, 8, 3)
    gl = TileConfig({"B_i": 128, "B_L": 128}, 4, 2, gluon_ws=True)
    tl_c = TileConfig({"B_i": 128, "B_L": 128}, 8, 2)  # the Gluon row's own tl form
    script = {id(tl_a): [2.10, 2.12], id(gl): [1.84, 1.86]}  # the re-timed rounds
    calls = []

    def fake_time(program, ks, target, tensors, configs, values=None, host=False, check=True):
        assert not check
        calls.append([c for c in configs])
        return [(c, script[id(c)].pop(0) if id(c) in script else 3.0, "ok") for c in configs]
    monkeypatch.setattr(ch, "time_configs", fake_time)
    ks = SimpleNamespace(launched=lambda fused: ["k"])
    tl_row = SimpleNamespace(program=None, kernel=ks, timings=[(tl_a, 1.90, "ok"), (tl_b, 2.5, "ok")])
    gl_row = SimpleNamespace(program=None, kernel=ks, timings=[(tl_c, 2.6, "ok"), (gl, 1.95, "ok")])
    ch._retime_near_ties([tl_row, gl_row], "cuda", None, None, True)
    # the first pass put tl_a ahead (1.90 < 1.95); the medians put Gluon ahead
    assert dict((id(c), ms) for c, ms, _ in tl_row.timings) == {id(tl_a): 2.10, id(tl_b): 2.5}
    assert gl_row.timings[1][1] == 1.86 and gl_row.timings[0][1] == 2.6
    assert len(calls) == 2 * ch.RETIME_ROUNDS
    assert all(cs == [tl_a] for cs in calls[0::2])            # tl_b (2.5) is not near
    assert all(cs == [gl] for cs in calls[1::2])
    calls.clear()
    tl_d = TileConfig({"B_i": 64, "B_L": 128}, 4, 2)
    tl_e = TileConfig({"B_i": 32, "B_L": 128}, 4, 3)
    many = SimpleNamespace(program=None, kernel=ks, timings=[
        (tl_a, 1.03, "ok"), (tl_b, 1.0, "ok"), (tl_c, 1.05, "ok"), (tl_d, 1.04, "ok"),
        (tl_e, 1.06, "ok"), (gl, 1.07, "ok")])
    script.update({id(c): [1.0, 1.0] for c in (tl_a, tl_b, tl_c, tl_d, tl_e)})
    assert ch.RETIME_MAX == 5
    ch._retime_near_ties([many], "cuda", None, None, True)  # all six near: the 5 fastest
    assert calls == [[tl_a, tl_b, tl_c, tl_d, tl_e]] * ch.RETIME_ROUNDS
    assert many.timings[5][1] == 1.07
    calls.clear()
    lone = SimpleNamespace(program=None, kernel=ks, timings=[(tl_a, 1.0, "ok"), (tl_b, 1.5, "ok")])
    ch._retime_near_ties([lone], "cuda", None, None, True)
    assert calls == [] and lone.timings[0][1] == 1.0
